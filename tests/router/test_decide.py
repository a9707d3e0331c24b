"""The routing decision's query: which prefix family a request belongs to; deciding again
without predictions."""

from __future__ import annotations

import xxhash

from kvroute.core.index import PrefixIndex
from kvroute.core.load import prefill_context
from kvroute.core.policies import KvrouteCost, make_policy
from kvroute.core.redis_schema import Heartbeat
from kvroute.router.decide import Decider, rank_request, rerank_confirmed
from kvroute.router.registry import WorkerRegistry

BLOCK = 4


def _setup() -> tuple[Decider, PrefixIndex, WorkerRegistry]:
    reg = WorkerRegistry({}, BLOCK)
    reg.apply_heartbeats({w: Heartbeat(w, f"127.0.0.1:{i + 1}", "e", block_size=BLOCK)
                          for i, w in enumerate(("a", "b"))})
    return Decider("m", BLOCK, KvrouteCost()), PrefixIndex(), reg


def test_family_is_the_first_block_no_worker_caches() -> None:
    decider, index, reg = _setup()
    tokens = list(range(6 * BLOCK))
    keys = decider.hasher("").keys(tokens)
    cold = decider.decide(tokens, index, reg).query
    assert cold.affinity == cold.family == keys[0]
    index.add("a", keys[:2])  # a shared system prompt, say
    index.add("b", keys[:3])
    q = decider.decide(tokens, index, reg).query
    assert q.affinity == keys[0]  # what the peers' policies key on
    assert q.family == keys[3]  # kvroute's: where this prompt leaves what is cached
    index.add("a", keys)
    whole = decider.decide(tokens, index, reg).query
    assert whole.family == keys[0]
    # Redis down (no index): nothing counts as cached.
    assert decider.decide(tokens, None, reg).query.family == keys[0]


def test_a_session_is_its_own_family() -> None:
    decider, index, reg = _setup()
    tokens = list(range(6 * BLOCK))
    index.add("a", decider.hasher("").keys(tokens)[:2])
    q = decider.decide(tokens, index, reg, session_id="s1").query
    assert q.affinity == q.family == xxhash.xxh3_64_intdigest(b"s1")


def test_a_decision_again_counts_only_what_workers_really_hold() -> None:
    decider, index, reg = _setup()
    decider.policy = make_policy("llmd")  # prefix-first: goes wherever the prefix is longest
    tokens = list(range(8 * BLOCK))
    keys = decider.hasher("").keys(tokens)
    index.add("a", keys[:3])
    index.predict("b", keys[:6], deadline=1e9)  # a request in flight on b will store these
    d = decider.decide(tokens, index, reg)
    assert d.best == "b" and d.query.matched_blocks == {"a": 3, "b": 6}
    again = rerank_confirmed(decider.policy, index, d, d.keys)
    assert again.best == "a" and again.query.matched_blocks == {"a": 3}
    assert (again.query.loads, again.query.family) == (d.query.loads, d.query.family)
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


def test_a_decision_says_what_each_worker_would_prefill() -> None:
    decider, index, reg = _setup()
    tokens = list(range(6 * BLOCK + 2))  # 26 tokens: 6 full blocks and 2 more
    index.add("a", decider.hasher("").keys(tokens)[:4])  # 16 tokens cached on a
    d = decider.decide(tokens, index, reg)
    # 10 new tokens after 16 cached attend to 10 * 16 + 10 * 10 // 2 token pairs
    assert d.prefill("a") == (10, 10 * 16 + 50)
    assert d.prefill("b") == (26, 26 * 26 // 2)  # nothing cached: all of it


def test_the_query_carries_the_tail_of_the_least_prefills_before_it() -> None:
    """``tail_work``, kept for a policy that reads it (kvroute's ``tail_hold``): inf until
    the decider has seen enough requests, then the 99th
    percentile of what the requests before needed at best (their tokens past the longest
    prefix any worker caches), weighed with the policy's attention cost."""
    _, index, reg = _setup()
    assert Decider("m", BLOCK, KvrouteCost()).tail is None  # the default reads no tail
    decider = Decider("m", BLOCK, KvrouteCost(tail_hold=1.0))
    assert decider.tail is not None and decider.tail.attn == KvrouteCost().attn
    short = list(range(2 * BLOCK))
    for _ in range(decider.tail.min_samples):
        assert decider.decide(short, index, reg).query.tail_work == float("inf")
    long = list(range(100, 100 + 40 * BLOCK))
    index.add("a", decider.hasher("").keys(long)[:30])  # 30 of its 40 blocks cached on a
    want = 10 * BLOCK + KvrouteCost().attn * prefill_context(10 * BLOCK, 30 * BLOCK)
    for _ in range(10):  # more than 1% of the window: the 99th percentile is this one's
        decider.decide(long, index, reg)
    assert decider.decide(short, index, reg).query.tail_work == want


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
