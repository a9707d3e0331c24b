"""What every router policy must do, and the behaviours a user of kvroute's policy relies on
whatever its terms (its formula term by term: test_policy_kvroute.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.load import WorkerLoad
from kvroute.core.policies import (
    REGISTRY,
    Kvroute,
    LeastLoaded,
    RoundRobin,
    RouteQuery,
    make_policy,
)
from kvroute.core.policies.base import rank_by_cost, tie_break


def q(matched: dict[str, int], loads: dict[str, WorkerLoad], prompt: int = 1024,
      affinity: int = 1) -> RouteQuery:
    return RouteQuery(prompt, 16, matched, loads, affinity)


IDLE = WorkerLoad()


def test_kvroute_prefers_longest_prefix_when_idle() -> None:
    r = Kvroute().rank(q({"a": 10, "b": 40}, {"a": IDLE, "b": IDLE, "c": IDLE}))
    assert [s.worker for s in r] == ["b", "a", "c"]


def test_kvroute_leaves_a_hot_worker_when_its_queue_outweighs_the_hit() -> None:
    busy = WorkerLoad(pending_prefill_tokens=8000, running=4)
    assert Kvroute().rank(q({"a": 60}, {"a": busy, "b": IDLE}))[0].worker == "b"
    light = WorkerLoad(pending_prefill_tokens=100)
    assert Kvroute().rank(q({"a": 60}, {"a": light, "b": IDLE}))[0].worker == "a"


def test_kvroute_counts_inflight_before_heartbeats_report_it() -> None:
    r = Kvroute().rank(q({}, {"a": WorkerLoad(inflight=3), "b": IDLE}))
    assert r[0].worker == "b"


def test_cached_tokens_never_exceed_the_prompt() -> None:
    query = q({"a": 100}, {"a": IDLE}, prompt=50)
    assert query.cached_tokens("a") == 50
    assert Kvroute().rank(query)[0].cost == 0  # fully cached, idle: nothing to pay


def test_ties_follow_affinity_stably() -> None:
    loads = {f"w{i}": IDLE for i in range(8)}
    first = {Kvroute().rank(q({}, loads, affinity=a))[0].worker for a in range(64)}
    assert len(first) > 4  # different prefixes spread over workers
    same = {Kvroute().rank(q({}, loads, affinity=99))[0].worker for _ in range(5)}
    assert len(same) == 1  # the same prefix sticks


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(0, 2**64 - 1),
       st.lists(st.integers(-40, 39), max_size=6))
def test_a_ranking_reads_its_ties_in_rendezvous_order_whatever_is_read_first(
        costs: list[int], affinity: int, reads: list[int]) -> None:
    """Runs of equal costs are ordered when first read; any order of reads gives the list
    of ordering them all at once: costs ascending, ties by the rendezvous hash."""
    loads = {f"w{i:02d}": IDLE for i in range(len(costs))}
    query = RouteQuery(1024, 16, {}, loads, affinity)
    ranking = rank_by_cost(query, {w: float(c) for w, c in zip(loads, costs, strict=True)})
    for i in reads:
        if -len(costs) <= i < len(costs):
            ranking[i]
    got = [(s.cost, s.worker) for s in ranking]
    want = sorted(((float(c), w) for w, c in zip(loads, costs, strict=True)),
                  key=lambda cw: (cw[0], tie_break(affinity, cw[1])))
    assert got == want


def test_round_robin_cycles_and_ranks_everyone() -> None:
    rr = RoundRobin()
    loads = {"a": IDLE, "b": IDLE, "c": IDLE}
    firsts = [rr.rank(q({"c": 64}, loads))[0].worker for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert sorted(s.worker for s in rr.rank(q({}, loads))) == ["a", "b", "c"]


def test_least_loaded() -> None:
    loads = {"a": WorkerLoad(running=3), "b": WorkerLoad(queued=1), "c": WorkerLoad(inflight=2)}
    assert [s.worker for s in LeastLoaded().rank(q({"a": 64}, loads))] == ["b", "c", "a"]


def test_the_router_runs_kvroute_and_two_baselines_never_a_peer() -> None:
    assert sorted(REGISTRY) == ["kvroute", "least_loaded", "round_robin"]
    assert make_policy("kvroute").name == "kvroute"
    with pytest.raises(ValueError, match="unknown policy 'llmd'; choose one of: kvroute, "
                                         "least_loaded, round_robin"):
        make_policy("llmd")


def test_no_copy_is_placed_for_a_worker_that_left_the_loads() -> None:
    # The router's loads are its registry's live table: the chosen worker may leave it while
    # the request waits for a coalesced prefill, before the copy is weighed (found by
    # bench/fuzz.py: a 500 from a KeyError).
    busy = WorkerLoad(pending_prefill_tokens=8000, running=4)
    loads = {"a": busy, "b": IDLE}
    hot = RouteQuery(8192, 16, {"a": 512}, loads, 1, prefix_rate=100.0)
    policy = Kvroute()
    assert policy.replica(hot, "a") is not None  # a copy pays while a holds it
    del loads["a"]
    assert policy.replica(hot, "a") is None


def test_every_policy_ranks_every_worker_and_declares_its_replicas() -> None:
    loads = {f"w{i}": WorkerLoad(running=i) for i in range(5)}
    hot = RouteQuery(1024, 16, {"w3": 8}, loads, 1, prefix_rate=100.0)
    for name in REGISTRY:
        policy = make_policy(name)
        ranked = policy.rank(hot)
        assert sorted(s.worker for s in ranked) == sorted(loads), name
        if not policy.places_replicas:
            assert policy.replica(hot, ranked[0].worker) is None, name
    assert Kvroute.places_replicas and not RoundRobin.places_replicas
