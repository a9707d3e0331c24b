from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.holders import NATIVE_AVAILABLE
from kvroute.core.index import PrefixIndex
from tests.support import collector_visits


def test_longest_prefix_per_worker(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("a", [1, 2, 3, 4])
    idx.add("b", [1, 2])
    idx.add("c", [9])
    assert idx.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert idx.match([1, 7]) == {"a": 1, "b": 1}
    assert idx.match([9, 1]) == {"c": 1}
    assert idx.match([5]) == {}
    assert idx.match([]) == {}


def test_a_hole_ends_the_prefix(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("a", [1, 3])  # block 2 evicted: only the first block is a usable prefix
    assert idx.match([1, 2, 3]) == {"a": 1}


def test_match_stops_consuming_at_first_miss(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("a", [1, 2])
    consumed = []

    def keys():
        for k in [1, 2, 3, 4, 5]:
            consumed.append(k)
            yield k

    assert idx.match(keys()) == {"a": 2}
    assert consumed == [1, 2, 3]


def test_remove_and_clear(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("a", [1, 2, 3])
    idx.add("b", [1, 2, 3])
    idx.remove("a", [3, 99])
    assert idx.match([1, 2, 3]) == {"a": 2, "b": 3}
    assert idx.clear_worker("b") == 3
    assert idx.match([1, 2, 3]) == {"a": 2}
    assert len(idx) == 2
    assert idx.remove_worker("a") == 2
    assert len(idx) == 0 and idx.entries() == 0
    assert idx.workers() == ["b"]


def test_slots_are_reused_without_leaking_keys(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("a", [1])
    idx.remove_worker("a")
    idx.add("z", [2])  # takes a's slot
    assert idx.match([1]) == {}
    assert idx.match([2]) == {"z": 1}


def test_replace_worker_is_a_snapshot_load(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("a", [1, 2, 3])
    idx.replace_worker("a", [7, 8])
    assert idx.keys_of("a") == {7, 8}
    assert idx.match([1]) == {}


def test_against_a_naive_model(native: bool) -> None:
    rng = random.Random(3)
    idx = PrefixIndex(native=native)
    naive: dict[str, set[int]] = {}
    workers = [f"w{i}" for i in range(70)]  # more than 64 slots: bitmasks past one word
    for _ in range(3000):
        w = rng.choice(workers)
        keys = [rng.randrange(40) for _ in range(rng.randrange(1, 6))]
        op = rng.random()
        if op < 0.6:
            idx.add(w, keys)
            naive.setdefault(w, set()).update(keys)
        elif op < 0.9:
            idx.remove(w, keys)
            naive.get(w, set()).difference_update(keys)
        elif op < 0.95:
            idx.clear_worker(w)
            naive.pop(w, None)
        else:
            idx.remove_worker(w)
            naive.pop(w, None)
        query = [rng.randrange(40) for _ in range(6)]
        expect = {}
        for name, ks in naive.items():
            n = 0
            while n < len(query) and query[n] in ks:
                n += 1
            if n:
                expect[name] = n
        assert idx.match(query) == expect
    assert idx.entries() == sum(len(s) for s in naive.values())


def test_predictions_match_until_they_expire_or_are_confirmed(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("a", [1])
    idx.predict("b", [1, 2, 3], deadline=10.0)
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 3}
    assert idx.count("b") == 0 and idx.predicted("b") == 3  # real counts stay real
    idx.add("b", [1, 2])  # the engine stored two of them
    assert idx.expire(9.0) == 0
    assert idx.expire(10.0) == 1  # only key 3 was still a prediction
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}


def test_confirmed_is_the_match_without_its_predictions(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("w", [1, 2, 4])
    idx.predict("w", [1, 2, 3, 4, 5], deadline=10.0)
    assert idx.match([1, 2, 3, 4, 5]) == {"w": 5}
    assert idx.confirmed("w", [1, 2, 3, 4, 5], 5) == 2  # 3 is only predicted: 4 is past it
    assert idx.confirmed("w", [1, 2, 3], 1) == 1  # no deeper than asked
    assert idx.confirmed("w", [9, 1], 2) == 0
    assert idx.confirmed("nobody", [1], 1) == 0
    idx.add("w", [3])  # the engine stored it
    assert idx.confirmed("w", [1, 2, 3, 4, 5], 5) == 4


def test_predictions_beyond_the_bound_expire_oldest_first(native: bool) -> None:
    idx = PrefixIndex(native=native, max_predicted=5)
    idx.add("w", [1])
    assert idx.predict("w", [1, 2, 3], deadline=10.0) == (2, 3)  # a real key is not counted
    idx.predict("w", [4, 5, 6], deadline=11.0)  # 5 keys waiting: within the bound
    assert idx.match([1, 2, 3]) == {"w": 3} and idx.predicted("w") == 5
    idx.predict("x", [7], deadline=12.0)  # 6: the earliest deadline's keys go now
    assert idx.match([1, 2, 3]) == {"w": 1} and idx.match([4, 5, 6]) == {"w": 3}
    assert idx.predicted("w") == 3 and idx.predicted("x") == 1
    assert idx.expire(11.5) == 3 and idx.expire(20.0) == 1 and len(idx) == 1


def test_predictions_survive_a_real_evict_and_clear_and_vice_versa(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("w", [1, 2])
    assert idx.predict("w", [2, 3], deadline=5.0) == (3,)  # 2 already real: not predicted
    assert idx.predicted("w") == 1
    idx.clear_worker("w")
    assert idx.match([1]) == {}
    idx.predict("w", [1], deadline=6.0)
    idx.remove("w", [1])  # not really held: nothing to remove; prediction stays
    assert idx.match([1]) == {"w": 1}
    idx.expire(7.0)
    assert idx.match([1]) == {} and len(idx) == 0
    idx.predict("z", [4], deadline=1.0)
    idx.remove_worker("z")
    assert idx.match([4]) == {} and idx.expire(2.0) == 0


def test_a_withdrawn_prediction_matches_no_more(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.add("w", [1])
    assert idx.predict("w", [1, 2, 3, 4], deadline=10.0) == (2, 3, 4)
    idx.add("w", [2])  # the engine stored one before the request failed
    idx.predict("w", [4], deadline=12.0)  # a later request predicts one again
    idx.predict("x", [1, 2, 3], deadline=10.0)  # the same deadline elsewhere
    assert idx.withdraw("w", (2, 3, 4), 10.0) == 1  # only 3: 2 is real, 4 is the later's
    assert idx.match([1, 2, 3]) == {"w": 2, "x": 3}
    assert idx.keys_of("w") == {1, 2} and idx.predicted("w") == 1
    assert idx.withdraw("w", (2, 3, 4), 10.0) == 0  # once only
    assert idx.withdraw("gone", (1,), 10.0) == 0
    # Its heap entry finds nothing left at the deadline; the later prediction still expires.
    assert idx.expire(11.0) == 3  # x's three
    assert idx.match([4]) == {"w": 1}
    assert idx.expire(12.0) == 1 and idx.match([4]) == {}


def test_a_later_prediction_extends_the_deadline(native: bool) -> None:
    idx = PrefixIndex(native=native)
    idx.predict("w", [1], deadline=1.0)
    idx.predict("w", [1], deadline=3.0)
    idx.expire(2.0)
    assert idx.match([1]) == {"w": 1}
    idx.expire(3.0)
    assert idx.match([1]) == {}


def test_the_collector_has_nothing_to_walk_per_key(native: bool) -> None:
    # The router holds the index for life, and every full collection walks whatever of it
    # the collector tracks: with a set per worker, 1M entries made that a ~100 ms stall.
    idx = PrefixIndex(native=native)
    for w in ("a", "b", "c"):
        idx.add(w, [0])
    one_key_each = collector_visits(idx)
    rng = random.Random(5)
    for w in ("a", "b", "c"):
        idx.add(w, [rng.getrandbits(64) for _ in range(4000)])
        idx.remove(w, sorted(idx.keys_of(w))[:500])
        idx.replace_worker(w, [rng.getrandbits(64) for _ in range(3000)])
        idx.predict(w, [rng.getrandbits(64) for _ in range(100)], deadline=1.0)
    idx.expire(2.0)  # the deadline heap holds tuples until then
    idx.clear_worker("c")
    idx.add("c", range(3000))
    assert idx.entries() == 9000
    assert collector_visits(idx) == one_key_each


_WORKERS = [f"w{i}" for i in range(6)]
_index_ops = st.lists(st.tuples(
    st.sampled_from(["add", "lower", "remove", "predict", "expire", "withdraw", "clear_worker",
                     "remove_worker", "replace_worker", "match"]),
    st.sampled_from(_WORKERS),
    st.lists(st.integers(0, 9), max_size=8),
    st.integers(0, 6)), max_size=100)


@settings(max_examples=300, deadline=None)
@given(ops=_index_ops)
def test_random_operations_give_identical_indexes_on_both_backends(
        ops: list[tuple[str, str, list[int], int]]) -> None:
    assert NATIVE_AVAILABLE, "the C holder map was not built; see setup.py"
    c, d = PrefixIndex(native=True, max_predicted=12), PrefixIndex(native=False, max_predicted=12)
    for name, w, keys, t in ops:
        if name == "match":
            matched = c.match(keys)
            assert list(matched.items()) == list(d.match(keys).items())
            assert c.confirmed(w, keys, t) == d.confirmed(w, keys, t)
            assert c.lower_blocks(keys, matched) == d.lower_blocks(keys, matched)
        elif name == "lower":
            c.add(w, keys, lower=True)
            d.add(w, keys, lower=True)
        elif name in ("predict", "withdraw"):
            assert getattr(c, name)(w, keys, float(t)) == getattr(d, name)(w, keys, float(t))
        elif name == "expire":
            assert c.expire(float(t)) == d.expire(float(t))
        elif name in ("clear_worker", "remove_worker"):
            assert getattr(c, name)(w) == getattr(d, name)(w)
        else:
            getattr(c, name)(w, keys)
            getattr(d, name)(w, keys)
        assert (len(c), c.entries(), c.workers()) == (len(d), d.entries(), d.workers())
    for w in _WORKERS:
        assert (c.count(w), c.keys_of(w), c.predicted(w)) == (d.count(w), d.keys_of(w),
                                                             d.predicted(w))
        assert (c.gpu_count(w), c.lower_keys_of(w)) == (d.gpu_count(w), d.lower_keys_of(w))
        assert c.lower_keys_of(w) <= c.keys_of(w)
        assert c.gpu_count(w) == len(c.keys_of(w) - c.lower_keys_of(w))
        assert [c.holds(w, k) for k in range(10)] == [d.holds(w, k) for k in range(10)]
    assert c.entries() == sum(c.count(w) for w in _WORKERS)


def test_a_packed_snapshot_load_is_replace_worker(native: bool) -> None:
    from kvroute.core.redis_schema import pack_keys

    idx, ref = PrefixIndex(native=native), PrefixIndex(native=native)
    for i in (idx, ref):
        i.add("a", [1, 2, 3])
        i.predict("a", [4, 5], deadline=10.0)
    idx.replace_worker_packed("a", [pack_keys((k,)) for k in (2, 4, 9)])
    ref.replace_worker("a", [2, 4, 9])
    assert idx.keys_of("a") == ref.keys_of("a") == {2, 4, 9}
    assert idx.predicted("a") == ref.predicted("a") == 1  # 4 confirmed, 5 still predicted
    assert idx.match([2, 4, 5]) == ref.match([2, 4, 5]) == {"a": 3}


def test_a_prefix_is_its_gpu_blocks_then_those_loaded_from_below(native: bool) -> None:
    """Per worker, the best tier of each key: ``lower_blocks`` counts a match's blocks
    from the first one held only in the lower tier; a store in GPU memory promotes it."""
    idx = PrefixIndex(native=native)
    idx.add("a", [1, 2])
    idx.add("a", [3, 4], lower=True)  # offloaded: only the CPU tier holds them
    idx.add("b", [1, 2, 3])
    keys = [1, 2, 3, 4, 5]
    matched = idx.match(keys)
    assert matched == {"a": 4, "b": 3}  # a lower-tier block is a hit...
    assert idx.lower_blocks(keys, matched) == {"a": 2}  # ...to load first; b has no tier
    assert idx.count("a") == 4 and idx.gpu_count("a") == 2
    idx.add("a", [3])  # loaded back: in GPU memory again
    assert idx.lower_blocks(keys, matched) == {"a": 1}
    assert idx.lower_keys_of("a") == {4} and idx.gpu_count("a") == 3
    # A lower-tier block before GPU ones: the engine hits the GPU prefix, loads the rest.
    idx.add("a", [1], lower=True)
    assert idx.lower_blocks(keys, matched) == {"a": 4}
    idx.remove("a", [1, 4])
    assert idx.lower_keys_of("a") == set() and idx.lower_blocks(keys, idx.match(keys)) == {}


def test_a_snapshot_load_sets_the_lower_tier_too(native: bool) -> None:
    from kvroute.core.redis_schema import pack_keys

    idx = PrefixIndex(native=native)
    idx.add("a", [7], lower=True)
    idx.replace_worker_packed("a", pack_keys((1, 2, 3)), [pack_keys((3,))])
    assert idx.keys_of("a") == {1, 2, 3} and idx.lower_keys_of("a") == {3}
    with pytest.raises(ValueError, match="8-byte"):
        idx.replace_worker_packed("a", pack_keys((5,)), [b"bad"])
    assert idx.keys_of("a") == {1, 2, 3}  # nothing changed
    idx.replace_worker_packed("a", pack_keys((1, 2)))
    assert idx.lower_keys_of("a") == set() and idx.gpu_count("a") == 2
