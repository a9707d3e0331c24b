"""In-flight prefixes: which routed request's prefill will store a block a prediction stands for.

A predicted index entry (``PrefixIndex.predict``) says a worker is about to hold a prompt's
blocks because a request was just sent there. A sibling routed on the strength of that
prediction hits only if its engine admits it *after* that prefill has stored the blocks: an
engine admits a queue in batches and computes each admitted prompt in full, so two prompts
admitted together both compute their shared prefix (no engine shares an in-flight prefix).
Sent at once, a burst of siblings therefore queues on one worker and prefills the prefix
once per sibling; held until the first sibling's first token, each of the others prefills
only its own suffix. :class:`InflightPrefixes` finds the request to wait for.

Invariants:

* ``_by_key[(w, k)]`` is the latest request sent to ``w`` whose prompt has block ``k`` and that
  has not been dropped; ``_entries[id(r)]`` holds ``r`` and exactly the ``(w, k)`` entries
  naming it (keyed by identity: requests need not be hashable; holding ``r`` keeps its id).
* ``producer`` returns a request only for a block matched on ``w`` by prediction alone (the
  index does not really hold it there): a really stored block needs no wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from kvroute.core.index import PrefixIndex

R = TypeVar("R")


class InflightPrefixes(Generic[R]):
    """Requests whose prefill has not finished, by (worker, block key) of their prompts."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, int], R] = {}
        self._entries: dict[int, tuple[R, list[tuple[str, int]]]] = {}

    def add(self, request: R, worker: str, keys: Sequence[int]) -> None:
        """``request``, sent to ``worker``, will store ``keys`` (its prompt's block keys)."""
        entries = [(worker, k) for k in keys]
        for e in entries:
            self._by_key[e] = request
        self._entries.setdefault(id(request), (request, []))[1].extend(entries)

    def drop(self, request: R) -> None:
        """``request`` has its first token (its prefix is stored) or has ended."""
        _, entries = self._entries.pop(id(request), (None, ()))
        for e in entries:
            if self._by_key.get(e) is request:
                del self._by_key[e]

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
        return self._by_key.get((worker, key))

    def __len__(self) -> int:
        return len(self._entries)
