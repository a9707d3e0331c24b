"""Does the vLLM server run kvroute's mask plugin? The check behind ``--vllm-mask-plugin``.

An agent told ``--vllm-mask-plugin`` sends a continued constrained region as ``vllm_xargs``
only the plugin reads (``kvroute_grammar``, ``kvroute_prefix``). A vLLM without it accepts
them and ignores them, so the region would run unconstrained. So the agent asks vLLM, at start
and every ``--vllm-render-check-s``, for one token with a ``kvroute_prefix`` and no grammar:
the plugin refuses that at admission (HTTP 400 naming ``kvroute_prefix``); a vLLM without it
answers. Until vLLM has said the plugin runs, and whenever it says it does not, the agent
continues regions as vLLM's own structured outputs (regular constraints only), and logs the
latter at ERROR; ``kvroute_agent_vllm_mask_plugin`` is 1, 0 or -1 (not known yet). A vLLM
that stopped answering may come back with other flags: the answer is forgotten then, and
asked again as soon as vLLM answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import httpx
from prometheus_client.core import GaugeMetricFamily, Metric

from kvroute.worker_agent.engines.vllm.checks import CheckError, every
from kvroute.worker_agent.engines.vllm.openai import PLUGIN_PREFIX

log = logging.getLogger("kvroute.agent.vllm.plugin")

PROBE_ARG = PLUGIN_PREFIX
"""The argument the probe sends alone, which only the plugin refuses."""


class PluginCheck:
    """Asks vLLM at ``url`` (serving ``served_model``) whether the plugin runs: :meth:`check`
    once, :meth:`run` at start and then every ``interval_s``."""

    def __init__(self, url: str, served_model: str, interval_s: float,
                 timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.served_model = served_model
        self.interval_s = interval_s
        self.state = -1
        """1: the plugin runs; 0: vLLM took the probe without it; -1: no answer yet."""
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)
        self._again = asyncio.Event()

    def on_liveness(self, alive: bool) -> None:
        """vLLM stopped answering (what it runs is unknown until it answers again) or
        answers again (ask at once)."""
        if alive:
            self._again.set()
        else:
            self.state = -1

    @property
    def runs(self) -> bool:
        return self.state == 1

    async def aclose(self) -> None:
        await self._http.aclose()

    async def check(self) -> bool:
        """One probe: True if the plugin runs. Raises CheckError when vLLM's answer says
        neither (unreachable, a server error)."""
        body = {"model": self.served_model, "prompt": [0], "max_tokens": 1,
                "vllm_xargs": {PROBE_ARG: [0]}}
        try:
            resp = await self._http.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise CheckError(f"POST {self.url}/v1/completions: {type(exc).__name__}: "
                             f"{exc}") from None
        if resp.status_code >= 500:
            raise CheckError(f"POST {self.url}/v1/completions: HTTP {resp.status_code}: "
                             f"{resp.text[:300]}")
        runs = resp.status_code == 400 and PROBE_ARG in resp.text
        self._set(1 if runs else 0, resp)
        return runs

    def _set(self, state: int, resp: httpx.Response) -> None:
        if state == 0 and self.state != 0:
            log.error(
                "vLLM does not run kvroute's mask plugin, although the agent was started with "
                "--vllm-mask-plugin: continued constrained regions take regular constraints "
                "only (start vLLM with the plugin's folder on PYTHONPATH and "
                "--logits-processors kvroute_vllm_mask:KvrouteMask; docs/engines.md)",
                extra={"kv": {"status": resp.status_code, "answer": resp.text[:200],
                              "served_model": self.served_model}})
        elif state == 1 and self.state != 1:
            log.info("vLLM runs kvroute's mask plugin", extra={"kv": {
                "served_model": self.served_model}})
        self.state = state

    async def run(self) -> None:
        await every(self.check, self.interval_s, "mask plugin check", log, wake=self._again)

    def metric_families(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvroute_agent_vllm_mask_plugin",
            "1 if vLLM runs kvroute's mask plugin (--vllm-mask-plugin), 0 if it answered "
            "without it, -1 before it answered", value=self.state)
