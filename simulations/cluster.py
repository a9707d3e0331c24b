"""One simulated worker: the sim engine's paged prefix cache under continuous batching.

The cache is :class:`kvroute.core.block_pool.BlockPool` and the scheduler
:class:`kvroute.core.scheduler.Scheduler` -- the very code the ``sim`` engine runs -- so
admissions, hits and LRU evictions are the engine's. Time is simulated, not slept: the
worker runs its iterations lazily up to the time of the next routing decision.

Scheduling, per iteration (the scheduler's rules, see its module doc: vLLM's, without
preemption):

1. Admit waiting requests FIFO while the batch is under ``max_batch``, the prefill budget of
   the iteration (``prefill_budget`` new tokens; at least one request) is not spent, and the
   pool can allocate the request's blocks: its cached prefix blocks are pinned (at most
   ``(prompt - 1) // B`` of them: one prompt token is always computed) and the rest of
   ``ceil((prompt + output - 1) / B)`` taken fresh, evicting LRU cached blocks.
2. The iteration lasts :meth:`CostModel.prefill_s` of every admitted request plus one decode
   step of the running batch. Admitted requests get their first token at its end and their
   full prompt blocks are stored in the cache (one cache event); running ones one more token.
3. Each block of the reply is stored (a cache event) at the decode step that fills it, as
   engines store generated tokens (``reply_keys``: a chat turn or agent call that carries
   the reply hits them): the step whose KV completes the block, the one producing token
   ``n`` computing the KV of ``prompt + n - 1`` tokens. Within a stretch of decode steps
   run in one jump, each block's event gets the time of its own step. So a router sees
   all of a reply but its last block or two by the time the reply ends, as a real one
   does (storing them all at the end hid the whole reply from the router for the
   propagation delay). A sequence that has produced ``output`` tokens finishes and its
   blocks are freed (they stay cached until evicted). A request another waits for
   (``watched``) is reported in ``ended`` when it finishes, and ``advance(...,
   stop_at_end=True)`` stops there, so that continuation is sent on time.

A request may wait for another's prefill (``after``): the branches of a controller-program
fork, and siblings the router coalesces, reach the queue (its tail) only once the agent or
router sees that prefill's first token, so they hit its prefix. Until then they are
``held``: counted in the router's in-flight load, not in the engine's queue, and blocking no
one.

With ``chunked_prefill`` (vLLM V1's scheduler, on by default there) an iteration has one token
budget, ``prefill_budget``: the running batch's decode tokens take one each, then prefills in
progress continue oldest first, then waiting requests are admitted FIFO; a prefill longer
than what is left of the budget takes the rest and goes on in the next iteration. So the
running batch decodes between a long prompt's chunks instead of stalling for its whole
prefill, and requests behind it are admitted into its last chunk's leftover budget. Each chunk
stores the blocks it completes; the first token comes at the end of the last chunk. With
``long_prefill_threshold`` (vLLM's ``--long-prefill-token-threshold``) no prefill computes more
than that many tokens in one iteration, running or newly admitted, so requests queued behind
a long prompt are admitted beside its first chunk rather than its last.

Stretches of pure decoding with no arrival and no finish are run in one jump.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.core.block_pool import BlockPool
from kvroute.core.cache_events import CacheEvent
from kvroute.core.load import PrefillMode, SentTraffic, WorkerLoad, prefill_context
from kvroute.core.policies.cost_model import CostModel
from kvroute.core.scheduler import Scheduler, blocks_needed

EventSink = Callable[[float, str, CacheEvent], None]


@dataclass(slots=True)
class SimRequest:
    """A trace request's life in the cluster."""

    idx: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    keys: tuple[int, ...]
    reply_keys: tuple[int, ...] = ()  # of the full blocks its reply fills (stored as filled)
    reply_stored_s: list[float] = field(default_factory=list)  # when each was stored
    worker: str = ""
    routed_uncached: int = 0  # the router's estimate when it chose the worker
    routed_context: int = 0  # ... and what those tokens attend to (prefill_context)
    cached_tokens: int = 0
    loaded_tokens: int = 0  # of cached_tokens, those loaded from its worker's host tier
    first_token_s: float = math.nan
    finished_s: float = math.nan
    blocks: list[int] = field(default_factory=list)
    done_step: int = 0  # its worker's decode-step count when its last token is out
    after: SimRequest | None = None  # not admitted before this one's prefill has finished
    moved_tokens: int = 0  # cached on another worker but not on its own, when it was routed
    prefill_left: int = 0  # uncached tokens not computed yet (the scheduler's)
    stored_blocks: int = 0  # leading blocks stored so far (the scheduler's)
    watched: bool = False  # a continuation waits for it to end (closed-loop replay)
    waited_s: float = 0.0  # sent this long after its trace time: the reply it continues ended then
    copy_of: int = -1  # a router's background copy of a hot prefix: the request that made it
    router: int = 0  # the router replica that routed it (ClusterSpec.routers)


