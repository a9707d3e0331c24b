"""The chat-rendering check: does the router's rendering of a conversation equal vLLM's own?

A router with ``--model NAME=SOURCE`` renders chats with SOURCE's template and tokenizer and
sends vLLM token ids (core/chat_tokenizer.py), so router and engine hash the same ids by
construction. What construction cannot promise is that SOURCE *is* the model vLLM serves: a
different revision, a template vLLM was given with ``--chat-template``, another tokenizer.
Chat traffic then still runs, but with a prompt the model was not trained on, and what
clients that send messages to vLLM directly get differs from what the router gives it.

So an agent started with ``--model-source SOURCE`` (the router's SOURCE of the model) asks
vLLM, at start and every ``--vllm-render-check-s``, to tokenize :data:`PROBES` itself: ``POST
/tokenize`` with ``{"model", "messages", "add_generation_prompt": true}`` (vLLM's
TokenizeChatRequest; the answer is ``{"tokens": [...], "count": N, "max_model_len": M}``),
and compares its ids with ``ChatTokenizer.apply`` of the same probe. A mismatch is logged at
ERROR with the first position that differs and exported as
``kvroute_agent_chat_template_mismatch`` (1; 0 when they agree, -1 before the first answer),
beside ``kvroute_agent_chat_template_checks_total{outcome}``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvroute.worker_agent.engines.vllm.checks import CheckError, every

log = logging.getLogger("kvroute.agent.vllm.render")

@dataclass(frozen=True)
class Probe:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
PROBES: tuple[Probe, ...] = (
    Probe("multi-turn", [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Hello! What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "Say it in words, please: «four»?"},
    ]),
    Probe("tools", [{"role": "user", "content": "Is it raining in Paris?"}], [_WEATHER]),
)
"""The conversations compared: several turns (earlier assistant turns are where templates
differ most: some drop reasoning, some add stop tokens), a non-ASCII character, and tools
(which a router must render, not drop)."""


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where ``a`` and ``b`` differ (-1 if they are equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


@dataclass
class RenderCheckStats:
    outcomes: dict[str, int] = field(default_factory=lambda: {"match": 0, "mismatch": 0,
                                                              "error": 0})
    mismatch: int = -1
    """1: the last answered check differed; 0: it agreed; -1: none answered yet."""


class RenderCheck:
    """Compares ``chat`` (a ChatTokenizer of the router's model source) with vLLM at ``url``
    serving ``served_model``. :meth:`check` once; :meth:`run` at start and then every
    ``interval_s``."""

    def __init__(self, url: str, served_model: str, chat: Any, interval_s: float,
                 timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.served_model = served_model
        self._chat = chat
        self.interval_s = interval_s
        self.stats = RenderCheckStats()
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _vllm_ids(self, probe: Probe) -> list[int]:
        body: dict[str, Any] = {"model": self.served_model, "messages": probe.messages,
                                "add_generation_prompt": True}
        if probe.tools is not None:
            body["tools"] = probe.tools
        try:
            resp = await self._http.post("/tokenize", json=body)
        except httpx.HTTPError as exc:
            raise CheckError(f"POST {self.url}/tokenize: {type(exc).__name__}: "
                             f"{exc}") from None
        if resp.status_code != 200:
            raise CheckError(f"POST {self.url}/tokenize: HTTP {resp.status_code}: "
                             f"{resp.text[:300]}")
        try:
            body = resp.json()
        except ValueError:
            body = None
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not (isinstance(tokens, list)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise CheckError(f"POST {self.url}/tokenize: no list of token ids in "
                             f"{resp.text[:300]!r}")
        return tokens

    async def check(self) -> bool:
        """One check of every probe: True if vLLM's ids equal the router's. Raises
        CheckError (counted) when vLLM's answer cannot be had or read."""
        try:
            for probe in PROBES:
                ours = self._chat.apply(probe.messages, tools=probe.tools,
                                        add_generation_prompt=True)
                theirs = await self._vllm_ids(probe)
                at = first_difference(ours, theirs)
                if at >= 0:
                    self._outcome("mismatch")
                    self.stats.mismatch = 1
                    log.error(
                        "chat template mismatch: vLLM renders the probe conversation to other "
                        "token ids than the router's model source; chat requests through the "
                        "router get a prompt the model does not expect (check that "
                        "--model-source is the model vLLM serves, and vLLM's --chat-template)",
                        extra={"kv": {
                            "probe": probe.name, "first_difference": at,
                            "router_tokens": len(ours), "vllm_tokens": len(theirs),
                            "router_ids_there": list(ours[at:at + 8]),
                            "vllm_ids_there": list(theirs[at:at + 8]),
                            "served_model": self.served_model}})
                    return False
        except CheckError:
            self._outcome("error")
            raise
        self._outcome("match")
        if self.stats.mismatch != 0:
            log.info("chat template check: vLLM's rendering equals the router's",
                     extra={"kv": {"probes": len(PROBES), "served_model": self.served_model}})
        self.stats.mismatch = 0
        return True

    def _outcome(self, outcome: str) -> None:
        self.stats.outcomes[outcome] += 1

    async def run(self) -> None:
        """Check at start and every ``interval_s``; sooner again after an error."""
        await every(self.check, self.interval_s, "chat template check", log,
                    on_error=lambda: self._outcome("error"))

    def metric_families(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvroute_agent_chat_template_mismatch",
            "1 if vLLM's rendering of the probe conversation differs from the router's model "
            "source (--model-source), 0 if equal, -1 before vLLM first answered",
            value=self.stats.mismatch)
        checks = CounterMetricFamily("kvroute_agent_chat_template_checks",
                                     "Chat-rendering checks against vLLM's /tokenize, by "
                                     "outcome", labels=["outcome"])
        for outcome, n in sorted(self.stats.outcomes.items()):
            checks.add_metric([outcome], n)
        yield checks
