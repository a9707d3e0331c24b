"""The policy interface: two narrow views in, a ranking out.

A policy sees the world only through :class:`RouteQuery`: per-worker prefix-match lengths and
per-worker load. The router and the replay simulator build the same query, so they run the
very same policy objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import groupby
from typing import NamedTuple, Protocol

import xxhash

from kvroute.core.load import WorkerLoad


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """Everything a policy may know about one request and the cluster.

    ``matched_blocks`` lists only workers holding at least the first block; every candidate
    worker appears in ``loads``. ``affinity`` is a stable 64-bit hash of what should stick
    together when nothing else decides (the session id, else the first block's key).
    """

    prompt_tokens: int
    block_size: int
    matched_blocks: Mapping[str, int]
    loads: Mapping[str, WorkerLoad]
    affinity: int = 0

    def cached_tokens(self, worker: str) -> int:
        return min(self.matched_blocks.get(worker, 0) * self.block_size, self.prompt_tokens)


class Scored(NamedTuple):
    """One ranked worker. A NamedTuple: a ranking builds one per worker per request, and a
    frozen dataclass costs ~1 us each to construct."""

    worker: str
    cost: float


class Policy(Protocol):
    """Ranks candidate workers, best first. Must rank every worker in ``query.loads``."""

    name: str

    def rank(self, query: RouteQuery) -> list[Scored]: ...


def tie_break(affinity: int, worker: str) -> int:
    """Rendezvous hash of (affinity, worker): a stable, well-spread order among equal costs.

    Requests with the same affinity prefer the same worker even before any cache exists, so
    a burst of cold requests sharing a system prompt lands together instead of everywhere.
    """
    return xxhash.xxh3_64_intdigest(worker.encode(), affinity & 0xFFFFFFFFFFFFFFFF)


def rank_by_cost(query: RouteQuery, costs: Mapping[str, float]) -> list[Scored]:
    """Sort by cost, ties by :func:`tie_break`.

    Only tied workers need the rendezvous hash, so it is computed for them alone: with many
    workers and distinct costs the ranking is one float sort.
    """
    order = sorted(costs, key=costs.__getitem__)
    if len(set(costs.values())) == len(order):
        return [Scored(w, costs[w]) for w in order]
    aff = query.affinity
    ranked: list[Scored] = []
    for c, group in groupby(order, key=costs.__getitem__):
        tied = list(group)
        if len(tied) > 1:
            tied.sort(key=lambda w: tie_break(aff, w))
        ranked.extend(Scored(w, c) for w in tied)
    return ranked
