"""The routing decision: tokens -> block keys -> index lookup -> policy -> ranked workers."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from kvroute.core.blocks import BlockHasher, tokens_to_bytes
from kvroute.core.index import PrefixIndex
from kvroute.core.load import PrefixDemand, WorkerLoad, prefill_context
from kvroute.core.policies import Policy, RouteQuery, Scored
from kvroute.router.registry import WorkerRegistry


class NoWorkersError(RuntimeError):
    """No worker is routable (reported as UNAVAILABLE)."""


@dataclass(frozen=True, slots=True)
class Decision:
    ranked: Sequence[Scored]
    query: RouteQuery
    keys: Sequence[int] = ()  # the prompt's block keys (for predicted index entries)

    @property
    def best(self) -> str:
        return self.ranked[0].worker

    def cached_tokens(self, worker: str) -> int:
        return self.query.cached_tokens(worker)

    def prefill(self, worker: str) -> tuple[int, int]:
        """The prompt tokens ``worker`` would prefill (those it does not cache) and the
        context they attend to (:func:`~kvroute.core.load.prefill_context`): what the
        registry counts pending there until the first token."""
        c = self.query.cached_tokens(worker)
        n = self.query.prompt_tokens - c
        return n, prefill_context(n, c)


class Decider:
    """Holds one hasher per cache salt; reads the index and loads, never Redis."""

    _MAX_HASHERS = 1024  # bound the per-salt cache; salts are few (LoRA adapters)

    def __init__(self, model: str, block_size: int, policy: Policy) -> None:
        self.model = model
        self.block_size = block_size
        self.policy = policy
        # How hot each cached prefix is (RouteQuery.prefix_rate), counted from now for a
        # policy that places replicas: nobody else reads it.
        self.demand = PrefixDemand(start=time.monotonic()) if policy.places_replicas else None
        self._hashers: dict[str, BlockHasher] = {}

    def hasher(self, salt: str) -> BlockHasher:
        h = self._hashers.get(salt)
        if h is None:
            if len(self._hashers) >= self._MAX_HASHERS:
                self._hashers.clear()
            h = self._hashers[salt] = BlockHasher(self.block_size, self.model, salt)
        return h

    def decide(
        self,
        tokens: Sequence[int],
        index: PrefixIndex | None,
        registry: WorkerRegistry,
        *,
        salt: str = "",
        session_id: str = "",
    ) -> Decision:
        """Rank routable workers. ``index=None`` means the index is not trustworthy (Redis
        down): every match is treated as 0 and load alone decides."""
        loads = registry.loads
        if not loads:
            raise NoWorkersError("no routable workers (none registered, or all down)")
        keys = self.hasher(salt).keys(tokens)
        if session_id:
            affinity = xxhash.xxh3_64_intdigest(session_id.encode())
        else:
            # Shorter than a block: spread by content rather than piling on one worker.
            affinity = keys[0] if keys else xxhash.xxh3_64_intdigest(tokens_to_bytes(tokens))
        return rank_request(self.policy, index, keys, len(tokens), self.block_size, loads,
                            affinity, registry.match_filter, demand=self.demand,
                            now=time.monotonic())


def rank_request(
    policy: Policy,
    index: PrefixIndex | None,
    keys: Sequence[int],
    prompt_tokens: int,
    block_size: int,
    loads: Mapping[str, WorkerLoad],
    affinity: int,
    compatible: Callable[[str], bool] | None = None,
    *,
    demand: PrefixDemand | None = None,
    now: float = 0.0,
) -> Decision:
    """Index lookup + policy: the part of a decision the router and the replay simulator
    share. Matches of workers not in ``loads`` (or not ``compatible``) are dropped.
    ``affinity`` is the session's hash, else the first block's key. With ``demand`` the
    query's ``prefix_rate`` is counted: the requests lately whose longest cached prefix ended
    at the same block (this one counted, at ``now``, for the next)."""
    matched: dict[str, int] = {}
    if index is not None:
        matched = index.match(keys)  # a new dict: ours to trim
        if compatible is not None:
            matched = {w: n for w, n in matched.items() if w in loads and compatible(w)}
        else:
            # Deleted in place (a new dict over a hot prefix's 250 holders was a tenth of a
            # 1,000-worker decision); found by probing ``loads``, not by a set difference,
            # which would walk all of ``loads``.
            for w in [w for w in matched if w not in loads]:
                del matched[w]
    top = max(matched.values(), default=0)  # blocks of the longest prefix cached anywhere
    rate = demand.observe(keys[top - 1], now) if demand is not None and top else 0.0
    lower = index.lower_blocks(keys, matched) if index is not None and matched else {}
    query = RouteQuery(prompt_tokens, block_size, matched, loads, affinity, rate, lower)
    return Decision(policy.rank(query), query, keys if isinstance(keys, list) else ())


def rerank_confirmed(policy: Policy, index: PrefixIndex, d: Decision,
                     keys: Sequence[int]) -> Decision:
    """``d`` decided again on the blocks workers really hold, predictions left out: for a
    request that will not wait for the in-flight prefill a prediction stands for
    (:meth:`~kvroute.router.coalesce.InflightPrefixes.worth_waiting`). ``keys`` are the
    prompt's block keys; the loads, affinity and prefix rate stay ``d``'s."""
    q = d.query
    matched = {w: n for w, m in q.matched_blocks.items() if (n := index.confirmed(w, keys, m))}
    query = dataclasses.replace(q, matched_blocks=matched,
                                lower_blocks=index.lower_blocks(keys, matched))
    return Decision(policy.rank(query), query, d.keys)

