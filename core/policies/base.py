"""The policy interface: two narrow views in, a ranking out.

A policy sees the world only through :class:`RouteQuery`: per-worker prefix-match lengths and
per-worker load. The router and the replay simulator build the same query, so they run the
very same policy objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, count, islice
from operator import eq
from typing import NamedTuple, Protocol, overload

import xxhash

from kvroute.core.load import WorkerLoad

_h64 = xxhash.xxh3_64_intdigest
_U64 = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """Everything a policy may know about one request and the cluster.

    ``matched_blocks`` lists only workers holding at least the first block; every candidate
    worker appears in ``loads``. ``affinity`` is a stable 64-bit hash of what should stick
    together when nothing else decides (the session id, else the first block's key).
    ``family`` (kvroute's placement key) is the session id's hash, else the key of the
    prompt's first block that no worker caches yet: below a system prompt every worker
    holds, requests diverge into families that the first block would lump together.
    ``prefix_rate`` is how many requests per second lately had the same longest cached
    prefix (:class:`~kvroute.core.load.PrefixDemand`): a hot shared document's is high, a
    session's ~0. ``tail_work`` is the prefill at the tail of what requests lately needed at
    best, in work units (:class:`~kvroute.core.load.PrefillTail`; ``inf``: no tail known
    yet, or none kept because the policy does not read it).
    """

    prompt_tokens: int
    block_size: int
    matched_blocks: Mapping[str, int]
    loads: Mapping[str, WorkerLoad]
    affinity: int = 0
    family: int = 0
    prefix_rate: float = 0.0
    tail_work: float = math.inf

    def cached_tokens(self, worker: str) -> int:
        return min(self.matched_blocks.get(worker, 0) * self.block_size, self.prompt_tokens)


class Scored(NamedTuple):
    """One ranked worker. A NamedTuple: a ranking builds one per worker per request, and a
    frozen dataclass costs ~1 us each to construct."""

    worker: str
    cost: float


class Ranking(Sequence[Scored]):
    """Workers best first, with their costs; :class:`Scored` items are made on access.

    A router reads one or two entries per request (the choice, and the next-best for a
    retry), so building a Scored for each of 128 workers would be most of the ranking's
    cost."""

    __slots__ = ("_costs", "_order")

    def __init__(self, order: list[str], costs: list[float]) -> None:
        self._order = order
        self._costs = costs

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, i: int) -> Scored: ...

    @overload
    def __getitem__(self, i: slice) -> list[Scored]: ...

    def __getitem__(self, i: int | slice) -> Scored | list[Scored]:
        if isinstance(i, slice):
            return list(map(Scored, self._order[i], self._costs[i]))
        return Scored(self._order[i], self._costs[i])

    def __iter__(self) -> Iterator[Scored]:
        return map(Scored, self._order, self._costs)


class Policy(Protocol):
    """Ranks candidate workers, best first. Must rank every worker in ``query.loads``."""

    name: str

    def rank(self, query: RouteQuery) -> Sequence[Scored]: ...


def tie_break(affinity: int, worker: str) -> int:
    """Rendezvous hash of (affinity, worker): a stable, well-spread order among equal costs.

    Requests with the same affinity prefer the same worker even before any cache exists, so
    a burst of cold requests sharing a system prompt lands together instead of everywhere.
    """
    return _h64(worker.encode(), affinity & _U64)


def rendezvous_order(affinity: int, workers: Iterable[str]) -> list[str]:
    """``workers`` sorted by :func:`tie_break` (stably): the same list as
    ``sorted(workers, key=lambda w: tie_break(affinity, w))`` with the seed masked once and
    one Python call per worker instead of two: under load kvroute orders every worker so."""
    seed = affinity & _U64
    return sorted(workers, key=lambda w: _h64(w.encode(), seed))


def rank_by_cost(query: RouteQuery, costs: Mapping[str, float]) -> Ranking:
    """Sort by cost, ties by :func:`tie_break`.

    Only tied workers need the rendezvous hash, so it is computed for them alone: with many
    workers and distinct costs the ranking is one float sort. Ties are found in C (equal
    neighbours in the sorted costs), so no Python loop runs over all the workers.
    """
    order = sorted(costs, key=costs.__getitem__)
    vals = list(map(costs.__getitem__, order))
    if len(set(vals)) != len(vals):  # cheaper than finding the ties when there are none
        aff = query.affinity
        tied = list(compress(count(), map(eq, vals, islice(vals, 1, None))))
        for i, j in _runs(tied):
            order[i:j] = rendezvous_order(aff, order[i:j])
    return Ranking(order, vals)


def _runs(tied: list[int]) -> Iterator[tuple[int, int]]:
    """The slices ``[i, j)`` of equal costs, given (ascending) every position ``i`` whose cost
    equals the next one's."""
    if not tied:
        return  # the set saw a NaN object twice: NaN equals nothing, so no tie
    start = prev = tied[0]
    for i in islice(tied, 1, None):
        if i != prev + 1:
            yield start, prev + 2
            start = i
        prev = i
    yield start, prev + 2


def fetch_plan(query: RouteQuery, worker: str, transfer_cost: float
               ) -> tuple[str, int] | None:
    """For policies that may fetch KV from another worker (Mooncake's transfer): the worker
    holding the longest cached prefix of the prompt and that prefix's length in tokens, when
    it is longer than ``worker``'s own and fetching a token (``transfer_cost``, in units of
    prefilling one) is cheaper than computing it; else None. The replay simulator performs
    the fetch (``simulations/replay.py``); the production router has no KV transfer."""
    if transfer_cost >= 1 or not query.matched_blocks:
        return None
    best, src = max((query.cached_tokens(w), w) for w in query.matched_blocks)
    if best <= query.cached_tokens(worker):
        return None
    return src, best

