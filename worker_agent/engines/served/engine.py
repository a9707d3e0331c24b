"""``EventedEngine``: an inference server the agent follows over HTTP and KV events.

vLLM and SGLang both publish their prefix cache as KV events on the same wire (ZMQ PUB of
``[topic, seq, msgpack batch]`` with a ROUTER replay socket, :mod:`.vllm.wire`), expose their
load on a Prometheus ``/metrics`` and generate over HTTP. This class is what the two adapters
share; each supplies a :class:`ServerClient` (its generation and version endpoints) and a
parser of its ``/metrics``.

What the router can believe, and for how long (the recovery contract):

* Events reach the agent in ~1 ms; the publisher writes them to Redis in the next batch.
* A lost batch that the server's replay buffer still holds is re-applied in order: no
  divergence beyond the time to notice (the next frame, or ``probe_s`` of silence).
* A lost batch past the buffer, or a server restart: the view is **reset** (``Op.CLEAR``
  published, then re-learned from new events). Until the server stores a block again the
  router **under-reports** it; it never reports a block the server does not hold beyond the
  propagation delay.
* Server unreachable (``/metrics`` silent for ``down_after_s``): every block is withdrawn at
  once and :meth:`EventedEngine.healthy` is False, so the agent stops heartbeating until the
  server answers again.
* A constrained request the server fails while its ``/health`` still answers 200 is the
  request's doing (another worker's engine would fail it the same way): it is refused as
  FAILED_PRECONDITION, and no router marks this worker down for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from prometheus_client.core import Metric

from kvroute.core.cache_events import CacheEvent, CacheListener
from kvroute.core.load import EngineLoad, PrefillMode
from kvroute.worker_agent.engines.base import (
    EngineError,
    EngineRequest,
    GrammarState,
    RequestRefusedError,
    TokenChunk,
)
from kvroute.worker_agent.engines.served.blockmap import BlockMap
from kvroute.worker_agent.engines.served.metrics import adapter_families
from kvroute.worker_agent.engines.served.poller import MetricsPoller, ServerMetrics
from kvroute.worker_agent.engines.served.stream import Chunk
from kvroute.worker_agent.engines.served.subscriber import (
    BatchSink,
    EventSubscriber,
    SubscriberConfig,
)
from kvroute.worker_agent.engines.served.wire import Batch

_FINISH = {"length": "length", "stop": "stop"}

Constraint = tuple[str, str | Sequence[str] | GrammarState]
"""``(kind, source)`` of a controller program's constrained gen: json_schema, regex, lark or
choices with the client's source, or ``state`` with a :class:`GrammarState` (an engine that
continues grammars: vLLM with the mask plugin)."""


@dataclass(frozen=True, slots=True)
class EventedConfig:
    url: str = "http://127.0.0.1:8000"
    """The server's HTTP base URL."""
    model: str = "default"
    """kvroute model name: seeds the block keys (must match the routers')."""
    served_model: str = ""
    """The model name the server is asked for (default: ``model``)."""
    block_size: int = 16
    events: str = "tcp://127.0.0.1:5557"
    replay: str = ""
    topic: str = ""
    capacity_blocks: int = 4096
    """Used for load only when the server does not tell its capacity."""
    max_num_seqs: int = 0
    """The most requests the server runs at once, reported as the load's ``max_running``
    (0: unknown)."""
    max_num_batched_tokens: int = 0
    """The most tokens it computes per iteration, reported as the load's
    ``max_batched_tokens`` (0: unknown)."""
    chunked_prefill: bool = True
    """Whether it chunks long prefills, reported as the load's ``prefill_mode``."""
    long_prefill_token_threshold: int = 0
    """The most tokens of one prefill per iteration (0: none), reported as the load's
    ``max_prefill_chunk`` when it chunks."""
    lower_tier_s_per_token: float = 0.0
    """Seconds the server takes to load one token's KV from its lower tier (CPU offloading,
    HiCache), reported as the load's ``lower_tier_s_per_token`` (0: unknown)."""
    metrics_interval_s: float = 0.5
    replay_timeout_s: float = 1.0
    probe_s: float = 1.0
    version_retry_s: float = 2.0
    """How often the version is asked again while the server does not answer (it may start
    after the agent)."""
    down_after_s: float = 2.0
    """The server is taken for dead once its ``/metrics`` has not answered for this long (it
    was answering before): its blocks are withdrawn at once and the agent stops
    heartbeating."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: unknown), got {getattr(self, name)}")


class ServerClient(Protocol):
    """One server's generation and version endpoints."""

    async def server_version(self) -> Any:
        """What the server says of itself (its version); None while it does not answer;
        EngineError when it answers something else."""
        ...

    def stream(self, request_id: str, request: EngineRequest, *,
               constraint: Constraint | None, report_reused: bool) -> AsyncIterator[Chunk]:
        """The request's chunks; the one carrying ``usage`` (the server's exact cache hit)
        comes after the finish chunk."""
        ...

    async def aclose(self) -> None: ...


