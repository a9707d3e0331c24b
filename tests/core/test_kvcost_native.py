"""The C build of kvroute's policy (kvroute/core/_native/kvcost.c) against its Python
reference (``KvrouteCost.rank_python``): the same workers, in the same order, with the same
costs to the last bit, on random clusters."""

from __future__ import annotations

import random
import struct
from dataclasses import replace
from types import MappingProxyType

import pytest

from kvroute.core.load import PACKED_FORMAT, PrefillMode, WorkerLoad
from kvroute.core.policies import KvrouteCost, RouteQuery, kvroute_cost


@pytest.fixture(autouse=True)
def _built() -> None:
    if not kvroute_cost.NATIVE_AVAILABLE:
        pytest.fail("kvroute.core._kvcost was not built; see setup.py")


def random_policy(rng: random.Random) -> KvrouteCost:
    """Defaults, or a draw from the tuning grid, sometimes with KV transfers."""
    if rng.random() < 0.2:
        return KvrouteCost(replicate=rng.choice((0.0, 1.0)))
    params = {k: rng.choice(v) for k, v in KvrouteCost.TUNING.items()}
    # Mostly without background copies: only then does a prefix's demand reach the ranking.
    params["replicate"] = float(rng.random() < 0.1)
    if rng.random() < 0.3:
        params["transfer_cost"] = rng.choice((0.122, 0.5))
    params["chunked_prefill"] = float(rng.random() < 0.3)
    params["chunk_caps"] = float(rng.random() < 0.8)
    params["join_hold"] = float(rng.random() < 0.7)
    return KvrouteCost(**params)


