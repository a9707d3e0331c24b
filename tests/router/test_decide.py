"""The routing decision's query: its affinity, its prefix's demand, what each worker would
prefill; deciding again without predictions."""

from __future__ import annotations

import xxhash

from kvroute.core.index import PrefixIndex
from kvroute.core.policies import Kvroute, RoundRobin
from kvroute.core.redis_schema import Heartbeat
from kvroute.router.decide import Decider, rank_request, rerank_confirmed
from kvroute.router.registry import WorkerRegistry
from kvroute.simulations.policies import make_replay_policy

BLOCK = 4


def _setup() -> tuple[Decider, PrefixIndex, WorkerRegistry]:
    reg = WorkerRegistry({}, BLOCK)
    reg.apply_heartbeats({w: Heartbeat(w, f"127.0.0.1:{i + 1}", "e", block_size=BLOCK)
                          for i, w in enumerate(("a", "b"))})
    return Decider("m", BLOCK, Kvroute()), PrefixIndex(), reg


def test_affinity_is_the_session_else_the_first_block() -> None:
    decider, index, reg = _setup()
    tokens = list(range(6 * BLOCK))
    keys = decider.hasher("").keys(tokens)
    index.add("a", keys[:2])
    assert decider.decide(tokens, index, reg).query.affinity == keys[0]
    q = decider.decide(tokens, index, reg, session_id="s1").query
    assert q.affinity == xxhash.xxh3_64_intdigest(b"s1")


def test_a_decision_again_counts_only_what_workers_really_hold() -> None:
    decider, index, reg = _setup()
    decider.policy = make_replay_policy("llmd")  # prefix-first: wherever the prefix is longest
    tokens = list(range(8 * BLOCK))
    keys = decider.hasher("").keys(tokens)
    index.add("a", keys[:3])
    index.predict("b", keys[:6], deadline=1e9)  # a request in flight on b will store these
    d = decider.decide(tokens, index, reg)
    assert d.best == "b" and d.query.matched_blocks == {"a": 3, "b": 6}
    again = rerank_confirmed(decider.policy, index, d, d.keys)
    assert again.best == "a" and again.query.matched_blocks == {"a": 3}
    assert again.query.loads == d.query.loads and again.query.affinity == d.query.affinity
    assert again.keys == d.keys


def test_a_decision_reads_how_hot_its_cached_prefix_is() -> None:
    """``prefix_rate``: the requests before this one whose longest cached prefix ended at
    the same block, whatever follows it."""
    decider, index, reg = _setup()
    doc = list(range(4 * BLOCK))
    keys = decider.hasher("").keys(doc)
    index.add("a", keys)
    rates = [decider.decide(doc + [900 + i] * BLOCK, index, reg).query.prefix_rate
             for i in range(3)]
    assert rates[0] == 0.0 and 0 < rates[1] < rates[2]
    cold = decider.decide(list(range(500, 500 + 4 * BLOCK)), index, reg).query
    assert cold.prefix_rate == 0.0  # nothing cached: no prefix to be hot
    # Counted only for a policy that places replicas: nobody else reads it.
    blind = Decider("m", BLOCK, RoundRobin())
    assert blind.demand is None
    assert blind.decide(doc + [7] * BLOCK, index, reg).query.prefix_rate == 0.0


def test_a_decision_says_what_each_worker_would_prefill() -> None:
    decider, index, reg = _setup()
    tokens = list(range(6 * BLOCK + 2))  # 26 tokens: 6 full blocks and 2 more
    index.add("a", decider.hasher("").keys(tokens)[:4])  # 16 tokens cached on a
    d = decider.decide(tokens, index, reg)
    # 10 new tokens after 16 cached attend to 10 * 16 + 10 * 10 // 2 token pairs
    assert d.prefill("a") == (10, 10 * 16 + 50)
    assert d.prefill("b") == (26, 26 * 26 // 2)  # nothing cached: all of it


def test_only_live_compatible_workers_count_as_matched() -> None:
    """A worker the index still lists but the registry no longer has (gone, or not yet
    heard from) is not a candidate, nor one ``compatible`` refuses."""
    decider, index, reg = _setup()
    tokens = list(range(4 * BLOCK))
    keys = decider.hasher("").keys(tokens)
    index.add("a", keys[:2])
    index.add("b", keys[:3])
    index.add("gone", keys)
    loads = reg.loads
    d = rank_request(decider.policy, index, keys, len(tokens), BLOCK, loads, keys[0])
    assert d.query.matched_blocks == {"a": 2, "b": 3}
    only_a = rank_request(decider.policy, index, keys, len(tokens), BLOCK, loads, keys[0],
                          lambda w: w == "a")
    assert only_a.query.matched_blocks == {"a": 2}
    assert index.match(keys) == {"a": 2, "b": 3, "gone": 4}  # the index keeps its own
