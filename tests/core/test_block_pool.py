"""BlockPool: LRU eviction, ref-count pinning, events, invariants."""

from __future__ import annotations

import random

import pytest

from kvroute.core.block_pool import BlockPool, PoolExhaustedError
from kvroute.core.cache_events import CacheEvent
from kvroute.core.redis_schema import Op


def make_pool(capacity: int) -> tuple[BlockPool, list[CacheEvent]]:
    events: list[CacheEvent] = []
    return BlockPool(capacity, events.append), events


def replay(events: list[CacheEvent]) -> set[int]:
    """The key set a subscriber of the event stream would hold."""
    keys: set[int] = set()
    for ev in events:
        if ev.op is Op.STORE:
            assert not keys & set(ev.keys), "STORE of an already stored key"
            keys |= set(ev.keys)
        elif ev.op is Op.EVICT:
            assert set(ev.keys) <= keys, "EVICT of a key never stored"
            keys -= set(ev.keys)
        elif ev.op is Op.CLEAR:
            assert ev.keys == ()
            keys.clear()
    return keys


def check_invariants(pool: BlockPool) -> None:
    cap = pool.capacity_blocks
    refs = [pool.ref_count(b) for b in range(cap)]
    assert all(r >= 0 for r in refs)
    free = list(pool._free)
    assert set(free) == {b for b in range(cap) if refs[b] == 0}
    assert pool.free_blocks == len(free)
    cached = list(pool._block_of)  # the GPU's (cached_keys adds a host tier's)
    assert len(cached) == len(set(cached)) == pool.num_cached
    holders = [b for b in range(cap) if pool.block_key(b) is not None]
    assert sorted(pool.block_key(b) for b in holders) == sorted(cached)
    assert pool.lookup(cached) == [pool._block_of[k] for k in cached]
    # Uncached free blocks all precede cached free blocks.
    flags = [pool.block_key(b) is not None for b in free]
    assert flags == sorted(flags)


def test_fresh_pool_is_empty_and_all_free() -> None:
    pool, events = make_pool(8)
    assert pool.free_blocks == 8
    assert pool.cached_keys() == []
    assert pool.longest_cached_prefix([1, 2, 3]) == 0
    assert events == []
    check_invariants(pool)


def test_commit_emits_one_store_event_and_makes_keys_findable() -> None:
    pool, events = make_pool(8)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.free_blocks == 5
    assert pool.commit(blocks, [11, 12, 13]) == [11, 12, 13]
    assert events == [CacheEvent(Op.STORE, (11, 12, 13))]
    assert pool.lookup([11, 12, 13, 14]) == blocks
    assert pool.longest_cached_prefix([11, 12, 99, 13]) == 2
    assert pool.longest_cached_prefix([12, 13]) == 2  # any keys; the chain makes them prefixes
    assert pool.longest_cached_prefix([99, 11]) == 0
    check_invariants(pool)


def test_lookup_stops_at_first_miss_without_consuming_more() -> None:
    pool, _ = make_pool(4)
    pool.commit(pool.allocate(1), [1])
    consumed: list[int] = []

    def keys():
        for k in [1, 2, 3, 4]:
            consumed.append(k)
            yield k

    assert pool.longest_cached_prefix(keys()) == 1
    assert consumed == [1, 2]


def test_freed_blocks_stay_cached_and_hits_revive_them() -> None:
    pool, events = make_pool(4)
    a = pool.allocate(2)
    pool.commit(a, [1, 2])
    pool.free(a)
    assert pool.free_blocks == 4
    assert pool.cached_keys() == [1, 2]
    hits = pool.lookup([1, 2, 3])
    assert hits == a
    got = pool.allocate(1, hits)
    assert got[:2] == a and len(got) == 3
    assert [pool.ref_count(b) for b in got] == [1, 1, 1]
    assert pool.free_blocks == 1
    assert all(ev.op is Op.STORE for ev in events)  # nothing evicted: 2 uncached were free
    check_invariants(pool)


