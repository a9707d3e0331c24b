"""The map under the prefix index: block key -> bitmask of the worker slots that hold it.

Two backends with one tiny interface (:class:`HolderMap`), chosen by ``make_holders``:

* ``kvroute.core._holders.HolderMap`` (C, built by setup.py when a compiler is present): one
  open-addressing table with each key's mask words inline, so the routing walk reads one
  entry per block instead of a dict slot, a key object and a mask object (each a cache miss
  on a 1M-key index). See ``kvroute/core/_native/holders.c`` for its invariants.
* :class:`DictHolders` (pure Python): a dict of key -> int mask, the reference the C map is
  tested against.

Both keep the invariant the index relies on: a key whose mask becomes 0 is deleted, so
``len`` counts keys with at least one holder. Keys are ints in [0, 2**64).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

try:  # the optional C build (setup.py); absent, the dict backend runs
    from kvroute.core._holders import HolderMap as _NativeHolders
except ImportError:  # pragma: no cover - depends on the build
    _NativeHolders = None

NATIVE_AVAILABLE = _NativeHolders is not None


class HolderMap(Protocol):
    def set_bit(self, keys: Iterable[int], slot: int) -> None:
        """Mark ``slot`` as a holder of every key."""

    def clear_bit(self, keys: Iterable[int], slot: int) -> None:
        """Unmark ``slot`` on every key; a key left with no holder is deleted."""

    def walk(self, keys: Iterable[int]) -> dict[int, int]:
        """``{slot: depth}``: for each slot holding the first key, how many leading keys it
        holds. Stops consuming ``keys`` at the first key no such slot still holds."""

    def get(self, key: int) -> int:
        """The key's holder bitmask (0: nobody)."""

    def __len__(self) -> int: ...


def make_holders(native: bool = True) -> HolderMap:
    """The C map when asked for and built, else the dict one."""
    if native and _NativeHolders is not None:
        return _NativeHolders()
    return DictHolders()


class DictHolders:
    """:class:`HolderMap` on a dict of key -> int bitmask (bit ``s`` set: slot ``s`` holds
    the key). Invariant: no value is 0."""

    __slots__ = ("_masks",)

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def get(self, key: int) -> int:
        return self._masks.get(key, 0)

    def set_bit(self, keys: Iterable[int], slot: int) -> None:
        bit = 1 << slot
        masks = self._masks
        for k in keys:
            masks[k] = masks.get(k, 0) | bit

    def clear_bit(self, keys: Iterable[int], slot: int) -> None:
        clear = ~(1 << slot)
        masks = self._masks
        for k in keys:
            m = masks.get(k, 0) & clear
            if m:
                masks[k] = m
            else:
                masks.pop(k, None)

    def walk(self, keys: Iterable[int]) -> dict[int, int]:
        # A running mask of the slots holding every key so far: one ``&`` per key whatever
        # the number of workers, and a slot is recorded when its bit drops.
        masks = self._masks
        it = iter(keys)
        first = next(it, None)
        active = 0 if first is None else masks.get(first, 0)
        out: dict[int, int] = {}
        if not active:
            return out
        depth = 1
        for k in it:
            nxt = active & masks.get(k, 0)
            if nxt != active:
                _record(active & ~nxt, depth, out)
                if not nxt:
                    return out
                active = nxt
            depth += 1
        _record(active, depth, out)
        return out


def _record(mask: int, depth: int, out: dict[int, int]) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = depth
        mask ^= low
