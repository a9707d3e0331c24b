"""The peers' policies: each ranks every worker once and follows its published formula."""

from __future__ import annotations

import pytest

from kvroute.core.load import WorkerLoad
from kvroute.core.policies import REGISTRY, Policy, RouteQuery
from kvroute.simulations.peers import (
    ConsistentHashBoundedLoads,
    DynamoKvRouter,
    LlmdPrecisePrefix,
    MooncakeConductor,
    PrebleE2,
    RandomChoice,
    SglangCacheAware,
)
from kvroute.simulations.policies import PEERS, REPLAY_REGISTRY
from kvroute.simulations.policies import make_replay_policy as make_policy

IDLE = WorkerLoad()
BS = 16


def pending(tokens: int) -> WorkerLoad:
    return WorkerLoad(pending_prefill_tokens=tokens)


def q(matched: dict[str, int], loads: dict[str, WorkerLoad], prompt: int = 1600,
      affinity: int = 1) -> RouteQuery:
    return RouteQuery(prompt, BS, matched, loads, affinity)


def first(policy: Policy, query: RouteQuery) -> str:
    return policy.rank(query)[0].worker


def order(policy: Policy, query: RouteQuery) -> list[str]:
    return [s.worker for s in policy.rank(query)]


# --- every peer -------------------------------------------------------------------------

QUERIES = [
    q({}, {"a": IDLE}),
    q({}, {f"w{i}": IDLE for i in range(8)}),
    q({"w1": 100, "w3": 20}, {f"w{i}": WorkerLoad(running=i, queued=i % 3, inflight=i % 2,
                                                   capacity_blocks=1000, free_blocks=900 - i,
                                                   pending_prefill_tokens=50 * i,
                                                   cached_blocks=10 * i) for i in range(6)}),
    q({"b": 3}, {"a": WorkerLoad(inflight=200), "b": IDLE, "c": WorkerLoad(running=90)},
      prompt=10),
    q({"a": 5}, {"a": IDLE, "b": IDLE}, prompt=0),
]


@pytest.mark.parametrize("name", list(PEERS))
def test_registered_under_its_name_for_the_replay_only(name: str) -> None:
    assert name in REPLAY_REGISTRY and name not in REGISTRY
    assert make_policy(name).name == name
    doc = type(make_policy(name)).__doc__ or ""
    assert "Formula" in doc and "Source" in doc


@pytest.mark.parametrize("name", list(PEERS))
@pytest.mark.parametrize("query", QUERIES)
def test_ranks_every_worker_exactly_once(name: str, query: RouteQuery) -> None:
    ranked = make_policy(name).rank(query)
    assert sorted(s.worker for s in ranked) == sorted(query.loads)


@pytest.mark.parametrize("name", list(PEERS))
def test_same_inputs_same_rankings(name: str) -> None:
    def run() -> list[list[str]]:
        p = make_policy(name)
        return [order(p, query) for query in QUERIES for _ in range(3)]

    assert run() == run()


# --- random -----------------------------------------------------------------------------

def test_random_is_seeded_and_spreads() -> None:
    loads = {f"w{i}": IDLE for i in range(8)}
    a = RandomChoice(seed=5)
    b = RandomChoice(seed=5)
    run_a = [first(a, q({"w0": 99}, loads)) for _ in range(64)]
    run_b = [first(b, q({"w0": 99}, loads)) for _ in range(64)]
    assert run_a == run_b
    assert len(set(run_a)) >= 6  # ignores the cache, spreads over workers
    other = RandomChoice(seed=6)
    assert [first(other, q({}, loads)) for _ in range(64)] != run_a


# --- chwbl ------------------------------------------------------------------------------

def test_chwbl_sticks_to_the_key_and_spreads_keys() -> None:
    loads = {f"w{i}": IDLE for i in range(8)}
    p = ConsistentHashBoundedLoads()
    assert len({first(p, q({}, loads, affinity=42)) for _ in range(5)}) == 1
    assert len({first(p, q({}, loads, affinity=a)) for a in range(200)}) == 8
    # consistent: removing a worker moves only the keys that were on it
    fewer = {w: IDLE for w in loads if w != "w3"}
    moved = sum(first(p, q({}, loads, affinity=a)) != first(p, q({}, fewer, affinity=a))
                for a in range(400))
    on_w3 = sum(first(p, q({}, loads, affinity=a)) == "w3" for a in range(400))
    assert moved == on_w3