def test_eviction_is_lru_and_tail_of_sequence_first() -> None:
    pool, events = make_pool(4)
    a = pool.allocate(2)
    pool.commit(a, [10, 11])  # sequence A: head 10, tail 11
    b = pool.allocate(2)
    pool.commit(b, [20, 21])
    pool.free(a)  # A freed first -> evicted first, its tail (11) before its head (10)
    pool.free(b)
    events.clear()
    order = []
    for _ in range(4):
        pool.allocate(1)
        order.extend(k for ev in events for k in ev.keys)
        events.clear()
    assert order == [11, 10, 21, 20]
    assert pool.cached_keys() == []
    assert pool.free_blocks == 0


def test_touching_a_free_cached_block_makes_it_most_recently_used() -> None:
    pool, events = make_pool(2)
    x, y = pool.allocate(2)
    pool.commit([x, y], [1, 2])
    pool.free([x])
    pool.free([y])  # LRU order: 1, 2
    pool.touch([x])
    pool.free([x])  # 1 used again: now order 2, 1
    events.clear()
    pool.allocate(1)
    assert events == [CacheEvent(Op.EVICT, (2,))]


def test_one_evict_event_per_allocate_with_all_evicted_keys() -> None:
    pool, events = make_pool(3)
    blocks = pool.allocate(3)
    pool.commit(blocks, [1, 2, 3])
    pool.free(blocks)
    events.clear()
    pool.allocate(3)
    assert events == [CacheEvent(Op.EVICT, (3, 2, 1))]


def test_ref_counts_pin_shared_blocks_against_eviction() -> None:
    pool, events = make_pool(4)
    a = pool.allocate(2)
    pool.commit(a, [1, 2])
    # Sequence B shares A's prefix: pins the same blocks.
    b = pool.allocate(0, pool.lookup([1, 2]))
    assert b == a
    assert [pool.ref_count(x) for x in a] == [2, 2]
    pool.free(a)  # A finishes; B still holds both blocks
    assert [pool.ref_count(x) for x in a] == [1, 1]
    assert pool.free_blocks == 2
    assert not pool.can_allocate(3)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(3)
    pool.allocate(2)  # takes the two never-used blocks, not B's
    assert pool.cached_keys() == [1, 2]
    assert not any(ev.op is Op.EVICT for ev in events)
    assert not pool.can_allocate(1)
    pool.free(b)
    assert pool.free_blocks == 2 and pool.can_allocate(2)
    check_invariants(pool)


def test_can_allocate_counts_free_hits_as_unavailable() -> None:
    pool, _ = make_pool(4)
    a = pool.allocate(2)
    pool.commit(a, [1, 2])
    pool.free(a)
    hits = pool.lookup([1, 2])
    # 4 free, but pinning the 2 free hits leaves 2 for fresh blocks.
    assert pool.can_allocate(2, hits)
    assert not pool.can_allocate(3, hits)
    assert pool.can_allocate(4)


def test_failed_allocate_changes_nothing() -> None:
    pool, events = make_pool(3)
    a = pool.allocate(2)
    pool.commit(a, [1, 2])
    pool.free(a)
    events.clear()
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2, pool.lookup([1, 2]))
    assert events == []
    assert pool.free_blocks == 3
    assert [pool.ref_count(b) for b in range(3)] == [0, 0, 0]
    assert pool.cached_keys() == [1, 2]
    check_invariants(pool)


def test_duplicate_key_keeps_existing_block_and_duplicate_is_reused_first() -> None:
    pool, events = make_pool(4)
    a = pool.allocate(1)
    b = pool.allocate(1)
    assert pool.commit(a, [7]) == [7]
    assert pool.commit(b, [7]) == []  # same prefix computed twice: keep one
    assert events == [CacheEvent(Op.STORE, (7,))]
    assert pool.block_key(b[0]) is None
    assert pool.lookup([7]) == a
    assert pool.commit(a, [7]) == []  # idempotent
    with pytest.raises(ValueError):
        pool.commit(a, [8])
    pool.free(a)
    pool.free(b)
    check_invariants(pool)
    # The uncached duplicate goes to the head: reused before anything cached is evicted.
    events.clear()
    pool.allocate(3)
    assert events == []
    assert pool.cached_keys() == [7]


