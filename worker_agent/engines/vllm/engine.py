"""``VllmEngine``: the agent's adapter for a vLLM server (see the package doc)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvroute.core.cache_events import CacheEvent, CacheListener
from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.load import EngineLoad, PrefillMode
from kvroute.worker_agent.engines.base import EngineError, EngineRequest, TokenChunk
from kvroute.worker_agent.engines.vllm.blockmap import BlockMap
from kvroute.worker_agent.engines.vllm.openai import CompletionsClient, structured_outputs
from kvroute.worker_agent.engines.vllm.prom import MetricsPoller
from kvroute.worker_agent.engines.vllm.render_check import RenderCheck
from kvroute.worker_agent.engines.vllm.subscriber import (
    BatchSink,
    EventSubscriber,
    SubscriberConfig,
)
from kvroute.worker_agent.engines.vllm.versions import (
    SUPPORTED,
    is_supported,
    parse_version,
    structured_dialect,
)
from kvroute.worker_agent.engines.vllm.wire import Batch

log = logging.getLogger("kvroute.agent.vllm")

_FINISH = {"length": "length", "stop": "stop"}
REPORT_MODES = ("auto", "always", "never")


@dataclass(frozen=True, slots=True)
class VllmConfig:
    url: str = "http://127.0.0.1:8000"
    """vLLM's OpenAI-compatible server."""
    model: str = "default"
    """kvroute model name: seeds the block keys (must match the routers')."""
    served_model: str = ""
    """The ``model`` sent to vLLM (default: ``model``)."""
    block_size: int = 16
    events: str = "tcp://127.0.0.1:5557"
    replay: str = ""
    topic: str = ""
    capacity_blocks: int = 4096
    """Used for load only when /metrics lacks ``vllm:cache_config_info``."""
    max_num_seqs: int = 0
    """vLLM's ``--max-num-seqs``, reported as the load's ``max_running`` (0: unknown)."""
    max_num_batched_tokens: int = 0
    """vLLM's ``--max-num-batched-tokens``, reported as the load's ``max_batched_tokens``
    (0: unknown)."""
    chunked_prefill: bool = True
    """Whether vLLM chunks long prefills (V1's default; False with
    ``--no-enable-chunked-prefill``), reported as the load's ``prefill_mode``."""
    long_prefill_token_threshold: int = 0
    """vLLM's ``--long-prefill-token-threshold`` (the most tokens of one prefill per
    iteration; 0: none), reported as the load's ``max_prefill_chunk`` when it chunks."""
    metrics_interval_s: float = 0.5
    replay_timeout_s: float = 1.0
    probe_s: float = 1.0
    version_retry_s: float = 2.0
    """How often ``GET /version`` is retried while vLLM does not answer (it may start after
    the agent)."""
    model_source: str = ""
    """The router's SOURCE of the model (``--model NAME=SOURCE``): with it, vLLM's rendering
    of a probe chat is checked against the router's (:mod:`.render_check`)."""
    render_check_s: float = 300.0
    """Seconds between those checks."""
    down_after_s: float = 2.0
    """vLLM is taken for dead once its ``/metrics`` has not answered for this long (it was
    answering before): its blocks are withdrawn at once and the agent stops heartbeating."""
    report_reused: str = "auto"
    """Ask vLLM to re-report reused prefix blocks (``kv_cache_report_mode=full``): ``auto``
    while the cache view is incomplete (started late or reset), ``always`` or ``never``."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.report_reused not in REPORT_MODES:
            raise ValueError(f"report_reused must be one of {REPORT_MODES}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: unknown), got {getattr(self, name)}")


@dataclass
class _Inflight:
    prompt_len: int
    predicted_cached: int
    started: bool = False  # first token received


class VllmEngine(BatchSink):
    """Implements the :class:`~kvroute.worker_agent.engines.base.Engine` protocol."""

    kind = "vllm"

    def __init__(self, config: VllmConfig, chat: ChatTokenizer | None = None) -> None:
        """``chat``: ``config.model_source`` already loaded (else it is loaded here)."""
        self.config = config
        self.block_size = config.block_size
        self.model = config.model
        self.served_model = config.served_model or config.model
        self.blocks = BlockMap(config.block_size, config.model, self.served_model)
        self.events = EventSubscriber(
            SubscriberConfig(config.events, config.replay, config.topic,
                             replay_timeout_s=config.replay_timeout_s, probe_s=config.probe_s),
            self)
        self.client = CompletionsClient(config.url, self.served_model)
        self.metrics = MetricsPoller(config.url, config.metrics_interval_s,
                                     on_poll=self._check_alive)
        self._alive = False
        self._listeners: list[CacheListener] = []
        self._inflight: dict[int, _Inflight] = {}
        self._next_id = 0
        self._started = False
        self.vllm_version: str | None = None
        """The server's release from ``GET /version``; None until it answers."""
        self._version_settled = False  # known, or the server cannot tell (no retries)
        self._version_task: asyncio.Task[None] | None = None
        self.render_check: RenderCheck | None = None
        """With ``model_source``: the chat-rendering check against vLLM's /tokenize."""
        if config.model_source:
            # Loaded now: a SOURCE that is not a tokenizer ends the start (ModelSourceError).
            chat = chat or ChatTokenizer.load(config.model_source, name=config.model)
            self.render_check = RenderCheck(config.url, self.served_model, chat,
                                            config.render_check_s)
        self._render_task: asyncio.Task[None] | None = None

    # -- Engine protocol ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        # httpx logs every request at INFO: with /metrics polled twice a second that drowns
        # the agent's own log.
        logging.getLogger("httpx").setLevel(max(logging.WARNING,
                                                logging.getLogger("httpx").level))
        await self.events.start()
        await self.metrics.start()
        log.info("following vLLM", extra={"kv": {
            "url": self.config.url, "events": self.config.events,
            "replay": self.config.replay or "off", "served_model": self.served_model,
            "block_size": self.block_size, "supported_vllm": "..".join(SUPPORTED)}})
        self._version_task = asyncio.create_task(self._watch_version(), name="vllm-version")
        if self.render_check is not None:
            self._render_task = asyncio.create_task(self.render_check.run(),
                                                    name="vllm-render-check")

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._version_task is not None:
            self._version_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._version_task
            self._version_task = None
        if self._render_task is not None:
            self._render_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._render_task
            self._render_task = None
        if self.render_check is not None:
            await self.render_check.aclose()
        await self.events.stop()
        await self.metrics.stop()
        await self.client.aclose()

    async def generate(self, request: EngineRequest, *,
                       constraint: tuple[str, str | Sequence[str]] | None = None
                       ) -> AsyncIterator[TokenChunk]:
        """``constraint``: ``(kind, source)`` of a controller program's constrained gen (kind
        json_schema, regex, lark or choices), sent as vLLM structured outputs."""
        if not self._started:
            raise EngineError("engine not started")
        prompt = list(request.token_ids)
        n = len(prompt)
        if n == 0:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if request.mask_fn is not None:
            # Masks are computed per step in-process; vLLM only takes whole grammars
            # (structured outputs), which the controller runtime must send instead.
            raise EngineError("the vllm engine cannot apply per-step token masks")
        structured = None
        if constraint is not None:
            structured = structured_outputs(*constraint)
            if not self._version_settled:
                await self._detect_version()  # its fields depend on the release
        # What vLLM will most likely hit: the cached prefix, short of the last token (vLLM
        # always computes at least one). Exact figure: vLLM's usage, on the last chunk.
        hit_cap = (n - 1) // self.block_size * self.block_size
        try:
            keys = self.blocks.hasher(request.cache_salt).keys(prompt[:hit_cap])
        except OverflowError as exc:
            raise EngineError(f"request {request.request_id}: token id out of range") from exc
        predicted = self.blocks.longest_prefix(keys) * self.block_size
        rid = self._next_id
        self._next_id += 1
        state = self._inflight[rid] = _Inflight(n, predicted)
        held: TokenChunk | None = None
        try:
            async for c in self.client.stream(
                    request.request_id, token_ids=prompt, max_tokens=request.max_tokens,
                    temperature=request.temperature, top_p=request.top_p,
                    top_k=request.top_k, seed=request.seed,
                    stop_token_ids=request.stop_token_ids, cache_salt=request.cache_salt,
                    report_reused=self._report_reused(), structured=structured,
                    logprobs=request.logprobs):
                if c.usage:
                    # vLLM's exact hit arrives after the finish chunk: put it on the last one.
                    if held is not None and c.cached_tokens is not None:
                        held = TokenChunk(held.token_ids, c.cached_tokens, held.finish_reason,
                                          held.logprobs)
                    continue
                if held is not None:
                    raise EngineError("vllm sent tokens after the finish reason")
                if c.finish_reason is not None:
                    reason = _FINISH.get(c.finish_reason)
                    if reason is None:
                        raise EngineError(f"vllm finished with {c.finish_reason!r}")
                    held = TokenChunk(c.token_ids, predicted, reason, c.logprobs)
                    state.started = True
                    continue
                if c.token_ids:
                    state.started = True
                    yield TokenChunk(c.token_ids, predicted, logprobs=c.logprobs)
            if held is None:
                raise EngineError("vllm stream ended without a finish reason")
            yield held
        finally:
            del self._inflight[rid]

    def load(self) -> EngineLoad:
        m = self.metrics.latest
        capacity = m.num_gpu_blocks or self.config.capacity_blocks
        free = capacity if m.kv_usage is None else round(capacity * (1.0 - m.kv_usage))
        decoding = prefill = 0
        for st in self._inflight.values():
            if st.started:
                decoding += 1
            else:
                prefill += st.prompt_len - st.predicted_cached
        # /metrics is up to one poll old; our own requests are counted at once.
        return EngineLoad(
            running=max(m.running, decoding), queued=m.waiting, free_blocks=free,
            capacity_blocks=capacity, pending_prefill_tokens=prefill,
            max_running=self.config.max_num_seqs,
            max_batched_tokens=self.config.max_num_batched_tokens,
            prefill_mode=PrefillMode.of(self.config.chunked_prefill),
            max_prefill_chunk=self.config.long_prefill_token_threshold
            if self.config.chunked_prefill else 0)

    def cached_keys(self) -> list[int]:
        return self.blocks.cached_keys()

    def cached_blocks(self, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Leading full blocks of ``token_ids`` in vLLM's cache, as far as its events tell."""
        n = len(token_ids) // self.block_size * self.block_size
        try:
            keys = self.blocks.hasher(cache_salt).keys(list(token_ids[:n]))
        except OverflowError:
            return 0
        return self.blocks.longest_prefix(keys)

    def add_listener(self, listener: CacheListener) -> None:
        self._listeners.append(listener)

    # -- BatchSink (called by the subscriber, on the event loop) -----------------------------

    def apply_batch(self, seq: int, batch: Batch) -> None:
        out: list[CacheEvent] = []
        apply = self.blocks.apply
        for ev in batch.events:
            apply(ev, out)
        for ce in out:
            self._emit(ce)

    def healthy(self) -> bool:
        """Whether vLLM answers (its ``/metrics``, polled in the background); False before it
        first does and once it has not for ``down_after_s``."""
        return self._alive

    def _check_alive(self) -> None:
        st = self.metrics.stats
        alive = st.up or (st.last_ok > 0
                          and time.monotonic() - st.last_ok < self.config.down_after_s)
        if alive == self._alive:
            return
        self._alive = alive
        if alive:
            log.info("vLLM answers; serving", extra={"kv": {"url": self.config.url}})
            return
        # Whatever it held is gone with it: routers must stop matching those blocks now,
        # not when its restart is noticed.
        log.warning("vLLM has not answered for %.1f s; withdrawing its blocks and this "
                    "worker's heartbeat until it answers again", self.config.down_after_s,
                    extra={"kv": {"url": self.config.url}})
        self.reset_view("vLLM unreachable")

    def reset_view(self, reason: str) -> None:
        log.warning("cache view reset: clearing this worker's published blocks; they are "
                    "re-learned as vLLM stores them again", extra={"kv": {"reason": reason}})
        out: list[CacheEvent] = []
        self.blocks.clear(out)
        for ce in out:
            self._emit(ce)

    # -- internals ---------------------------------------------------------------------------

    async def _watch_version(self) -> None:
        while not await self._detect_version():
            await asyncio.sleep(self.config.version_retry_s)

    async def _detect_version(self) -> bool:
        """Ask ``GET /version`` once; pick the request dialect; warn outside
        :data:`SUPPORTED`. True once settled (no more asking)."""
        if self._version_settled:
            return True
        lo, hi = SUPPORTED
        try:
            text = await self.client.server_version()
        except EngineError as exc:
            self._version_settled = True
            log.warning("cannot tell vLLM's version; assuming the newest supported",
                        extra={"kv": {"error": str(exc), "supported_vllm": f"{lo}..{hi}"}})
            return True
        if text is None or self._version_settled:
            return self._version_settled
        self._version_settled = True
        self.vllm_version = text
        version = parse_version(text)
        self.client.dialect = structured_dialect(version)
        info = {"version": text, "supported_vllm": f"{lo}..{hi}",
                "constraint_fields": self.client.dialect.value}
        if version is not None and is_supported(version):
            log.info("vLLM version", extra={"kv": info})
        else:
            log.warning(f"vLLM {text} is outside the supported range {lo}..{hi}: carrying on, "
                        "but its KV events and request fields are untested", extra={"kv": info})
        return True

    def _report_reused(self) -> bool:
        mode = self.config.report_reused
        return mode == "always" or (mode == "auto" and not self.events.stats.complete)

    def _emit(self, event: CacheEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("cache listener failed", extra={"kv": {"op": event.op.value}})

    def metric_families(self) -> Iterator[Metric]:
        """Adapter counters for the agent's /metrics (see kvroute.worker_agent.metrics)."""
        s, b, m = self.events.stats, self.blocks.stats, self.metrics.stats
        p = "kvroute_agent_vllm_"
        rej = CounterMetricFamily(p + "frames_rejected", "KV-event frames rejected, by reason",
                                  labels=["reason"])
        for reason, n in sorted(s.rejected.items()):
            rej.add_metric([reason], n)
        yield rej
        skipped = CounterMetricFamily(p + "blocks_skipped",
                                      "vLLM blocks not published, by reason", labels=["reason"])
        for reason, n in (("block_size", b.block_size_mismatch),
                          ("unknown_parent", b.unknown_parent), ("opaque", b.opaque_blocks),
                          ("unknown_removal", b.unknown_removals),
                          ("key_conflict", b.key_conflicts)):
            skipped.add_metric([reason], n)
        yield skipped
        for name, doc, value in (
            ("frames", "Live KV-event frames received", s.frames),
            ("batches", "KV-event batches applied (live or replayed)", s.batches),
            ("events", "KV events applied", s.events),
            ("unknown_events", "KV events of an unknown type skipped", s.unknown_events),
            ("duplicates", "Live batches already applied from a replay", s.duplicates),
            ("replayed_batches", "Batches applied from the replay socket", s.replayed_batches),
            ("gaps_healed", "Seq gaps healed from the replay socket", s.gaps_healed),
            ("replay_failures", "Replay requests unanswered or cut short", s.replay_failures),
            ("silent_recoveries", "Idle replay probes that found batches while the live "
             "stream never delivered a frame (vLLM's publisher connecting instead of binding)",
             s.silent_recoveries),
            ("view_resets", "Cache-view resets (CLEAR, then re-learn): new epochs", s.resets),
            ("publisher_restarts", "vLLM event-publisher restarts detected", s.restarts),
            ("metrics_errors", "Failed polls of vLLM's /metrics", m.errors),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        for name, doc, value in (
            ("last_seq", "Last KV-event seq applied", s.last_seq),
            ("view_complete", "1 if the cache view covers vLLM's whole event history",
             int(s.complete)),
            ("engine_hashes", "vLLM block hashes tracked", self.blocks.engine_hashes),
            ("cached_keys", "kvroute block keys published as cached", self.blocks.cached_count),
            ("metrics_up", "1 if the last poll of vLLM's /metrics succeeded", int(m.up)),
            ("up", "1 while vLLM answers; at 0 its blocks are withdrawn and the agent sends "
             "no heartbeat", int(self._alive)),
            ("metrics_age_seconds", "Seconds since the last good /metrics poll",
             time.monotonic() - m.last_ok if m.last_ok else -1.0),
        ):
            yield GaugeMetricFamily(p + name, doc, value=value)
        if self.render_check is not None:
            yield from self.render_check.metric_families()
