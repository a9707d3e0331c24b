"""Continuous batching over a :class:`BlockPool`: the engine loop of the sim and tiny engines.

:class:`BatchingEngine` implements the :class:`~kvroute.worker_agent.engines.base.Engine`
protocol except for how a step's tokens are produced; a subclass supplies
:meth:`BatchingEngine._next_tokens` (the sim engine sleeps and hashes, the tiny engine runs a
transformer over the paged KV cache).

Scheduling is :class:`kvroute.core.scheduler.Scheduler`'s -- the replay simulator's workers
run the same -- driven in real time by one engine-loop task; each *step*:

1. The scheduler admits waiting requests (FIFO, head-of-line blocking, under ``max_batch``,
   the prefill budget and block availability; blocks reserved up front for the whole request,
   so nothing is ever preempted) and sizes each prefill's chunk: the whole uncached prompt,
   or with ``chunked_prefill`` vLLM V1's token budget (sim engine only)::

       out_limit   = min(max_tokens, capacity_blocks * B - prompt_len + 1)
       need_blocks = ceil((prompt_len + out_limit - 1) / B)

   (the last output token never has its KV computed). ``out_limit < max_tokens`` only when the
   request cannot fit the whole pool; it then ends early with finish_reason "length".
2. ``_next_tokens`` gives one token to every running sequence and to each whose prefill
   completes in this step (its first token, from the prefill of its uncached prompt tokens,
   ``[cached_tokens, prompt_len)``; the others decode their last token). It may await;
   sequences cancelled meanwhile are skipped.
3. Blocks fully covered by computed KV (``prompt_len + n_out - 1`` tokens; a chunk's prompt
   blocks) are committed under the chained keys of ``prompt + output`` in one ``Op.STORE``
   event per step, so a follow-up chat turn whose prompt contains this reply hits the cache.
4. Finished sequences free their blocks (they stay cached until evicted).

Cache hit of a request, capped so that at least one prompt token is computed (as vLLM)::

    hit_blocks    = min(longest cached prefix of the prompt's block keys, (prompt_len - 1) // B)
    cached_tokens = hit_blocks * B
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.core.block_pool import BlockPool
from kvroute.core.blocks import BlockHasher
from kvroute.core.cache_events import CacheEvent, CacheListener
from kvroute.core.load import EngineLoad, PrefillMode
from kvroute.core.scheduler import Scheduler
from kvroute.worker_agent.engines.base import (
    EngineError,
    EngineRequest,
    RequestRefusedError,
    TokenChunk,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
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
class Seq:
    """One request's state (a :class:`~kvroute.core.scheduler.Schedulable`).

    Engines that need more per-request state subclass it (fields with defaults only).
    """

    request: EngineRequest
    hasher: BlockHasher
    tokens: list[int]  # prompt + output so far
    prompt_tokens: int
    output_tokens: int  # most tokens it generates (out_limit)
    keys: list[int]  # chained keys of the full blocks of ``tokens`` computed so far
    out: asyncio.Queue[TokenChunk | BaseException] = field(default_factory=asyncio.Queue)
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prefill_left: int = 0  # uncached prompt tokens not computed yet
    n_out: int = 0
    stored_blocks: int = 0  # leading blocks whose keys are in the pool (or were hits)
    done: bool = False

    @property
    def kv_tokens(self) -> int:
        """Leading tokens whose KV is in this sequence's blocks: the cache hit and the chunks
        computed until its first token, then ``prompt_tokens + n_out - 1`` (every token but
        the newest)."""
        if self.n_out == 0:
            return self.prompt_tokens - self.prefill_left if self.blocks else 0
        return self.prompt_tokens + self.n_out - 1


class BatchingEngine:
    """Continuous batching on a :class:`BlockPool`; see the module doc. Subclasses implement
    :meth:`_next_tokens` and may override :meth:`_new_seq` / :meth:`_validate`.

    Consumers should close ``generate()`` when they stop early (``contextlib.aclosing``);
    cancelling the consuming task does so and frees the request's blocks at once.
    """

    kind = "batching"
    """Engine name for logs and task names."""

    def __init__(self, *, capacity_blocks: int, block_size: int, model: str,
                 max_batch: int, prefill_budget: int = 0, chunked_prefill: bool = False,
                 long_prefill_threshold: int = 0, host_blocks: int = 0,
                 lower_tier_s_per_token: float = 0.0) -> None:
        """``prefill_budget``: most prompt tokens computed per step (0: no limit; whole
        prompts are admitted the first of a step however long); ``chunked_prefill`` and
        ``long_prefill_threshold``: vLLM V1's chunked prefill and its chunk cap (the
        :class:`~kvroute.core.scheduler.Scheduler`'s rules; only for an engine whose
        ``_next_tokens`` can compute part of a prompt); ``host_blocks``: a host tier
        behind the pool (:class:`BlockPool`; only for an engine whose ``_next_tokens`` need
        no KV data: blocks loaded from it hold none), loading a token's KV back in
        ``lower_tier_s_per_token``, reported in the load."""
        self.block_size = block_size
        self.model = model
        self.max_batch = max_batch
        self.stats = EngineStats()
        self.pool = BlockPool(capacity_blocks, self._emit, host_blocks=host_blocks)
        self.lower_tier_s_per_token = lower_tier_s_per_token
        self.sched: Scheduler[Seq] = Scheduler(
            self.pool, block_size, max_batch=max_batch, prefill_budget=prefill_budget,
            chunked=chunked_prefill, long_prefill_threshold=long_prefill_threshold)
        self._listeners: list[CacheListener] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dead: str | None = "engine not started"

    # -- hooks -----------------------------------------------------------------------------

    async def _next_tokens(self, seqs: list[Seq], prefill_tokens: int, loaded_tokens: int = 0
                           ) -> Sequence[int | BaseException]:
        """One token per sequence of ``seqs``, in order (step 2), or an exception that fails
        just that request. ``prefill_tokens`` counts the prompt tokens computed in this step
        (of ``seqs`` and, chunked, of prefills not done yet), ``loaded_tokens`` those its
        admissions load from the host tier."""
        raise NotImplementedError

    def _validate(self, request: EngineRequest) -> None:
        """Raise :class:`EngineError` for a request this engine cannot run."""

    def _new_seq(self, **fields: Any) -> Seq:
        return Seq(**fields)

    # -- Engine protocol -------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._dead = None
        self._task = asyncio.create_task(self._loop(), name=f"{self.kind}-engine:{self.model}")

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
        self.sched.add(seq)
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

    def healthy(self) -> bool:
        return True  # in-process: it lives as long as the agent

    def load(self) -> EngineLoad:
        sched = self.sched
        return EngineLoad(
            running=sched.num_running + sched.num_prefilling,
            queued=len(sched.waiting),
            free_blocks=self.pool.free_blocks,
            capacity_blocks=self.pool.capacity_blocks,
            pending_prefill_tokens=sched.pending_prefill_tokens(),
            max_running=self.max_batch,
            max_batched_tokens=sched.prefill_budget,
            prefill_mode=PrefillMode.of(sched.chunked),
            max_prefill_chunk=sched.long_prefill_threshold if sched.chunked else 0,
            lower_tier_s_per_token=self.lower_tier_s_per_token if self.pool.host_blocks else 0.0,
        )

    def cached_keys(self) -> list[int]:
        return self.pool.cached_keys()

    def lower_keys(self) -> list[int]:
        """The keys held only in the host tier."""
        return self.pool.lower_keys()

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

    def _make_seq(self, request: EngineRequest) -> Seq:
        bs, capacity = self.block_size, self.pool.capacity_blocks
        prompt = list(request.token_ids)
        n = len(prompt)
        if n == 0:
            raise RequestRefusedError(f"request {request.request_id}: empty prompt")
        if request.max_tokens < 1:
            raise RequestRefusedError(f"request {request.request_id}: max_tokens must be >= 1")
        prompt_blocks = -(-n // bs)
        if prompt_blocks > capacity:
            raise RequestRefusedError(
                f"request {request.request_id}: prompt of {n} tokens needs {prompt_blocks} "
                f"blocks of {bs}, more than the engine's whole KV cache "
                f"({capacity} blocks)", "RESOURCE_EXHAUSTED"
            )
        self._validate(request)
        hasher = BlockHasher(bs, self.model, request.cache_salt)
        try:
            keys = hasher.keys(prompt)
        except OverflowError as exc:
            raise RequestRefusedError(
                f"request {request.request_id}: token id out of range") from exc
        out_limit = min(request.max_tokens, capacity * bs - n + 1)
        return self._new_seq(
            request=request,
            hasher=hasher,
            tokens=prompt,
            prompt_tokens=n,
            output_tokens=out_limit,
            keys=keys,
        )

    def _abort(self, seq: Seq) -> None:
        seq.done = True
        self.sched.abort(seq)
        self.stats.aborted += 1

    def _fail_all(self, exc: EngineError) -> None:
        sched = self.sched
        for seq in [*sched.waiting, *sched.prefilling, *sched.running]:
            self._abort(seq)
            seq.out.put_nowait(exc)

    async def _loop(self) -> None:
        try:
            while True:
                if self.sched.idle():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await self._step()
        except Exception as exc:  # CancelledError (stop) is not an Exception: propagates
            log.exception("%s engine loop failed", self.kind)
            self._dead = f"engine loop failed: {exc!r}"
            self._fail_all(EngineError(self._dead))

    async def _step(self) -> None:
        bs, stats, sched = self.block_size, self.stats, self.sched
        it = sched.schedule()
        for seq in it.admitted:
            stats.admitted += 1
            stats.prefill_tokens += seq.prefill_left
            stats.cached_tokens += seq.cached_tokens
        # Token producers: the decoding batch, then the prefills this step completes.
        seqs = [*sched.running, *(r for r, take in it.chunks if take == r.prefill_left)]
        if not it.chunks and not seqs:
            # Cannot happen (an idle pool fits any admitted-size request); fail rather than spin.
            seq = sched.waiting[0]
            self._abort(seq)
            seq.out.put_nowait(EngineError("cannot allocate KV blocks for the request"))
            return
        stats.steps += 1
        stats.max_running = max(stats.max_running, sched.num_running + sched.num_prefilling)
        tokens = await self._next_tokens(seqs, it.prefill_tokens, it.loaded_tokens)
        sched.complete(it)  # stages the prompt blocks the step's chunks filled

        chunks: list[tuple[Seq, TokenChunk | BaseException]] = []
        for seq, tok in zip(seqs, tokens, strict=True):
            if seq.done:
                continue  # cancelled while the step ran: already left the batch
            if isinstance(tok, BaseException):
                chunks.append((seq, tok))
                continue
            seq.tokens.append(tok)
            seq.n_out += 1
            full = (seq.prompt_tokens + seq.n_out - 1) // bs  # blocks fully covered by KV
            if full > seq.stored_blocks:
                if full > len(seq.keys):
                    parent = seq.keys[-1] if seq.keys else None
                    seq.keys.extend(seq.hasher.iter_keys(
                        seq.tokens[len(seq.keys) * bs : full * bs], parent))
                sched.store(seq, full, seq.keys)
            if tok in seq.request.stop_token_ids:
                reason: str | None = "stop"
            elif seq.n_out >= seq.output_tokens:
                reason = "length"
            else:
                reason = None
            chunks.append((seq, TokenChunk((tok,), seq.cached_tokens, reason)))
            stats.generated_tokens += 1
        sched.flush()  # before finished sequences free their blocks
        for seq, chunk in chunks:
            if isinstance(chunk, BaseException):
                self._abort(seq)
            elif chunk.finish_reason is not None:
                seq.done = True
                sched.finish(seq)
                stats.finished += 1
            seq.out.put_nowait(chunk)
