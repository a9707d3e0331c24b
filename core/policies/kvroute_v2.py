"""kvroute's derived policy: the request's first token on each worker, plus what placing it
there costs the requests after it. The formula, each term's reason and what removing it does
are in docs/policy.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from kvroute.core.config import Range
from kvroute.core.load import PrefillMode, WorkerLoad
from kvroute.core.policies.base import RouteQuery, Scored, rank_by_cost
from kvroute.core.policies.cost_model import CostModel

_MODEL = CostModel()


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


def queued_wait(ld: WorkerLoad, attn: float) -> float:
    """The prefill queued ahead of it on the worker: its pending tokens plus ``attn`` times
    the context they attend to. Requests queued or running there whose blocks this one shares
    are counted by the router's predicted blocks (lookahead): the query's prefix already
    includes what they will have stored when this request starts."""
    return ld.pending_prefill_tokens + attn * ld.pending_prefill_context


def decode_delay(ld: WorkerLoad, prefill_ahead: float, decode: float) -> float:
    """The decode steps its first token waits through: every iteration until its prefill
    ends also decodes a token for each running sequence (``decode`` units each), and its
    prefill and the queue's take ``prefill_ahead / budget`` iterations beyond the first."""
    iterations = 1.0 + (prefill_ahead / ld.max_batched_tokens if ld.max_batched_tokens else 0.0)
    return decode * ld.busy * iterations


def joined(ld: WorkerLoad, n: float, c: float, attn: float) -> float:
    """The prefill it adds to the iteration the worker's queue is admitted in: each request
    in that iteration gets its first token when the iteration's prefill ends, so those queued
    there wait this long more for it. A whole prompt joins if it fits the budget's room; a
    chunking engine (vLLM V1) puts the room's worth of it in, the rest in later iterations."""
    budget = ld.max_batched_tokens
    if not ld.queued or not budget:
        return 0.0
    room = budget - ld.pending_prefill_tokens
    if n <= room:
        return own_prefill(n, c, attn)
    if room > 0 and ld.prefill_mode is PrefillMode.CHUNKED:
        return own_prefill(room, c, attn)
    return 0.0


def later_arrivals(loads: Mapping[str, WorkerLoad], attn: float, unit_s: float, most: float
                   ) -> float:
    """The requests that reach the average worker before its queue drains (M/G/1, first come
    first served): its queued prefill (:func:`queued_wait`) drains in ``wait * unit_s / (1 -
    rho)`` seconds at prefill utilisation ``rho`` (what arrives meanwhile is served too), and
    requests arrive at its ``arrival_rate``. ``rho`` is the uncached tokens a second sent to
    it lately times the seconds each takes, at most ``most`` (a saturated queue's busy
    period has no end, and the rates lag the queue)."""
    if not loads:
        return 0.0
    n = len(loads)
    wait = sum(queued_wait(ld, attn) for ld in loads.values()) / n
    rate = sum(ld.arrival_rate for ld in loads.values()) / n
    rho = sum(ld.prefill_rate for ld in loads.values()) * unit_s / n
    return rate * wait * unit_s / (1.0 - (rho if rho < most else most))


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
    """The tokens of the prompt's longest prefix cached on any candidate worker."""
    return max((query.cached_tokens(w) for w in query.matched_blocks if w in query.loads),
               default=0)


