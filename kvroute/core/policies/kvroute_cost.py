"""kvroute's default policy: least estimated time-to-first-token, in prefill-token units."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.core.policies.base import RouteQuery, Scored, rank_by_cost


@dataclass(slots=True)
class KvrouteCost:
    """Send the request where its first token is expected soonest.

    Formula, for each candidate worker ``w`` (all terms in prefill-token equivalents)::

        cost_w = (P - cached_w)                                # this prompt's miss on w
               + queue_weight * pending_w                      # prefill queued ahead on w
               + decode_weight * max(running_w, inflight_w)    # decode batch it joins

    ``P`` is the prompt length, ``cached_w`` the tokens of its longest prefix cached on ``w``
    (matched blocks x block size), ``pending_w``/``running_w``/``inflight_w`` come from the
    load view (``inflight_w``, this router's own outstanding requests, covers the time before
    a heartbeat reports them in ``running_w``). Lowest cost wins; equal costs are broken by
    a rendezvous hash of the request's affinity (session or first block), so cold requests
    sharing a prefix land together.

    Why this shape: a cache hit saves exactly the prefill of the cached tokens, and queued
    prefill delays the first token token-for-token, so both are counted in the same unit. A
    hot prefix stops attracting traffic once its worker's queue costs more than the prefix
    saves, and the next request pays once to warm a second worker (no hot-spotting).

    Parameters:
        queue_weight: weight of queued prefill tokens (default 1.0: same unit as a miss).
        decode_weight: prefill tokens one running sequence is worth (default 32).
    """

    queue_weight: float = 1.0
    decode_weight: float = 32.0
    name: str = "kvroute"

    def rank(self, query: RouteQuery) -> list[Scored]:
        p = query.prompt_tokens
        bs = query.block_size
        matched = query.matched_blocks
        qw, dw = self.queue_weight, self.decode_weight
        costs: dict[str, float] = {}
        for w, load in query.loads.items():
            miss = p - min(matched.get(w, 0) * bs, p)
            costs[w] = (
                miss
                + qw * load.pending_prefill_tokens
                + dw * max(load.running, load.inflight)
            )
        return rank_by_cost(query, costs)
