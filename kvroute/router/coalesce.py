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

* ``_by_key[w][k]`` is the latest request sent to ``w`` whose prefill will store block ``k``
  there (a block of its prompt that ``w`` was predicted, not known, to hold) and that has
  not been dropped; ``_entries[id(r)]`` holds ``r`` and every ``(w, keys)`` it was added
  with, which covers every entry naming it (keyed by identity: requests need not be hashable;
  holding ``r`` keeps its id). No ``_by_key[w]`` is left empty.
* Only predicted blocks are added (``PrefixIndex.predict`` returns them): a warm session's
  prompt adds just its new suffix, a cold 8k-token prompt 512 keys.
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
        self._by_key: dict[str, dict[int, R]] = {}
        self._entries: dict[int, tuple[R, list[tuple[str, Sequence[int]]]]] = {}

    def add(self, request: R, worker: str, keys: Sequence[int]) -> None:
        """``request``, sent to ``worker``, will store ``keys``: the blocks of its prompt
        predicted there (``PrefixIndex.predict`` returns them; a block ``worker`` really holds
        already makes nobody wait)."""
        self._by_key.setdefault(worker, {}).update(dict.fromkeys(keys, request))
        self._entries.setdefault(id(request), (request, []))[1].append((worker, keys))

    def drop(self, request: R) -> None:
        """``request`` has its first token (its prefix is stored) or has ended."""
        _, added = self._entries.pop(id(request), (None, ()))
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

    def __len__(self) -> int:
        return len(self._entries)
