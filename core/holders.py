"""The map under the prefix index: block key -> the worker slots holding it, each really
(stored, as the worker's events say) or predicted (``PrefixIndex.predict``).

Two backends with one interface (:class:`HolderMap`), chosen by ``make_holders``:

* ``kvroute.core._holders.HolderMap`` (C, built by setup.py when a compiler is present): one
  open-addressing table of 32-byte entries, each a key with its first holders inline, more
  in a heap list, many in two bitmasks: memory proportional to (key, holder) pairs, not to
  keys x workers, and nothing the cyclic collector traverses. Per-slot counts of real keys
  are kept in C. See ``core/_native/holders.h`` for its invariants.
* :class:`DictHolders` (pure Python): the reference the C map is tested against.

Both keep the invariants the index relies on: a key with no holder is deleted, so ``len``
counts keys with at least one holder; a slot holds a key at most once, really or predicted
(``add`` turns a prediction real, ``predict`` skips a real holder). Keys are ints in
[0, 2**64); slots ints in [0, 2**20).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any, Protocol

from kvroute.core.redis_schema import unpack_keys

try:  # the optional C build (setup.py); absent, the dict backend runs
    from kvroute.core._holders import HolderMap as _NativeHolders
except ImportError:  # pragma: no cover - depends on the build
    _NativeHolders = None

NATIVE_AVAILABLE = _NativeHolders is not None


class HolderMap(Protocol):
    def add(self, keys: Iterable[int], slot: int) -> None:
        """``slot`` really holds every key (a prediction of one becomes real)."""

    def add_packed(self, members: Iterable[bytes] | bytes, slot: int,
                   replace: bool = False) -> None:
        """``add`` of keys packed as 8 big-endian bytes each (a snapshot's members, as
        ``redis_schema.pack_keys`` writes them: a sequence of members, or one ``bytes`` of
        them end to end), decoded by the map; ValueError, before any change, for a member
        of another size or a blob not of whole keys. With ``replace``, ``clear_slot``
        first."""

    def remove(self, keys: Iterable[int], slot: int) -> None:
        """``slot`` no longer really holds the keys (its predictions stay); a key left with
        no holder is deleted."""

    def predict(self, keys: Iterable[int], slot: int) -> tuple[int, ...]:
        """Mark ``slot`` a predicted holder of each key it does not really hold; returns
        those keys, in order (duplicates and already-predicted ones included)."""

    def unpredict(self, keys: Iterable[int], slot: int) -> None:
        """Drop ``slot``'s predictions of the keys (real holders stay)."""

    def holds(self, key: int, slot: int) -> bool:
        """Whether ``slot`` really holds ``key``."""

    def leading(self, keys: Sequence[int], limit: int, slot: int) -> int:
        """How many of ``keys[:limit]`` ``slot`` really holds, leading ones only."""

    def first_held(self, keys: Sequence[int], limit: int, slot: int) -> int:
        """The position of the first of ``keys[:limit]`` ``slot`` really holds (their
        number if none)."""

    def count(self, slot: int) -> int:
        """Keys ``slot`` really holds."""

    def keys_of(self, slot: int) -> list[int]:
        """The keys ``slot`` really holds (any order)."""

    def clear_slot(self, slot: int) -> int:
        """Drop every key ``slot`` really holds (predictions stay); returns how many."""

    def entries(self) -> int:
        """(key, slot) pairs really held."""

    def walk(self, keys: Iterable[int], names: list[str] | None = None) -> dict[Any, int]:
        """``{slot: depth}``: for each slot holding the first key (really or predicted), how
        many leading keys it holds, in order of depth, then slot; with ``names``,
        ``{names[slot]: depth}``. Stops consuming ``keys`` at the first key no such slot
        still holds."""

    def get(self, key: int) -> int:
        """The bitmask of the key's holders, real or predicted (0: nobody)."""

    def __len__(self) -> int: ...


def make_holders(native: bool = True) -> HolderMap:
    """The C map when asked for and built, else the dict one."""
    if native and _NativeHolders is not None:
        return _NativeHolders()
    return DictHolders()


