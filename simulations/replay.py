"""Replay a trace through a simulated cluster behind a router running a real policy.

The router side is production code: :class:`kvroute.core.index.PrefixIndex` fed by the
workers' cache events, and :func:`kvroute.router.decide.rank_request` with a policy object
from :data:`kvroute.simulations.policies.REPLAY_REGISTRY`. Cache events reach the router's
index ``propagation_s`` after the engine emitted them (the agent -> Redis -> router path), so
routing decisions see stale state exactly as a real router does. With ``predict_ttl_s`` (the
router's default, 600 s) the router predicts that a routed prompt's blocks will be on its
worker until its events arrive (``PrefixIndex.predict``), as the production router does with
``--predict-ttl-s``, and a request routed there on a prediction is held until that
prefill's first token (:class:`kvroute.router.coalesce.InflightPrefixes`): the worker queues
it only then (``SimWorker.held``), as it would receive it from the router. A request that
would get less than ``coalesce_share`` of that prefill is decided again on what workers
really hold instead (:func:`kvroute.router.decide.rerank_confirmed`), as the router does.
Workers cache replies as engines do: each full block a request's reply fills is stored at
the decode step that fills it (:meth:`Trace.reply_keys` reads their keys from the request
that continues it), so a chat turn or agent call hits the previous reply where it was
generated, and the router has seen all but its last block or two when it ends.
By default every request is sent at its trace time (open loop: what a rate scale scales), so a
trace replayed faster than recorded can have a turn overtake the reply it carries. With
``closed_loop`` such a continuation is sent when that reply ends, or at its trace time if that
is later, as its client would send it: the workers running replies that a continuation waits
for are run ahead, in the order they can end one (:meth:`Replayer._run_to_next`), so each
continuation is routed at the very time its reply ends, and its TTFT counts from then
(``SimRequest.waited_s``: how much later than its trace time). A session's requests are then
serial, so scaling the rate raises the load only as far as its sessions can.
The load view is the router's own accounting (requests outstanding, its estimate of
uncached tokens not yet prefilled, released at each request's first token as the production
router releases it) plus the engine's queue and batch, as an agent's heartbeat reports them.

A policy that places replicas (``Policy.places_replicas``, kvroute's) may name a worker to
copy the request's longest cached prefix to: the replay sends that copy as the
router does (:class:`kvroute.router.copies.PrefixCopier`): a one-token request of the
prefix's whole blocks, at most one per prefix and worker before its first token, counted on
that worker's load and coalesced on like any prefill, but not among the trace's requests
(``ReplayResult.copies``; their prefill is reported apart from the hit ratio). The router's
cap on copies in flight (``--max-copies``, 4) is not modelled: on the generated rag traces
and the Mooncake trace (16 workers, 50% and 95% load) a replay makes 3-15 copies, at most 2
at once.

With ``programs``, requests that share a ``program`` id are the branches of one controller
program, run as kvroute's agent runs them: the router places the program once (by its first
branch's prompt), and the agent runs every branch on that worker: the first prefills the
branches' longest common prefix with its own suffix, the others start once it has and find
the prefix cached (all at once when the worker holds it already; see ``_ForkGroup``).
Without it, each branch is an independent request, routed on its own -- what every peer
router does. With ``overflow`` (the router's default), a program whose branches do not fit
its worker's batch is split as the router splits it
(:func:`kvroute.core.placement.place_fork`, one branch = weight 1): on each overflow worker
its first branch prefills the shared prefix once and the others follow it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.core.cache_events import CacheEvent
from kvroute.core.config import COALESCE_SHARE, PREDICT_TTL_S
from kvroute.core.index import PrefixIndex
from kvroute.core.load import PrefixDemand, SentTraffic, WorkerLoad
from kvroute.core.placement import place_fork
from kvroute.core.policies import Policy
from kvroute.core.policies.cost_model import CostModel
from kvroute.core.redis_schema import Op
from kvroute.router.coalesce import InflightPrefixes
from kvroute.router.copies import copy_blocks
from kvroute.router.decide import rank_request, rerank_confirmed
from kvroute.router.registry import seen_load
from kvroute.simulations.cluster import SimRequest, SimWorker
from kvroute.simulations.trace import Trace


@dataclass(slots=True)
class _ForkGroup:
    """A program's branches placed on one worker, run as the agent runs a fork: when the
    worker lacks the branches' shared prefix (``prefix_tokens``, its full blocks), the first
    branch to start leads, prefilling the prefix with its own suffix, and the others are
    admitted once its first token is out, so they find the prefix cached; when the worker
    holds it, they all start at once."""

    cached_tokens: int  # of the program's prompt cached on the worker when it was placed
    prefix_tokens: int
    leader: SimRequest | None = None

    def join(self, req: SimRequest) -> None:
        """Set ``req``'s prefill to wait for, and what the router expects it to compute."""
        if self.leader is not None and self.cached_tokens < self.prefix_tokens:
            req.after = self.leader
            req.routed_uncached = req.prompt_tokens - self.prefix_tokens
        else:
            self.leader = req
            req.routed_uncached = req.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class ClusterSpec:
    workers: int = 16
    capacity_blocks: int = 937
    max_batch: int = 256
    prefill_budget: int = 16384
    chunked_prefill: bool = False  # vLLM V1's scheduler (see simulations/cluster.py)
    long_prefill_threshold: int = 0  # > 0: most tokens of one prefill per iteration (chunked)
    propagation_s: float = 0.05
    # > 0: the router predicts a routed prompt's blocks until stored, at most this long, and
    # coalesces on them
    predict_ttl_s: float = PREDICT_TTL_S
    coalesce_share: float = COALESCE_SHARE  # see kvroute.router.coalesce
    programs: bool = False  # run forks as controller programs (see Replayer)
    copies: bool = True  # False: no background copies, as a router with --max-copies 0
    # True: a continuation (a chat turn, an agent call) is sent no earlier than the reply it
    # carries has ended (see Replayer); False: every request at its trace time.
    closed_loop: bool = False
    overflow: bool = True  # programs: split a fork that does not fit (router's placement)
    cost: CostModel = field(default_factory=CostModel)
    # Router replicas the arrivals are split over (round robin), each with its own index,
    # predictions and in-flight counts; > 1: each sees the others' traffic only through the
    # workers' heartbeats, every heartbeat_s (see _Router).
    routers: int = 1
    heartbeat_s: float = 1.0
    # Several routers: each routing decision (worker, uncached tokens, predicted prefix)
    # reaches the other routers propagation_s later, as if published beside the feed; they
    # count it in their in-flight view and predict and coalesce on it as on their own.
    share_inflight: bool = False

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ValueError(f"routers must be >= 1, got {self.routers}")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.long_prefill_threshold < 0:
            raise ValueError(f"long_prefill_threshold must be >= 0 (0: none), got "
                             f"{self.long_prefill_threshold}")
        if self.long_prefill_threshold and not self.chunked_prefill:
            raise ValueError("a long-prefill threshold caps the chunks of a chunked prefill: "
                             "it needs chunked prefill (--chunked-prefill)")