def _held(r: SimRequest, now: float) -> bool:
    """Whether ``r`` still waits, at ``now``, for the first token of the request it follows
    (``nan``: that one is not even admitted yet, and compares false)."""
    return r.after is not None and not r.after.first_token_s <= now


class SimWorker:
    def __init__(self, name: str, capacity_blocks: int, block_size: int, cost: CostModel,
                 sink: EventSink, *, host_blocks: int = 0, max_batch: int = 256,
                 prefill_budget: int = 16384,
                 chunked_prefill: bool = False, long_prefill_threshold: int = 0) -> None:
        self.name = name
        self.block_size = block_size
        self.cost = cost
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.chunked_prefill = chunked_prefill
        self.long_prefill_threshold = long_prefill_threshold
        self._sink = sink
        self._now = 0.0
        self.pool = BlockPool(capacity_blocks, listener=self._emit, host_blocks=host_blocks)
        # Owns the queue and the prefills in progress; ``running`` below indexes its
        # decoding set by finish step.
        self.sched: Scheduler[SimRequest] = Scheduler(
            self.pool, block_size, max_batch=max_batch, prefill_budget=prefill_budget,
            chunked=chunked_prefill, long_prefill_threshold=long_prefill_threshold)
        self.t = 0.0  # when the engine is next free to start an iteration
        # Requests held (by the agent or router, not in the engine's queue) until the request
        # they follow (``after``) has its first token: they then join the queue's tail.
        self.held: list[SimRequest] = []
        # The decoding batch, a heap by ``done_step`` (then by join order): a decode
        # stretch jumps to its first finish and an iteration frees only what finished,
        # instead of counting down every sequence at every step.
        self.running: list[tuple[int, int, SimRequest]] = []
        # Reply blocks still to fill, a heap by the decode step that fills each: (step,
        # join order, request); one entry per running request, for its next block.
        self._fills: list[tuple[int, int, SimRequest]] = []
        self.steps = 0  # decode steps run (each gives every running sequence a token)
        self._joined = 0  # sequences that joined the batch: the heap's tie-break
        self.pending_prefill = 0  # router-side estimate of uncached tokens not yet prefilled
        self.pending_context = 0  # ... and the context they attend to (prefill_context)
        self.prefill_tokens = 0  # uncached tokens actually prefilled
        self.busy_s = 0.0
        self.finished: list[SimRequest] = []
        self._version = 0  # bumped on every state change, to reuse the load view
        self._load_key: tuple[int, int, bool, int] | None = None
        # Requests routed here and the tokens they had to prefill, as the router counts them
        # (registry.begin); the replay counts from its first arrival.
        self.sent = SentTraffic()
        self._admitted: list[SimRequest] = []  # prefilled in the latest admitting iteration
        self._admitted_end = 0.0  # ... which ends then (their first token)
        self._load = WorkerLoad()
        # Watched requests here not ended yet (by idx), and those ended since the replay
        # last collected them (``ended``; it clears the list).
        self.watched: dict[int, SimRequest] = {}
        self.ended: list[SimRequest] = []

    def _emit(self, ev: CacheEvent) -> None:
        self._sink(self._now, self.name, ev)

    @property
    def waiting(self) -> deque[SimRequest]:
        """The engine's queue, FIFO."""
        return self.sched.waiting

    @property
    def prefilling(self) -> list[SimRequest]:
        """Admitted requests whose (chunked) prefill is in progress, oldest first."""
        return self.sched.prefilling

    def _busy(self) -> bool:
        return bool(self.sched.waiting or self.running or self.sched.num_prefilling)

    def load(self, cached_blocks: int, now: float) -> WorkerLoad:
        """The load view at ``now`` (rebuilt only when it changed).

        As the production router counts it, a request's uncached tokens stay pending until
        its first token: so those of the requests whose prefill iteration is still running at
        ``now`` (it started before ``now`` and ends after) are pending too. The arrival rate
        is read when the view is rebuilt, at least once a second (as often as the router
        refreshes a worker's load from its heartbeat)."""
        prefilling = self._admitted_end > now
        key = (self._version, cached_blocks, prefilling, math.floor(now))
        if self._load_key != key:
            self._load_key = key
            self._load = self._build_load(cached_blocks, prefilling,
                                          self.sent.arrivals.at(now), self.sent.prefills.at(now))
        return self._load

    def _build_load(self, cached_blocks: int, prefilling: bool, arrival_rate: float,
                    prefill_rate: float) -> WorkerLoad:
        chunking = self.sched.prefilling
        pending = self.pending_prefill + sum(r.routed_uncached for r in chunking)
        context = self.pending_context + sum(r.routed_context for r in chunking)
        if prefilling:
            pending += sum(r.routed_uncached for r in self._admitted)
            context += sum(r.routed_context for r in self._admitted)
        return WorkerLoad(
            inflight=len(self.running) + len(chunking) + len(self.sched.waiting)
            + len(self.held),
            running=len(self.running) + len(chunking),
            queued=len(self.sched.waiting), free_blocks=self.pool.free_blocks,
            capacity_blocks=self.pool.capacity_blocks,
            pending_prefill_tokens=pending, cached_blocks=cached_blocks,
            max_running=self.max_batch, max_batched_tokens=self.prefill_budget,
            arrival_rate=arrival_rate, pending_prefill_context=context,
            prefill_rate=prefill_rate,
            prefill_mode=PrefillMode.of(self.chunked_prefill),
            max_prefill_chunk=self.long_prefill_threshold if self.chunked_prefill else 0,
            lower_tier_s_per_token=self.cost.lower_tier_s_per_token
            if self.pool.host_blocks else 0.0)

    def submit(self, req: SimRequest, now: float) -> None:
        if blocks_needed(req.prompt_tokens, req.output_tokens, self.block_size) \
                > self.pool.capacity_blocks:
            raise ValueError(f"request {req.idx} ({req.prompt_tokens}+{req.output_tokens} "
                             f"tokens) cannot fit a worker of {self.pool.capacity_blocks} "
                             f"blocks; raise --capacity-blocks")
        req.worker = self.name
        self._version += 1
        self.pending_prefill += req.routed_uncached
        req.routed_context = prefill_context(req.routed_uncached,
                                             req.prompt_tokens - req.routed_uncached)
        self.pending_context += req.routed_context
        if not self._busy():
            self.t = max(self.t, now)
        if _held(req, now):
            self.held.append(req)
        else:
            self.sched.add(req)
        if req.watched:
            self.watched[req.idx] = req

    def end_bound(self) -> float:
        """The earliest time a watched request here can end (inf: none here): no iteration
        starts before ``t``, each gives a running sequence one token and lasts at least
        ``decode_step_s(1)``; one that has not started decoding needs ``output - 1`` of them
        after its first token."""
        watched = self.watched
        if not watched:
            return math.inf
        steps = self.steps
        left = min(r.output_tokens - 1 if math.isnan(r.first_token_s)  # not decoding yet
                   else r.done_step - steps for r in watched.values())
        return self.t + max(0, left) * self.cost.decode_step_s(1)

    def advance(self, until: float, stop_at_end: bool = False) -> None:
        """Run every iteration that starts before ``until``; with ``stop_at_end``, stop after
        one in which a watched request ends (it is then in ``ended``)."""
        while (self.held or self._busy()) and self.t < until \
                and not (stop_at_end and self.ended):
            self._version += 1
            if not self._busy():
                # Only held requests: idle until the first is released; none known yet:
                # stop.
                parents = [r.after.first_token_s for r in self.held if r.after is not None]
                nxt = min((t for t in parents if not math.isnan(t)), default=math.inf)
                if not nxt < until:
                    break
                self.t = max(self.t, nxt)
            if not self._iterate():
                self._decode_stretch(until)

    def _iterate(self) -> bool:
        """One iteration with a prefill (the scheduler's admissions and chunks); False when
        it has none to do (the caller then runs a decode stretch)."""
        start = self.t
        self._now = start
        if self.held:
            self._release_held(start)
        sched = self.sched
        it = sched.schedule()
        if not it.chunks:
            return False
        for r in it.admitted:
            self.pending_prefill -= r.routed_uncached
            self.pending_context -= r.routed_context
            self.prefill_tokens += r.prefill_left
        cost = self.cost
        # Each chunk attends to the prompt tokens computed before it.
        work = sum(cost.prefill_s(take, r.prompt_tokens - r.prefill_left) for r, take in it.chunks)
        # Blocks loaded from the host tier: transferred before the forward pass, not hidden
        # behind it (a bound: engines overlap part of it layer by layer).
        work += cost.load_s(it.loaded_tokens)
        for r, n in it.loaded:
            r.loaded_tokens = n
        end = start + work + cost.decode_step_s(len(self.running))
        self._now = end
        done = sched.complete(it)
        sched.flush()
        self._end_iteration(start, end, done)
        return True

    def _end_iteration(self, start: float, end: float, first: list[SimRequest]) -> None:
        """Close an iteration ending at ``end``: ``first`` (whose prefill it completed) get
        their first token, the running batch one more token each."""
        self._admitted = first
        self._admitted_end = end
        for r in first:
            r.first_token_s = end
        self._finish_step(start, end, 1)
        for r in first:
            left = r.output_tokens - 1
            if r.reply_keys and left > 0:
                # Token n comes at step steps + n - 1 and completes the KV of prompt + n - 1
                # tokens: the reply's first block (the prompt's partial last one, if any) is
                # full when that reaches (len(keys) + 1) * B.
                fill = self.steps + (len(r.keys) + 1) * self.block_size - r.prompt_tokens
                heapq.heappush(self._fills, (fill, self._joined, r))
            if left <= 0:
                self._finish(r, end)
            else:
                r.done_step = self.steps + left
                heapq.heappush(self.running, (r.done_step, self._joined, r))
                self._joined += 1
        self.busy_s += end - start
        self.t = end

    def tokens_left(self, r: SimRequest) -> int:
        """Tokens a running sequence has still to produce."""
        return r.done_step - self.steps

    def _release_held(self, now: float) -> None:
        """Queue the held requests whose ``after`` has its first token by ``now``, in the
        order they were held."""
        still = []
        for r in self.held:
            if _held(r, now):
                still.append(r)
            else:
                self.sched.add(r)
        self.held = still

    def _decode_stretch(self, until: float) -> None:
        if not self.running:  # waiting but nothing admissible and nothing to free: stuck
            raise RuntimeError(f"{self.name}: head request can never be admitted")
        step = self.cost.decode_step_s(len(self.running))
        # Nothing changes before the next finish (the queue head cannot be admitted until
        # one frees blocks or a batch slot; arrivals only join the tail): jump to it, but
        # not past `until`, so the load the router sees then is exact.
        k = self.running[0][0] - self.steps
        if until != math.inf:
            k = min(k, max(1, math.ceil((until - self.t) / step)))
        end = self.t + k * step
        self._now = end
        self._finish_step(self.t, end, k)
        self.busy_s += end - self.t
        self.t = end

    def _finish_step(self, start: float, end: float, k: int) -> None:
        """``k`` decode steps from ``start`` to ``end`` (each as long): the reply blocks they
        fill are stored, each at its own step's end, then the sequences whose last token
        they produce finish, in the order they joined the batch (the order their blocks are
        freed in decides which the LRU evicts first)."""
        first = self.steps
        self.steps += k
        fills = self._fills
        if fills and fills[0][0] <= self.steps:
            step_s = (end - start) / k
            bs = self.block_size
            while fills and fills[0][0] <= self.steps:
                s, order, r = heapq.heappop(fills)
                if not r.blocks:
                    continue  # ended first: it had more reply keys than its output fills
                j = len(r.reply_stored_s)
                self._now = start + (s - first) * step_s
                n = len(r.keys)
                self.sched.store(r, n + j + 1, r.reply_keys, offset=n)
                self.sched.flush()
                r.reply_stored_s.append(self._now)
                if j + 1 < len(r.reply_keys):
                    heapq.heappush(fills, (s + bs, order, r))
            self._now = end
        heap = self.running
        if heap and heap[0][0] <= self.steps:
            done = []
            while heap and heap[0][0] <= self.steps:
                done.append(heapq.heappop(heap))
            done.sort(key=lambda entry: entry[1])
            for _, _, r in done:
                self._finish(r, end)

    def _finish(self, r: SimRequest, end: float) -> None:
        r.finished_s = end
        self.sched.finish(r)
        self.finished.append(r)
        if r.watched:
            del self.watched[r.idx]
            self.ended.append(r)