@dataclass
class _Inflight:
    prompt_len: int
    predicted_cached: int
    started: bool = False  # first token received


class EventedEngine(BatchSink):
    """Implements the :class:`~kvroute.worker_agent.engines.base.Engine` protocol for a
    server that :attr:`client` reaches; subclasses name the product and read its version."""

    kind = "evented"
    product = "server"

    def __init__(self, config: EventedConfig, client: ServerClient,
                 parse_metrics: Callable[[str], ServerMetrics], log: logging.Logger) -> None:
        self.config = config
        self.log = log
        self.block_size = config.block_size
        self.model = config.model
        self.served_model = config.served_model or config.model
        self.blocks = BlockMap(config.block_size, config.model, self.served_model)
        self.events = EventSubscriber(
            SubscriberConfig(config.events, config.replay, config.topic,
                             replay_timeout_s=config.replay_timeout_s, probe_s=config.probe_s),
            self)
        self.client = client
        self.metrics = MetricsPoller(config.url, config.metrics_interval_s,
                                     on_poll=self._check_alive, parse=parse_metrics)
        self._alive = False
        self._listeners: list[CacheListener] = []
        self._inflight: dict[int, _Inflight] = {}
        self._next_id = 0
        self._started = False
        self.server_version: str | None = None
        """The server's release; None until it answers."""
        self._version_settled = False  # known, or the server cannot tell (no retries)
        self._tasks: list[asyncio.Task[None]] = []

    # -- subclass hooks ----------------------------------------------------------------------

    def _on_version(self, answer: Any) -> str:
        """Take the server's answer to the version request (not None); return its version
        text. ValueError when the answer is not the product's."""
        if not isinstance(answer, str):
            raise ValueError(f"unexpected version answer {answer!r}")
        return answer

    def _version_info(self) -> dict[str, Any]:
        """Fields logged with the version."""
        return {}

    def _supported(self) -> tuple[str, str]:
        return ("", "")

    def _version_supported(self, text: str) -> bool:
        return True

    def _report_reused(self) -> bool:
        return False

    def _capacity_blocks(self) -> int:
        """The KV cache's size in blocks: the server's, else the configured one."""
        return self.metrics.latest.num_gpu_blocks or self.config.capacity_blocks

    def _background(self) -> list[tuple[str, Callable[[], Any]]]:
        """Extra (name, coroutine function) run while started."""
        return []

    async def _close_extra(self) -> None:
        return None

    def _on_liveness(self, alive: bool) -> None:
        """Told when the server starts or stops answering (:meth:`healthy` changes)."""

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
        self.log.info(f"following {self.product}", extra={"kv": {
            "url": self.config.url, "events": self.config.events,
            "replay": self.config.replay or "off", "served_model": self.served_model,
            "block_size": self.block_size,
            f"supported_{self.kind}": "..".join(self._supported())}})
        jobs = [(f"{self.kind}-version", self._watch_version), *self._background()]
        self._tasks = [asyncio.create_task(fn(), name=name) for name, fn in jobs]

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self._close_extra()
        await self.events.stop()
        await self.metrics.stop()
        await self.client.aclose()

    async def generate(self, request: EngineRequest, *, constraint: Constraint | None = None
                       ) -> AsyncIterator[TokenChunk]:
        """``constraint``: a controller program's constrained gen, sent as the server's
        grammar fields."""
        if not self._started:
            raise EngineError("engine not started")
        prompt = list(request.token_ids)
        n = len(prompt)
        if n == 0:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if request.mask_fn is not None:
            # Masks are computed per step in-process; the server only takes whole grammars,
            # which the controller runtime must send instead.
            raise EngineError(f"the {self.kind} engine cannot apply per-step token masks")
        if not self._version_settled:
            await self._detect_version()  # request fields may depend on the release
        # What the server will most likely hit: the cached prefix, short of the last token (it
        # always computes at least one). Exact figure: its own, on the last chunk.
        hit_cap = (n - 1) // self.block_size * self.block_size
        try:
            keys = self.blocks.hasher(request.cache_salt).keys(prompt[:hit_cap])
        except OverflowError as exc:
            raise EngineError(f"request {request.request_id}: token id out of range") from exc
        predicted = self.blocks.longest_prefix(keys) * self.block_size
        rid = self._next_id
        self._next_id += 1
        state = self._inflight[rid] = _Inflight(n, predicted)
        try:
            async for chunk in self._chunks(request, constraint, predicted, state):
                yield chunk
        except RequestRefusedError:
            raise
        except EngineError as exc:
            if constraint is None or not await self._answers_health():
                raise
            raise RequestRefusedError(
                f"{self.product} failed this constrained request and still answers /health, "
                f"so the constraint is the likely cause and any worker would fail it alike "
                f"({exc}). A known case: constrained text that spells one of the model's "
                f"added tokens, such as Qwen's </tool_call>, which the engine's llguidance "
                f"forces as that token and then rejects", "FAILED_PRECONDITION") from exc
        finally:
            del self._inflight[rid]

    async def _answers_health(self) -> bool:
        """Whether the server's ``GET /health`` answers 200 now (its engine is alive)."""
        try:
            async with httpx.AsyncClient(timeout=2.0) as http:
                return (await http.get(self.config.url.rstrip("/") + "/health")
                        ).status_code == 200
        except httpx.HTTPError:
            return False

    async def _chunks(self, request: EngineRequest, constraint: Constraint | None,
                      predicted: int, state: _Inflight) -> AsyncIterator[TokenChunk]:
        held: TokenChunk | None = None
        name = self.product
        async for c in self.client.stream(request.request_id, request, constraint=constraint,
                                          report_reused=self._report_reused()):
            if c.usage:
                # The exact hit arrives after the finish chunk: put it on the last one.
                if held is not None and c.cached_tokens is not None:
                    held = TokenChunk(held.token_ids, c.cached_tokens, held.finish_reason,
                                      held.logprobs)
                continue
            if held is not None:
                raise EngineError(f"{name} sent tokens after the finish reason")
            if c.finish_reason is not None:
                reason = _FINISH.get(c.finish_reason)
                if reason is None:
                    raise EngineError(f"{name} finished with {c.finish_reason!r}")
                held = TokenChunk(c.token_ids, predicted, reason, c.logprobs)
                state.started = True
                continue
            if c.token_ids:
                state.started = True
                yield TokenChunk(c.token_ids, predicted, logprobs=c.logprobs)
        if held is None:
            raise EngineError(f"{name} stream ended without a finish reason")
        yield held

    def load(self) -> EngineLoad:
        m = self.metrics.latest
        capacity = self._capacity_blocks()
        free = capacity if m.kv_usage is None else round(capacity * (1.0 - m.kv_usage))
        decoding = prefill = 0
        for st in self._inflight.values():
            if st.started:
                decoding += 1
            else:
                prefill += st.prompt_len - st.predicted_cached
        cfg = self.config
        # /metrics is up to one poll old; our own requests are counted at once.
        return EngineLoad(
            running=max(m.running, decoding), queued=m.waiting, free_blocks=free,
            capacity_blocks=capacity, pending_prefill_tokens=prefill,
            max_running=cfg.max_num_seqs, max_batched_tokens=cfg.max_num_batched_tokens,
            prefill_mode=PrefillMode.of(cfg.chunked_prefill),
            max_prefill_chunk=cfg.long_prefill_token_threshold if cfg.chunked_prefill else 0,
            lower_tier_s_per_token=cfg.lower_tier_s_per_token)

    def cached_keys(self) -> list[int]:
        return self.blocks.cached_keys()

    def lower_keys(self) -> list[int]:
        """The keys the server holds only in its lower tier (CPU offloading, HiCache)."""
        return self.blocks.lower_keys()

    def cached_blocks(self, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Leading full blocks of ``token_ids`` in the server's cache, as far as its events
        tell."""
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
        """Whether the server answers (its ``/metrics``, polled in the background); False
        before it first does and once it has not for ``down_after_s``."""
        return self._alive

    def _check_alive(self) -> None:
        st = self.metrics.stats
        alive = st.up or (st.last_ok > 0
                          and time.monotonic() - st.last_ok < self.config.down_after_s)
        if alive == self._alive:
            return
        self._alive = alive
        self._on_liveness(alive)
        if alive:
            self.log.info(f"{self.product} answers; serving",
                          extra={"kv": {"url": self.config.url}})
            return
        # Whatever it held is gone with it: routers must stop matching those blocks now,
        # not when its restart is noticed.
        self.log.warning(f"{self.product} has not answered for %.1f s; withdrawing its blocks "
                         "and this worker's heartbeat until it answers again",
                         self.config.down_after_s, extra={"kv": {"url": self.config.url}})
        self.reset_view(f"{self.product} unreachable")

    def reset_view(self, reason: str) -> None:
        self.log.warning("cache view reset: clearing this worker's published blocks; they are "
                         f"re-learned as {self.product} stores them again",
                         extra={"kv": {"reason": reason}})
        out: list[CacheEvent] = []
        self.blocks.clear(out)
        for ce in out:
            self._emit(ce)

    # -- internals ---------------------------------------------------------------------------

    async def _watch_version(self) -> None:
        while not await self._detect_version():
            await asyncio.sleep(self.config.version_retry_s)

    async def _detect_version(self) -> bool:
        """Ask the server its version once; warn outside the supported range. True once
        settled (no more asking)."""
        if self._version_settled:
            return True
        lo, hi = self._supported()
        try:
            answer = await self.client.server_version()
        except EngineError as exc:
            self._version_settled = True
            self.log.warning(f"cannot tell {self.product}'s version; assuming the newest "
                             "supported", extra={"kv": {"error": str(exc),
                                                          "supported": f"{lo}..{hi}"}})
            return True
        if answer is None or self._version_settled:
            return self._version_settled
        self._version_settled = True
        try:
            text = self._on_version(answer)
        except ValueError as exc:
            self.log.warning(f"cannot tell {self.product}'s version; assuming the newest "
                             "supported", extra={"kv": {"error": str(exc)}})
            return True
        self.server_version = text
        info = {"version": text, "supported": f"{lo}..{hi}", **self._version_info()}
        if self._version_supported(text):
            self.log.info(f"{self.product} version", extra={"kv": info})
        else:
            self.log.warning(f"{self.product} {text} is outside the supported range {lo}..{hi}: "
                             "carrying on, but its KV events and request fields are untested",
                             extra={"kv": info})
        return True

    def _emit(self, event: CacheEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                self.log.exception("cache listener failed", extra={"kv": {"op": event.op.value}})

    def metric_families(self) -> Iterator[Metric]:
        """Adapter counters for the agent's /metrics (see kvroute.worker_agent.metrics)."""
        return adapter_families(self.kind, self.product, self.events.stats,
                                self.blocks, self.metrics.stats, self._alive)
