"""kvroute's policy: the request's first token on each worker, plus what placing it there
costs the requests after it, and a background copy of a hot prefix when its demand pays for
one. Every term is derived from the cost model; the formula is in :class:`Kvroute`, each
term's reason and what removing it does in docs/policy.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np

from kvroute.core.load import ARRIVAL_TAU_S, WorkerLoad
from kvroute.core.load_table import Column, LoadTable
from kvroute.core.policies.base import (
    Ranking,
    RouteQuery,
    Scored,
    Sorted,
    rank_by_cost,
)
from kvroute.core.policies.columns import (
    cached_columns,
    kth_smallest,
    queued_waits,
    sorted_costs,
    worker_costs,
)
from kvroute.core.policies.cost_model import CostModel
from kvroute.core.settings import Range

_MODEL = CostModel()
# From this many workers a ranking reads a LoadTable's columns with numpy: below it, numpy's
# fixed cost per array operation is more than the Python loop over the workers.
COLUMNS_FROM = 64
HEAD = 8
"""Over the load columns, the workers a ranking sorts at once: every one costing no more than
the ``HEAD``-th cheapest (the rest is sorted if a caller reads past them)."""


def param(default: float, range_: Range, meaning: str) -> float:
    """A policy parameter: its default, the values it accepts and what it stands for (the
    one place each is declared; ``kvroute policies NAME`` prints them)."""
    return field(default=default, metadata={"range": range_, "help": meaning})


# --- the terms, in work units: one unit is the linear prefill of one token ---------------

def own_prefill(n: float, c: float, attn: float) -> float:
    """This request's prefill of ``n`` new tokens after ``c`` cached ones: each new token
    costs one unit plus ``attn`` per token of context it attends to (the ``c`` cached ones
    and, on average, half of the new ones)."""
    return n * (1.0 + attn * (c + n / 2.0))


def queued_prefill(ld: WorkerLoad, attn: float) -> float:
    """The prefill queued ahead of it on the worker: its pending tokens plus ``attn`` times
    the context they attend to. Requests queued or running there whose blocks this one shares
    are counted by the router's predicted blocks (lookahead): the query's prefix already
    includes what they will have stored when this request starts."""
    return ld.pending_prefill_tokens + attn * ld.pending_prefill_context


def elapsed(ld: WorkerLoad, queued: float) -> float:
    """The part of ``queued`` (:func:`queued_prefill`) already done when the request comes:
    the worker's first iteration of it (a budget's worth, or all of it when it fits one) is
    running, and a request arriving at a random moment of that iteration finds half of it
    done on average. The router counts a prefill whole until its first token, so without
    this a worker part-way through a long prefill looks as busy as one about to start it."""
    p, budget = ld.pending_prefill_tokens, ld.max_batched_tokens
    if not p:
        return 0.0
    return 0.5 * queued * (budget / p if budget and budget < p else 1.0)


def queued_wait(ld: WorkerLoad, attn: float) -> float:
    """What it waits for the queue ahead: :func:`queued_prefill` less :func:`elapsed`."""
    queued = queued_prefill(ld, attn)
    return queued - elapsed(ld, queued)


def decode_delay(ld: WorkerLoad, prefill_ahead: float, decode: float) -> float:
    """The decode steps its first token waits through: every iteration until its prefill
    ends also decodes a token for each running sequence (``decode`` units each), and its
    prefill and the queue's take ``prefill_ahead / budget`` iterations beyond the first."""
    iterations = 1.0 + (prefill_ahead / ld.max_batched_tokens if ld.max_batched_tokens else 0.0)
    return decode * ld.busy * iterations


def utilisation(by_rate: float, waiting: float, most: float) -> float:
    """The average worker's prefill utilisation ``rho``, at most ``most`` (a saturated
    queue's busy period has no end). Of two estimates the higher: ``by_rate``, the uncached
    tokens a second sent to it lately times the seconds each takes, and what its queue
    shows, ``L / (1 + L)`` for ``L = waiting`` requests waiting there (M/M/1: ``L = rho / (1
    - rho)``). The rates are decaying sums over tens of seconds and lag a burst; the queue
    shows it at once."""
    rho = max(by_rate, waiting / (1.0 + waiting))
    return rho if rho < most else most