class _Router:
    """One router replica's own state: what the production router keeps per process (its
    mirror's index with its predictions, in-flight prefixes, demand, copies) and, with
    several replicas, its own counts of what it sent each worker. Alone, its counts are all
    the traffic there is, and a worker's load is read from the worker as it is."""

    def __init__(self, policy: Policy, start: float, workers: Sequence[SimWorker],
                 coalesce_share: float, alone: bool) -> None:
        self.index = PrefixIndex()
        self.inflight: InflightPrefixes[SimRequest] = InflightPrefixes(coalesce_share)
        self.producers: deque[SimRequest] = deque()  # added to ``inflight``, in routing order
        # As the router's decider keeps it: for a policy that places replicas.
        self.demand = PrefixDemand(start=start) if policy.places_replicas else None
        self.copying: dict[tuple[str, int], SimRequest] = {}  # (worker, last key) -> copy
        self.alone = alone
        # Several replicas: what this one sent each worker (rates, and its requests not
        # ended, for its in-flight and pending counts).
        self.sent = {w.name: w.sent if alone else SentTraffic(start=start) for w in workers}
        self.out: dict[str, list[SimRequest]] = {w.name: [] for w in workers}
        self.routed = 0

    def send(self, worker: str, req: SimRequest, now: float) -> None:
        """Count ``req`` as sent to ``worker`` at ``now`` (the router's SentTraffic)."""
        self.sent[worker].add(now, req.routed_uncached)
        if not self.alone:
            self.out[worker].append(req)

    def learn(self, worker: str, req: SimRequest, now: float, ttl: float) -> None:
        """Another router sent ``req`` to ``worker`` (``share_inflight``): count and predict
        it as this router's own."""
        self.send(worker, req, now)
        if ttl > 0 and not req.first_token_s <= now:
            self.inflight.add(req, worker, self.index.predict(worker, req.keys, now + ttl),
                              req.routed_uncached)
            self.producers.append(req)

    def loads(self, workers: Sequence[SimWorker], now: float,
              beats: dict[str, WorkerLoad]) -> dict[str, WorkerLoad]:
        if self.alone:
            return {w.name: w.load(self.index.count(w.name), now) for w in workers}
        out = {}
        for w in workers:
            mine = self.out[w.name] = [r for r in self.out[w.name] if not r.finished_s <= now]
            pending = [r for r in mine if not r.first_token_s <= now]
            sent = self.sent[w.name]
            own = WorkerLoad(inflight=len(mine),
                             pending_prefill_tokens=sum(r.routed_uncached for r in pending),
                             cached_blocks=self.index.count(w.name),
                             arrival_rate=sent.arrivals.at(now),
                             pending_prefill_context=sum(r.routed_context for r in pending),
                             prefill_rate=sent.prefills.at(now))
            out[w.name] = seen_load(own, beats[w.name])
        return out


