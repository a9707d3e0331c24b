"""The holder map's two backends against each other (and the C one against bad input)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.holders import DictHolders, HolderMap, make_holders

U64 = (1 << 64) - 1


def test_holders_add_remove_and_delete(native: bool) -> None:
    m = make_holders(native)
    m.add([0, 5, U64], 3)
    m.add([5], 130)  # a third mask word
    assert len(m) == 3 and m.entries() == 4
    assert (m.get(0), m.get(5), m.get(U64), m.get(7)) == (8, 8 | 1 << 130, 8, 0)
    m.remove([5, 7], 3)  # 7 is not stored: nothing to do
    assert m.get(5) == 1 << 130 and len(m) == 3 and m.count(3) == 2
    m.remove([0, U64], 3)  # no holder left: deleted
    assert len(m) == 1 and m.get(0) == 0 and m.count(3) == 0
    m.remove([5], 999)  # a slot never given
    assert m.get(5) == 1 << 130 and m.entries() == 1


def test_predictions_are_holders_the_walk_sees_but_not_real_ones(native: bool) -> None:
    m = make_holders(native)
    m.add([1], 2)
    assert m.predict([1, 2, 2, 3], 2) == (2, 2, 3)  # 1 is real: not predicted
    assert m.walk([1, 2, 3]) == {2: 3} and m.get(2) == 4
    assert (m.holds(1, 2), m.holds(2, 2), m.count(2), m.entries()) == (True, False, 1, 1)
    assert m.leading([1, 2, 3], 3, 2) == 1
    m.remove([2], 2)  # not really held: the prediction stays
    assert m.walk([2]) == {2: 1}
    m.add([2], 2)  # confirmed: real now, no longer a prediction
    assert m.holds(2, 2) and m.count(2) == 2
    m.unpredict([1, 2, 3], 2)  # only 3 was still a prediction
    assert m.walk([1, 2, 3]) == {2: 2} and len(m) == 2
    assert m.clear_slot(2) == 2 and len(m) == 0 and m.entries() == 0


def test_walk_gives_each_slots_leading_run(native: bool) -> None:
    m = make_holders(native)
    m.add([1, 2, 3, 4], 0)
    m.add([1, 2], 70)
    m.add([1, 3], 140)  # a hole at 2 ends its run
    assert m.walk([1, 2, 3, 4, 5]) == {0: 4, 70: 2, 140: 1}
    assert list(m.walk((1, 2, 3, 4))) == [140, 70, 0]  # by depth, then slot
    assert m.walk([2, 3]) == {0: 2, 70: 1}
    assert m.walk([9, 1]) == {} and m.walk([]) == {}
    assert make_holders(native).walk([1, 2]) == {}  # never written


def test_walk_over_many_keys_ends_each_run_where_it_ends(native: bool) -> None:
    # The C walk reads a listed prompt's keys in chunks (64): runs ending on either side
    # of a chunk's edge, or past the last one, must each end where they end.
    keys = list(range(1000, 1200))
    m = make_holders(native)
    depths = {0: 1, 1: 63, 2: 64, 3: 65, 4: 128, 5: 129, 6: 199, 7: 200, 200: 130}
    for slot, depth in depths.items():
        m.add(keys[:depth], slot)
    m.add(keys[66:], 8)  # no run: it lacks the first key
    m.add([*keys[:10], *keys[11:]], 9)  # a hole at 10
    want = {**depths, 9: 10}
    assert m.walk(keys) == want
    assert m.walk(iter(keys)) == want  # one at a time: the same
    assert m.walk([*keys, 5, 6]) == want  # keys nobody holds past every run
    assert m.walk(keys[:64]) == {s: min(d, 64) for s, d in want.items()}


def test_walk_stops_consuming_at_the_first_key_nobody_left_holds(native: bool) -> None:
    m = make_holders(native)
    m.add([1, 2], 0)
    consumed: list[int] = []

    def keys() -> Iterator[int]:
        for k in [1, 2, 3, 4, 5]:
            consumed.append(k)
            yield k

    assert m.walk(keys()) == {0: 2}
    assert consumed == [1, 2, 3]


def test_a_key_held_by_many_slots_and_then_few(native: bool) -> None:
    # Past a few holders a key's holders move to a list, past 64 to masks, and back inline.
    m = make_holders(native)
    slots = list(range(0, 1000, 3))
    for s in slots:
        m.add([7, 8], s)
        m.predict([9], s)
    assert m.walk([7, 8, 9, 10]) == dict.fromkeys(slots, 3)
    assert m.get(7) == sum(1 << s for s in slots) == m.get(9)
    for s in slots[4:]:
        m.remove([7], s)
        m.unpredict([9], s)
    assert m.walk([7, 8, 9]) == dict.fromkeys(slots[:4], 3)
    assert m.walk([8, 7]) == dict.fromkeys(slots[4:], 1) | dict.fromkeys(slots[:4], 2)
    assert m.count(slots[0]) == 2 and m.count(slots[-1]) == 1 and m.entries() == len(slots) + 4
    assert sorted(m.keys_of(slots[0])) == [7, 8] and m.keys_of(slots[-1]) == [8]


def model_walk(model: dict[int, int], keys: list[int]) -> dict[int, int]:
    """The walk written plainly: per slot, the leading keys it holds."""
    if not keys or not model.get(keys[0]):
        return {}
    out = {}
    for s in range(model[keys[0]].bit_length()):
        n = 0
        while n < len(keys) and model.get(keys[n], 0) >> s & 1:
            n += 1
        if n:
            out[s] = n
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_both_backends_agree_with_a_plain_model_through_resizes(seed: int) -> None:
    rng = random.Random(seed)
    pool = [0, U64, *(rng.getrandbits(64) for _ in range(300)), *range(1, 300)]
    maps: list[HolderMap] = [DictHolders(), make_holders(True)]
    model: dict[int, int] = {}
    for step in range(4000):
        keys = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        slot = rng.choice([0, 1, 5, 63, 64, 65, 127, 128, 200])
        if rng.random() < 0.55:
            for m in maps:
                m.add(keys, slot)
            for k in keys:
                model[k] = model.get(k, 0) | 1 << slot
        else:
            for m in maps:
                m.remove(keys, slot)
            for k in keys:
                v = model.get(k, 0) & ~(1 << slot)
                if v:
                    model[k] = v
                else:
                    model.pop(k, None)
        if step % 50 == 0:
            query = [rng.choice(pool) for _ in range(8)]
            for m in maps:
                assert len(m) == len(model)
                assert all(m.get(k) == model.get(k, 0) for k in pool)
                assert m.walk(query) == model_walk(model, query)
                # a walk along a stored chain gets past the first key
                chain = sorted(model, key=lambda k: -model[k])[:6]
                assert m.walk(chain) == model_walk(model, chain)


# One operation on both maps: (name, key indices, slot).
_ops = st.lists(st.tuples(
    st.sampled_from(["add", "remove", "predict", "unpredict", "clear_slot", "walk"]),
    st.lists(st.integers(0, 11), max_size=9),
    st.sampled_from([0, 1, 2, 3, 63, 64, 65, 130, 700])), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, many=st.booleans())
def test_random_operations_give_identical_maps(ops: list[tuple[str, list[int], int]],
                                               many: bool) -> None:
    pool = [0, U64, 1, 2, 3, *(k * 0x9E3779B97F4A7C15 % (1 << 64) for k in range(7))]
    c, d = make_holders(True), DictHolders()
    assert not isinstance(c, DictHolders), "the C holder map was not built; see setup.py"
    if many:  # keys 0-2 held by 80 slots: lists and masks, not only inline holders
        for s in range(80):
            c.add(pool[:3], s * 7)
            d.add(pool[:3], s * 7)
    for name, idx, slot in ops:
        keys = [pool[i] for i in idx]
        if name == "walk":
            assert list(c.walk(keys).items()) == list(d.walk(keys).items())
            assert c.walk(iter(keys)) == d.walk(keys)
            assert c.leading(keys, 5, slot) == d.leading(keys, 5, slot)
        elif name == "clear_slot":
            assert c.clear_slot(slot) == d.clear_slot(slot)
        else:
            assert getattr(c, name)(keys, slot) == getattr(d, name)(keys, slot)
    assert (len(c), c.entries()) == (len(d), d.entries())
    for s in {0, 1, 2, 3, 63, 64, 65, 130, 700, *range(0, 560, 7)}:
        assert c.count(s) == d.count(s)
        assert sorted(c.keys_of(s)) == sorted(d.keys_of(s))
        assert [c.holds(k, s) for k in pool] == [d.holds(k, s) for k in pool]
    assert [c.get(k) for k in pool] == [d.get(k) for k in pool]


def test_a_big_table_grows_and_empties(native: bool) -> None:
    m = make_holders(native)
    keys = list(range(50_000))  # sequential keys: must not pile into one probe run
    m.add(keys, 1)
    m.add(keys[::3], 64)
    assert len(m) == 50_000
    m.remove(keys[::2], 1)  # deletes every even key not also in slot 64
    assert all(m.get(k) == (1 << 64 if k % 3 == 0 else 0) for k in keys[::2])
    assert all(m.get(k) == 2 | (1 << 64 if k % 3 == 0 else 0) for k in keys[1::2])
    assert m.clear_slot(1) == 25_000 and m.count(1) == 0
    m.remove(keys, 64)
    assert len(m) == 0 and m.walk(keys) == {} and m.entries() == 0
    m.add([7], 0)
    assert m.walk([7]) == {0: 1}


def test_memory_grows_with_holders_not_with_slots() -> None:
    # 1,000 slots, each key held by 4 of them: the table costs per (key, holder) pair.
    m = make_holders(True)
    rng = random.Random(4)
    keys = [rng.getrandbits(64) for _ in range(50_000)]
    for s in range(1000):
        for part in (s, s + 250, s + 500, s + 750):
            m.add(keys[part % 1000 * 50:(part % 1000 + 1) * 50], s)
    assert m.entries() == 200_000 and len(m) == 50_000
    # 32-byte entries at a load of 3/8 here (just past a doubling): 21 B a pair, and each
    # slot's key log 8-12 B a pair. A mask 1,000 slots wide per key, as before, was 136 B a
    # key slot: 68 B a pair at best.
    assert m.nbytes / m.entries() < 34


def test_bad_keys_and_slots_are_refused_before_any_change() -> None:
    m = make_holders(True)
    assert not isinstance(m, DictHolders), "the C holder map was not built; see setup.py"
    m.add([1], 0)
    for bad, err in (([2, -1], OverflowError), ([2, 1 << 64], OverflowError),
                     ([2, -(1 << 64)], OverflowError), ([2, 1 << 100], OverflowError),
                     ([2, "3"], TypeError), ([2, 1.0], TypeError)):
        with pytest.raises(err):
            m.add(bad, 0)
        assert m.get(2) == 0 and len(m) == 1
        with pytest.raises(err):
            m.predict(bad, 0)
        assert m.get(2) == 0 and len(m) == 1
        with pytest.raises(err):
            m.remove([1, *bad], 0)
        assert m.get(1) == 1
    with pytest.raises(ValueError, match="slot"):
        m.add([1], -1)
    with pytest.raises(ValueError, match="slot"):
        m.count(1 << 20)
    with pytest.raises(TypeError):
        m.walk(5)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        m.walk([1, -5])
    with pytest.raises(TypeError, match="no arguments"):
        type(m)(3)  # type: ignore[call-arg]


def test_packed_members_are_decoded_as_pack_keys_writes_them(native: bool) -> None:
    from kvroute.core.redis_schema import pack_keys

    m = make_holders(native)
    keys = [0, 1, U64, 0x0102030405060708]
    m.add([5, 1], 2)
    m.predict([6], 2)
    m.add_packed({pack_keys((k,)) for k in keys}, 2)  # a set, as SMEMBERS gives
    assert sorted(m.keys_of(2)) == sorted({5, *keys}) and m.get(6) == 4
    m.add_packed([pack_keys((k,)) for k in keys[:2]], 2, True)  # replace: real keys only
    assert sorted(m.keys_of(2)) == [0, 1] and m.walk([6]) == {2: 1}
    with pytest.raises(ValueError, match="member of 7 bytes"):
        m.add_packed([pack_keys((9,)), b"1234567"], 2, True)
    assert sorted(m.keys_of(2)) == [0, 1] and not m.holds(9, 2)  # refused before any change


def test_a_blob_of_packed_keys_is_decoded_as_the_members_would_be(native: bool) -> None:
    from kvroute.core.redis_schema import pack_keys

    keys = [0, 1, U64, 0x0102030405060708, 77]
    by_list, by_blob = make_holders(native), make_holders(native)
    for m in (by_list, by_blob):
        m.add([5], 3)
        m.predict([77], 3)
    by_list.add_packed([pack_keys((k,)) for k in keys], 3, True)
    by_blob.add_packed(pack_keys(keys), 3, True)  # a snapshot as DUMP gives it, end to end
    assert sorted(by_blob.keys_of(3)) == sorted(by_list.keys_of(3)) == sorted(keys)
    assert by_blob.walk([77]) == {3: 1} and by_blob.entries() == by_list.entries()
    by_blob.add_packed(b"", 3, True)  # an empty snapshot clears the real keys
    assert by_blob.count(3) == 0
    by_blob.add_packed(pack_keys([9]), 3)
    with pytest.raises(ValueError, match="12 bytes"):
        by_blob.add_packed(pack_keys([1]) + b"1234", 3, True)
    assert sorted(by_blob.keys_of(3)) == [9]  # refused before any change