def test_commit_rejects_free_blocks_and_mismatched_lengths() -> None:
    pool, _ = make_pool(2)
    with pytest.raises(ValueError):
        pool.commit([0], [1])
    blocks = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.commit(blocks, [1])


def test_double_free_raises() -> None:
    pool, _ = make_pool(2)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free(a)


def test_clear_drops_every_key_and_emits_clear() -> None:
    pool, events = make_pool(4)
    a = pool.allocate(2)
    pool.commit(a, [1, 2])
    b = pool.allocate(1)
    pool.commit(b, [3])
    pool.free(a)  # 1, 2 free and cached; 3 in use and cached
    events.clear()
    assert pool.clear() == 3
    assert events == [CacheEvent(Op.CLEAR, ())]
    assert pool.cached_keys() == []
    assert pool.lookup([1]) == [] and pool.lookup([3]) == []
    assert pool.ref_count(b[0]) == 1  # still allocated to its sequence
    check_invariants(pool)
    events.clear()
    pool.allocate(3)
    assert events == []  # nothing left to evict


def test_randomized_operations_keep_invariants_and_event_stream_consistent() -> None:
    rng = random.Random(1234)
    pool, events = make_pool(32)
    live: list[list[int]] = []
    next_key = 1
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            # A sequence: maybe reuse a cached prefix, then fresh blocks.
            cached = pool.cached_keys()
            prefix = rng.sample(cached, k=min(len(cached), rng.randint(0, 3)))
            hits = pool.lookup(prefix)
            n = rng.randint(0, 6)
            if pool.can_allocate(n, hits):
                blocks = pool.allocate(n, hits)
                fresh = blocks[len(hits):]
                k = rng.randint(0, len(fresh))
                keys = [rng.choice(cached) if cached and rng.random() < 0.1 else next_key + i
                        for i in range(k)]
                next_key += k
                pool.commit(fresh[:k], keys)
                live.append(blocks)
            else:
                with pytest.raises(PoolExhaustedError):
                    pool.allocate(n, hits)
        elif op < 0.95:
            if live:
                pool.free(live.pop(rng.randrange(len(live))))
        else:
            pool.clear()
        check_invariants(pool)
        assert replay(events) == set(pool.cached_keys())
    held = sum(len(b) for b in live)
    assert sum(pool.ref_count(b) for b in range(32)) == held
    for blocks in live:
        pool.free(blocks)
    assert pool.free_blocks == 32


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_a_host_tier_keeps_what_the_gpu_evicts_and_reports_each_keys_best_tier() -> None:
    """Evicted keys go to the host tier (LOWER), its LRU keys leave it (EVICT); a key's last
    event is its best tier, and the events replay to cached_keys / lower_keys."""
    events: list[CacheEvent] = []
    pool = BlockPool(4, events.append, host_blocks=3)
    rng = random.Random(5)
    for step in range(300):
        n = rng.randint(1, 3)
        base = rng.randrange(12)
        keys = [base + i for i in range(n)]
        hits = pool.lookup(keys)
        loaded = pool.host_prefix(keys[len(hits):])
        pool.load_from_host(keys[len(hits):len(hits) + loaded])
        blocks = pool.allocate(n - len(hits), hits)
        pool.commit(blocks[len(hits):], keys[len(hits):])
        pool.free(blocks)
        best: dict[int, Op] = {}
        for ev in events:
            for k in ev.keys:
                if ev.op is Op.EVICT:
                    best.pop(k, None)
                else:
                    best[k] = ev.op
        assert set(best) == set(pool.cached_keys()), step
        assert {k for k, op in best.items() if op is Op.LOWER} == set(pool.lower_keys())
        assert len(pool._host) <= 3
        check_invariants(pool)
    assert {Op.LOWER, Op.EVICT} <= {ev.op for ev in events}
    assert pool.clear() == len(pool.cached_keys()) or not pool.cached_keys()
    assert pool.lower_keys() == [] and pool.cached_keys() == []
