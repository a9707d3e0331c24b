"""The holder map's two backends against each other (and the C one against bad input)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvroute.core.holders import DictHolders, HolderMap, make_holders

U64 = (1 << 64) - 1


def test_bits_set_clear_and_delete(native: bool) -> None:
    m = make_holders(native)
    m.set_bit([0, 5, U64], 3)
    m.set_bit([5], 130)  # a third mask word
    assert len(m) == 3
    assert (m.get(0), m.get(5), m.get(U64), m.get(7)) == (8, 8 | 1 << 130, 8, 0)
    m.clear_bit([5, 7], 3)  # 7 is not stored: nothing to do
    assert m.get(5) == 1 << 130 and len(m) == 3
    m.clear_bit([0, U64], 3)  # no holder left: deleted
    assert len(m) == 1 and m.get(0) == 0
    m.clear_bit([5], 999)  # a slot never set
    assert m.get(5) == 1 << 130


def test_walk_gives_each_slots_leading_run(native: bool) -> None:
    m = make_holders(native)
    m.set_bit([1, 2, 3, 4], 0)
    m.set_bit([1, 2], 70)
    m.set_bit([1, 3], 140)  # a hole at 2 ends its run
    assert m.walk([1, 2, 3, 4, 5]) == {0: 4, 70: 2, 140: 1}
    assert m.walk((1, 2, 3, 4)) == {0: 4, 70: 2, 140: 1}
    assert m.walk([2, 3]) == {0: 2, 70: 1}
    assert m.walk([9, 1]) == {} and m.walk([]) == {}
    assert make_holders(native).walk([1, 2]) == {}  # never written


def test_walk_stops_consuming_at_the_first_key_nobody_left_holds(native: bool) -> None:
    m = make_holders(native)
    m.set_bit([1, 2], 0)
    consumed: list[int] = []

    def keys() -> Iterator[int]:
        for k in [1, 2, 3, 4, 5]:
            consumed.append(k)
            yield k

    assert m.walk(keys()) == {0: 2}
    assert consumed == [1, 2, 3]


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
                m.set_bit(keys, slot)
            for k in keys:
                model[k] = model.get(k, 0) | 1 << slot
        else:
            for m in maps:
                m.clear_bit(keys, slot)
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


def test_a_big_table_grows_and_empties(native: bool) -> None:
    m = make_holders(native)
    keys = list(range(50_000))  # sequential keys: must not pile into one probe run
    m.set_bit(keys, 1)
    m.set_bit(keys[::3], 64)
    assert len(m) == 50_000
    m.clear_bit(keys[::2], 1)  # deletes every even key not also in slot 64
    assert all(m.get(k) == (1 << 64 if k % 3 == 0 else 0) for k in keys[::2])
    assert all(m.get(k) == 2 | (1 << 64 if k % 3 == 0 else 0) for k in keys[1::2])
    m.clear_bit(keys, 1)
    m.clear_bit(keys, 64)
    assert len(m) == 0 and m.walk(keys) == {}
    m.set_bit([7], 0)
    assert m.walk([7]) == {0: 1}


def test_bad_keys_and_slots_are_refused_before_any_change() -> None:
    m = make_holders(True)
    assert not isinstance(m, DictHolders), "the C holder map was not built; see setup.py"
    m.set_bit([1], 0)
    for bad, err in (([2, -1], OverflowError), ([2, 1 << 64], OverflowError),
                     ([2, "3"], TypeError), ([2, 1.0], TypeError)):
        with pytest.raises(err):
            m.set_bit(bad, 0)
        assert m.get(2) == 0 and len(m) == 1
        with pytest.raises(err):
            m.clear_bit([1, *bad], 0)
        assert m.get(1) == 1
    with pytest.raises(ValueError, match="slot"):
        m.set_bit([1], -1)
    with pytest.raises(TypeError):
        m.walk(5)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        m.walk([1, -5])
    with pytest.raises(TypeError, match="no arguments"):
        type(m)(3)  # type: ignore[call-arg]
