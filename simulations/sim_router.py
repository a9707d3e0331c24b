"""One simulated router replica (the replay's router side): production code's index,
in-flight prefixes and decision, fed with what one router process sees.

What the production router keeps per process (its mirror's index with its predictions,
in-flight prefixes, demand, copies) and, with several replicas, its own counts of what it sent
each worker. Alone, its counts are all the traffic there is, and a worker's load is read from
the worker as it is; among several, a worker's load is this router's own counts seen through
the workers' last heartbeats (:func:`kvroute.router.registry.seen_load`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvroute.core.index import PrefixIndex
from kvroute.core.load import PrefixDemand, SentTraffic, WorkerLoad
from kvroute.core.policies import Policy
from kvroute.router.coalesce import InflightPrefixes
from kvroute.router.decide import Decision, rank_request, rerank_confirmed
from kvroute.router.registry import seen_load
from kvroute.simulations.cluster import SimRequest, SimWorker


class SimRouter:
    """One router replica's own state and decisions."""

    def __init__(self, policy: Policy, start: float, workers: Sequence[SimWorker],
                 coalesce_share: float, alone: bool) -> None:
        self.policy = policy
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

    def predict(self, worker: str, req: SimRequest, now: float, ttl: float) -> None:
        """``req``'s blocks are predicted on ``worker`` until stored (at most ``ttl``), and
        later requests may coalesce on its prefill, as the router adds what it sends."""
        self.inflight.add(req, worker, self.index.predict(worker, req.keys, now + ttl),
                          req.routed_uncached)
        self.producers.append(req)

    def learn(self, worker: str, req: SimRequest, now: float, ttl: float) -> None:
        """Another router sent ``req`` to ``worker`` (``share_inflight``): count and predict
        it as this router's own."""
        self.send(worker, req, now)
        if ttl > 0 and not req.first_token_s <= now:
            self.predict(worker, req, now, ttl)

    def expire(self, now: float) -> None:
        """Predictions past their time go, and (as the router drops a request at its first
        token, for bounded memory) so do in-flight prefills whose first token is out."""
        self.index.expire(now)
        while self.producers and self.producers[0].first_token_s <= now:
            self.inflight.drop(self.producers.popleft())

    def decide(self, req: SimRequest, affinity: str, loads: dict[str, WorkerLoad],
               block_size: int, now: float, coalesce: bool) -> tuple[Decision, bool]:
        """The decision for ``req``, and whether it is held. ``coalesce``: a request routed on
        a prediction is held until that prefill's first token if that prefill is mostly
        what it gets from it (``req.after``), else decided again on what workers really
        hold, as the router's Generate does."""
        d = rank_request(self.policy, self.index, req.keys, req.prompt_tokens, block_size,
                         loads, affinity, demand=self.demand, now=now)
        if not coalesce:
            return d, False
        m = d.query.matched_blocks.get(d.best, 0)
        parent = self.inflight.producer(self.index, d.best, req.keys, m)
        if parent is None or parent.first_token_s <= now:
            return d, False
        if self.inflight.worth_waiting(parent, self.index, d.best, req.keys, m, block_size):
            req.after = parent
            return d, True
        return rerank_confirmed(self.policy, self.index, d, req.keys), False

    def loads(self, workers: Sequence[SimWorker], now: float,
              beats: dict[str, WorkerLoad]) -> dict[str, WorkerLoad]:
        if self.alone:
            return {w.name: w.load(self.index.gpu_count(w.name), now) for w in workers}
        out = {}
        for w in workers:
            mine = self.out[w.name] = [r for r in self.out[w.name] if not r.finished_s <= now]
            pending = [r for r in mine if not r.first_token_s <= now]
            sent = self.sent[w.name]
            own = WorkerLoad(inflight=len(mine),
                             pending_prefill_tokens=sum(r.routed_uncached for r in pending),
                             cached_blocks=self.index.gpu_count(w.name),
                             arrival_rate=sent.arrivals.at(now),
                             pending_prefill_context=sum(r.routed_context for r in pending),
                             prefill_rate=sent.prefills.at(now))
            out[w.name] = seen_load(own, beats[w.name])
        return out