def test_chwbl_spills_to_the_next_ring_worker_when_over_the_bound() -> None:
    p = ConsistentHashBoundedLoads()
    idle = {f"w{i}": IDLE for i in range(4)}
    ring = p.ring_order(q({}, idle, affinity=7))
    assert order(p, q({}, idle, affinity=7)) == ring  # idle: pure ring order
    # ring[0] has 10 requests: bound = 1.25 * (10 + 1) / 4 = 3.44 < 10 + 1 -> next on ring
    busy = dict(idle, **{ring[0]: WorkerLoad(inflight=10)})
    assert order(p, q({}, busy, affinity=7)) == [ring[1], ring[0], ring[2], ring[3]]
    # total 9: bound = 1.25 * (9 + 1) / 4 = 3.125, and ring[0] passes with 2 + 1 <= 3.125
    spread = {ring[0]: WorkerLoad(running=2), ring[1]: WorkerLoad(running=3),
              ring[2]: WorkerLoad(running=4), ring[3]: IDLE}
    assert first(p, q({}, spread, affinity=7)) == ring[0]
    # total 10: bound 3.44; ring[0..2] need 4, 4, 5 -> ring[3]
    spread[ring[0]] = WorkerLoad(running=3)
    assert first(p, q({}, spread, affinity=7)) == ring[3]


def test_chwbl_falls_back_to_the_ring_head_when_no_worker_passes() -> None:
    # 16 workers, total load 1: bound = 1.25 * 2 / 16 = 0.156 < 0 + 1, so nobody passes and
    # KubeAI returns the first endpoint on the ring.
    p = ConsistentHashBoundedLoads()
    loads = {f"w{i:02d}": IDLE for i in range(16)}
    ring = p.ring_order(q({}, loads, affinity=3))
    loads[ring[1]] = WorkerLoad(inflight=1)
    assert first(p, q({}, loads, affinity=3)) == ring[0]


def test_chwbl_ignores_the_cache() -> None:
    p = ConsistentHashBoundedLoads()
    loads = {f"w{i}": IDLE for i in range(4)}
    head = first(p, q({}, loads, affinity=9))
    other = next(w for w in loads if w != head)
    assert first(p, q({other: 100}, loads, affinity=9)) == head


# --- sglang -----------------------------------------------------------------------------

def test_sglang_follows_the_cache_while_load_is_balanced() -> None:
    p = SglangCacheAware()
    # a holds 60% of the prompt and has 63 more requests than b: not imbalanced (63 <= 64)
    loads = {"a": WorkerLoad(running=70), "b": WorkerLoad(running=7)}
    assert first(p, q({"a": 60}, loads)) == "a"


def test_sglang_switches_to_least_loaded_past_both_thresholds() -> None:
    p = SglangCacheAware()
    loads = {"a": WorkerLoad(running=75), "b": WorkerLoad(running=10)}  # 65 > 64, 75 > 15
    assert first(p, q({"a": 60}, loads)) == "b"
    # the relative threshold must hold too: 300 - 210 = 90 > 64, but 300 <= 1.5 * 210
    loads = {"a": WorkerLoad(running=300), "b": WorkerLoad(running=210)}
    assert first(p, q({"a": 60}, loads)) == "a"
    # inflight counts as load (the router's own outstanding requests)
    loads = {"a": WorkerLoad(inflight=100), "b": IDLE}
    assert first(p, q({"a": 60}, loads)) == "b"


def test_sglang_low_match_goes_to_the_smallest_tree() -> None:
    p = SglangCacheAware()
    loads = {"a": WorkerLoad(cached_blocks=500), "b": WorkerLoad(cached_blocks=40),
             "c": WorkerLoad(cached_blocks=90)}
    # 30 of 100 blocks = exactly 0.3: not above the threshold
    assert order(p, q({"a": 30}, loads)) == ["b", "c", "a"]
    assert first(p, q({"a": 31}, loads)) == "a"


# --- llm-d ------------------------------------------------------------------------------

def test_llmd_scores_follow_the_published_scorers() -> None:
    p = LlmdPrecisePrefix()
    loads = {
        "a": WorkerLoad(capacity_blocks=100, free_blocks=20, queued=4),  # kv 0.8 used
        "b": WorkerLoad(capacity_blocks=100, free_blocks=60, queued=2),
        "c": WorkerLoad(capacity_blocks=100, free_blocks=100, queued=0),
    }
    s = p.scores(q({"a": 80, "b": 20}, loads))
    # prefix: min-max over matching pods (a=1, b=0), c unmatched=0; kv: 1-usage; queue:
    # (4 - q) / 4
    assert s["a"] == pytest.approx(2 * 1 + 0.2 + 0.0)
    assert s["b"] == pytest.approx(2 * 0 + 0.6 + 0.5)
    assert s["c"] == pytest.approx(2 * 0 + 1.0 + 1.0)
    assert order(p, q({"a": 80, "b": 20}, loads)) == ["a", "c", "b"]


