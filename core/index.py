"""The prefix index: block key -> the workers that hold it; longest cached prefix per worker.

Design (the hot path of every routing decision):

* Workers are given small integer *slots*; the holders of a key are a bitmask over slots
  (:mod:`kvroute.core.holders`: a C table with the mask words inline, or a dict of ints), so
  intersecting "who holds every block so far" is one ``&`` whatever the number of workers.
* ``match`` walks a prompt's keys in order with a running mask of workers that hold the whole
  prefix so far, and stops at the first key nobody in that mask holds: a cold prompt costs one
  lookup, and the caller's lazy key iterator hashes no further.

* *Predicted* entries (``predict``) stand for blocks a worker is about to store because a
  request was just routed there, before its engine's events arrive: a burst of siblings then
  finds the prefix where the first one went. They expire at a deadline unless a real store
  confirms them. At most ``max_predicted`` predicted keys wait for their deadlines; past
  that, the earliest deadline's go first.

* Each worker's real keys are a ``dict`` mapping key -> None, not a ``set``: CPython's cyclic
  collector never tracks a dict that holds only ints (``gc.is_tracked`` is False), but it
  traverses every set entry on every full collection. With the keys in sets, a 1M-entry
  index made each full collection a ~100 ms stall of every in-flight routing decision
  (``bench/gc_pause.py``).

Invariants:

* ``_holders.get(k)`` is 0 only for a key that is not stored: a key with no holder is deleted.
* For every slot ``s`` and key ``k``: bit ``s`` of ``_holders.get(k)`` is set iff ``k`` is in
  ``_keys_of[worker(s)]`` (really stored) or in ``_pred_of[worker(s)]`` (predicted).
* ``count``, ``keys_of`` and ``entries`` report real keys only.
* A slot is reused only after its worker has been removed and all its keys cleared.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Container, Iterable, Sequence
from itertools import filterfalse

from kvroute.core.holders import make_holders

# The most predicted keys kept waiting for their deadline (~40 MB of key tuples): 3,000 cold
# 5k-token prompts of 16-token blocks, 30 s of a 100-request/s router at the default TTL.
MAX_PREDICTED_KEYS = 1 << 20


class PrefixIndex:
    """Key -> worker bitmask, plus each worker's key set (for removal and snapshots)."""

    def __init__(self, native: bool = True, max_predicted: int = MAX_PREDICTED_KEYS) -> None:
        self._holders = make_holders(native)  # the C map when built (same results, faster)
        # Predictions wait in the heap until their deadline, confirmed or not: bounding the
        # keys it holds bounds the memory a burst of cold prompts takes (oldest go first).
        self._max_predicted = max_predicted
        self._pred_heap_keys = 0
        self._slot_of: dict[str, int] = {}
        self._worker_of_slot: dict[int, str] = {}
        self._keys_of: dict[str, dict[int, None]] = {}  # a set that the collector skips
        self._pred_of: dict[str, dict[int, float]] = {}  # worker -> predicted key -> deadline
        self._pred_heap: list[tuple[float, str, tuple[int, ...]]] = []
        self._free_slots: list[int] = []

    # -- workers -------------------------------------------------------------------------

    def _slot(self, worker: str) -> int:
        slot = self._slot_of.get(worker)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[worker] = slot
            self._worker_of_slot[slot] = worker
            self._keys_of[worker] = {}
            self._pred_of[worker] = {}
        return slot

    def workers(self) -> list[str]:
        return list(self._slot_of)

    def remove_worker(self, worker: str) -> int:
        """Forget a worker and every key it held. Returns the number of keys dropped."""
        n = self.clear_worker(worker)
        slot = self._slot_of.pop(worker, None)
        if slot is not None:
            pred = self._pred_of.pop(worker)
            self._drop(slot, list(pred), keep=())
            del self._worker_of_slot[slot]
            del self._keys_of[worker]
            self._free_slots.append(slot)
        return n

    def clear_worker(self, worker: str) -> int:
        """Drop every key ``worker`` really holds (predictions stay) but keep its slot."""
        keys = self._keys_of.get(worker)
        if not keys:
            return 0
        self._drop(self._slot_of[worker], keys, keep=self._pred_of[worker])
        n = len(keys)
        keys.clear()
        return n

    # -- keys ----------------------------------------------------------------------------

    def add(self, worker: str, keys: Iterable[int]) -> None:
        slot = self._slot(worker)
        keys = _listed(keys)
        mine = self._keys_of[worker]
        pred = self._pred_of[worker]
        self._holders.set_bit(keys, slot)
        mine.update(dict.fromkeys(keys))
        if pred:
            for k in [k for k in pred if k in mine]:
                del pred[k]  # confirmed by the engine

    def remove(self, worker: str, keys: Iterable[int]) -> None:
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        mine = self._keys_of[worker]
        present = [k for k in keys if k in mine]
        for k in present:
            mine.pop(k, None)  # not del: a batch may name a key twice
        self._drop(slot, present, keep=self._pred_of[worker])

    def _drop(self, slot: int, keys: Iterable[int], keep: Collection[int]) -> None:
        """Clear ``slot``'s bit on ``keys``, except those in ``keep``."""
        self._holders.clear_bit(list(filterfalse(keep.__contains__, keys)) if keep else keys,
                                slot)

    def predict(self, worker: str, keys: Iterable[int], deadline: float) -> tuple[int, ...]:
        """``worker`` is expected to store ``keys`` soon: match them as held until
        ``deadline`` (on the caller's clock) unless a real store confirms them first.
        Returns the keys predicted: those ``worker`` does not really hold already."""
        slot = self._slot(worker)
        mine = self._keys_of[worker]
        pred = self._pred_of[worker]
        new = tuple(filterfalse(mine.__contains__, keys))
        self._holders.set_bit(new, slot)
        pred.update(dict.fromkeys(new, deadline))
        if new:
            heapq.heappush(self._pred_heap, (deadline, worker, new))
            self._pred_heap_keys += len(new)
            while self._pred_heap_keys > self._max_predicted:
                self._expire_first()
        return new

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline has passed. Returns how many were dropped."""
        heap = self._pred_heap
        n = 0
        while heap and heap[0][0] <= now:
            n += self._expire_first()
        return n

    def _expire_first(self) -> int:
        """Drop the predictions made with the earliest deadline that were not confirmed or
        predicted again since. Returns how many were dropped."""
        deadline, worker, keys = heapq.heappop(self._pred_heap)
        self._pred_heap_keys -= len(keys)
        return self.withdraw(worker, keys, deadline)

    def withdraw(self, worker: str, keys: Iterable[int], deadline: float) -> int:
        """Drop the predictions of ``keys`` on ``worker`` made with ``deadline`` (by
        :meth:`predict`) that were not confirmed or predicted again since: the request they
        stood for failed before its prefill, so nothing will store them. Returns how many
        were dropped. (Their heap entry stays and finds nothing at its deadline.)"""
        pred = self._pred_of.get(worker)
        slot = self._slot_of.get(worker)
        if pred is None or slot is None:
            return 0
        stale = [k for k in keys if pred.get(k) == deadline]
        for k in stale:
            pred.pop(k, None)  # not del: a prompt may name a key twice
        self._drop(slot, stale, keep=self._keys_of[worker])
        return len(stale)

    def holds(self, worker: str, key: int) -> bool:
        """Whether ``worker`` really stores ``key`` (a prediction does not count)."""
        keys = self._keys_of.get(worker)
        return keys is not None and key in keys

    def confirmed(self, worker: str, keys: Sequence[int], depth: int) -> int:
        """How many of the first ``depth`` ``keys`` ``worker`` really stores, leading ones
        only: a match (``match``'s depth) without its predictions."""
        mine = self._keys_of.get(worker)
        return leading_held(keys, depth, mine) if mine else 0

    def predicted(self, worker: str) -> int:
        return len(self._pred_of.get(worker, ()))

    def replace_worker(self, worker: str, keys: Iterable[int]) -> None:
        """Set ``worker``'s keys to exactly ``keys`` (a snapshot load)."""
        self.clear_worker(worker)
        self.add(worker, keys)

    def count(self, worker: str) -> int:
        """Keys held by ``worker``."""
        return len(self._keys_of.get(worker, ()))

    def keys_of(self, worker: str) -> set[int]:
        return set(self._keys_of.get(worker, ()))

    def __len__(self) -> int:
        """Distinct keys held by at least one worker."""
        return len(self._holders)

    def entries(self) -> int:
        """(key, worker) pairs: the index's size as a count of cached blocks cluster-wide."""
        return sum(len(s) for s in self._keys_of.values())

    # -- lookup --------------------------------------------------------------------------

    def match(self, keys: Iterable[int]) -> dict[str, int]:
        """Longest cached prefix per worker, in blocks, for workers holding at least block 0.

        Stops consuming ``keys`` at the first block that no worker still matching holds.
        """
        names = self._worker_of_slot
        return {names[s]: depth for s, depth in self._holders.walk(keys).items()}


def leading_held(keys: Sequence[int], limit: int, held: Container[int]) -> int:
    """How many of the first ``limit`` ``keys`` are in ``held``, leading ones only (a
    prefix ends at its first block not held)."""
    n = 0
    for k in keys[:limit]:
        if k not in held:
            break
        n += 1
    return n


def _listed(keys: Iterable[int]) -> Sequence[int]:
    """``keys`` as a list or tuple (read twice by ``add``)."""
    return keys if isinstance(keys, (list, tuple)) else list(keys)
