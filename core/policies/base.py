"""The policy interface: two narrow views in, a ranking out.

A policy sees the world only through :class:`RouteQuery`: per-worker prefix-match lengths and
per-worker load. The router and the replay simulator build the same query, so they run the
very same policy objects. A policy declares what it does beyond ranking (:class:`Policy`), so
no caller probes it for attributes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, islice
from operator import eq
from typing import ClassVar, NamedTuple, Protocol, overload

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
    ``prefix_rate`` is how many requests per second lately had the same longest cached
    prefix (:class:`~kvroute.core.load.PrefixDemand`): a hot shared document's is high, a
    session's ~0. It is counted only for a policy that places replicas (0 otherwise).
    ``lower_blocks`` says, per worker of ``matched_blocks`` whose engine keeps a lower tier,
    how many of its matched blocks (the last ones: a prefix is its GPU blocks, then those
    the engine loads from below) are held only in that tier; a worker absent holds them all
    in GPU memory.
    """

    prompt_tokens: int
    block_size: int
    matched_blocks: Mapping[str, int]
    loads: Mapping[str, WorkerLoad]
    affinity: int = 0
    prefix_rate: float = 0.0
    lower_blocks: Mapping[str, int] = field(default_factory=dict)

    def cached_tokens(self, worker: str) -> int:
        return min(self.matched_blocks.get(worker, 0) * self.block_size, self.prompt_tokens)

    def lower_tokens(self, worker: str) -> int:
        """Of :meth:`cached_tokens`, those held only in ``worker``'s lower tier."""
        low = self.lower_blocks.get(worker, 0)
        if not low:
            return 0
        gpu = (self.matched_blocks.get(worker, 0) - low) * self.block_size
        return self.cached_tokens(worker) - min(gpu, self.prompt_tokens)


class Scored(NamedTuple):
    """One ranked worker. A NamedTuple: a ranking builds one per worker per request, and a
    frozen dataclass costs ~1 us each to construct."""

    worker: str
    cost: float


Sorted = tuple[list[str], list[float], list[int], list[int]]
"""A ranking's workers sorted by cost, their costs, and the starts and ends of its runs of
equal costs (:class:`Ranking`'s arguments)."""


class Ranking(Sequence[Scored]):
    """Workers best first, with their costs; :class:`Scored` items are made on access.

    A router reads one or two entries per request (the choice, and the next-best for a
    retry), so building a Scored for each of 128 workers would be most of the ranking's
    cost. Runs of equal costs are put in :func:`tie_break` order when first read, for the
    same reason: over 1,000 workers a ranking can hold a hundred such runs, hashing most of
    the workers, and a router reads the first. What is read is the same either way."""

    __slots__ = ("_affinity", "_costs", "_ends", "_order", "_rest", "_size", "_starts")

    def __init__(self, order: list[str], costs: list[float], affinity: int = 0,
                 starts: list[int] | None = None, ends: list[int] | None = None, *,
                 rest: Callable[[], Sorted] | None = None, size: int = 0) -> None:
        """``starts``, ``ends``: the slices ``[starts[k], ends[k])`` of ``order`` holding
        equal costs, ascending, still to be put in ``affinity``'s rendezvous order.
        ``rest``: ``order`` is only the ranking's head, every worker costing no more than its
        last (so no run of equal costs goes past it), of ``size`` workers in all; ``rest()``
        gives the whole, sorted the same way, when a caller reads past the head."""
        self._order = order
        self._costs = costs
        self._affinity = affinity
        self._starts = starts if starts is not None else []
        self._ends = ends if ends is not None else []
        self._rest = rest
        self._size = size if rest is not None else len(order)

    def _complete(self) -> None:
        """Sort the rest, once: the head's runs come again and settle as they did."""
        if self._rest is not None:
            self._order, self._costs, self._starts, self._ends = self._rest()
            self._rest = None

    def _settle(self, i: int) -> None:
        """Put the run holding position ``i`` (if any is left) in rendezvous order."""
        k = bisect_right(self._starts, i) - 1
        if k >= 0 and i < self._ends[k]:
            a, b = self._starts.pop(k), self._ends.pop(k)
            self._order[a:b] = rendezvous_order(self._affinity, self._order[a:b])

    def _settle_all(self) -> None:
        self._settle_to(self._size)

    def _settle_to(self, stop: int) -> None:
        """Settle positions ``[0, stop)``: a read ending in the head (a Route response's best
        few) leaves the rest unsorted, its later runs unhashed."""
        if stop > len(self._order):
            self._complete()
        while self._starts and self._starts[0] < stop:
            self._settle(self._starts[0])

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, i: int) -> Scored: ...

    @overload
    def __getitem__(self, i: slice) -> list[Scored]: ...

    def __getitem__(self, i: int | slice) -> Scored | list[Scored]:
        if isinstance(i, slice):
            # Positions in the whole ranking: the head alone is shorter.
            at = range(*i.indices(self._size))
            self._settle_to(max(at, default=-1) + 1)
            return [Scored(self._order[k], self._costs[k]) for k in at]
        if i < 0:
            i += self._size
            if i < 0:
                raise IndexError("ranking index out of range")
        if i >= len(self._order):
            self._complete()
        if self._starts:
            self._settle(i)
        return Scored(self._order[i], self._costs[i])

    def __iter__(self) -> Iterator[Scored]:
        if self._rest is not None:
            return self._head_first()
        self._settle_all()
        return map(Scored, self._order, self._costs)

    def _head_first(self) -> Iterator[Scored]:
        """The head read as it is, the rest sorted only if the caller reads on."""
        i = 0
        while self._rest is not None and i < len(self._order):
            yield self[i]
            i += 1
        self._settle_all()
        yield from map(Scored, self._order[i:], self._costs[i:])