def test_llmd_a_lone_match_scores_one_however_short() -> None:
    p = LlmdPrecisePrefix()
    loads = {"a": IDLE, "b": IDLE}
    assert p.scores(q({"a": 1}, loads)) == p.scores(q({"a": 100}, loads))
    assert p.scores(q({"a": 1}, loads))["a"] == pytest.approx(2 + 1 + 1)


def test_llmd_breaks_ties_at_random_with_a_seed() -> None:
    loads = {f"w{i}": IDLE for i in range(8)}
    firsts = {first(LlmdPrecisePrefix(seed=s), q({}, loads)) for s in range(40)}
    assert len(firsts) >= 4
    a, b = LlmdPrecisePrefix(seed=3), LlmdPrecisePrefix(seed=3)
    assert [first(a, q({}, loads)) for _ in range(20)] == [first(b, q({}, loads))
                                                           for _ in range(20)]


# --- dynamo -----------------------------------------------------------------------------

def test_dynamo_cost_matches_the_formula() -> None:
    p = DynamoKvRouter()
    # 1600 tokens = 100 blocks; a: 60 cached, 320 pending tokens (20 blocks), 30 blocks used
    a = WorkerLoad(pending_prefill_tokens=320, capacity_blocks=1000, free_blocks=970)
    b = WorkerLoad(capacity_blocks=1000, free_blocks=1000)
    costs = p.costs(q({"a": 60}, {"a": a, "b": b}))
    assert costs["a"] == pytest.approx((20 + 100 - 60) + 30 + 100)
    assert costs["b"] == pytest.approx(100 + 0 + 100)
    assert first(p, q({"a": 60}, {"a": a, "b": b})) == "a"
    # decode blocks held on a grow past the prefill saving -> b wins
    a_full = WorkerLoad(pending_prefill_tokens=320, capacity_blocks=1000, free_blocks=900)
    assert first(p, q({"a": 60}, {"a": a_full, "b": b})) == "b"


def test_dynamo_without_capacity_counts_running_sequences() -> None:
    p = DynamoKvRouter()
    costs = p.costs(q({}, {"a": WorkerLoad(running=2), "b": WorkerLoad(inflight=3)}))
    assert costs["a"] == pytest.approx(100 + 2 * 100 + 100)
    assert costs["b"] == pytest.approx(100 + 3 * 100 + 100)


def test_dynamo_temperature_samples_deterministically() -> None:
    loads = {f"w{i}": WorkerLoad(capacity_blocks=100, free_blocks=100 - i) for i in range(6)}
    greedy = DynamoKvRouter()
    assert all(first(greedy, q({}, loads)) == "w0" for _ in range(10))
    hot = DynamoKvRouter(temperature=1.0, seed=1)
    picks = [first(hot, q({}, loads)) for _ in range(60)]
    assert len(set(picks)) > 1
    again = DynamoKvRouter(temperature=1.0, seed=1)
    assert [first(again, q({}, loads)) for _ in range(60)] == picks


# --- preble -----------------------------------------------------------------------------

def test_preble_exploits_when_the_cached_part_outweighs_the_rest() -> None:
    p = PrebleE2()
    loads = {"a": WorkerLoad(pending_prefill_tokens=5000, running=8), "b": IDLE}
    # 51 of 100 blocks cached on a: 816 > 784 -> a, despite its queue
    assert first(p, q({"a": 51}, loads)) == "a"
    # 50 blocks: 800 is not > 800 -> explore -> least loaded
    assert first(p, q({"a": 50}, loads)) == "b"


def test_preble_exploit_ties_go_to_the_less_loaded() -> None:
    p = PrebleE2()
    loads = {"a": pending(900), "b": pending(10), "c": IDLE}
    assert order(p, q({"a": 80, "b": 80}, loads))[:2] == ["b", "a"]


def test_preble_explore_counts_this_prompts_prefill() -> None:
    p = PrebleE2()
    # 20 of 100 blocks on a: explore; a's load 320 + 1280 = 1600 vs b's 400 + 1600 = 2000
    loads = {"a": pending(320), "b": pending(400)}
    assert first(p, q({"a": 20}, loads)) == "a"


# --- mooncake ---------------------------------------------------------------------------

def test_mooncake_minimises_queue_plus_uncached_prefill() -> None:
    p = MooncakeConductor()
    loads = {"a": pending(1000), "b": pending(100), "c": IDLE}
    ranked = p.rank(q({"a": 90}, loads))
    assert [s.worker for s in ranked] == ["a", "c", "b"]
    assert [s.cost for s in ranked] == [1000 + 160, 1600, 100 + 1600]
    # a hot prefix stops attracting requests once its queue outweighs the hit
    loads["a"] = pending(1500)
    assert first(p, q({"a": 90}, loads)) == "c"