def later_arrivals(loads: Mapping[str, WorkerLoad], waits: Sequence[float], unit_s: float,
                   most: float) -> tuple[float, float]:
    """``(k, wait)``: the requests reaching the average worker per unit of work its queue
    takes to drain, and that queue (the mean of ``waits``, each worker's
    :func:`queued_wait` in ``loads``' order). At utilisation ``rho`` (:func:`utilisation`)
    ``x`` units drain in ``x * unit_s / (1 - rho)`` seconds (M/G/1, first come first
    served: what arrives meanwhile is served too), and requests arrive at its
    ``arrival_rate``: ``k = rate * unit_s / (1 - rho)`` (0, 0 for no workers)."""
    if not loads:
        return 0.0, 0.0
    n = len(loads)
    lds = loads.values()
    rho = utilisation(sum(ld.prefill_rate for ld in lds) * unit_s / n,
                      sum(ld.waiting for ld in lds) / n, most)
    return sum(ld.arrival_rate for ld in lds) / n * unit_s / (1.0 - rho), sum(waits) / n


def drain_delay(own: float, k: float, wait: float) -> float:
    """What a prefill of ``own`` units costs the ``k * wait`` requests arriving before the
    queue ahead of it drains (:func:`later_arrivals`): each waits all of it."""
    return own * k * wait


def extension_delay(own: float, k: float) -> float:
    """What it costs the ``k * own`` requests arriving while it runs, beyond that queue:
    each waits half of it on average. Makes a long redo dear even on an idle worker."""
    return own * k * (own / 2.0)


def cache_pressure(n: float, duplicate: float, ld: WorkerLoad, block_size: int,
                   reuse: float) -> float:
    """What it evicts for nothing: of the ``n`` tokens it stores on the worker, those beyond
    the cache's free room each evict a block, and those that copy a prefix another worker
    holds (``duplicate``) add nothing to what the cluster caches. Each such eviction loses a
    block asked for again with chance ``reuse``: the redo a later request pays."""
    if ld.capacity_blocks <= 0 or duplicate <= 0:
        return 0.0  # capacity unknown (no eviction to predict), or nothing copied
    evicted = n - max(0, ld.capacity_blocks - ld.cached_blocks) * block_size
    return reuse * min(duplicate, evicted) if evicted > 0 else 0.0


def longest_cached(query: RouteQuery) -> int:
    """The tokens of the prompt's longest prefix cached on any candidate worker: the
    :meth:`~RouteQuery.cached_tokens` of the most blocks matched."""
    loads = query.loads
    most = max((m for w, m in query.matched_blocks.items() if w in loads), default=0)
    return min(most * query.block_size, query.prompt_tokens)


