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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.core.cache_events import CacheEvent
from kvroute.core.config import COALESCE_SHARE, PREDICT_TTL_S
from kvroute.core.index import PrefixIndex
from kvroute.core.load import SentTraffic, WorkerLoad
from kvroute.core.placement import place_fork
from kvroute.core.policies import Policy
from kvroute.core.policies.cost_model import CostModel
from kvroute.core.redis_schema import Op
from kvroute.router.copies import copy_blocks
from kvroute.router.decide import Decision
from kvroute.simulations.cluster import SimRequest, SimWorker
from kvroute.simulations.sim_router import SimRouter
from kvroute.simulations.trace import Trace, TraceRequest


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


LOWER_TIER_VIEWS = ("weighted", "gpu", "ignore")


@dataclass(frozen=True)
class ClusterSpec:
    workers: int = 16
    capacity_blocks: int = 937
    # > 0: each worker keeps this many blocks in a host (CPU) tier behind its GPU cache,
    # loaded back at CostModel.lower_tier_s_per_token (core/block_pool.py)
    host_blocks: int = 0
    # What the router makes of the host tier's events: "weighted" (as kvroute's router: a
    # hit to load, at its cost), "gpu" (counted as GPU hits), "ignore" (as no hit at all).
    lower_tier: str = "weighted"
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
    # workers' heartbeats, every heartbeat_s (see SimRouter).
    routers: int = 1
    heartbeat_s: float = 1.0
    # Several routers: each routing decision (worker, uncached tokens, predicted prefix)
    # reaches the other routers propagation_s later, as if published beside the feed; they
    # count it in their in-flight view and predict and coalesce on it as on their own.
    share_inflight: bool = False

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ValueError(f"routers must be >= 1, got {self.routers}")
        if self.host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {self.host_blocks}")
        if self.lower_tier not in LOWER_TIER_VIEWS:
            raise ValueError(f"lower_tier must be one of {', '.join(LOWER_TIER_VIEWS)}, got "
                             f"{self.lower_tier!r}")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.long_prefill_threshold < 0:
            raise ValueError(f"long_prefill_threshold must be >= 0 (0: none), got "
                             f"{self.long_prefill_threshold}")
        if self.long_prefill_threshold and not self.chunked_prefill:
            raise ValueError("a long-prefill threshold caps the chunks of a chunked prefill: "
                             "it needs chunked prefill (--chunked-prefill)")


