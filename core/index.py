"""The prefix index: block key -> the workers that hold it; longest cached prefix per worker.

Design (the hot path of every routing decision):

* Workers are given small integer *slots*. The holder map (:mod:`kvroute.core.holders`: a C
  table of (key, holder slots) entries, or dicts in the pure-Python reference) keeps, per key,
  the slots that really hold it and those predicted to, and per slot the count of its real
  keys: nothing else holds the real keys, so the index costs per (key, worker) pair, not per
  key x workers, and `holds`, `count`, `confirmed`, `keys_of`, `entries` and `clear_worker`
  ask the map.
* ``match`` walks a prompt's keys in order with a running set of the slots that hold the whole
  prefix so far, and stops at the first key nobody in that set holds: a cold prompt costs one
  lookup, and the caller's lazy key iterator hashes no further.

* *Predicted* entries (``predict``) stand for blocks a worker is about to store because a
  request was just routed there, before its engine's events arrive: a burst of siblings then
  finds the prefix where the first one went. They expire at a deadline unless a real store
  confirms them. At most ``max_predicted`` predicted keys wait for their deadlines; past
  that, the earliest deadline's go first. Their deadlines are a dict per worker (bounded by
  ``max_predicted``).

* *Tiers*: a second holder map keeps, per worker whose engine has a lower tier (CPU memory
  behind its GPU cache), the keys it holds only there. The main map holds every key whatever
  its tier (``match`` and ``count`` see them all); ``lower_blocks`` says how much of a match
  must be loaded back, ``gpu_count`` how many keys fill the GPU cache. A worker without
  tiers costs the second map nothing.

* No Python container holds the real keys: CPython's cyclic collector traverses every entry
  of a tracked container on each full collection, and with the keys in sets a 1M-entry index
  made each full collection a ~100 ms stall of every in-flight routing decision
  (``bench/gc_pause.py``). The C map is one object the collector does not traverse; the
  pure-Python map keeps each slot's keys in a dict of int -> None, which it never tracks, as
  are the deadline dicts (int -> float).

Invariants:

* A key with no holder is not stored (``len`` counts keys with at least one holder).
* For every worker ``w`` with slot ``s`` and key ``k``: ``s`` holds ``k`` in ``_holders``
  really iff ``w``'s engine stores it (as its events and snapshots said), predicted iff
  ``k`` is in ``_pred_of[w]``; never both (a real store confirms a prediction, and a key
  really held is not predicted).
* ``_lower`` holds ``(k, s)`` only if ``_holders`` really does, and then iff ``w``'s engine
  holds ``k`` in no tier above its lowest (its events' ``Op.LOWER``).
* ``count``, ``keys_of``, ``holds``, ``confirmed`` and ``entries`` report real keys only;
  ``match`` counts both.
* A slot is reused only after its worker has been removed and all its keys and predictions
  dropped.
* ``_worker_of_slot[s]`` is slot ``s``'s worker ('' while free), so the map's walk names
  the workers itself (no slot -> name pass per decision).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

# leading_held is re-exported: the replay's metrics count leading blocks the same way.
from kvroute.core.holders import leading_held as leading_held
from kvroute.core.holders import make_holders, packed

# The most predicted keys kept waiting for their deadline (~40 MB of key tuples): 3,000 cold
# 5k-token prompts of 16-token blocks, 30 s of a 100-request/s router at the default TTL.
MAX_PREDICTED_KEYS = 1 << 20


class PrefixIndex:
    """Key -> the workers holding it (really or predicted), and each worker's real key count."""

    def __init__(self, native: bool = True, max_predicted: int = MAX_PREDICTED_KEYS) -> None:
        self._holders = make_holders(native)  # the C map when built (same results, faster)
        self._lower = make_holders(native)  # keys held only in a worker's lower tier
        # Predictions wait in the heap until their deadline, confirmed or not: bounding the
        # keys it holds bounds the memory a burst of cold prompts takes (oldest go first).
        self._max_predicted = max_predicted
        self._pred_heap_keys = 0
        self._slot_of: dict[str, int] = {}
        self._worker_of_slot: list[str] = []  # slot -> worker ('' while free)
        self._pred_of: dict[str, dict[int, float]] = {}  # worker -> predicted key -> deadline
        self._pred_heap: list[tuple[float, str, tuple[int, ...]]] = []
        self._free_slots: list[int] = []

    # -- workers -------------------------------------------------------------------------

    def _slot(self, worker: str) -> int:
        slot = self._slot_of.get(worker)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._worker_of_slot[slot] = worker
            else:
                slot = len(self._worker_of_slot)
                self._worker_of_slot.append(worker)
            self._slot_of[worker] = slot
            self._pred_of[worker] = {}
        return slot

    def workers(self) -> list[str]:
        return list(self._slot_of)

    def remove_worker(self, worker: str) -> int:
        """Forget a worker and every key it held. Returns the number of keys dropped."""
        n = self.clear_worker(worker)
        slot = self._slot_of.pop(worker, None)
        if slot is not None:
            self._holders.unpredict(list(self._pred_of.pop(worker)), slot)
            self._worker_of_slot[slot] = ""
            self._free_slots.append(slot)
        return n

    def clear_worker(self, worker: str) -> int:
        """Drop every key ``worker`` really holds (predictions stay) but keep its slot.
        Returns the number of keys dropped. (It visits the worker's key log in the map:
        its own keys, not the whole map's.)"""
        slot = self._slot_of.get(worker)
        if slot is None:
            return 0
        self._lower.clear_slot(slot)
        return self._holders.clear_slot(slot)

    # -- keys ----------------------------------------------------------------------------

    def add(self, worker: str, keys: Iterable[int], lower: bool = False) -> None:
        """``worker`` holds ``keys``: in GPU memory, or with ``lower`` only in its lower
        tier."""
        slot = self._slot(worker)
        keys = _listed(keys)
        self._holders.add(keys, slot)
        if lower:
            self._lower.add(keys, slot)
        elif self._lower.count(slot):
            self._lower.remove(keys, slot)  # brought back into GPU memory
        pred = self._pred_of[worker]
        if pred:
            for k in keys:
                pred.pop(k, None)  # confirmed by the engine

    def remove(self, worker: str, keys: Iterable[int]) -> None:
        slot = self._slot_of.get(worker)
        if slot is not None:
            keys = _listed(keys)
            self._holders.remove(keys, slot)  # keys it does not really hold: ignored
            if self._lower.count(slot):
                self._lower.remove(keys, slot)

    def predict(self, worker: str, keys: Iterable[int], deadline: float) -> tuple[int, ...]:
        """``worker`` is expected to store ``keys`` soon: match them as held until
        ``deadline`` (on the caller's clock) unless a real store confirms them first.
        Returns the keys predicted: those ``worker`` does not really hold already."""
        slot = self._slot(worker)
        new = self._holders.predict(_listed(keys), slot)
        self._pred_of[worker].update(dict.fromkeys(new, deadline))
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
        self._holders.unpredict(stale, slot)
        return len(stale)

    def holds(self, worker: str, key: int) -> bool:
        """Whether ``worker`` really stores ``key`` (a prediction does not count)."""
        slot = self._slot_of.get(worker)
        return slot is not None and self._holders.holds(key, slot)

    def confirmed(self, worker: str, keys: Sequence[int], depth: int) -> int:
        """How many of the first ``depth`` ``keys`` ``worker`` really stores, leading ones
        only: a match (``match``'s depth) without its predictions."""
        slot = self._slot_of.get(worker)
        return 0 if slot is None else self._holders.leading(keys, depth, slot)

    def predicted(self, worker: str) -> int:
        return len(self._pred_of.get(worker, ()))

    def replace_worker(self, worker: str, keys: Iterable[int]) -> None:
        """Set ``worker``'s keys to exactly ``keys`` (a snapshot load)."""
        self.clear_worker(worker)
        self.add(worker, keys)

    def replace_worker_packed(self, worker: str, members: Iterable[bytes] | bytes,
                              lower: Iterable[bytes] | bytes = b"") -> None:
        """``replace_worker`` with the keys as a snapshot's members read from Redis (8
        big-endian bytes each, ``redis_schema.pack_keys``; a sequence of members or one
        ``bytes`` of them end to end), decoded in the map: no int object per key on a
        bootstrap of millions. ``lower``: those of them held only in its lower tier, packed
        alike. ValueError, before any change to either map, for a member of another size or
        a blob not of whole keys."""
        slot = self._slot(worker)
        if lower or self._lower.count(slot):
            lower = packed(lower)  # checked before the main map changes
        self._holders.add_packed(members, slot, True)
        if lower or self._lower.count(slot):
            self._lower.add_packed(lower, slot, True)
        pred = self._pred_of[worker]
        if pred:
            for k in [k for k in pred if self._holders.holds(k, slot)]:
                del pred[k]  # confirmed by the engine

    def count(self, worker: str) -> int:
        """Keys ``worker`` really holds."""
        slot = self._slot_of.get(worker)
        return 0 if slot is None else self._holders.count(slot)

    def gpu_count(self, worker: str) -> int:
        """Keys ``worker`` really holds in GPU memory: what fills its GPU cache."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return 0
        return max(0, self._holders.count(slot) - self._lower.count(slot))

    def lower_keys_of(self, worker: str) -> set[int]:
        """The keys ``worker`` holds only in its lower tier."""
        slot = self._slot_of.get(worker)
        return set() if slot is None else set(self._lower.keys_of(slot))

    def keys_of(self, worker: str) -> set[int]:
        """The keys ``worker`` really holds (from its key log in the map: not per
        decision)."""
        slot = self._slot_of.get(worker)
        return set() if slot is None else set(self._holders.keys_of(slot))

    def __len__(self) -> int:
        """Distinct keys held by at least one worker."""
        return len(self._holders)

    def entries(self) -> int:
        """(key, worker) pairs: the index's size as a count of cached blocks cluster-wide."""
        return self._holders.entries()

    # -- lookup --------------------------------------------------------------------------

    def match(self, keys: Iterable[int]) -> dict[str, int]:
        """Longest cached prefix per worker, in blocks, for workers holding at least block 0.

        Stops consuming ``keys`` at the first block that no worker still matching holds.
        """
        return self._holders.walk(keys, self._worker_of_slot)

    def lower_blocks(self, keys: Sequence[int], matched: Mapping[str, int]) -> dict[str, int]:
        """For each worker of ``matched`` (``match``'s depths over ``keys``) with a lower
        tier, how many of its matched blocks its engine must load from there: those from
        the first one it holds only below GPU memory (its engine hits GPU blocks, then
        loads what follows). Workers with none are left out."""
        out: dict[str, int] = {}
        if not len(self._lower):
            return out
        lower, slot_of = self._lower, self._slot_of
        for w, depth in matched.items():
            slot = slot_of.get(w)
            if slot is None or not lower.count(slot):
                continue
            first = lower.first_held(keys, depth, slot)
            if first < depth:
                out[w] = depth - first
        return out


def _listed(keys: Iterable[int]) -> Sequence[int]:
    """``keys`` as a list or tuple (read twice by ``add``)."""
    return keys if isinstance(keys, (list, tuple)) else list(keys)