class Policy(Protocol):
    """Ranks candidate workers, best first, and may name a background copy of a hot prefix.

    ``rank`` must rank every worker in ``query.loads``. ``places_replicas`` declares that
    ``replica`` may return a copy: the router and the replay then count each cached prefix's
    demand (``RouteQuery.prefix_rate``) for it, and make the copies it names. A policy that
    only ranks inherits :class:`RanksOnly`."""

    name: str
    places_replicas: ClassVar[bool]

    def rank(self, query: RouteQuery) -> Sequence[Scored]: ...

    def replica(self, query: RouteQuery, worker: str) -> tuple[str, int] | None:
        """Where to copy the prompt's longest cached prefix, and its tokens, when the
        request goes to ``worker``; None for no copy."""
        ...


class RanksOnly:
    """The :class:`Policy` declarations of a policy that only ranks: no replicas, so no
    prefix demand is counted for it."""

    __slots__ = ()
    places_replicas: ClassVar[bool] = False

    def replica(self, query: RouteQuery, worker: str) -> tuple[str, int] | None:
        return None


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
    return ranking_of(query, order, list(map(costs.__getitem__, order)))


def ranking_of(query: RouteQuery, order: list[str], vals: list[float],
               runs: tuple[list[int], list[int]] | None = None) -> Ranking:
    """``order`` (workers sorted by their ``vals``, stably) with each run of equal costs put
    in :func:`tie_break` order: :func:`rank_by_cost` once sorted. ``runs``, when the caller
    found them: the starts and ends of the runs of equal costs, ascending."""
    if runs is None:
        runs = ([], [])
        if len(set(vals)) != len(vals):  # cheaper than finding no ties
            _runs(list(compress(count(), map(eq, vals, islice(vals, 1, None)))), *runs)
    return Ranking(order, vals, query.affinity, *runs)


def _runs(tied: list[int], starts: list[int], ends: list[int]) -> None:
    """Append to ``starts`` and ``ends`` the slices ``[i, j)`` of equal costs, given
    (ascending) every position ``i`` whose cost equals the next one's."""
    if not tied:
        return  # the set saw a NaN object twice: NaN equals nothing, so no tie
    start = prev = tied[0]
    for i in islice(tied, 1, None):
        if i != prev + 1:
            starts.append(start)
            ends.append(prev + 2)
            start = i
        prev = i
    starts.append(start)
    ends.append(prev + 2)