@dataclass
class _Run:
    """One replay's moving parts (:meth:`Replayer.run`)."""

    reqs: list[SimRequest]
    nxt: list[int]  # request -> the continuation its reply releases (-1: none)
    arrivals: list[tuple[float, int]]  # heap of (time, request)
    programs: dict[str, tuple[tuple[int, ...], int]]  # see Replayer._programs
    # Program id -> where each later branch (by arrival order) runs, after which prefill.
    placed: dict[str, list[tuple[SimWorker, _ForkGroup]]] = field(default_factory=dict)
    # share_inflight: (when the others see it, order, router, worker, request)
    shared: list[tuple[float, int, int, str, SimRequest]] = field(default_factory=list)
    beats: dict[str, WorkerLoad] = field(default_factory=dict)  # the workers' last heartbeats
    next_beat: float = -math.inf
    samples: list[tuple[float, list[int]]] = field(default_factory=list)
    next_sample: float = 0.0
    copies: list[SimRequest] = field(default_factory=list)


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
        self.routers: list[SimRouter] = []  # made at run()
        self.index = PrefixIndex()  # router 0's (every router's, until run())
        self._events: list[tuple[float, int, str, CacheEvent]] = []
        self._seq = itertools.count()
        self.workers = [
            SimWorker(f"w{i:02d}", spec.capacity_blocks, trace.block_size, spec.cost,
                      self._on_event, host_blocks=spec.host_blocks, max_batch=spec.max_batch,
                      prefill_budget=spec.prefill_budget,
                      chunked_prefill=spec.chunked_prefill,
                      long_prefill_threshold=spec.long_prefill_threshold)
            for i in range(spec.workers)]
        self._by_name = {w.name: w for w in self.workers}
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
        lower = self.spec.lower_tier
        while ev_heap and ev_heap[0][0] <= now:
            _, _, worker, ev = heapq.heappop(ev_heap)
            op = ev.op
            if op is Op.LOWER and lower != "weighted":
                op = Op.STORE if lower == "gpu" else Op.EVICT
            for index in indexes:
                if op is Op.STORE or op is Op.LOWER:
                    index.add(worker, ev.keys, lower=op is Op.LOWER)
                elif op is Op.EVICT:
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
        st = self._start()
        n = 0
        while True:
            # With no arrival left: until replies release more.
            self._run_to_next(st.arrivals, st.reqs, st.nxt)
            if not st.arrivals:
                break
            now, i = heapq.heappop(st.arrivals)
            n += 1
            for w in self.workers:
                w.advance(now)
            self._release(st.arrivals, st.reqs, st.nxt, now)
            self._arrive(st, st.reqs[i], self.trace.requests[i], now)
            if self._progress is not None and n % 256 == 0:
                self._progress(n)
        for w in self.workers:
            w.advance(math.inf)
        if n != len(st.reqs):  # a continuation whose reply never ended: a bug, not a result
            raise RuntimeError(f"replay routed {n} of {len(st.reqs)} requests")
        if self._progress is not None:
            self._progress(len(st.reqs))
        return ReplayResult(self.policy.name, st.reqs, self.workers, st.samples,
                            propagation_s=self.spec.propagation_s, warmup=self.trace.warmup,
                            copies=st.copies, routed_by=[rt.routed for rt in self.routers])

    def _start(self) -> _Run:
        """The requests, their first arrivals, and one router per replica."""
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
        # The router starts with the replay: its rates count from the first arrival.
        start = min((r.arrival_s for r in reqs), default=0.0)
        for w in self.workers:
            w.sent = SentTraffic(start=start)  # with several routers: the agent's count
        n_routers = self.spec.routers
        self.routers = [SimRouter(self.policy, start, self.workers, self.spec.coalesce_share,
                                  n_routers == 1) for _ in range(n_routers)]
        self.index = self.routers[0].index
        return _Run(reqs, nxt, arrivals, self._programs() if self.spec.programs else {},
                    next_sample=reqs[0].arrival_s if reqs else 0.0)

    def _arrive(self, st: _Run, req: SimRequest, treq: TraceRequest, now: float) -> None:
        """Route ``req`` (trace request ``treq``) arriving at ``now`` and submit it: a
        program's later branch to where its program placed it; else through its router."""
        prog, n_branches = st.programs.get(treq.program, ((), 0))
        if n_branches and treq.program in st.placed:
            worker, group = st.placed[treq.program].pop(0)
            group.join(req)
            worker.submit(req, now)
            return
        self._apply_visible(now)
        # Arrivals are split over the routers in turn, as a load balancer in front would.
        req.router = req.idx % len(self.routers)
        rt = self.routers[req.router]
        rt.routed += 1
        ttl = self.spec.predict_ttl_s
        self._share(st, now)
        if ttl > 0:
            rt.expire(now)
        self._beat(st, now)
        loads = rt.loads(self.workers, now, st.beats)
        d, held = rt.decide(req, treq.affinity, loads, self.trace.block_size, now,
                            coalesce=ttl > 0 and not n_branches)
        chosen = self._by_name[d.best]
        req.routed_uncached = req.prompt_tokens - d.cached_tokens(d.best)
        if n_branches:
            chosen = self._place_program(st, req, treq.program, d, len(prog), n_branches)
        # The policy's move: prefix it walked away from (its hits lost to balance).
        q = d.query
        req.moved_tokens = max(0, max(map(q.cached_tokens, q.matched_blocks), default=0)
                               - q.cached_tokens(chosen.name))
        self._send(st, rt, chosen, req, now, share=self.spec.share_inflight)
        replica = self.policy.replica if self.policy.places_replicas and self.spec.copies \
            else None
        if replica is not None and not n_branches \
                and (plan := replica(q, chosen.name)) is not None:
            self._send_copy(st, rt, req, plan, q.cached_tokens(plan[0]), now)
        if ttl > 0 and not held:
            # As the router: a held request is no burst member's producer (the router
            # adds it only once sent, when the prefix is stored), so a burst's later
            # members wait for its first member, not for each other.
            # Only predicted blocks can make a sibling wait (InflightPrefixes.producer).
            rt.predict(chosen.name, req, now, ttl)
        if now >= st.next_sample:
            st.samples.append((now, [lw.inflight for lw in loads.values()]))
            st.next_sample = now + self._sample_every

    def _share(self, st: _Run, now: float) -> None:
        """Decisions other routers made (``share_inflight``) that reach a router by ``now``."""
        while st.shared and st.shared[0][0] <= now:
            t_seen, _, origin, wname, other = heapq.heappop(st.shared)
            for k, peer in enumerate(self.routers):
                if k != origin:
                    peer.learn(wname, other, t_seen, self.spec.predict_ttl_s)

    def _beat(self, st: _Run, now: float) -> None:
        """Several routers: the workers' heartbeats, every ``heartbeat_s``. Each reports its
        worker as it is now (all routers' traffic), read by every router until the next."""
        if len(self.routers) > 1 and now >= st.next_beat:
            st.beats = {w.name: w.load(0, now) for w in self.workers}
            hb = self.spec.heartbeat_s
            st.next_beat = (math.floor(now / hb) + 1) * hb

    def _place_program(self, st: _Run, req: SimRequest, program: str, d: Decision,
                       prefix_blocks: int, n_branches: int) -> SimWorker:
        """Place a program's branches as the agent's fork runs them: on each worker it runs
        on, its first branch prefills the shared prefix with its own suffix and the others
        follow once that prefill is done (``controller/runtime.py``); with ``overflow``, the
        branches that do not fit go where the router's placement splits them. ``req`` (the
        first branch) joins its group; the worker it runs on is returned."""
        moved = place_fork(d.ranked, d.query, [1] * n_branches) if self.spec.overflow else ()
        where: dict[int, tuple[SimWorker, _ForkGroup]] = {}
        chosen = self._by_name[d.best]
        for w, o in [(chosen, None), *((self._by_name[o.worker], o) for o in moved)]:
            group = _ForkGroup(d.cached_tokens(w.name), prefix_blocks * self.trace.block_size)
            if o is None:
                where.update(dict.fromkeys(range(n_branches), (w, group)))
            else:
                where.update(dict.fromkeys(o.children, (w, group)))
                self.overflowed += len(o.children)
        branches = [where[i] for i in range(n_branches)]
        worker, group = branches.pop(0)
        group.join(req)
        st.placed[program] = branches
        return worker

    def _send(self, st: _Run, rt: SimRouter, worker: SimWorker, req: SimRequest, now: float,
              share: bool = False) -> None:
        """``rt`` sends ``req`` to ``worker`` (counted as the router and, among several, as
        the agent counts all routers' traffic); ``share``: the other routers learn of it
        ``propagation_s`` later."""
        rt.send(worker.name, req, now)
        if len(self.routers) > 1:
            worker.sent.add(now, req.routed_uncached)
            if share:
                heapq.heappush(st.shared, (now + self.spec.propagation_s, next(self._seq),
                                              req.router, worker.name, req))
        worker.submit(req, now)

    def _send_copy(self, st: _Run, rt: SimRouter, req: SimRequest, plan: tuple[str, int],
                   cached: int, now: float) -> None:
        """The router's background copy of ``req``'s prefix to ``plan``'s worker, unless
        the same copy is still before its first token."""
        copy = self._copy(req, plan, cached, rt.copying, now)
        if copy is None:
            return
        st.copies.append(copy)
        copy.router = req.router
        self._send(st, rt, self._by_name[plan[0]], copy, now)
        if self.spec.predict_ttl_s > 0:  # as the router: later requests coalesce on it
            rt.predict(plan[0], copy, now, self.spec.predict_ttl_s)

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