def random_query(rng: random.Random) -> RouteQuery:
    """A cluster of 1-40 workers. Loads are drawn from few values so that costs tie (idle
    workers, equal queues) and several workers hold the longest prefix: the tie-breaks must
    agree too."""
    n = rng.randint(1, 40)
    idle = rng.random() < 0.3
    loads = {}
    for i in range(n):
        q = 0 if idle else rng.choice((0, 0, 1, 2, 5))
        running = 0 if idle else rng.choice((0, 1, 8, 64))
        cap = rng.choice((0, 4096))
        loads[f"worker-{rng.randrange(10**6)}-{i}"] = WorkerLoad(
            inflight=running + q + rng.choice((0, 0, 1)), running=running, queued=q,
            free_blocks=rng.randint(0, cap), capacity_blocks=cap,
            pending_prefill_tokens=0 if idle else rng.choice((0, 512, 3000, 20000)),
            pending_prefill_context=0 if idle else rng.choice((0, 10**6, 2 * 10**8)),
            max_running=rng.choice((0, 64)),
            max_batched_tokens=rng.choice((0, 2048, 8192)),
            cached_blocks=rng.choice((0, 1000, 4096, 5000)),  # 5000: an index ahead of evictions
            arrival_rate=0.0 if idle else rng.choice((0.0, 0.05, 1.5, 7.25)),
            prefill_rate=0.0 if idle else rng.choice((0.0, 0.0, 120.5, 4000.0, 25000.0)),
            prefill_mode=rng.choice(list(PrefillMode)),
            max_prefill_chunk=rng.choice((0, 0, 512, 2048)))
    bs = rng.choice((16, 64))
    p = rng.randint(1, 20000)
    names = list(loads)
    matched = {w: rng.choice((1, p // bs // 2 or 1, p // bs, p // bs + 3))
               for w in rng.sample(names, rng.randint(0, n))}
    matched[f"gone-{rng.randrange(100)}"] = 5  # a worker the loads no longer list
    return RouteQuery(p, bs, matched, loads, rng.getrandbits(64), rng.getrandbits(64),
                      rng.choice((0.0, 0.0, 0.2, 3.7)))


def test_c_and_python_rank_alike_on_random_clusters() -> None:
    rng, tails = random.Random(7), random.Random(11)
    held = spread = tied = arrivals = demanded = ramped = tailed = churned = capped = 0
    for _ in range(3000):
        policy, query = random_policy(rng), random_query(rng)
        want = list(policy.rank_python(query))
        got = list(policy.rank(query))
        assert got == want, (policy, query)
        costs = [s.cost for s in want]
        tied += len(set(costs)) < len(costs)
        mean_q = sum(ld.queued for ld in query.loads.values()) / len(query.loads)
        spread += mean_q > 1
        held += policy.hold > 0 and bool(query.matched_blocks)
        room = 1 - sum(ld.cache_fill for ld in query.loads.values()) / len(query.loads)
        ramped += policy.kv_weight > 0 and 0 < policy._kv_ramp(1 - room) < 1
        arrivals += policy.arrival_weight > 0 and room > 0 and any(
            ld.arrival_rate for ld in query.loads.values())
        if policy.churn_s:  # did the churn term change the order?
            churned += list(policy.rank_python(
                replace(query, loads={w: replace(ld, prefill_rate=0.0)
                                      for w, ld in query.loads.items()}))) != want
        if any(ld.max_prefill_chunk for ld in query.loads.values()):  # did a cap matter?
            capped += list(policy.rank_python(
                replace(query, loads={w: replace(ld, max_prefill_chunk=0)
                                      for w, ld in query.loads.items()}))) != want
        if query.prefix_rate:  # a hot prefix: did its demand change the hold rule's verdict?
            demanded += list(policy.rank_python(replace(query, prefix_rate=0.0))) != want
        # The same query with a tail known: the paths agree, and the tail let a held
        # request go in some
        for tail in tails.sample((500.0, 1000.0, 2000.0, 4000.0, 8000.0, 16000.0, 25000.0), 3):
            tailed_query = replace(query, tail_work=tail)
            with_tail = list(policy.rank_python(tailed_query))
            assert list(policy.rank(tailed_query)) == with_tail, (policy, tailed_query)
            tailed += with_tail != want
    # the draws reached the tie-breaks, the affinity, hold, arrival and churn terms, demand,
    # the tail, the engines' chunk caps, and the KV term's ramp between its ends
    assert tied > 300 and spread > 300 and held > 1000 and arrivals > 1000 and demanded > 5
    assert ramped > 100 and tailed > 10 and churned > 50 and capped > 200, \
        (ramped, tailed, churned, capped)


def test_c_and_python_rank_alike_on_large_clusters() -> None:
    # The merge sorts' many levels, and the affinity term's order over every worker.
    rng = random.Random(5)
    for _ in range(12):
        policy, query = random_policy(rng), random_query(rng)
        loads = dict(query.loads)
        for i, ld in enumerate(rng.choices(list(loads.values()), k=rng.randint(200, 1000))):
            loads[f"w{i}"] = ld  # equal loads: ties among hundreds of workers
        query = replace(query, loads=loads, matched_blocks={
            **query.matched_blocks, **{w: rng.randint(1, 40) for w in rng.sample(
                list(loads), len(loads) // 4)}})
        assert list(policy.rank(query)) == list(policy.rank_python(query)), policy


def test_packed_fields_as_a_tuple_rank_as_bytes() -> None:
    # A load whose fields did not fit the bytes (WorkerLoad.packed's fallback) is converted
    # from the tuple: the same ranking, and a field that is not an int refused as before.
    rng = random.Random(9)
    for _ in range(200):
        policy, query = random_policy(rng), random_query(rng)
        loads = {}
        for w, ld in query.loads.items():
            as_tuple = replace(ld)
            object.__setattr__(as_tuple, "packed", struct.unpack(PACKED_FORMAT, ld.packed))
            loads[w] = as_tuple if rng.random() < 0.5 else ld
        assert list(policy.rank(replace(query, loads=loads))) == list(policy.rank(query))
    with pytest.raises(TypeError):
        KvrouteCost().rank(RouteQuery(100, 16, {}, {"a": WorkerLoad(queued=1.5)}))


def test_the_c_path_is_the_one_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    query = random_query(rng)
    calls = []
    native = kvroute_cost._native_rank

    def counting(*args: object) -> object:
        calls.append(args)
        return native(*args)

    monkeypatch.setattr(kvroute_cost, "_native_rank", counting)
    KvrouteCost().rank(query)
    assert len(calls) == 1
    # Loads that are not a dict (a read-only view) take the Python path, same answer.
    view = RouteQuery(query.prompt_tokens, query.block_size, query.matched_blocks,
                      MappingProxyType(dict(query.loads)), query.affinity, query.family)
    assert list(KvrouteCost().rank(view)) == list(KvrouteCost().rank_python(query))
    assert len(calls) == 1
    assert KvrouteCost().rank(RouteQuery(10, 16, {}, {})) == []


def test_bad_input_is_refused_not_misread() -> None:
    loads = {"a": WorkerLoad(), "b": WorkerLoad(queued=1)}
    with pytest.raises(ValueError, match="matched block counts"):
        KvrouteCost().rank(RouteQuery(100, 16, {"a": -1}, loads))
    with pytest.raises(AttributeError, match="packed"):
        KvrouteCost().rank(RouteQuery(100, 16, {}, {"a": WorkerLoad(), "b": object()}))
    with pytest.raises(TypeError, match="str"):
        KvrouteCost().rank(RouteQuery(100, 16, {}, {1: WorkerLoad()}))


def test_the_hold_rule_breaks_a_tie_of_many_holders_by_matched_order() -> None:
    # Hundreds of equally busy holders of the prefix and idle workers lacking it: the hold
    # rule's holder is the first tied one in ``matched``'s order, whose names are equal to
    # the loads' but other objects (as the index's are), listed in any order.
    rng = random.Random(11)
    busy = WorkerLoad(inflight=3, running=2, queued=1, pending_prefill_tokens=3000,
                      max_running=64, max_batched_tokens=8192)
    for _ in range(20):
        n = rng.randint(260, 1000)
        loads = {f"w{i}": busy if i < n // 4 else WorkerLoad() for i in range(n)}
        holders = [f"w{i}" for i in range(n // 4)]
        rng.shuffle(holders)
        matched = {"".join(reversed(w[::-1])): 40 for w in holders}  # equal, not identical
        query = RouteQuery(640 + rng.randrange(64), 16, matched, loads, rng.getrandbits(64),
                           rng.getrandbits(64))
        for policy in (KvrouteCost(), KvrouteCost(hold=rng.choice((0.5, 2.0, 8.0)))):
            assert list(policy.rank(query)) == list(policy.rank_python(query))
