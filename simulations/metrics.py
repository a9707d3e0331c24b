"""What a replay measured, and the bounds it is compared with: on the hit ratio, and on
TTFT."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from kvroute.core.index import leading_held
from kvroute.core.policies.cost_model import CostModel
from kvroute.simulations.cluster import SimRequest
from kvroute.simulations.replay import ReplayResult
from kvroute.simulations.trace import Trace


@dataclass(frozen=True)
class PolicyMetrics:
    policy: str
    requests: int
    hit_ratio: float  # prompt tokens found in the worker's own cache / prompt tokens
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_mean_s: float
    e2e_p99_s: float
    throughput_rps: float  # completed requests per second of simulated time
    imbalance: float  # max / mean of per-worker prefilled tokens
    wall_s: float  # how long the replay took on this machine
    moved_ratio: float = 0.0  # prompt tokens cached elsewhere, not where the policy sent them
    # prompt tokens the router could not see yet (see ``missed_hits``): still being
    # prefilled when the request arrived, or prefilled but their event not yet arrived
    inflight_ratio: float = 0.0
    stale_ratio: float = 0.0
    # prompt tokens an infinite cache would have hit that no worker held any more: with
    # hit, moved, in-flight and stale, the infinite cache's hit ratio
    evicted_ratio: float = 0.0
    # requests sent after their trace time, because the reply they carry had not ended yet
    # (closed-loop replay), and how much later on average
    waited_ratio: float = 0.0
    waited_mean_s: float = 0.0
    sent_rps: float = 0.0  # requests sent per second (closed loop: slower than the trace's rate)
    # tokens the router's background copies of hot prefixes prefilled (kvroute), per prompt
    # token: work the requests that set them off did not wait for (later ones may be held
    # for one in flight: requests.csv's held_for=copy), not counted in the hit ratio
    copied_ratio: float = 0.0
    copies: int = 0
    # The p99 tail (see :func:`tail_of`): its requests, the share of their TTFT that is their
    # own prefill, and how many waited mostly for other work on a worker holding at least
    # half of their prompt (held there by their cache) or less (queued); the counts are
    # floats, as they are once averaged over jitters
    tail_requests: float = 0.0
    tail_own_share: float = 0.0
    tail_held: float = 0.0
    tail_queued: float = 0.0

    def row(self) -> dict[str, float | str | int]:
        return asdict(self)

    def offered_load(self, capacity_rps: float) -> float:
        """The load its clients offered, a fraction of the cluster's capacity: in a closed
        loop a policy that serves replies slowly is sent less than the trace's rate."""
        return self.sent_rps / capacity_rps


def measure(res: ReplayResult) -> PolicyMetrics:
    """A replay's figures, over its measured requests (all but the trace's warm-up)."""
    reqs = res.measured
    ttft = np.array([r.first_token_s - r.arrival_s for r in reqs])
    e2e = np.array([r.finished_s - r.arrival_s for r in reqs])
    if np.isnan(ttft).any() or np.isnan(e2e).any():
        raise RuntimeError(f"{res.policy}: some requests never completed")
    prompt = sum(r.prompt_tokens for r in reqs)
    first = min(r.arrival_s for r in reqs)
    missed = missed_hits(res)[res.warmup:]
    copies = res.measured_copies
    waited = [r.waited_s for r in reqs if r.waited_s > 0]
    tail = tail_of(reqs, ttft, res.workers[0].cost) if res.workers else Tail(0, 0.0, 0, 0)
    return PolicyMetrics(
        policy=res.policy, requests=len(reqs),
        hit_ratio=sum(r.cached_tokens for r in reqs) / prompt,
        ttft_mean_s=float(ttft.mean()), ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)), e2e_mean_s=float(e2e.mean()),
        e2e_p99_s=float(np.percentile(e2e, 99)),
        throughput_rps=_per_s(len(reqs), max(r.finished_s for r in reqs) - first),
        imbalance=_imbalance(res), wall_s=res.wall_s,
        moved_ratio=sum(r.moved_tokens for r in reqs) / prompt,
        inflight_ratio=sum(m.flight for m in missed) / prompt,
        stale_ratio=sum(m.stale for m in missed) / prompt,
        evicted_ratio=sum(m.evicted for m in missed) / prompt,
        waited_ratio=len(waited) / len(reqs),
        waited_mean_s=float(np.mean(waited)) if waited else 0.0,
        sent_rps=_per_s(len(reqs), max(r.arrival_s for r in reqs) - first),
        copied_ratio=sum(c.prompt_tokens - c.cached_tokens for c in copies) / prompt,
        copies=len(copies), tail_requests=tail.requests, tail_own_share=tail.own_share,
        tail_held=tail.held, tail_queued=tail.queued)