@dataclass(slots=True)
class Kvroute:
    """Least first-token time plus what the choice costs the requests after it, and a
    background copy of a hot prefix when its demand pays for one.

    Formula, for each worker ``w``, in work units (one = the linear prefill of one token,
    ``unit_s`` = 86 us on the default cost model); lowest wins, ties by a rendezvous hash of
    the request's affinity. Why each term, and what removing it does: docs/policy.md::

        score_w = first_w + decode_w + externality_w + pressure_w

        first_w       = wait_w + load_w + own_w            # its prefill ends
        load_w        = l_w * tier_s_w / unit_s
        own_w         = n_w * (1 + attn * (c_w + n_w / 2))  n_w = P - c_w
        wait_w        = queued_w - elapsed_w
        queued_w      = pending_w + attn * context_w
        elapsed_w     = queued_w * min(1, budget_w / pending_w) / 2
        decode_w      = decode * busy_w * (1 + first_w / budget_w)
        externality_w = own_w * k * (wait + own_w / 2)
        k             = delay * lambda * unit_s / (1 - rho)
        rho           = min(most_busy, max(pi * unit_s, L / (1 + L)))
        pressure_w    = reuse * min(c* - c_w, n_w - room_w)   if both > 0, else 0

    ``P`` is the prompt's tokens, ``c_w`` those of its longest prefix cached on ``w`` (with
    the router's predicted blocks: what requests already sent there will have stored when
    this one starts), ``l_w`` those of ``c_w`` its engine holds only in a lower tier (CPU
    memory) and must load back first, ``tier_s_w`` the seconds a token takes to load (the
    worker's report, else ``lower_tier_s``), ``c*`` the longest on any worker;
    ``pending_w`` / ``context_w`` the prefill queued there and the context it attends to,
    ``elapsed_w`` the half of its first iteration done on average when a request comes,
    ``busy_w`` its running sequences, ``budget_w`` its prefill tokens per iteration (0:
    unknown, one iteration), ``room_w`` the tokens of its cache holding no prefix. ``k *
    wait`` later requests wait out all of a prefill placed now (those reaching the average
    worker, ``lambda`` a second, before its ``wait`` drains at utilisation ``rho``: the
    M/G/1 busy period), and the ``k * own_w`` arriving while it runs half of it. ``rho`` is
    the higher of the rates' estimate (``pi`` uncached tokens a second) and the queue's
    (``L`` requests waiting; M/M/1).
    ``first_w`` and ``decode_w`` are when the request's first token comes on ``w``; the
    rest is what it costs others. ``load_w`` is a transfer over the host link, not compute:
    it delays this request's first token, not the others'. :meth:`replica` names the copy.
    """

    attn: float = param(_MODEL.attn_s_per_token_pair / _MODEL.linear_s_per_token,
                        Range(0, 1e-2),
                        "units per (new token, context token) pair: attention FLOPs over "
                        "weight FLOPs per token (cost model: 2.8e-9 s / 8.6e-5 s)")
    decode: float = param(_MODEL.decode_per_seq_s / _MODEL.linear_s_per_token,
                          Range(0, 1e4),
                          "units one running sequence adds to an iteration (cost model: "
                          "0.41 ms / 86 us)")
    unit_s: float = param(_MODEL.linear_s_per_token, Range(0, 1),
                          "seconds one unit of work takes: the linear prefill of a token "
                          "(cost model: 8.6e-5 s)")
    delay: float = param(1.0, Range(0, 100),
                         "how much of its prefill each later arrival waits out (1: all of "
                         "it, first come first served)")
    most_busy: float = param(0.9, Range(0, 0.99),
                             "the highest prefill utilisation the busy period is reckoned at")
    reuse: float = param(0.5, Range(0, 1),
                         "chance an evicted cache block is asked for again (0.5: LRU "
                         "victims are as likely to come back as not)")
    lower_tier_s: float = param(_MODEL.lower_tier_s_per_token, Range(0, 1),
                                "seconds to load one token's KV from a lower tier when its "
                                "worker does not report it (cost model: 128 KiB over 25 GB/s "
                                "PCIe 4.0 x16 = 5.2e-6 s)")
    name: str = "kvroute"
    places_replicas: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for f in fields(self):
            r = f.metadata.get("range")
            if r is not None and not r.accepts(getattr(self, f.name)):
                raise ValueError(f"{f.name} must be {r.wanted(False)} ({f.metadata['help']}), "
                                 f"got {getattr(self, f.name)!r}")

    def terms(self, query: RouteQuery, worker: str, later: tuple[float, float], top: int
              ) -> dict[str, float]:
        """The formula's terms for one worker, by name (``later``: :meth:`later`; ``top``:
        :func:`longest_cached`): what docs/policy.md's ablation removes one at a time. Their
        sum, in this order, is :meth:`score`."""
        ld = query.loads[worker]
        c = query.cached_tokens(worker)
        n = query.prompt_tokens - c
        own = own_prefill(n, c, self.attn)
        queued = queued_prefill(ld, self.attn)
        done = -elapsed(ld, queued)
        k, wait = later
        return {"wait": queued, "elapsed": done, "load": self.load(query, worker), "own": own,
                "decode": decode_delay(ld, queued + done + own, self.decode),
                "arrivals": drain_delay(own, k, wait), "extension": extension_delay(own, k),
                "pressure": cache_pressure(n, top - c, ld, query.block_size, self.reuse)}

    def score(self, query: RouteQuery, worker: str, later: tuple[float, float], top: int
              ) -> float:
        """``score_w`` of the formula for one worker, term by term: the reference
        :meth:`rank` is checked against."""
        t = self.terms(query, worker, later, top)
        return (t["wait"] + t["elapsed"] + t["own"] + t["decode"]
                + (t["arrivals"] + t["extension"]) + t["pressure"] + t["load"])

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        """Workers by :meth:`score`, the terms inlined: a decision ranks every worker, and
        five calls per worker were half of its time at 128 workers. Over many workers held
        in a :class:`LoadTable` (the router's), the same sums over its columns
        (:meth:`rank_columns`)."""
        loads = query.loads
        if not loads:
            return []
        if len(loads) >= COLUMNS_FROM and isinstance(loads, LoadTable):
            return self.rank_columns(query, loads)
        p, bs = query.prompt_tokens, query.block_size
        attn, decode, reuse = self.attn, self.decode, self.reuse
        # Each worker's queued_wait, once: the averages need them all before any score.
        waits = []
        for ld in loads.values():
            pending, budget = ld.pending_prefill_tokens, ld.max_batched_tokens
            queued = pending + attn * ld.pending_prefill_context
            if pending:
                queued += -(0.5 * queued * (budget / pending if budget and budget < pending
                                            else 1.0))
            waits.append(queued)
        k, wait_avg = self._later(loads, waits)
        matched = query.matched_blocks
        top = longest_cached(query)
        costs: dict[str, float] = {}
        # The same sums in the same order as score(), so both give the very same floats.
        for (w, ld), queued in zip(loads.items(), waits, strict=True):
            m = matched.get(w)
            c = min(m * bs, p) if m else 0
            n = p - c
            own = n * (1.0 + attn * (c + n / 2.0))
            budget = ld.max_batched_tokens
            first = queued + own
            cost = first
            if ld.busy:
                cost += decode * ld.busy * (1.0 + first / budget if budget else 1.0)
            cost += own * k * wait_avg + own * k * (own / 2.0)
            if c < top and ld.capacity_blocks > 0:
                room = (ld.capacity_blocks - ld.cached_blocks) * bs
                evicted = n - (room if room > 0 else 0)
                if evicted > 0:
                    dup = top - c
                    cost += reuse * (dup if dup < evicted else evicted)
            costs[w] = cost
        for w in query.lower_blocks:
            if w in costs:
                costs[w] += self.load(query, w)
        return rank_by_cost(query, costs)

    def rank_columns(self, query: RouteQuery, loads: LoadTable) -> Sequence[Scored]:
        """:meth:`rank` over ``loads``' columns: each worker's sums as the loop's, operation
        for operation, so the costs are the loop's but for the averages' last bits (numpy
        sums pairwise, Python in order)."""
        names, rows, d = loads.columns()
        p, bs = query.prompt_tokens, query.block_size
        queued = queued_waits(d, self.attn)
        n_workers = len(names)
        k, wait_avg = self._later_columns(d, queued)
        c = cached_columns(query, rows, n_workers)
        cost = worker_costs(queued, d, c, p=p, bs=bs, attn=self.attn, decode=self.decode,
                            k=k, wait_avg=wait_avg, reuse=self.reuse, top=c.max())
        for w in query.lower_blocks:
            if (i := rows.get(w)) is not None:
                cost[i] += self.load(query, w)

        def whole() -> Sorted:
            return sorted_costs(names, cost, np.argsort(cost, kind="stable"))

        # A router reads the choice and perhaps a retry's: the head is sorted now, the rest
        # when a caller reads past it (unless ties make the head most of the ranking).
        if len(cost) > 4 * HEAD:
            head = np.flatnonzero(cost <= kth_smallest(cost, HEAD - 1))
            if len(head) * 2 <= len(cost):
                # Indices ascending, sorted stably: the full stable sort's first len(head).
                order, vals, starts, ends = sorted_costs(
                    names, cost, head[np.argsort(cost[head], kind="stable")])
                return Ranking(order, vals, query.affinity, starts, ends, rest=whole,
                               size=len(cost))
        order, vals, starts, ends = whole()
        return Ranking(order, vals, query.affinity, starts, ends)

    def load(self, query: RouteQuery, worker: str) -> float:
        """``load_w``: loading the prompt's blocks ``worker`` holds only in a lower tier
        back into GPU memory, in units (the transfer, not compute: it delays this request
        only)."""
        lower = query.lower_tokens(worker)
        if not lower:
            return 0.0
        tier_s = query.loads[worker].lower_tier_s_per_token or self.lower_tier_s
        return lower * tier_s / self.unit_s

    def costs_by_terms(self, query: RouteQuery) -> dict[str, float]:
        """Every worker's :meth:`score` (the oracle, for tests and docs)."""
        later, top = self.later(query), longest_cached(query)
        return {w: self.score(query, w, later, top) for w in query.loads}

    def later(self, query: RouteQuery) -> tuple[float, float]:
        """``(k, wait)`` of :func:`later_arrivals`, ``k`` times ``delay``."""
        loads = query.loads
        return self._later(loads, [queued_wait(ld, self.attn) for ld in loads.values()])

    def _later(self, loads: Mapping[str, WorkerLoad], waits: Sequence[float]
               ) -> tuple[float, float]:
        k, wait = later_arrivals(loads, waits, self.unit_s, self.most_busy)
        return self.delay * k, wait

    def _later_columns(self, d: np.ndarray, queued: np.ndarray) -> tuple[float, float]:
        """:meth:`_later` over load columns ``d``, ``queued`` each worker's wait."""
        n = len(queued)
        arrivals, prefill, waiting = d[Column.ARRIVAL_RATE:Column.WAITING + 1].sum(axis=1)
        rho = utilisation(prefill * self.unit_s / n, waiting / n, self.most_busy)
        return (self.delay * (arrivals / n * self.unit_s / (1.0 - rho)),
                float(queued.sum() / n))

    def replica(self, query: RouteQuery, worker: str) -> tuple[str, int] | None:
        """Where to copy the prompt's longest cached prefix in the background, and its
        tokens, when the request goes to a holder ``h`` of it and a second copy saves the
        prefix's next requests more than it costs; else None (see docs/policy.md).

        The prefix's demand (``prefix_rate``, requests a second over the router's rate
        window, ``ARRIVAL_TAU_S``) is taken to go on for one more such window: that many of
        its next requests wait ``wait_h`` on ``h``. A copy on the worker ``m`` with the
        shortest wait among those lacking it lets each start ``wait_h - wait_m`` sooner; it
        costs the prefix's prefill there and what that delays others (the arrivals terms).
        Copy when ``rate * ARRIVAL_TAU_S * (wait_h - wait_m)`` exceeds that cost."""
        rate = query.prefix_rate
        loads = query.loads
        top = longest_cached(query)
        if not rate or not top or query.cached_tokens(worker) < top:
            return None  # no demand, nothing cached, or the request brings it itself
        if worker not in loads:
            # The router's loads are its registry's live table: a worker that left it while
            # the request waited (coalescing) has no load to weigh a copy against.
            return None
        attn = self.attn
        wait_h = queued_wait(loads[worker], attn)
        copy = own_prefill(top, 0, attn)
        if rate * ARRIVAL_TAU_S * wait_h <= copy:
            return None  # even an idle worker free of cost would not pay: skip the scan
        if len(loads) >= COLUMNS_FROM and isinstance(loads, LoadTable):
            shortest = self._shortest_lacking(query, loads, top)
        else:
            lacking = [(queued_wait(ld, attn), w) for w, ld in loads.items()
                       if query.cached_tokens(w) < top]
            shortest = (*min(lacking), self.later(query)) if lacking else None
        if shortest is None:
            return None  # every worker holds it
        wait_m, target, (k, wait) = shortest  # ties: by name, the same on every router
        if wait_m >= wait_h:
            return None
        cost = copy + drain_delay(copy, k, wait) + extension_delay(copy, k)
        return (target, top) if rate * ARRIVAL_TAU_S * (wait_h - wait_m) > cost else None

    def _shortest_lacking(self, query: RouteQuery, loads: LoadTable, top: int
                          ) -> tuple[float, str, tuple[float, float]] | None:
        """Over ``loads``' columns: the shortest wait among the workers caching fewer than
        ``top`` of the prompt's tokens, that worker (ties: the first name), and
        :meth:`later`; None when every worker caches them."""
        names, rows, d = loads.columns()
        queued = queued_waits(d, self.attn)
        lacking = cached_columns(query, rows, len(names)) < top
        if not lacking.any():
            return None
        waits = np.where(lacking, queued, np.inf)
        wait_m = waits.min()
        target = min(names[np.flatnonzero(waits == wait_m)].tolist())
        return float(wait_m), target, self._later_columns(d, queued)
