"""Baseline policies that ignore the cache: round-robin and least-loaded (what a cache-blind
load balancer does; the demo measures kvroute against them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.core.policies.base import RanksOnly, RouteQuery, Scored, rank_by_cost


@dataclass(slots=True)
class RoundRobin(RanksOnly):
    """Cycle through workers in sorted-name order; ignores cache and load.

    Formula: the n-th request goes to ``sorted(workers)[n mod len(workers)]``; the rest of the
    ranking follows in cyclic order (used for retries). No parameters.
    """

    name: str = "round_robin"
    _next: int = field(default=0, repr=False)

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        workers = sorted(query.loads)
        if not workers:
            return []
        start = self._next % len(workers)
        self._next += 1
        order = workers[start:] + workers[:start]
        return [Scored(w, float(i)) for i, w in enumerate(order)]


@dataclass(slots=True)
class LeastLoaded(RanksOnly):
    """Send to the worker with the least outstanding work; ignores the cache.

    Formula: ``cost_w = inflight_w + running_w + queued_w``; ties by rendezvous hash of the
    request's affinity. No parameters.
    """

    name: str = "least_loaded"

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        costs = {
            w: float(ld.inflight + ld.running + ld.queued) for w, ld in query.loads.items()
        }
        return rank_by_cost(query, costs)