def _per_s(n: int, span_s: float) -> float:
    return n / span_s if span_s > 0 else math.inf


def _imbalance(res: ReplayResult) -> float:
    """The busiest worker's prefill over the mean: what each worker prefilled for the
    measured requests and the copies their routing made (a request's uncached prompt
    tokens: a worker computes nothing else)."""
    by_worker = dict.fromkeys((w.name for w in res.workers), 0)
    for r in (*res.measured, *res.measured_copies):
        by_worker[r.worker] += r.prompt_tokens - r.cached_tokens
    prefilled = np.array(list(by_worker.values()), dtype=float)
    return float(prefilled.max() / prefilled.mean()) if prefilled.mean() else 1.0


class Tail(NamedTuple):
    """What a replay's p99 tail is made of (:func:`tail_of`)."""

    requests: int
    own_share: float
    held: int
    queued: int


def tail_of(reqs: Sequence[SimRequest], ttft: np.ndarray, cost: CostModel) -> Tail:
    """The requests whose TTFT is at least the 99th percentile (``ttft``, in ``reqs``'
    order): how many, the share of their TTFT that is their own prefill (of what they did
    not find cached on the worker they were sent to, that worker otherwise idle), and how
    many waited longer than that for other work: on a worker caching at least half of their
    prompt (``held``: the policy kept them with their cache, or a coalesced prefill they
    waited for) or less (``queued``). A policy whose tail is its own prefill has the p99
    the traffic's longest prompts make; ``held`` and ``queued`` are what it could change."""
    if not len(reqs):
        return Tail(0, 0.0, 0, 0)
    cut = np.percentile(ttft, 99)
    own_s = total_s = 0.0
    held = queued = n = 0
    for r, t in zip(reqs, ttft, strict=True):
        if t < cut:
            continue
        n += 1
        own = min(float(t), cost.prefill_s(r.prompt_tokens - r.cached_tokens, r.cached_tokens))
        own_s += own
        total_s += float(t)
        if t - own > own:
            if 2 * r.cached_tokens >= r.prompt_tokens:
                held += 1
            else:
                queued += 1
    return Tail(n, own_s / total_s if total_s > 0 else 1.0, held, queued)


class Missed(NamedTuple):
    """A request's prompt tokens that an earlier request had already brought (so an infinite
    cache would hit them) and that it neither got nor was sent away from (``moved_tokens``),
    by why: see :func:`missed_hits`."""

    flight: int
    stale: int
    evicted: int


