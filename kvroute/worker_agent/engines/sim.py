"""``SimEngine``: an inference engine without a model, for tests, benchmarks and the replay sim.

It reproduces what matters to a cache-affinity router: a paged prefix cache with real block
keys (:class:`BlockPool` + :class:`BlockHasher`), continuous batching, and a latency model in
which cached prompt tokens are free and uncached ones cost prefill time.

Scheduling, one engine-loop task; each *step*:

1. Admit waiting requests FIFO (head-of-line blocking, as vLLM) while
   ``running < max_batch`` and the pool can allocate the request's blocks: its cache-hit
   blocks are pinned and ``need_blocks - hit_blocks`` fresh blocks taken (evicting LRU cached
   blocks). Blocks are reserved up front for the whole request, so a running sequence never
   runs out of blocks and nothing is ever preempted::

       out_limit   = min(max_tokens, capacity_blocks * B - prompt_len + 1)
       need_blocks = ceil((prompt_len + out_limit - 1) / B)

   (the last output token never has its KV computed). ``out_limit < max_tokens`` only when the
   request cannot fit the whole pool; it then ends early with finish_reason "length".
2. Step time, in seconds::

       step_s = prefill_s_per_token * sum(uncached prompt tokens of requests admitted now)
              + decode_step_base_s + decode_step_per_seq_s * running

   then ``sleep(step_s * time_scale)`` (``time_scale = 0`` still yields to the event loop).
3. Every running sequence gets one token (a newly admitted one gets its first token from the
   prefill). Blocks fully covered by computed KV (``prompt_len + n_out - 1`` tokens) are
   committed under the chained keys of ``prompt + output`` in one ``Op.STORE`` event per step,
   so a follow-up chat turn whose prompt contains this reply hits the cache.
4. Finished sequences free their blocks (they stay cached until evicted).

Cache hit of a request, capped so that at least one prompt token is computed (as vLLM)::

    hit_blocks    = min(longest cached prefix of the prompt's block keys, (prompt_len - 1) // B)
    cached_tokens = hit_blocks * B

Output tokens are deterministic (see :func:`sim_tokens`): the same prompt and seed always give
the same tokens, whatever the cache state, batch or timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

import xxhash

from kvroute.core.blocks import BlockHasher, tokens_to_bytes
from kvroute.worker_agent.engines.base import (
    CacheEvent,
    CacheListener,
    EngineError,
    EngineLoad,
    EngineRequest,
    TokenChunk,
)
from kvroute.worker_agent.engines.block_pool import BlockPool

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_h64 = xxhash.xxh3_64_intdigest
_pack_qq = struct.Struct("<QQ").pack


def sim_token_base(token_ids: Sequence[int], seed: int = 0) -> int:
    """Per-request output seed: ``xxh3_64(le32 tokens of the prompt, seed=seed mod 2**64)``."""
    return _h64(tokens_to_bytes(token_ids), seed=seed & _MASK64)


def sim_token(base: int, t: int, vocab_size: int) -> int:
    """Output token ``t`` (0-based): ``xxh3_64(le64(base) + le64(t)) mod vocab_size``."""
    return _h64(_pack_qq(base, t)) % vocab_size


def sim_tokens(token_ids: Sequence[int], seed: int, n: int, vocab_size: int) -> list[int]:
    """The first ``n`` tokens the sim generates for this prompt and seed (ignoring stops)."""
    base = sim_token_base(token_ids, seed)
    return [sim_token(base, t, vocab_size) for t in range(n)]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Sim engine settings. Defaults: a mid-size GPU serving a ~7B model, roughly."""

    capacity_blocks: int = 4096
    """KV cache size in blocks (4096 * 16 = 65536 tokens)."""
    block_size: int = 16
    model: str = "sim-model"
    vocab_size: int = 50257
    max_batch: int = 64
    """Most sequences running at once."""
    prefill_s_per_token: float = 1e-4
    """Prefill cost per uncached prompt token (~10k tokens/s)."""
    decode_step_base_s: float = 0.01
    """Fixed cost of one decode step (weights read once per step)."""
    decode_step_per_seq_s: float = 2e-4
    """Extra decode-step cost per running sequence."""
    time_scale: float = 1.0
    """Multiplies every sleep; 0 = no sleeping (tests), still yields to the event loop."""

    def __post_init__(self) -> None:
        for name in ("capacity_blocks", "block_size", "vocab_size", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_s_per_token", "decode_step_base_s", "decode_step_per_seq_s",
                     "time_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True)
class SimStats:
    """Counters since construction (for benchmarks and tests)."""

    steps: int = 0
    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    prefill_tokens: int = 0
    """Prompt tokens computed (uncached)."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    generated_tokens: int = 0
    max_running: int = 0
    """Largest batch seen in any step."""


@dataclass(eq=False, slots=True)
class _Seq:
    """One request's state. Identity-hashed: used as a key of the waiting/running dicts."""

    request: EngineRequest
    hasher: BlockHasher
    tokens: list[int]  # prompt + output so far
    prompt_len: int
    out_limit: int
    need_blocks: int
    keys: list[int]  # chained keys of the full blocks of ``tokens`` computed so far
    base: int
    out: asyncio.Queue[TokenChunk | BaseException] = field(default_factory=asyncio.Queue)
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    n_out: int = 0
    n_committed: int = 0  # leading blocks whose keys are in the pool (or were hits)
    done: bool = False


class SimEngine:
    """Implements the :class:`~kvroute.worker_agent.engines.base.Engine` protocol; see module doc.

    Consumers should close ``generate()`` when they stop early (``contextlib.aclosing``);
    cancelling the consuming task does so and frees the request's blocks at once.
    """

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.block_size = self.config.block_size
        self.model = self.config.model
        self.stats = SimStats()
        self.pool = BlockPool(self.config.capacity_blocks, self._emit)
        self._listeners: list[CacheListener] = []
        self._waiting: OrderedDict[_Seq, None] = OrderedDict()
        self._running: dict[_Seq, None] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dead: str | None = "engine not started"

    # -- Engine protocol -------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._dead = None
        self._task = asyncio.create_task(self._loop(), name=f"sim-engine:{self.model}")

    async def stop(self) -> None:
        """Cancel the loop; pending requests fail with :class:`EngineError`; the cache is kept."""
        task, self._task = self._task, None
        self._dead = "engine stopped"
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(EngineError("engine stopped"))

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        seq = self._make_seq(request)
        if self._dead is not None:
            raise EngineError(self._dead)
        self._waiting[seq] = None
        self._wakeup.set()
        try:
            while True:
                item = await seq.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Consumer gone (cancelled / closed early): leave the batch, release blocks.
            if not seq.done:
                self._abort(seq)

    def load(self) -> EngineLoad:
        bs = self.block_size
        pending = 0
        for seq in self._waiting:
            cap = (seq.prompt_len - 1) // bs
            hit = self.pool.longest_cached_prefix(islice(seq.keys, cap))
            pending += seq.prompt_len - hit * bs
        return EngineLoad(
            running=len(self._running),
            queued=len(self._waiting),
            free_blocks=self.pool.free_blocks,
            capacity_blocks=self.pool.capacity_blocks,
            pending_prefill_tokens=pending,
        )

    def cached_keys(self) -> list[int]:
        return self.pool.cached_keys()

    def add_listener(self, listener: CacheListener) -> None:
        self._listeners.append(listener)

    # -- extras ----------------------------------------------------------------------------

    def clear_cache(self) -> int:
        """Drop every cached key (``Op.CLEAR``); running requests keep their blocks."""
        return self.pool.clear()

    # -- internals -------------------------------------------------------------------------

    def _emit(self, event: CacheEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                # A broken listener must not kill the engine loop mid-step.
                log.exception("cache listener %r failed on %s", listener, event.op)

    def _make_seq(self, request: EngineRequest) -> _Seq:
        cfg, bs = self.config, self.block_size
        prompt = list(request.token_ids)
        n = len(prompt)
        if n == 0:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if request.max_tokens < 1:
            raise EngineError(f"request {request.request_id}: max_tokens must be >= 1")
        prompt_blocks = -(-n // bs)
        if prompt_blocks > cfg.capacity_blocks:
            raise EngineError(
                f"request {request.request_id}: prompt of {n} tokens needs {prompt_blocks} "
                f"blocks of {bs}, more than the engine's whole KV cache "
                f"({cfg.capacity_blocks} blocks)"
            )
        hasher = BlockHasher(bs, self.model, request.cache_salt)
        try:
            keys = hasher.keys(prompt)
        except OverflowError as exc:
            raise EngineError(f"request {request.request_id}: token id out of range") from exc
        out_limit = min(request.max_tokens, cfg.capacity_blocks * bs - n + 1)
        return _Seq(
            request=request,
            hasher=hasher,
            tokens=prompt,
            prompt_len=n,
            out_limit=out_limit,
            need_blocks=-(-(n + out_limit - 1) // bs),
            keys=keys,
            base=sim_token_base(prompt, request.seed),
        )

    def _abort(self, seq: _Seq) -> None:
        seq.done = True
        if seq in self._waiting:
            del self._waiting[seq]
        elif seq in self._running:
            del self._running[seq]
            self.pool.free(seq.blocks)
            seq.blocks = []
        self.stats.aborted += 1

    def _fail_all(self, exc: EngineError) -> None:
        for seq in [*self._waiting, *self._running]:
            self._abort(seq)
            seq.out.put_nowait(exc)

    async def _loop(self) -> None:
        try:
            while True:
                if not self._waiting and not self._running:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await self._step()
        except Exception as exc:  # CancelledError (stop) is not an Exception: propagates
            log.exception("sim engine loop failed")
            self._dead = f"engine loop failed: {exc!r}"
            self._fail_all(EngineError(self._dead))

    def _admit(self) -> int:
        """Admit waiting requests (step 1); returns the uncached prompt tokens to prefill."""
        bs, pool, waiting, running = self.block_size, self.pool, self._waiting, self._running
        max_batch, stats = self.config.max_batch, self.stats
        prefill = 0
        while waiting and len(running) < max_batch:
            seq = next(iter(waiting))
            hits = pool.lookup(islice(seq.keys, (seq.prompt_len - 1) // bs))
            n_new = seq.need_blocks - len(hits)
            if not pool.can_allocate(n_new, hits):
                break  # FIFO: later requests wait behind the head
            del waiting[seq]
            seq.blocks = pool.allocate(n_new, hits)
            seq.cached_tokens = len(hits) * bs
            seq.n_committed = len(hits)
            running[seq] = None
            uncached = seq.prompt_len - seq.cached_tokens
            prefill += uncached
            stats.admitted += 1
            stats.prefill_tokens += uncached
            stats.cached_tokens += seq.cached_tokens
        return prefill

    async def _step(self) -> None:
        cfg, bs, stats = self.config, self.block_size, self.stats
        prefill = self._admit()
        if not self._running:
            # Cannot happen (an idle pool fits any admitted-size request); fail rather than spin.
            seq = next(iter(self._waiting))
            self._abort(seq)
            seq.out.put_nowait(EngineError("cannot allocate KV blocks for the request"))
            return
        n_run = len(self._running)
        stats.steps += 1
        stats.max_running = max(stats.max_running, n_run)
        step_s = (cfg.prefill_s_per_token * prefill + cfg.decode_step_base_s
                  + cfg.decode_step_per_seq_s * n_run)
        await asyncio.sleep(step_s * cfg.time_scale)

        # Sequences cancelled during the sleep have already left self._running.
        vocab = cfg.vocab_size
        store_blocks: list[int] = []
        store_keys: list[int] = []
        chunks: list[tuple[_Seq, TokenChunk]] = []
        for seq in self._running:
            tok = sim_token(seq.base, seq.n_out, vocab)
            seq.tokens.append(tok)
            seq.n_out += 1
            full = (seq.prompt_len + seq.n_out - 1) // bs  # blocks fully covered by KV
            if full > seq.n_committed:
                if full > len(seq.keys):
                    parent = seq.keys[-1] if seq.keys else None
                    seq.keys.extend(seq.hasher.iter_keys(
                        seq.tokens[len(seq.keys) * bs : full * bs], parent))
                store_blocks.extend(seq.blocks[seq.n_committed : full])
                store_keys.extend(seq.keys[seq.n_committed : full])
                seq.n_committed = full
            if tok in seq.request.stop_token_ids:
                reason: str | None = "stop"
            elif seq.n_out >= seq.out_limit:
                reason = "length"
            else:
                reason = None
            chunks.append((seq, TokenChunk((tok,), seq.cached_tokens, reason)))
        stats.generated_tokens += len(chunks)
        # Commit before freeing finished sequences: only in-use blocks can be committed.
        if store_blocks:
            self.pool.commit(store_blocks, store_keys)
        for seq, chunk in chunks:
            if chunk.finish_reason is not None:
                seq.done = True
                del self._running[seq]
                self.pool.free(seq.blocks)
                seq.blocks = []
                stats.finished += 1
            seq.out.put_nowait(chunk)
