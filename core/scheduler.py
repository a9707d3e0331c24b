"""How an engine admits work: the iteration scheduler of the sim and tiny engines and of the
replay simulator's workers, modelled on vLLM V1's scheduler (without preemption).

Pure and clock-free: it owns the waiting queue, the prefills in progress and the decoding
(running) set over a :class:`~kvroute.core.block_pool.BlockPool`, and decides each iteration
what is computed; a driver says how long that takes (the sim engine sleeps, the tiny engine
runs a model, the replay's ``SimWorker`` advances simulated time), which keys a decoded block
gets, and when a sequence ends (its output count, a stop token, a cancel).

An iteration, driven as::

    it = sched.schedule()          # admissions and each prefill's chunk
    ... compute it ...             # every running sequence decodes one token besides
    first = sched.complete(it)     # prefills done: they got their first token, now decode
    sched.store(seq, n_blocks, keys)   # decoded tokens that fill a block (driver's keys)
    sched.flush()                  # one Op.STORE for the iteration's full blocks
    sched.finish(seq)              # a sequence that produced its last token

Rules (``B`` = block size):

* **Cache hit**, looked up at admission, capped so that at least one prompt token is
  computed (as vLLM)::

      hit_blocks    = min(longest cached prefix of the prompt's keys, (prompt - 1) // B)
      cached_tokens = hit_blocks * B

  With a host tier (``BlockPool.host_blocks``) the blocks that follow the hits in it, up to
  the same cap, are loaded into fresh blocks instead of computed: they count in
  ``cached_tokens``, are staged for the cache at admission, and the iteration's
  ``loaded_tokens`` says what the driver spends on the transfer.

* **Reservation**: an admitted sequence pins its hit blocks and takes the rest of its blocks
  fresh, up front for its whole life, so it never runs out and nothing is preempted (vLLM
  allocates as it goes and preempts instead; up front, the blocks are the ones vLLM ends
  with). Its KV at the end covers every token but the last output, whose KV is never
  computed, as vLLM allocates slots for exactly the tokens it computes::

      need_blocks = ceil((prompt + output - 1) / B)          (blocks_needed)

  ``output`` is the most tokens it may generate. Fresh blocks evict the LRU cached ones.
* **Admission** is FIFO with head-of-line blocking: the head is admitted only if the batch
  (decoding + prefilling) is under ``max_batch``, the pool can allocate its blocks, and
  the iteration's prefill budget allows; otherwise nothing behind it is admitted either.
* **Whole prompts** (``chunked=False``): an admitted sequence prefills its whole uncached
  prompt in its first iteration. The admissions of one iteration compute at most
  ``prefill_budget`` uncached tokens (0: no limit), except that the first one is always
  admitted, however long. Decoding sequences do not spend the budget.
* **Chunked prefill** (``chunked=True``, vLLM V1): one token budget per iteration,
  ``prefill_budget``: the decoding sequences take one token each first, then prefills in
  progress continue oldest first, then waiting sequences are admitted while budget is left;
  each prefill takes ``min(its uncached rest, budget left, long_prefill_threshold or
  budget)`` tokens and, if that is not all of it, goes on next iteration.
* **Stores**: at :meth:`complete` each chunk's newly full prompt blocks (``computed // B``,
  at most ``len(keys)``) are staged; the driver stages decoded blocks (a block is full once
  the KV of ``(i + 1) * B`` tokens is computed; the step producing output token ``n``
  computes that of ``prompt + n - 1``). :meth:`flush` commits all staged blocks in one
  ``Op.STORE`` (a block whose key another block already holds stays uncached).
* A sequence whose prefill completes in an iteration gets its first token at its end and
  joins the decoding set; :meth:`finish` frees its blocks (they stay cached until evicted).

Invariants (between calls): a sequence is in exactly one of ``waiting``, ``prefilling``,
``running``, or none (finished/aborted: its blocks freed, ``blocks == []``); a prefilling or
running sequence holds exactly ``blocks_needed`` blocks, its first ``cached_tokens // B``
the hits and the blocks loaded from the host tier; ``0 <= prefill_left <= prompt -
cached_tokens``, and ``prefill_left == 0`` for a running one; ``len(running) +
len(prefilling) <= max_batch``; ``stored_blocks * B`` never exceeds the tokens whose KV is
computed. A sequence aborted between :meth:`schedule` and
:meth:`complete` (a cancel while the iteration runs) is skipped by the latter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvroute.core.block_pool import BlockPool


class Schedulable(Protocol):
    """What the scheduler reads and writes of a sequence (the driver's request object)."""

    prompt_tokens: int
    output_tokens: int
    """Most output tokens: blocks are reserved for them."""
    keys: Sequence[int]
    """Chained keys of (at least) the prompt's full blocks, in order."""
    blocks: list[int]
    """Its block table (set at admission, emptied when it ends)."""
    cached_tokens: int
    """Prompt tokens served from the cache (set at admission)."""
    prefill_left: int
    """Uncached prompt tokens not computed yet."""
    stored_blocks: int
    """Leading blocks committed to the cache (or hits)."""


S = TypeVar("S", bound=Schedulable)


def blocks_needed(prompt_tokens: int, output_tokens: int, block_size: int) -> int:
    """Blocks a sequence holds over its life: ``ceil((prompt + output - 1) / B)``."""
    return -(-(prompt_tokens + output_tokens - 1) // block_size)


@dataclass(slots=True)
class Iteration(Generic[S]):
    """What one iteration computes besides one decode token per running sequence."""

    chunks: list[tuple[S, int]] = field(default_factory=list)
    """``(sequence, prompt tokens it computes)``: prefills in progress, then admissions."""
    admitted: list[S] = field(default_factory=list)
    """Admitted in this iteration (their hits are pinned, ``cached_tokens`` set)."""
    decodes: int = 0
    """Sequences decoding in it (``len(running)`` when scheduled)."""
    loaded: list[tuple[S, int]] = field(default_factory=list)
    """``(sequence, prompt tokens it loads from the host tier instead of computing)``."""

    @property
    def loaded_tokens(self) -> int:
        return sum(n for _, n in self.loaded)

    @property
    def prefill_tokens(self) -> int:
        return sum(take for _, take in self.chunks)


class Scheduler(Generic[S]):
    """See the module doc. ``prefill_budget`` 0 means no limit (whole prompts only);
    ``long_prefill_threshold`` caps chunks, so it means nothing without ``chunked``."""

    def __init__(self, pool: BlockPool, block_size: int, *, max_batch: int,
                 prefill_budget: int = 0, chunked: bool = False,
                 long_prefill_threshold: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if max_batch <= 0:
            raise ValueError(f"max_batch must be > 0, got {max_batch}")
        if prefill_budget < 0:
            raise ValueError(f"prefill_budget must be >= 0, got {prefill_budget}")
        if long_prefill_threshold < 0:
            raise ValueError(f"long_prefill_threshold must be >= 0, got {long_prefill_threshold}")
        if chunked and prefill_budget <= 0:
            raise ValueError("chunked prefill needs a prefill_budget > 0 (its one token budget "
                             f"per iteration), got {prefill_budget}")
        self.pool = pool
        self.block_size = block_size
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.chunked = chunked
        self.long_prefill_threshold = long_prefill_threshold
        self.waiting: deque[S] = deque()
        # By id: drivers' request objects need not be hashable; dicts keep join order.
        self._prefilling: dict[int, S] = {}
        self._running: dict[int, S] = {}
        self._stage_blocks: list[int] = []
        self._stage_keys: list[int] = []
        self._loaded: list[tuple[S, int]] = []  # this schedule()'s loads from the host tier

    # -- queries ---------------------------------------------------------------------------

    @property
    def prefilling(self) -> list[S]:
        """Admitted sequences whose prefill is not done, oldest first."""
        return list(self._prefilling.values())

    @property
    def running(self) -> list[S]:
        """Decoding sequences, in the order they joined."""
        return list(self._running.values())

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_prefilling(self) -> int:
        return len(self._prefilling)

    def idle(self) -> bool:
        return not (self.waiting or self._prefilling or self._running)

    def hit_blocks(self, seq: S) -> list[int]:
        """The cached blocks ``seq`` would pin if admitted now (capped; module doc)."""
        return self.pool.lookup(seq.keys[: (seq.prompt_tokens - 1) // self.block_size])

    def pending_prefill_tokens(self) -> int:
        """Uncached prompt tokens not computed yet: the waiting ones' (at today's hits) and
        the prefills in progress' rest."""
        bs, longest = self.block_size, self.pool.longest_cached_prefix
        pending = sum(r.prefill_left for r in self._prefilling.values())
        for r in self.waiting:
            pending += r.prompt_tokens - \
                longest(r.keys[: (r.prompt_tokens - 1) // bs]) * bs
        return pending

    # -- one iteration ---------------------------------------------------------------------

    def add(self, seq: S) -> None:
        """Queue ``seq`` at the tail."""
        self.waiting.append(seq)

    def schedule(self) -> Iteration[S]:
        """Decide the next iteration (module doc): admit, and size each prefill's chunk."""
        it: Iteration[S] = Iteration(decodes=len(self._running))
        chunks, prefilling, waiting = it.chunks, self._prefilling, self.waiting
        room = self.max_batch - len(self._running) - len(prefilling)
        if self.chunked:
            budget = self.prefill_budget - len(self._running)
            cap = self.long_prefill_threshold or budget
            for r in prefilling.values():
                if budget <= 0:
                    break
                take = min(r.prefill_left, budget, cap)
                chunks.append((r, take))
                budget -= take
            while waiting and budget > 0 and room > 0 and self._admit_head(None):
                r = waiting.popleft()
                it.admitted.append(r)
                room -= 1
                take = min(r.prefill_left, budget, cap)
                chunks.append((r, take))
                budget -= take
        else:
            budget = self.prefill_budget or None
            while waiting and room > 0 and self._admit_head(budget if it.admitted else None):
                r = waiting.popleft()
                it.admitted.append(r)
                room -= 1
                chunks.append((r, r.prefill_left))
                if budget is not None:
                    budget -= r.prefill_left
        it.loaded, self._loaded = self._loaded, []
        return it

    def _admit_head(self, max_new: int | None) -> bool:
        """Admit the queue's head (left at the head for the caller to pop) unless it needs
        more than ``max_new`` uncached tokens or its blocks do not fit; False, nothing changed."""
        bs, pool = self.block_size, self.pool
        r = self.waiting[0]
        hits = self.hit_blocks(r)
        h = len(hits)
        loaded = (pool.host_prefix(r.keys[h:(r.prompt_tokens - 1) // bs])
                  if pool.host_blocks else 0)
        if max_new is not None and r.prompt_tokens - (h + loaded) * bs > max_new:
            return False
        need = blocks_needed(r.prompt_tokens, r.output_tokens, bs) - h
        if not pool.can_allocate(need, hits):
            return False
        if loaded:  # used now: the evictions this allocation writes back go after them
            pool.load_from_host(r.keys[h:h + loaded])
        r.blocks = pool.allocate(need, hits)
        r.cached_tokens = (h + loaded) * bs
        r.stored_blocks = h
        if loaded:
            self.store(r, h + loaded, r.keys)
            self._loaded.append((r, loaded * bs))
        r.prefill_left = r.prompt_tokens - r.cached_tokens
        self._prefilling[id(r)] = r
        return True

    def complete(self, it: Iteration[S]) -> list[S]:
        """The iteration ran: apply each chunk, stage the prompt blocks it filled, and move
        the finished prefills to the decoding set. Returns them (their first token is this
        iteration's), oldest first. Sequences aborted meanwhile are skipped."""
        bs, prefilling = self.block_size, self._prefilling
        for r, take in it.chunks:
            if id(r) not in prefilling:
                continue
            r.prefill_left -= take
            full = min((r.prompt_tokens - r.prefill_left) // bs, len(r.keys))
            if full > r.stored_blocks:
                self.store(r, full, r.keys)
        done = [r for r in prefilling.values() if not r.prefill_left]
        for r in done:
            del prefilling[id(r)]
            self._running[id(r)] = r
        return done

    def store(self, seq: S, full_blocks: int, keys: Sequence[int], offset: int = 0) -> None:
        """Stage ``seq``'s now-full blocks ``[stored_blocks, full_blocks)`` for the next
        :meth:`flush`, block ``i`` under ``keys[i - offset]`` (``offset`` 0: ``keys`` is
        indexed like its block table; a reply's keys start at ``len(prompt keys)``)."""
        lo = seq.stored_blocks
        if full_blocks <= lo:
            return
        if lo < offset or full_blocks > len(seq.blocks) or full_blocks - offset > len(keys):
            raise ValueError(f"store of blocks [{lo}, {full_blocks}): the sequence holds "
                             f"{len(seq.blocks)}, keys given for [{offset}, "
                             f"{offset + len(keys)})")
        self._stage_blocks.extend(seq.blocks[lo:full_blocks])
        self._stage_keys.extend(keys[lo - offset:full_blocks - offset])
        seq.stored_blocks = full_blocks

    def flush(self) -> list[int]:
        """Commit every staged block in one ``Op.STORE``; returns the keys newly stored.
        Call it before :meth:`finish` frees them (only in-use blocks can be committed)."""
        if not self._stage_blocks:
            return []
        blocks, keys = self._stage_blocks, self._stage_keys
        self._stage_blocks, self._stage_keys = [], []
        return self.pool.commit(blocks, keys)

    def finish(self, seq: S) -> None:
        """``seq`` produced its last token: leave the decoding set, free its blocks."""
        del self._running[id(seq)]
        self.pool.free(seq.blocks)
        seq.blocks = []

    def abort(self, seq: S) -> bool:
        """Drop ``seq`` wherever it is, freeing its blocks; False if it was in none."""
        key = id(seq)
        if self._running.pop(key, None) is None and self._prefilling.pop(key, None) is None:
            # By identity: a driver's request objects may compare equal by value.
            for i, r in enumerate(self.waiting):
                if r is seq:
                    del self.waiting[i]
                    return True
            return False
        self.pool.free(seq.blocks)
        seq.blocks = []
        return True