def missed_hits(res: ReplayResult) -> list[Missed]:
    """Per request of ``res.requests``, in that order, the tokens of its prefix that an
    earlier request had already brought (so an infinite cache would hit them) but that it
    neither got nor was moved away from, by why: the router could not see them yet when it
    routed this one (in flight, stale), or no worker held them any more (evicted).

    * in flight: their first prefill had not ended anywhere when it arrived (bursts sharing
      a new prefix; the router's coalescing, ``--predict-ttl-ms``, recovers them), or, for
      a reply's blocks, that reply had not filled them yet (in an open-loop replay, the
      default, a next turn can arrive before its reply ends; not with
      ``ClusterSpec.closed_loop``);
    * stale: it had ended, but less than the propagation delay before (the cache event was
      still on its way to the router's index).

    * evicted: the rest: no worker's cache held them any more (a finite cache's LRU made room
      for other blocks), or the router saw them nowhere.

    So per request, hits + moved + in flight + stale + evicted = the infinite
    cache's hits, that cache fed in the order the requests were sent (in a closed loop not
    always the trace's order, which ``infinite_cache_hits`` follows). A prefill ends at its
    request's first token (with ``--chunked-prefill`` its early chunks are stored sooner,
    so a few of those tokens count as in flight a little too long)."""
    reqs = res.requests
    if not reqs or not res.workers:
        return [Missed(0, 0, 0)] * len(reqs)
    bs = res.workers[0].block_size
    ready: dict[int, float] = {}  # key -> when a prefill holding it first ended
    for r in reqs:
        for k in r.keys:
            if not ready.get(k, math.inf) <= r.first_token_s:
                ready[k] = r.first_token_s
        # (a reply given more keys than its output fills stores only those it fills)
        for k, t in zip(r.reply_keys, r.reply_stored_s, strict=False):
            if not ready.get(k, math.inf) <= t:
                ready[k] = t
    seen: set[int] = set()
    out = [Missed(0, 0, 0)] * len(reqs)
    for i in sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s):
        r = reqs[i]
        n = leading_held(r.keys, _cacheable(r.prompt_tokens, len(r.keys), bs), seen)
        done = visible = 0  # leading blocks prefilled / whose event had reached the router
        while done < n and ready[r.keys[done]] <= r.arrival_s:
            done += 1
        while visible < done and ready[r.keys[visible]] + res.propagation_s <= r.arrival_s:
            visible += 1
        missed = max(0, n * bs - r.cached_tokens - r.moved_tokens)
        flight = min(missed, (n - done) * bs)
        stale = min(missed - flight, (done - visible) * bs)
        out[i] = Missed(flight, stale, missed - flight - stale)
        seen.update(r.keys)
        seen.update(r.reply_keys)
    return out


# requests.csv: one row per request and policy (see :func:`request_rows`)
REQUEST_COLUMNS = ("policy", "request", "warmup", "worker", "sent_s", "waited_s",
                   "prompt_tokens", "output_tokens", "cached_tokens", "moved_tokens",
                   "flight_tokens", "stale_tokens", "evicted_tokens", "held_for", "floor_s",
                   "ttft_s", "e2e_s")


def request_rows(res: ReplayResult, floor: np.ndarray) -> list[dict[str, object]]:
    """One row per request of a replay, in trace order (``request``: its position among the
    trace's valid requests; ``warmup``: 1 if it is in the trace's warm-up, which the figures
    leave out): the worker it was sent to and when (``waited_s``: how long after
    its trace time, closed loop), what it found cached there (``cached_tokens``, hits), the
    prompt tokens it missed that
    another worker held (``moved_tokens``), that were still in flight or whose event was
    still on its way, or that no worker held any more (``flight_tokens``, ``stale_tokens``,
    ``evicted_tokens``; see :func:`missed_hits`), the
    request whose prefill it waited for (``held_for``: coalesced, or the branch leading its
    program's fork on its worker; ``copy``: a background copy of its prefix), its TTFT
    floor (``floor``: :func:`ttft_floor`), TTFT and end-to-end latency. Sorting by
    ``ttft_s - floor_s`` finds what a policy's tail is made of."""
    rows: list[dict[str, object]] = []
    for r, (flight, stale, evicted) in zip(res.requests, missed_hits(res), strict=True):
        # A request held for a background copy of its prefix: the copy is no trace request.
        held = "" if r.after is None else "copy" if r.after.idx < 0 else r.after.idx
        rows.append(dict(zip(REQUEST_COLUMNS, (
            res.policy, r.idx, int(r.idx < res.warmup), r.worker, r.arrival_s, r.waited_s,
            r.prompt_tokens, r.output_tokens, r.cached_tokens,
            r.moved_tokens, flight, stale, evicted, held, float(floor[r.idx]),
            r.first_token_s - r.arrival_s,
            r.finished_s - r.arrival_s), strict=True)))
    rows.sort(key=lambda row: row["request"])
    return rows


