"""The peers' routing policies, rebuilt on kvroute's two views (prefix matches, load): the
replay's yardsticks, never the router's policy.

Each class reproduces one published router with its published default constants, so the
replay simulator can put kvroute's policy side by side with them. Where a peer sees something
our views do not carry (SGLang's text tree), the docstring says what
stands in for it. ``Scored.cost`` is always "lower is better"; score-based peers report the
negated score.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from kvroute.core.load import WorkerLoad
from kvroute.core.policies.base import (
    RanksOnly,
    RouteQuery,
    Scored,
    rank_by_cost,
    tie_break,
)


def outstanding(load: WorkerLoad) -> int:
    """Requests a worker has in hand, as a router that proxies them would count them.

    KubeAI and SGLang count the requests they forwarded and that have not completed. Our
    view has both this router's own count (``inflight``: exact, immediate) and the engine's
    (``running + queued``: includes other routers' traffic, one heartbeat old); the larger of
    the two is the best estimate of the same quantity.
    """
    return max(load.inflight, load.running + load.queued)


def rank_by_key(query: RouteQuery, keys: Mapping[str, tuple[float, ...]],
                cost: Callable[[str], float]) -> list[Scored]:
    """Sort workers by a lexicographic key, remaining ties by the affinity rendezvous hash.

    As in :func:`rank_by_cost`, only tied workers are hashed (the common case is none)."""
    aff = query.affinity
    order = sorted(keys, key=keys.__getitem__)
    ranked: list[Scored] = []
    i, n = 0, len(order)
    while i < n:
        k = keys[order[i]]
        j = i + 1
        while j < n and keys[order[j]] == k:
            j += 1
        group = order[i:j] if j - i == 1 else sorted(order[i:j],
                                                     key=lambda w: tie_break(aff, w))
        ranked.extend(Scored(w, float(cost(w))) for w in group)
        i = j
    return ranked


@dataclass(slots=True)
class RandomChoice(RanksOnly):
    """Uniformly random order; ignores cache and load. The baseline every paper reports.

    Formula: a uniformly random permutation of the workers (sorted by name first, so the
    sequence depends only on the seed and the worker set, not on dict order).

    Parameters:
        seed: seed of the policy's own ``random.Random`` (default 0); the same seed and the
            same queries give the same sequence of rankings.

    Source: the "random" baseline of Mooncake's scheduling experiment (FAST'25; conversation
    trace on 16 nodes, mean TTFT 19.65 s) and of llm-d's precise-prefix blog (p90 TTFT 93 s).
    """

    seed: int = 0
    name: str = "random"
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        workers = sorted(query.loads)
        self._rng.shuffle(workers)
        return [Scored(w, float(i)) for i, w in enumerate(workers)]


@dataclass(slots=True)
class ConsistentHashBoundedLoads(RanksOnly):
    """KubeAI's PrefixHash strategy: consistent hashing with bounded loads (CHWBL).

    Formula: every worker ``w`` has ``replication`` virtual nodes on a 64-bit ring at
    ``xxh64(f"{w}{i}")``. The request's key is hashed to a ring position and the ring is
    walked clockwise; the first worker whose load passes the bound is chosen::

        ok(w) = total == 0  or  load_w + 1 <= load_factor * (total + 1) / n

    with ``load_w`` the worker's outstanding requests (see :func:`outstanding`; KubeAI counts
    its proxied in-flight requests), ``total`` the sum over the ``n`` workers. No ceiling is
    taken (KubeAI compares floats). If no worker passes, the first worker on the ring is
    chosen (KubeAI's "default endpoint"). The rest of the ranking is the other workers in
    clockwise ring order (their first virtual node after the key).

    Key: KubeAI hashes the adapter name + the prompt's first ``prefixCharLength`` (100)
    characters. Our stand-in is ``query.affinity`` — the session id's hash, else the first
    block's key — i.e. the first block of tokens instead of the first 100 characters; both
    identify a shared system prompt / conversation head.

    Parameters (KubeAI CRD defaults):
        load_factor: ``meanLoadPercentage / 100`` = 1.25 (the value Mirrokni et al. and
            KubeAI's docs call widely accepted).
        replication: virtual nodes per worker = 256.

    Source: substratusai/kubeai ``internal/loadbalancer/balance_chwbl.go`` (``chwblGetAddr``,
    ``chwblLoadOK``, cespare/xxhash = XXH64 seed 0) and the ``PrefixHash`` CRD reference
    (meanLoadPercentage 125, replication 256, prefixCharLength 100); KubeAI blog "LLM Load
    Balancing at Scale: CHWBL"; Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
    Bounded Loads", SODA 2018.
    """

    load_factor: float = 1.25
    replication: int = 256
    name: str = "chwbl"
    # The ring depends only on the worker set; rebuilt when it changes.
    _ring_for: tuple[str, ...] = field(default=(), init=False, repr=False)
    _ring_hashes: list[int] = field(default_factory=list, init=False, repr=False)
    _ring_workers: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.load_factor < 1.0 or self.replication < 1:
            raise ValueError(f"load_factor must be >= 1 (a bound of mean load x c) and "
                             f"replication >= 1; got {self.load_factor}, {self.replication}")

    def _ring(self, workers: tuple[str, ...]) -> None:
        if workers == self._ring_for:
            return
        nodes = sorted(
            (xxhash.xxh64_intdigest(f"{w}{i}".encode()), w)
            for w in workers for i in range(self.replication)
        )
        self._ring_for = workers
        self._ring_hashes = [h for h, _ in nodes]
        self._ring_workers = [w for _, w in nodes]

    def ring_order(self, query: RouteQuery) -> list[str]:
        """Distinct workers in clockwise order from the request's key."""
        workers = tuple(sorted(query.loads))
        self._ring(workers)
        hashes, names = self._ring_hashes, self._ring_workers
        if not hashes:
            return []
        key = xxhash.xxh64_intdigest((query.affinity & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"))
        i = bisect.bisect_left(hashes, key)
        size, n = len(hashes), len(workers)
        seen: dict[str, None] = {}
        for step in range(size):
            w = names[(i + step) % size]
            if w not in seen:
                seen[w] = None
                if len(seen) == n:
                    break
        return list(seen)

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        order = self.ring_order(query)
        if not order:
            return []
        loads = {w: outstanding(query.loads[w]) for w in order}
        total, n = sum(loads.values()), len(order)
        bound = self.load_factor * (total + 1) / n
        chosen = next((w for w in order if total == 0 or loads[w] + 1 <= bound), order[0])
        ranked = [chosen] + [w for w in order if w != chosen]
        return [Scored(w, float(i)) for i, w in enumerate(ranked)]


@dataclass(slots=True)
class SglangCacheAware(RanksOnly):
    """SGLang router's ``cache_aware`` policy: cache affinity unless load is imbalanced.

    Formula, with ``load_w`` the worker's outstanding requests (:func:`outstanding`; SGLang
    counts the requests it forwarded and that have not finished)::

        if max(load) - min(load) > balance_abs_threshold
           and max(load) > balance_rel_threshold * min(load):
            -> least loaded worker                               (shortest queue)
        elif matched_tokens(best) / prompt_tokens > cache_threshold:
            -> best = worker with the longest prefix match       (cache affinity)
        else:
            -> worker with the smallest tree                     (most cache room)

    Both comparisons are strict, as in SGLang. The rest of the ranking follows the same
    criterion (load; match length then load; tree size then load), remaining ties by the
    affinity rendezvous hash (SGLang picks the first such worker).

    What stands in for SGLang's state: SGLang keeps an *approximate* radix tree per worker
    of the raw text it routed there — updated at once on routing, never told what the
    engine evicted. We give it the match from kvroute's index instead (matched blocks x
    block size, over prompt tokens): exact about evictions, but as fresh as the cache events
    (the simulator's propagation delay), so it differs from SGLang's view both ways. Its
    "tree size" is the worker's ``cached_blocks`` as our index sees it, where SGLang's tree
    counts the characters routed there until its LRU eviction (``max_tree_size`` = 2^26
    characters, rarely reached in a replay).

    Parameters (sgl-router CLI defaults):
        cache_threshold: 0.3 (early releases documented 0.5).
        balance_abs_threshold: 64.
        balance_rel_threshold: 1.5.

    Source: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` (selection logic
    and the imbalance test) and the router's CLI defaults (``cache_threshold: 0.3,
    balance_abs_threshold: 64, balance_rel_threshold: 1.5``); SGLang v0.4 blog (cache-aware
    load balancer: 1.9x throughput, 3.8x hit rate vs round robin).
    """

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    name: str = "sglang"

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        loads = {w: outstanding(ld) for w, ld in query.loads.items()}
        if not loads:
            return []
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return rank_by_cost(query, {w: float(x) for w, x in loads.items()})
        cached = {w: query.cached_tokens(w) for w in loads}
        best = max(cached.values())
        p = query.prompt_tokens
        if p > 0 and best / p > self.cache_threshold:
            keys = {w: (-cached[w], loads[w]) for w in loads}
            return rank_by_key(query, keys, lambda w: p - cached[w])
        tree = {w: query.loads[w].cached_blocks for w in loads}
        keys = {w: (tree[w], loads[w]) for w in loads}
        return rank_by_key(query, keys, lambda w: tree[w])


@dataclass(slots=True)
class LlmdPrecisePrefix(RanksOnly):
    """llm-d inference scheduler, precise prefix-cache profile: weighted scorers, max wins.

    Formula, for each worker ``w`` (each scorer in [0, 1])::

        score_w = 2 * prefix_w + 1 * kv_util_w + 1 * queue_w          (highest wins)

        prefix_w   = (m_w - min m) / (max m - min m)   over workers with m_w >= 1 block,
                     1 for them when all their m are equal, 0 for workers with no match
        kv_util_w  = 1 - kv_usage_w                    (fraction of KV blocks free)
        queue_w    = (max q - q_w) / (max q - min q),  1 for all when all q are equal

    ``m_w`` is the worker's longest run of leading prompt blocks in the index (llm-d's
    ``computeScoresFromKeyToPods``: a pod's chain ends at its first missing block), capped at
    the prompt's blocks. Note that llm-d min-max normalises the prefix scores among the
    matching pods (``indexedScoresToNormalizedScoredPods``), not by the prompt's block count:
    a lone matching pod scores 1 whether it holds one block or all of them. ``q_w`` is the
    engine's waiting queue (vLLM ``num_requests_waiting`` -> our ``queued``), as in the
    queue-scorer; running requests are not counted there. Ties are broken at random (the
    max-score picker shuffles), here with a seeded RNG.

    Not modelled: llm-d's speculative index entries for the routing-to-event gap (our
    router's index staleness is the simulator's business) and ``maxPrefixBlocksToMatch``.

    Parameters (llm-d precise-prefix-cache guide, ``EndpointPickerConfig`` weights):
        prefix_weight: precise-prefix-cache-scorer weight 2.0.
        kv_util_weight: kv-cache-utilization-scorer weight 1.0.
        queue_weight: queue-scorer weight 1.0.
        seed: tie-break RNG seed (default 0).

    Source: llm-d/llm-d-inference-scheduler ``pkg/plugins/scorer/precise_prefix_cache.go``
    and ``pkg/plugins/scorer/utils.go``; kubernetes-sigs/gateway-api-inference-extension
    ``pkg/epp/scheduling/framework/plugins/scorer/queue.go`` and ``kvcache_utilization.go``;
    llm-d blog "KV-Cache Wins You Can See" (8 pods, p90 TTFT 0.54 s precise vs 31 s approx).
    """

    prefix_weight: float = 2.0
    kv_util_weight: float = 1.0
    queue_weight: float = 1.0
    seed: int = 0
    name: str = "llmd"
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def scores(self, query: RouteQuery) -> dict[str, float]:
        loads = query.loads
        bs = query.block_size
        cap = -(-query.prompt_tokens // bs) if bs > 0 else 0
        hits = {w: min(m, cap) for w, m in query.matched_blocks.items() if w in loads}
        hits = {w: m for w, m in hits.items() if m > 0}
        lo_m, hi_m = (min(hits.values()), max(hits.values())) if hits else (0, 0)
        qs = {w: ld.queued for w, ld in loads.items()}
        lo_q, hi_q = (min(qs.values()), max(qs.values())) if qs else (0, 0)
        out: dict[str, float] = {}
        for w, ld in loads.items():
            if w not in hits:
                prefix = 0.0
            elif hi_m == lo_m:
                prefix = 1.0
            else:
                prefix = (hits[w] - lo_m) / (hi_m - lo_m)
            queue = 1.0 if hi_q == lo_q else (hi_q - qs[w]) / (hi_q - lo_q)
            out[w] = (self.prefix_weight * prefix + self.kv_util_weight * (1.0 - ld.kv_usage)
                      + self.queue_weight * queue)
        return out

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        scores = self.scores(query)
        rng = self._rng
        # One random draw per worker, in name order, so the sequence depends only on the seed.
        jitter = {w: rng.random() for w in sorted(scores)}
        order = sorted(scores, key=lambda w: (-scores[w], jitter[w]))
        return [Scored(w, -scores[w]) for w in order]


@dataclass(slots=True)
class DynamoKvRouter(RanksOnly):
    """NVIDIA Dynamo's KV router: prefill blocks to compute plus decode blocks held.

    Formula, for each worker ``w``, in blocks of ``block_size`` tokens::

        cost_w = prefill_load_scale * max(active_prefill_w + prompt_blocks - overlap_w, 0)
                 + decode_w                                               (lowest wins)

        active_prefill_w = pending_prefill_tokens_w / block_size
        prompt_blocks    = prompt_tokens / block_size
        overlap_w        = cached_tokens_w / block_size       (the worker's prefix match)
        decode_w         = (capacity_blocks_w - free_blocks_w) + prompt_blocks

    ``decode_w`` is Dynamo's "potential active blocks": the blocks its active sequences hold
    plus the new request's. Dynamo tracks the former itself from the requests it routed; our
    nearest view is the blocks in use on the engine, ``capacity - free`` — in a vLLM-style
    pool a cached block nobody uses sits in the free queue, so that is exactly the blocks
    held by running sequences (it also counts other routers' traffic, which Dynamo's replica
    sync shares). When the capacity is unknown (0) it falls back to
    ``max(running, inflight) * prompt_blocks`` (each active sequence assumed this prompt's
    size). Dynamo de-duplicates blocks shared between active sequences; our view cannot, so
    the new request's blocks are added in full on every worker (the same for all, so it does
    not change the order).

    ``temperature`` > 0 samples the winner with softmax over the min-max normalised costs,
    ``p_w ~ exp(-norm_w / temperature)`` (seeded), the rest in cost order; at the default 0
    the lowest cost wins, ties by the affinity rendezvous hash.

    Parameters (Dynamo router defaults):
        prefill_load_scale: 1.0 — ``--router-prefill-load-scale`` (current docs), the same
            weight earlier releases called ``overlap_score_weight`` /
            ``--kv-overlap-score-weight`` (default 1.0). The device overlap credit
            (``--router-kv-overlap-score-credit``, default 1.0) is folded in: a cached
            block is fully credited.
        temperature: ``--router-temperature`` = 0.0.
        seed: RNG seed for temperature sampling (default 0).

    Source: Dynamo docs, "Routing Concepts" (cost = prefill_load_scale *
    adjusted_prefill_blocks + decode_blocks) and "Configuration and Tuning" (flags and
    defaults), docs.nvidia.com/dynamo; ai-dynamo/dynamo ``docs/design_docs/router_design.md``.
    """

    prefill_load_scale: float = 1.0
    temperature: float = 0.0
    seed: int = 0
    name: str = "dynamo"
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def costs(self, query: RouteQuery) -> dict[str, float]:
        bs = float(query.block_size)
        prompt_blocks = query.prompt_tokens / bs
        out: dict[str, float] = {}
        for w, ld in query.loads.items():
            overlap = query.cached_tokens(w) / bs
            prefill = max(ld.pending_prefill_tokens / bs + prompt_blocks - overlap, 0.0)
            held = float(ld.used_blocks) if ld.capacity_blocks > 0 else ld.busy * prompt_blocks
            out[w] = self.prefill_load_scale * prefill + held + prompt_blocks
        return out

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        costs = self.costs(query)
        ranked = rank_by_cost(query, costs)
        if self.temperature <= 0 or len(ranked) < 2:
            return ranked
        order = sorted(costs)  # name order: the draw depends only on the seed
        lo, hi = min(costs.values()), max(costs.values())
        span = hi - lo
        weights = [math.exp(-((costs[w] - lo) / span if span else 0.0) / self.temperature)
                   for w in order]
        pick = self._rng.choices(order, weights=weights)[0]
        return [s for s in ranked if s.worker == pick] + [s for s in ranked if s.worker != pick]


@dataclass(slots=True)
class PrebleE2(RanksOnly):
    """Preble's E2 global scheduler: exploit a long cached prefix, else explore by load.

    Formula, with ``cached_w`` the prompt tokens cached on ``w`` and ``best = max cached_w``::

        if best > prompt_tokens - best:            # the cached part outweighs the rest
            exploit: the worker(s) with the longest match; among them the least loaded
        else:
            explore: the least loaded worker, load_w = (pending_prefill_tokens_w
                     + prompt_tokens - cached_w, max(running_w, inflight_w))

    Load keys are lexicographic (tuples). Preble's explore cost is L_i + M_i + P_i: recent
    prefill+decode compute on the GPU (a 3-minute window), eviction cost, and this request's
    prefill on it. Here the queued prefill plus this request's uncached tokens stand for
    L_i's prefill part and P_i, both in prefill tokens; decode work has no published constant
    to put it in the same unit, so it only breaks ties (count of running sequences), and the
    eviction cost M_i is not modelled. The rest of the ranking follows the same key;
    remaining ties by the affinity rendezvous hash.

    Not modelled (needs the cluster, not a ranking): Preble's hot-prefix replication and
    autoscaling, its post-assignment load rebalancing, and the per-GPU priority scheduling.

    Parameters: none (the exploit/explore switch is the paper's parameter-free rule).

    Source: Srivatsa, He, Abhyankar, Li, Zhang, "Preble: Efficient Distributed Prompt
    Scheduling for LLM Serving", ICLR 2025 (arXiv:2407.00023), Section 3 (E2 algorithm).
    """

    name: str = "preble"

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        p = query.prompt_tokens
        cached = {w: query.cached_tokens(w) for w in query.loads}
        if not cached:
            return []
        best = max(cached.values())
        loads = query.loads
        if best > p - best:
            keys = {w: (-cached[w], loads[w].pending_prefill_tokens,
                        loads[w].busy) for w in loads}
            return rank_by_key(query, keys, lambda w: p - cached[w])
        keys = {w: (loads[w].pending_prefill_tokens + p - cached[w],
                    loads[w].busy) for w in loads}
        return rank_by_key(query, keys, lambda w: keys[w][0])


@dataclass(slots=True)
class MooncakeConductor(RanksOnly):
    """Mooncake's Conductor, prefill-instance choice on a cluster that moves no KV (as
    kvroute's): least estimated time to first token.

    Formula, for each worker ``w`` (time in prefill-token units: one token = one unit)::

        TTFT_w = pending_prefill_tokens_w + (P - c_w)

    lowest wins, ties by the affinity rendezvous hash. ``c_w`` is ``w``'s own prefix match
    (kvroute's index plays the Conductor's global prefix index). This is the instance loop of
    the paper's Algorithm 1 without its KVCache transfer (the "local cache-aware"
    scheduler): a cluster whose workers cannot fetch KV from each other.

    Not modelled: prefill/decode disaggregation (Mooncake picks the decode instance
    separately, by TBT, so decode load does not enter the prefill choice -- nor here, though
    our workers do both), prediction-based early rejection and the SLO checks, and the
    profiled non-linear prefill time (taken as linear in tokens here). No parameters.

    Source: Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM
    Serving", USENIX FAST 2025 (arXiv:2407.00079), Algorithm 1 and the scheduling
    evaluation (16 nodes, conversation trace: random 19.65 s, load balancing 5.27 s, local
    cache-aware 3.58 s, global cache-aware 3.07 s mean TTFT).
    """

    name: str = "mooncake_local"

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        p = query.prompt_tokens
        costs = {w: float(ld.pending_prefill_tokens + p - query.cached_tokens(w))
                 for w, ld in query.loads.items()}
        return rank_by_cost(query, costs)