@dataclass(slots=True)
class KvrouteV2:
    """Least first-token time plus what the choice costs the requests after it.

    Formula, for each worker ``w``, in work units (one = the linear prefill of one token,
    ``unit_s`` = 86 us on the default cost model); lowest wins, ties by a rendezvous hash of
    the request's affinity. Why each term, and what removing it does: docs/policy.md::

        score_w = first_w + decode_w + externality_w + pressure_w

        first_w       = wait_w + own_w                     # its prefill ends
        own_w         = n_w * (1 + attn * (c_w + n_w / 2))  n_w = P - c_w
        wait_w        = pending_w + attn * context_w
        decode_w      = decode * busy_w * (1 + first_w / budget_w)
        externality_w = own_w * N + joined_w * queued_w
        N             = delay * lambda * unit_s * wait / (1 - min(rho, most_busy))
        pressure_w    = reuse * min(c* - c_w, n_w - room_w)   if both > 0, else 0

    ``P`` is the prompt's tokens, ``c_w`` those of its longest prefix cached on ``w`` (with
    the router's predicted blocks: what requests already sent there will have stored when
    this one starts), ``c*`` the longest on any worker; ``pending_w`` / ``context_w`` the
    prefill queued there and the context it attends to, ``busy_w`` its running sequences,
    ``budget_w`` its prefill tokens per iteration (0: unknown, one iteration), ``queued_w``
    its queue and ``joined_w`` the part of ``own_w`` admitted in the same iteration as that
    queue (all of it if it fits the budget's room; the room's worth on a chunking engine),
    ``room_w`` the tokens of its cache holding no prefix. ``N`` is how many later requests
    each unit of prefill delays: those reaching the average worker (``lambda`` a second)
    before its queue (``wait``) drains at its prefill utilisation ``rho`` (uncached tokens a
    second sent to it times ``unit_s``), the M/G/1 busy period. ``first_w`` and ``decode_w``
    are when the request's first token comes on ``w``; the rest is what it costs others.
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
    name: str = "kvroute_v2"

    def __post_init__(self) -> None:
        for f in fields(self):
            r = f.metadata.get("range")
            if r is not None and not r.accepts(getattr(self, f.name)):
                raise ValueError(f"{f.name} must be {r.wanted(False)} ({f.metadata['help']}), "
                                 f"got {getattr(self, f.name)!r}")

    def terms(self, query: RouteQuery, worker: str, delayed: float, top: int
              ) -> dict[str, float]:
        """The formula's terms for one worker, by name (``delayed``: :meth:`delayed`;
        ``top``: :func:`longest_cached`): what docs/policy.md's ablation removes one at a
        time. Their sum, in this order, is :meth:`score`."""
        ld = query.loads[worker]
        c = query.cached_tokens(worker)
        n = query.prompt_tokens - c
        own = own_prefill(n, c, self.attn)
        wait = queued_wait(ld, self.attn)
        return {"wait": wait, "own": own,
                "decode": decode_delay(ld, wait + own, self.decode),
                "arrivals": own * delayed,
                "joined": joined(ld, n, c, self.attn) * ld.queued,
                "pressure": cache_pressure(n, top - c, ld, query.block_size, self.reuse)}

    def score(self, query: RouteQuery, worker: str, delayed: float, top: int) -> float:
        """``score_w`` of the formula for one worker, term by term: the reference
        :meth:`rank` is checked against."""
        t = self.terms(query, worker, delayed, top)
        return (t["wait"] + t["own"] + t["decode"] + (t["arrivals"] + t["joined"])
                + t["pressure"])

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        """Workers by :meth:`score`, the terms inlined: a decision ranks every worker, and
        five calls per worker were half of its time at 128 workers."""
        loads = query.loads
        if not loads:
            return []
        p, bs = query.prompt_tokens, query.block_size
        attn, decode, reuse = self.attn, self.decode, self.reuse
        chunked = PrefillMode.CHUNKED
        delayed = self.delayed(query)
        matched = query.matched_blocks
        top = longest_cached(query)
        costs: dict[str, float] = {}
        # The same sums in the same order as score(), so both give the very same floats.
        for w, ld in loads.items():
            m = matched.get(w)
            c = min(m * bs, p) if m else 0
            n = p - c
            own = n * (1.0 + attn * (c + n / 2.0))
            first = ld.pending_prefill_tokens + attn * ld.pending_prefill_context + own
            cost = first
            if ld.busy:
                budget = ld.max_batched_tokens
                cost += decode * ld.busy * (1.0 + first / budget if budget else 1.0)
            ext = own * delayed
            queued = ld.queued
            if queued and ld.max_batched_tokens:
                room = ld.max_batched_tokens - ld.pending_prefill_tokens
                if n <= room:
                    ext += own * queued
                elif room > 0 and ld.prefill_mode is chunked:
                    ext += room * (1.0 + attn * (c + room / 2.0)) * queued
            cost += ext
            if c < top and ld.capacity_blocks > 0:
                room = (ld.capacity_blocks - ld.cached_blocks) * bs
                evicted = n - (room if room > 0 else 0)
                if evicted > 0:
                    dup = top - c
                    cost += reuse * (dup if dup < evicted else evicted)
            costs[w] = cost
        return rank_by_cost(query, costs)

    def costs_by_terms(self, query: RouteQuery) -> dict[str, float]:
        """Every worker's :meth:`score` (the oracle, for tests and docs)."""
        delayed, top = self.delayed(query), longest_cached(query)
        return {w: self.score(query, w, delayed, top) for w in query.loads}

    def delayed(self, query: RouteQuery) -> float:
        """How many later requests each unit of this one's prefill delays: ``delay`` times
        :func:`later_arrivals`."""
        return self.delay * later_arrivals(query.loads, self.attn, self.unit_s, self.most_busy)