def _cacheable(prompt_tokens: int, n_keys: int, block_size: int) -> int:
    # An engine always computes at least one prompt token (see cluster.py).
    return min(n_keys, (prompt_tokens - 1) // block_size)


def infinite_cache_hits(trace: Trace) -> list[int]:
    """Cached tokens per request if one unbounded cache served every request, holding each
    earlier request's prompt and reply blocks (:meth:`Trace.reply_keys`; a reply counts from
    its request's arrival, which only raises the bound)."""
    seen: set[int] = set()
    bs = trace.block_size
    out = []
    for r, reply in zip(trace.requests, trace.reply_keys(), strict=True):
        out.append(leading_held(r.keys, _cacheable(r.prompt_tokens, len(r.keys), bs),
                                 seen) * bs)
        seen.update(r.keys)
        seen.update(reply)
    return out


def global_lru_hits(trace: Trace, capacity_blocks: int) -> list[int]:
    """Cached tokens per request with one LRU cache holding the whole cluster's capacity: a
    reference point (no routing pools capacity better, though LRU is not optimal)."""
    lru: OrderedDict[int, None] = OrderedDict()
    bs = trace.block_size
    out = []
    for r, reply in zip(trace.requests, trace.reply_keys(), strict=True):
        out.append(leading_held(r.keys, _cacheable(r.prompt_tokens, len(r.keys), bs),
                                 lru) * bs)
        for k in (*r.keys, *reply):
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return out


def ttft_floor(trace: Trace, cost: CostModel, hits: list[int] | None = None) -> np.ndarray:
    """Per request, a time to first token no policy can beat on this cluster model: its own
    prefill alone, after every prefix token an earlier request brought (the infinite cache's
    hits), on a worker with nothing else to do.

    It bounds every request of every replay from below, whatever the load: a request's first
    token ends an iteration that prefills at least its own uncached tokens (chunked or not:
    chunks' costs add up to the whole prefill's), after at most the infinite cache's hits
    (a worker caches, or fetches, only blocks an earlier request brought), and prefill time
    falls as the cached part grows. So the floor's mean and percentiles bound the policies'
    too: how far a policy's TTFT sits above them is what queueing and lost hits cost it.
    ``hits``: :func:`infinite_cache_hits` of ``trace``, when the caller has them already."""
    if hits is None:
        hits = infinite_cache_hits(trace)
    return np.array([cost.prefill_s(r.prompt_tokens - h, h)
                     for r, h in zip(trace.requests, hits, strict=True)])


def floor_summary(floor: np.ndarray) -> dict[str, float]:
    """The floor's mean, p50 and p99, as the replay reports a policy's TTFT."""
    return {"mean_s": float(floor.mean()), "p50_s": float(np.percentile(floor, 50)),
            "p99_s": float(np.percentile(floor, 99))}


def hit_ratio(trace: Trace, hits: list[int]) -> float:
    """The token hit ratio of per-request ``hits`` over the trace's measured requests."""
    return sum(hits[trace.warmup:]) / sum(r.prompt_tokens for r in trace.measured)


def capacity_rps(trace: Trace, workers: int, capacity_blocks: int, cost: CostModel,
                 typical_batch: int = 16) -> float:
    """Requests per second the cluster sustains on this trace's mix, if it reached the
    global-LRU reference hit ratio: ``workers / mean(service_s)``, where a request's service
    is the prefill of its uncached tokens plus its output tokens at the marginal decode cost
    of a ``typical_batch``-sequence batch. Loads (``--sweep``) are fractions of this."""
    hits = global_lru_hits(trace, workers * capacity_blocks)
    per_token_decode = cost.decode_per_seq_s + cost.decode_base_s / typical_batch
    total = sum(cost.prefill_s(r.prompt_tokens - h, h) + r.output_tokens * per_token_decode
                for r, h in zip(trace.requests, hits, strict=True))
    return workers / (total / len(trace.requests))
