"""Load from vLLM's Prometheus ``/metrics``, polled in the background (never per request).

Read (summed over the ``engine`` label, i.e. data-parallel engines behind one server):

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting``
* KV-cache usage in [0, 1]: ``vllm:kv_cache_usage_perc`` (v1 engine, current) or
  ``vllm:gpu_cache_usage_perc`` (older releases); averaged over engines
* capacity: the ``num_gpu_blocks`` label of ``vllm:cache_config_info`` (summed over engines)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvroute.agent.vllm")

_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """What vLLM's ``/metrics`` says of its load: the vLLM engine's ``load()`` reads it
    (with its own counts) into the one load record, ``core.load.EngineLoad``."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    num_gpu_blocks: int | None = None


def parse_metrics(text: str) -> VllmMetrics:
    """ValueError if the text is not Prometheus exposition format."""
    running = waiting = 0
    usage: dict[str, list[float]] = {}
    blocks: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if name == "vllm:num_requests_running":
            running += int(sum(s.value for s in fam.samples))
        elif name == "vllm:num_requests_waiting":
            waiting += int(sum(s.value for s in fam.samples))
        elif name in _USAGE:
            usage.setdefault(name, []).extend(s.value for s in fam.samples)
        elif name == "vllm:cache_config_info":
            for s in fam.samples:
                raw = s.labels.get("num_gpu_blocks")
                if raw and raw.isdigit():
                    blocks[s.labels.get("engine", "")] = int(raw)
    values = next((usage[n] for n in _USAGE if usage.get(n)), None)
    kv = min(1.0, max(0.0, sum(values) / len(values))) if values else None
    return VllmMetrics(running, waiting, kv, sum(blocks.values()) if blocks else None)


@dataclass
class MetricsStats:
    polls: int = 0
    errors: int = 0
    up: bool = False
    last_ok: float = 0.0


class MetricsPoller:
    """Keeps :attr:`latest` fresh by polling ``{base_url}/metrics`` every ``interval_s``."""

    def __init__(self, base_url: str, interval_s: float = 0.5, timeout_s: float = 2.0,
                 on_poll: Callable[[], None] | None = None) -> None:
        """``on_poll``: called after every poll, failed or not (the engine's liveness)."""
        self._url = base_url.rstrip("/") + "/metrics"
        self._on_poll = on_poll
        self._interval = interval_s
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self.latest = VllmMetrics()
        self.stats = MetricsStats()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="vllm-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._http.aclose()

    async def poll_once(self) -> None:
        st = self.stats
        st.polls += 1
        try:
            resp = await self._http.get(self._url)
            resp.raise_for_status()
            self.latest = parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            st.errors += 1
            if st.up or st.polls == 1:
                log.warning("cannot read vLLM metrics; keeping the last load",
                            extra={"kv": {"url": self._url, "error": repr(exc)[:200]}})
            st.up = False
            return
        if not st.up:
            log.info("reading vLLM metrics", extra={"kv": {"url": self._url}})
        st.up = True
        st.last_ok = time.monotonic()

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            if self._on_poll is not None:
                self._on_poll()
            await asyncio.sleep(self._interval)