class DictHolders:
    """:class:`HolderMap` on a dict of key -> int bitmask of every holder (bit ``s``: slot
    ``s`` holds the key, really or predicted) and, per slot, its real keys as a dict of key ->
    None (a set the cyclic collector skips: ``gc.is_tracked`` is False for a dict of ints).

    Invariants: no mask is 0; ``k in _real[s]`` implies bit ``s`` of ``_masks[k]``; a set bit
    whose key is not in ``_real[s]`` is a prediction."""

    __slots__ = ("_masks", "_real")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._real: dict[int, dict[int, None]] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def get(self, key: int) -> int:
        return self._masks.get(key, 0)

    def add(self, keys: Iterable[int], slot: int) -> None:
        bit = 1 << slot
        masks = self._masks
        real = self._real.setdefault(slot, {})
        for k in keys:
            masks[k] = masks.get(k, 0) | bit
            real[k] = None

    def add_packed(self, members: Iterable[bytes] | bytes, slot: int,
                   replace: bool = False) -> None:
        keys = unpack_keys(packed(members))
        if replace:
            self.clear_slot(slot)
        self.add(keys, slot)

    def _clear(self, keys: Iterable[int], slot: int) -> None:
        clear = ~(1 << slot)
        masks = self._masks
        for k in keys:
            m = masks.get(k, 0) & clear
            if m:
                masks[k] = m
            else:
                masks.pop(k, None)

    def remove(self, keys: Iterable[int], slot: int) -> None:
        real = self._real.get(slot)
        if real:
            # pop, not del: a batch may name a key twice
            self._clear([k for k in keys if real.pop(k, 0) is None], slot)

    def predict(self, keys: Iterable[int], slot: int) -> tuple[int, ...]:
        real = self._real.get(slot, {})
        new = tuple(k for k in keys if k not in real)
        bit = 1 << slot
        masks = self._masks
        for k in new:
            masks[k] = masks.get(k, 0) | bit
        return new

    def unpredict(self, keys: Iterable[int], slot: int) -> None:
        real = self._real.get(slot, {})
        self._clear([k for k in keys if k not in real], slot)

    def holds(self, key: int, slot: int) -> bool:
        return key in self._real.get(slot, ())

    def leading(self, keys: Sequence[int], limit: int, slot: int) -> int:
        return leading_held(keys, limit, self._real.get(slot, {}))

    def first_held(self, keys: Sequence[int], limit: int, slot: int) -> int:
        real = self._real.get(slot, {})
        head = keys[:limit]
        return next((i for i, k in enumerate(head) if k in real), len(head))

    def count(self, slot: int) -> int:
        return len(self._real.get(slot, ()))

    def keys_of(self, slot: int) -> list[int]:
        return list(self._real.get(slot, ()))

    def clear_slot(self, slot: int) -> int:
        real = self._real.pop(slot, {})
        self._clear(real, slot)
        return len(real)

    def entries(self) -> int:
        return sum(map(len, self._real.values()))

    def walk(self, keys: Iterable[int], names: list[str] | None = None) -> dict[Any, int]:
        # A running mask of the slots holding every key so far: one ``&`` per key whatever
        # the number of workers, and a slot is recorded when its bit drops.
        masks = self._masks
        it = iter(keys)
        first = next(it, None)
        active = 0 if first is None else masks.get(first, 0)
        out: dict[Any, int] = {}
        if not active:
            return out
        depth = 1
        for k in it:
            nxt = active & masks.get(k, 0)
            if nxt != active:
                _record(active & ~nxt, depth, out, names)
                if not nxt:
                    return out
                active = nxt
            depth += 1
        _record(active, depth, out, names)
        return out


def _record(mask: int, depth: int, out: dict[Any, int], names: list[str] | None) -> None:
    while mask:
        low = mask & -mask
        slot = low.bit_length() - 1
        out[slot if names is None else names[slot]] = depth
        mask ^= low


def packed(members: Iterable[bytes] | bytes) -> bytes:
    """Snapshot members (8 big-endian bytes each: a sequence of members, or one ``bytes``
    of them end to end) as one ``bytes``; ValueError for a member of another size or a blob
    not of whole keys."""
    if isinstance(members, bytes):
        if len(members) % 8:
            raise ValueError(f"key blob of {len(members)} bytes is not a multiple of 8")
        return members
    members = list(members)
    bad = next((m for m in members if len(m) != 8), None)
    if bad is not None:
        raise ValueError(f"snapshot member of {len(bad)} bytes is not one 8-byte key")
    return b"".join(members)


def leading_held(keys: Sequence[int], limit: int, held: Container[int]) -> int:
    """How many of the first ``limit`` ``keys`` are in ``held``, leading ones only (a
    prefix ends at its first block not held)."""
    n = 0
    for k in keys[:limit]:
        if k not in held:
            break
        n += 1
    return n
