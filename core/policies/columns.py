"""The kvroute policy's per-worker sums over a :class:`~kvroute.core.load_table.LoadTable`'s
columns (:meth:`~kvroute.core.policies.kvroute.Kvroute.rank_columns`): numpy expressions,
or the C kernel ``core/_native/costs.c`` where it was built, which does the same operations
in the same order in one pass over the workers (the same floats, bit for bit). Over 1,000
workers the numpy expressions are some thirty array operations, each paying numpy's call
overhead; the kernel is one loop. Also here: each worker's cached tokens by row, and a
ranking's sort with its runs of equal costs.

The sums take each row of ``d`` (``d[Column.X][i]`` is worker ``i``'s X) as float64."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvroute.core.load_table import Column
from kvroute.core.policies.base import RouteQuery, Sorted

try:
    from kvroute.core import _costs as _native
except ImportError:  # no compiler at install: numpy alone, the same results
    _native = None

NATIVE = _native is not None
"""Whether the C kernel is built."""


def queued_waits(d: np.ndarray, attn: float, native: bool = NATIVE) -> np.ndarray:
    """Each worker's ``queued_wait``: its pending prefill and its context's attention, less
    the half iteration already under way (a budget's worth of a longer queue)."""
    pending, budget, context = d[Column.PENDING], d[Column.BUDGET], d[Column.CONTEXT]
    if native and _native is not None:
        out = np.empty(len(pending))
        _native.queued(pending, budget, context, attn, out)
        return out
    queued = pending + attn * context
    part = np.ones(len(pending))
    np.divide(budget, pending, out=part, where=(budget > 0) & (budget < pending))
    return np.where(pending > 0, queued - 0.5 * queued * part, queued)


def worker_costs(queued: np.ndarray, d: np.ndarray, c: np.ndarray, *, p: float, bs: float,
                 attn: float, decode: float, k: float, wait_avg: float, reuse: float,
                 top: float, native: bool = NATIVE) -> np.ndarray:
    """Each worker's ``score_w`` but for the lower tier's load term: ``c`` its cached
    tokens of the prompt, ``top`` the most any worker has; the other arguments are the
    formula's (docs/policy.md)."""
    budget, busy = d[Column.BUDGET], d[Column.BUSY]
    capacity, cached = d[Column.CAPACITY], d[Column.CACHED]
    if native and _native is not None:
        out = np.empty(len(c))
        _native.costs(queued, budget, busy, capacity, cached, c, out, p, bs, attn, decode, k,
                      wait_avg, reuse, top)
        return out
    n = p - c
    own = n * (1.0 + attn * (c + n / 2.0))
    first = queued + own
    iterations = np.ones(len(c))
    np.divide(first, budget, out=iterations, where=budget != 0)
    iterations = np.where(budget != 0, 1.0 + iterations, 1.0)
    cost = np.where(busy > 0, first + decode * busy * iterations, first)
    cost = cost + (own * k * wait_avg + own * k * (own / 2.0))
    evicted = n - np.maximum((capacity - cached) * bs, 0.0)
    pressure = (c < top) & (capacity > 0) & (evicted > 0)
    return np.where(pressure, cost + reuse * np.minimum(top - c, evicted), cost)


def cached_columns(query: RouteQuery, rows: Mapping[str, int], n: int,
                   native: bool = NATIVE) -> np.ndarray:
    """Each worker's :meth:`~RouteQuery.cached_tokens` of the prompt, by its row of the load
    columns (a match of a worker with no row is left out: not a candidate)."""
    c = np.zeros(n)
    matched = query.matched_blocks
    if not matched:
        return c
    if native and _native is not None and type(matched) is dict and type(rows) is dict:
        _native.cached(matched, rows, c, float(query.block_size), float(query.prompt_tokens))
        return c
    try:  # the rows in one C loop: every match has one, as the router's rank_request leaves it
        at = np.fromiter(map(rows.__getitem__, matched), np.intp, len(matched))
        blocks = np.fromiter(matched.values(), float, len(matched))
    except KeyError:
        kept = [(rows[w], m) for w, m in matched.items() if w in rows]
        at = np.fromiter((i for i, _ in kept), np.intp, len(kept))
        blocks = np.fromiter((m for _, m in kept), float, len(kept))
    c[at] = np.minimum(blocks * query.block_size, query.prompt_tokens)
    return c


def kth_smallest(values: np.ndarray, k: int, native: bool = NATIVE) -> float:
    """``values``' ``k``-th smallest (0-based), as ``np.partition`` gives it; one pass of the
    C kernel for ``k < 64`` (numpy's selection costs ~10 µs over 1,000 values)."""
    if native and _native is not None and k < 64:
        return _native.kth(values, k)
    return float(np.partition(values, k)[k])


def sorted_costs(names: np.ndarray, cost: np.ndarray, idx: np.ndarray) -> Sorted:
    """The workers at ``idx`` (sorted by ``cost``, stably), their costs and their runs of
    equal costs, found with numpy (on a quiet cluster most workers tie)."""
    ranked = cost[idx]
    tied = np.flatnonzero(ranked[1:] == ranked[:-1])
    starts: list[int] = []
    ends: list[int] = []
    if tied.size:
        breaks = np.flatnonzero(np.diff(tied) != 1)
        starts = tied[np.concatenate(([0], breaks + 1))].tolist()
        ends = (tied[np.concatenate((breaks, [tied.size - 1]))] + 2).tolist()
    return names[idx].tolist(), ranked.tolist(), starts, ends