@dataclass
class ReplayResult:
    policy: str
    requests: list[SimRequest]
    workers: list[SimWorker]
    load_samples: list[tuple[float, list[int]]]  # (time, outstanding requests per worker)
    wall_s: float = 0.0
    propagation_s: float = 0.0  # how late the router saw each cache event
    warmup: int = 0  # the trace's first requests, run but left out of the figures
    # The router's background copies of hot prefixes (``copy_of``: the request whose
    # routing made each), in the order they were sent.
    copies: list[SimRequest] = field(default_factory=list)
    routed_by: list[int] = field(default_factory=list)  # requests each router routed

    @property
    def measured(self) -> list[SimRequest]:
        """The requests the figures count (``requests`` is in trace order)."""
        return self.requests[self.warmup:]

    @property
    def measured_copies(self) -> list[SimRequest]:
        """The copies made while routing a measured request."""
        return [c for c in self.copies if c.copy_of >= self.warmup]


class Replayer:
    def __init__(self, trace: Trace, policy: Policy, spec: ClusterSpec,
                 progress: Callable[[int], None] | None = None,
                 sample_every_s: float = 5.0) -> None:
        self.trace = trace
        self.policy = policy
        self.spec = spec
        self.routers: list[_Router] = []  # made at run()
        self.index = PrefixIndex()  # router 0's (every router's, until run())
        self._events: list[tuple[float, int, str, CacheEvent]] = []
        self._seq = itertools.count()
        self.workers = [
            SimWorker(f"w{i:02d}", spec.capacity_blocks, trace.block_size, spec.cost,
                      self._on_event, max_batch=spec.max_batch,
                      prefill_budget=spec.prefill_budget,
                      chunked_prefill=spec.chunked_prefill,
                      long_prefill_threshold=spec.long_prefill_threshold)
            for i in range(spec.workers)]
        self._progress = progress
        self._sample_every = sample_every_s
        self.overflowed = 0  # program branches placed on another worker than their program's

    def _on_event(self, t: float, worker: str, ev: CacheEvent) -> None:
        heapq.heappush(self._events, (t + self.spec.propagation_s, next(self._seq), worker, ev))

    def _apply_visible(self, now: float) -> None:
        """Every router's mirror applies the events visible at ``now`` (all follow one feed,
        ``propagation_s`` late)."""
        ev_heap = self._events
        indexes = [rt.index for rt in self.routers] or [self.index]
        while ev_heap and ev_heap[0][0] <= now:
            _, _, worker, ev = heapq.heappop(ev_heap)
            for index in indexes:
                if ev.op is Op.STORE:
                    index.add(worker, ev.keys)
                elif ev.op is Op.EVICT:
                    index.remove(worker, ev.keys)
                elif ev.op is Op.CLEAR:
                    index.clear_worker(worker)

    def _run_to_next(self, arrivals: list[tuple[float, int]], reqs: list[SimRequest],
                     nxt: list[int]) -> None:
        """Run the workers holding watched requests (whose replies a continuation waits for)
        up to the next arrival, releasing each continuation at its reply's end, which may
        make it the next arrival. Exact: the worker that can end a watched request soonest
        (:meth:`SimWorker.end_bound`) runs first, no further than the others' bounds, so no
        worker runs past the time a continuation released elsewhere could reach it."""
        inf = math.inf
        t_next = arrivals[0][0] if arrivals else inf
        workers = self.workers
        # (end bound, worker number): only the worker that ran has a new bound
        bounds = [(w.end_bound(), k) for k, w in enumerate(workers) if w.watched and w.t < t_next]
        heapq.heapify(bounds)
        while bounds:
            _, k = heapq.heappop(bounds)
            w = workers[k]
            if not w.t < t_next:
                continue  # a continuation released meanwhile comes first
            limit = min(t_next, bounds[0][0]) if bounds else t_next
            t0, steps0 = w.t, w.steps
            # Iterations starting at ``limit`` run too (none can be reached from elsewhere
            # before), except at the next arrival, which may join them.
            w.advance(t_next if limit >= t_next else math.nextafter(limit, inf),
                      stop_at_end=True)
            if self._release(arrivals, reqs, nxt, -inf, (w,)):
                t_next = arrivals[0][0]
            elif w.t == t0 and w.steps == steps0:
                continue  # nothing it can run yet (held requests): the main loop runs it
            if w.watched and w.t < t_next:
                heapq.heappush(bounds, (w.end_bound(), k))

    def _release(self, arrivals: list[tuple[float, int]], reqs: list[SimRequest],
                 nxt: list[int], now: float, workers: Sequence[SimWorker] = ()) -> int:
        """Send the continuations of the watched requests that ended on ``workers`` (all by
        default): each at its trace time or its reply's end, whichever is later (not before
        ``now``). Returns how many."""
        n = 0
        for w in workers or self.workers:
            for r in w.ended:
                c = reqs[nxt[r.idx]]
                t = max(c.arrival_s, r.finished_s, now)
                c.waited_s = t - c.arrival_s
                c.arrival_s = t
                heapq.heappush(arrivals, (t, c.idx))
                n += 1
            w.ended.clear()
        return n

    def _programs(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """Program id -> the keys its branches share and its branch count (for programs of
        2+ branches)."""
        groups: dict[str, list[tuple[int, ...]]] = {}
        for r in self.trace.requests:
            if r.program:
                groups.setdefault(r.program, []).append(r.keys)
        out = {}
        for pid, keysets in groups.items():
            if len(keysets) < 2:
                continue
            n = min(len(k) for k in keysets)
            first = keysets[0]
            lcp = 0
            while lcp < n and all(k[lcp] == first[lcp] for k in keysets):
                lcp += 1
            if lcp:
                out[pid] = (first[:lcp], len(keysets))
        return out

    def run(self) -> ReplayResult:
        bs = self.trace.block_size
        by_name = {w.name: w for w in self.workers}
        reqs = [SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens, r.keys, reply)
                for i, (r, reply) in enumerate(zip(self.trace.requests,
                                                    self.trace.reply_keys(), strict=True))]
        # The arrivals, by time: a continuation joins when the reply it carries ends.
        nxt = self.trace.continuations() if self.spec.closed_loop else [-1] * len(reqs)
        blocked = [False] * len(reqs)
        for i, j in enumerate(nxt):
            if j >= 0:
                reqs[i].watched = blocked[j] = True
        arrivals = [(r.arrival_s, r.idx) for r in reqs if not blocked[r.idx]]
        heapq.heapify(arrivals)
        programs = self._programs() if self.spec.programs else {}
        replica = self.policy.replica \
            if self.policy.places_replicas and self.spec.copies else None
        copies: list[SimRequest] = []
        # Program id -> where each branch (by arrival order) runs, after which prefill.
        placed: dict[str, list[tuple[SimWorker, _ForkGroup]]] = {}
        # The router starts with the replay: its rates count from the first arrival.
        start = min((r.arrival_s for r in reqs), default=0.0)
        for w in self.workers:
            w.sent = SentTraffic(start=start)  # with several routers: the agent's count
        n_routers = self.spec.routers
        self.routers = [_Router(self.policy, start, self.workers, self.spec.coalesce_share,
                                n_routers == 1) for _ in range(n_routers)]
        self.index = self.routers[0].index
        # The workers' last heartbeats (several routers), taken every heartbeat_s.
        beats: dict[str, WorkerLoad] = {}
        next_beat = -math.inf
        # share_inflight: (when the others see it, order, router, worker, request)
        shared: list[tuple[float, int, int, str, SimRequest]] = []
        samples: list[tuple[float, list[int]]] = []
        next_sample = reqs[0].arrival_s if reqs else 0.0
        n = 0
        while True:
            self._run_to_next(arrivals, reqs, nxt)  # with none left: until replies release more
            if not arrivals:
                break
            now, i = heapq.heappop(arrivals)
            req, treq = reqs[i], self.trace.requests[i]
            n += 1
            for w in self.workers:
                w.advance(now)
            self._release(arrivals, reqs, nxt, now)
            prog, n_branches = programs.get(treq.program, ((), 0))
            if n_branches and treq.program in placed:
                worker, group = placed[treq.program].pop(0)
                group.join(req)
                worker.submit(req, now)
                continue
            self._apply_visible(now)
            # Arrivals are split over the routers in turn, as a load balancer in front would.
            rt = self.routers[i % n_routers]
            rt.routed += 1
            req.router = i % n_routers
            index, inflight, producers, copying = rt.index, rt.inflight, rt.producers, \
                rt.copying
            ttl = self.spec.predict_ttl_s
            while shared and shared[0][0] <= now:
                t_seen, _, origin, wname, other = heapq.heappop(shared)
                for k, peer in enumerate(self.routers):
                    if k != origin:
                        peer.learn(wname, other, t_seen, ttl)
            if ttl > 0:
                index.expire(now)
                # As the router drops a request at its first token (bounded memory).
                while producers and producers[0].first_token_s <= now:
                    inflight.drop(producers.popleft())
            if n_routers > 1 and now >= next_beat:
                # What each agent's heartbeat reports: its worker as it is now (all routers'
                # traffic), read by every router until the next one.
                beats = {w.name: w.load(0, now) for w in self.workers}
                next_beat = (math.floor(now / self.spec.heartbeat_s) + 1) * self.spec.heartbeat_s
            loads = rt.loads(self.workers, now, beats)
            d = rank_request(self.policy, index, req.keys, req.prompt_tokens, bs, loads,
                             treq.affinity, demand=rt.demand, now=now)
            held = False
            if ttl > 0 and not n_branches:
                # Routed there on a prediction: held until that prefill's first token, if
                # that prefill is mostly what it gets from it; else decided again on what
                # workers really hold (as the router's Generate does).
                m = d.query.matched_blocks.get(d.best, 0)
                parent = inflight.producer(index, d.best, req.keys, m)
                if parent is not None and not parent.first_token_s <= now:
                    if inflight.worth_waiting(parent, index, d.best, req.keys, m, bs):
                        req.after = parent
                        held = True
                    else:
                        d = rerank_confirmed(self.policy, index, d, req.keys)
            chosen = by_name[d.best]
            req.routed_uncached = req.prompt_tokens - d.cached_tokens(d.best)
            if n_branches:
                # On each worker the program runs on, its first branch prefills the shared
                # prefix with its own suffix and the others follow once that prefill is
                # done (the agent's fork, ``controller/runtime.py``); so on each overflow
                # worker.
                moved = place_fork(d.ranked, d.query, [1] * n_branches) \
                    if self.spec.overflow else ()
                where: dict[int, tuple[SimWorker, _ForkGroup]] = {}
                for w, o in [(chosen, None), *((by_name[o.worker], o) for o in moved)]:
                    group = _ForkGroup(d.cached_tokens(w.name), len(prog) * bs)
                    if o is None:
                        where.update(dict.fromkeys(range(n_branches), (w, group)))
                    else:
                        where.update(dict.fromkeys(o.children, (w, group)))
                        self.overflowed += len(o.children)
                branches = [where[i] for i in range(n_branches)]
                chosen, group = branches.pop(0)
                group.join(req)
                placed[treq.program] = branches
            # The policy's move: prefix it walked away from (its hits lost to balance).
            q = d.query
            req.moved_tokens = max(0, max(map(q.cached_tokens, q.matched_blocks), default=0)
                                   - q.cached_tokens(chosen.name))
            rt.send(chosen.name, req, now)  # as the router counts what it sends
            if n_routers > 1:
                chosen.sent.add(now, req.routed_uncached)  # the agent counts all routers'
                if self.spec.share_inflight:
                    heapq.heappush(shared, (now + self.spec.propagation_s, next(self._seq),
                                            req.router, chosen.name, req))
            chosen.submit(req, now)
            if replica is not None and not n_branches \
                    and (plan := replica(d.query, chosen.name)) is not None:
                copy = self._copy(req, plan, d.query.cached_tokens(plan[0]), copying, now)
                if copy is not None:
                    copies.append(copy)
                    copy.router = req.router
                    rt.send(plan[0], copy, now)  # as the router
                    if n_routers > 1:
                        by_name[plan[0]].sent.add(now, copy.routed_uncached)
                    by_name[plan[0]].submit(copy, now)
                    if ttl > 0:  # as the router: later requests coalesce on it
                        inflight.add(copy, plan[0],
                                     index.predict(plan[0], copy.keys, now + ttl),
                                     copy.routed_uncached)
                        producers.append(copy)
            if ttl > 0 and not held:
                # As the router: a held request is no burst member's producer (the router
                # adds it only once sent, when the prefix is stored), so a burst's later
                # members wait for its first member, not for each other.
                # Only predicted blocks can make a sibling wait (InflightPrefixes.producer).
                inflight.add(req, chosen.name, index.predict(chosen.name, req.keys, now + ttl),
                             req.routed_uncached)
                producers.append(req)
            if now >= next_sample:
                samples.append((now, [lw.inflight for lw in loads.values()]))
                next_sample = now + self._sample_every
            if self._progress is not None and n % 256 == 0:
                self._progress(n)
        for w in self.workers:
            w.advance(math.inf)
        if n != len(reqs):  # a continuation whose reply never ended: a bug, not a result
            raise RuntimeError(f"replay routed {n} of {len(reqs)} requests")
        if self._progress is not None:
            self._progress(len(reqs))
        return ReplayResult(self.policy.name, reqs, self.workers, samples,
                            propagation_s=self.spec.propagation_s, warmup=self.trace.warmup,
                            copies=copies, routed_by=[rt.routed for rt in self.routers])

    def _copy(self, req: SimRequest, plan: tuple[str, int], cached: int,
              copying: dict[tuple[str, int], SimRequest], now: float) -> SimRequest | None:
        """The router's background copy of ``req``'s prefix (``plan``: the policy's target
        and prefix tokens; ``cached``: of those, what the target holds): a one-token request
        of the prefix's whole blocks, as :meth:`PrefixCopier.maybe_copy` sends it; None
        while the same copy is still before its first token."""
        target, tokens = plan
        bs = self.trace.block_size
        nb = copy_blocks(tokens, req.keys, bs)
        if not nb:
            return None
        key = (target, req.keys[nb - 1])
        old = copying.get(key)
        if old is not None and not old.first_token_s <= now:
            return None
        copy = SimRequest(-1, now, nb * bs, 1, req.keys[:nb], copy_of=req.idx)
        copy.routed_uncached = max(0, nb * bs - cached)
        copying[key] = copy
        return copy
