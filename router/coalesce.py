"""In-flight prefixes: which routed request's prefill will store a block a prediction stands for.

A predicted index entry (``PrefixIndex.predict``) says a worker is about to hold a prompt's
blocks because a request was just sent there. A sibling routed on the strength of that
prediction hits only if its engine admits it *after* that prefill has stored the blocks: an
engine admits a queue in batches and computes each admitted prompt in full, so two prompts
admitted together both compute their shared prefix (no engine shares an in-flight prefix).
Sent at once, a burst of siblings therefore queues on one worker and prefills the prefix
once per sibling; held until the first sibling's first token, each of the others prefills
only its own suffix. :class:`InflightPrefixes` finds the request to wait for.

Waiting pays only when the producer's prefill is mostly the part the sibling would get from
it: the sibling waits for that whole prefill, the producer's own suffix included. Parallel
calls of an agent loop share a few hundred tokens and each adds thousands of its own; held,
each would wait out its sibling's suffix to save a short prefix. So a sibling waits only when
the predicted part it matched is at least ``share`` of what its producer is prefilling
(:meth:`InflightPrefixes.worth_waiting`); else it is routed again on what workers really hold
(:func:`kvroute.router.decide.rerank_confirmed`), as if nothing were in flight.

Invariants:

* ``_by_key[w][k]`` is the latest request sent to ``w`` whose prefill will store block ``k``
  there (a block of its prompt that ``w`` was predicted, not known, to hold) and that has
  not been dropped; ``_entries[id(r)]`` holds ``r``, the tokens it prefills and every
  ``(w, keys)`` it was added with, which covers every entry naming it (keyed by identity:
  requests need not be hashable; holding ``r`` keeps its id). No ``_by_key[w]`` is left
  empty.
* Only predicted blocks are added (``PrefixIndex.predict`` returns them): a warm session's
  prompt adds just its new suffix, a cold 8k-token prompt 512 keys.
* ``producer`` returns a request only for a block matched on ``w`` by prediction alone (the
  index does not really hold it there): a really stored block needs no wait.

A request (or a background copy) that fails before its prefill will store nothing: its
predictions are withdrawn at once (:meth:`Predicted.withdraw`) rather than left to mislead
routing until their deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvroute.core.config import COALESCE_SHARE
from kvroute.core.index import PrefixIndex

R = TypeVar("R")


class InflightPrefixes(Generic[R]):
    """Requests whose prefill has not finished, by (worker, block key) of their prompts.

    ``share``: the least fraction of a producer's prefill a sibling must get from it to wait
    for it (see the module docstring; 0: always wait)."""

    def __init__(self, share: float = COALESCE_SHARE) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"coalesce share is a fraction, in [0, 1]; got {share}")
        self.share = share
        self._by_key: dict[str, dict[int, R]] = {}
        self._entries: dict[int, tuple[R, int, list[tuple[str, Sequence[int]]]]] = {}

    def add(self, request: R, worker: str, keys: Sequence[int], uncached: int) -> None:
        """``request``, sent to ``worker`` to prefill ``uncached`` tokens, will store
        ``keys``: the blocks of its prompt predicted there (``PrefixIndex.predict`` returns
        them; a block ``worker`` really holds already makes nobody wait)."""
        self._by_key.setdefault(worker, {}).update(dict.fromkeys(keys, request))
        entry = self._entries.get(id(request))
        if entry is None:
            entry = self._entries[id(request)] = (request, uncached, [])
        entry[2].append((worker, keys))

    def drop(self, request: R) -> None:
        """``request`` has its first token (its prefix is stored) or has ended."""
        _, _, added = self._entries.pop(id(request), (None, 0, ()))
        for worker, keys in added:
            on = self._by_key.get(worker)
            if on is None:
                continue
            for k in keys:  # only entries still naming it: a later request may own a key
                if on.get(k) is request:
                    del on[k]
            if not on:
                del self._by_key[worker]

    def producer(self, index: PrefixIndex, worker: str, keys: Sequence[int],
                 matched_blocks: int) -> R | None:
        """The in-flight request on ``worker`` whose prefill stores the deepest of the
        ``matched_blocks`` leading ``keys`` matched there, when only a prediction matched
        it; else None (nothing to wait for)."""
        m = min(matched_blocks, len(keys))
        if m <= 0:
            return None
        key = keys[m - 1]
        if index.holds(worker, key):
            return None
        on = self._by_key.get(worker)
        return None if on is None else on.get(key)

    def worth_waiting(self, producer: R, index: PrefixIndex, worker: str,
                      keys: Sequence[int], matched_blocks: int, block_size: int) -> bool:
        """Whether a request matching ``matched_blocks`` of ``keys`` on ``worker`` should wait
        for ``producer`` (from :meth:`producer`): the blocks it matched there only by
        prediction are at least ``share`` of the tokens ``producer`` prefills."""
        entry = self._entries.get(id(producer))
        if entry is None:
            return False  # dropped meanwhile: its prefix is stored, nothing to wait for
        m = min(matched_blocks, len(keys))
        gain = (m - index.confirmed(worker, keys, m)) * block_size
        return gain >= self.share * entry[1]

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True, slots=True)
class Predicted:
    """The blocks a request just sent to ``worker`` is predicted to store, until ``deadline``
    (on ``time.monotonic``)."""

    worker: str
    keys: tuple[int, ...]
    deadline: float

    def withdraw(self, index: PrefixIndex) -> int:
        """The request failed before its prefill: nothing will store these blocks, so drop
        what is still only predicted of them. Returns how many were dropped."""
        return index.withdraw(self.worker, self.keys, self.deadline)


def predict_sent(index: PrefixIndex, inflight: InflightPrefixes[R], request: R, worker: str,
                 keys: Sequence[int], uncached: int, ttl_s: float) -> Predicted:
    """``request`` is being sent to ``worker`` to prefill ``uncached`` tokens of a prompt of
    block ``keys``: predict them there for ``ttl_s`` and register it as their producer, so a
    sibling routed to them waits for its first token."""
    deadline = time.monotonic() + ttl_s
    predicted = index.predict(worker, keys, deadline)
    inflight.add(request, worker, predicted, uncached)
    return Predicted(worker, predicted, deadline)
