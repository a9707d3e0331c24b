"""Replay a trace through a simulated cluster behind a router running a real policy.

The router side is production code: :class:`kvroute.core.index.PrefixIndex` fed by the
workers' cache events, and :func:`kvroute.router.decide.rank_request` with a policy object
from :data:`kvroute.core.policies.REGISTRY`. Cache events reach the router's index
``propagation_s`` after the engine emitted them (the agent -> Redis -> router path), so
routing decisions see stale state exactly as a real router does. With ``predict_ttl_s``
the router predicts that a routed prompt's blocks will be on its worker until its events
arrive (``PrefixIndex.predict``), as the production router does with ``--predict-ttl-s``.
The load view is the router's own accounting (requests outstanding, its estimate of
uncached tokens not yet prefilled) plus the engine's queue and batch, as an agent's heartbeat
reports them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.core.index import PrefixIndex
from kvroute.core.policies import Policy
from kvroute.core.redis_schema import Op
from kvroute.router.decide import rank_request
from kvroute.worker_agent.engines.base import CacheEvent
from simulations.cluster import SimRequest, SimWorker
from simulations.costmodel import CostModel
from simulations.trace import Trace


@dataclass(frozen=True)
class ClusterSpec:
    workers: int = 16
    capacity_blocks: int = 937
    max_batch: int = 256
    prefill_budget: int = 16384
    propagation_s: float = 0.05
    predict_ttl_s: float = 0.0  # > 0: the router predicts a routed prompt's blocks this long
    cost: CostModel = field(default_factory=CostModel)


@dataclass
class ReplayResult:
    policy: str
    requests: list[SimRequest]
    workers: list[SimWorker]
    load_samples: list[tuple[float, list[int]]]  # (time, outstanding requests per worker)
    wall_s: float = 0.0


class Replayer:
    def __init__(self, trace: Trace, policy: Policy, spec: ClusterSpec,
                 progress: Callable[[int], None] | None = None,
                 sample_every_s: float = 5.0) -> None:
        self.trace = trace
        self.policy = policy
        self.spec = spec
        self.index = PrefixIndex()
        self._events: list[tuple[float, int, str, CacheEvent]] = []
        self._seq = itertools.count()
        self.workers = [
            SimWorker(f"w{i:02d}", spec.capacity_blocks, trace.block_size, spec.cost,
                      self._on_event, max_batch=spec.max_batch,
                      prefill_budget=spec.prefill_budget)
            for i in range(spec.workers)]
        self._progress = progress
        self._sample_every = sample_every_s

    def _on_event(self, t: float, worker: str, ev: CacheEvent) -> None:
        heapq.heappush(self._events, (t + self.spec.propagation_s, next(self._seq), worker, ev))

    def _apply_visible(self, now: float) -> None:
        ev_heap, index = self._events, self.index
        while ev_heap and ev_heap[0][0] <= now:
            _, _, worker, ev = heapq.heappop(ev_heap)
            if ev.op is Op.STORE:
                index.add(worker, ev.keys)
            elif ev.op is Op.EVICT:
                index.remove(worker, ev.keys)
            elif ev.op is Op.CLEAR:
                index.clear_worker(worker)

    def run(self) -> ReplayResult:
        bs = self.trace.block_size
        by_name = {w.name: w for w in self.workers}
        reqs = [SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens, r.keys)
                for i, r in enumerate(self.trace.requests)]
        samples: list[tuple[float, list[int]]] = []
        next_sample = reqs[0].arrival_s if reqs else 0.0
        for n, (req, treq) in enumerate(zip(reqs, self.trace.requests, strict=True)):
            now = req.arrival_s
            for w in self.workers:
                w.advance(now)
            self._apply_visible(now)
            index = self.index
            ttl = self.spec.predict_ttl_s
            if ttl > 0:
                index.expire(now)
            loads = {w.name: w.load(index.count(w.name)) for w in self.workers}
            d = rank_request(self.policy, index, req.keys, req.prompt_tokens, bs, loads,
                             treq.affinity)
            chosen = by_name[d.best]
            req.routed_uncached = req.prompt_tokens - d.cached_tokens(d.best)
            chosen.submit(req, now)
            if ttl > 0:
                index.predict(chosen.name, req.keys, now + ttl)
            if now >= next_sample:
                samples.append((now, [lw.inflight for lw in loads.values()]))
                next_sample = now + self._sample_every
            if self._progress is not None and n % 256 == 0:
                self._progress(n)
        for w in self.workers:
            w.advance(math.inf)
        if self._progress is not None:
            self._progress(len(reqs))
        return ReplayResult(self.policy.name, reqs, self.workers, samples)
