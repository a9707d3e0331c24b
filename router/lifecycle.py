"""One request's stay on a worker, begun and ended the same way by every front: gRPC and
HTTP (``RouterService.generate``) and the endpoint picker (router/epp.py), whose gateway
carries the request itself.

A stay adds to the registry (the worker's in-flight sequences, its pending prefill and the
context it attends to), to the index (the blocks the request is predicted to store there,
with the request registered as their producer so siblings wait for it; router/coalesce.py)
and to the shared-decisions stream (the other routers count the prefill until its first
token; router/shared.py). :meth:`Lifecycle.first_token` takes off what the first token
settles, :meth:`Lifecycle.end` everything else; each is done once whatever calls it twice,
so a front calls ``end`` in a ``finally`` and nothing is ever left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvroute.router.coalesce import InflightPrefixes, Predicted, predict_sent

if TYPE_CHECKING:
    from kvroute.router.metrics import RouterMetrics
    from kvroute.router.mirror import IndexMirror
    from kvroute.router.registry import WorkerRegistry


@dataclass(slots=True, eq=False)
class Stay:
    """What one request added on ``worker``. ``uncached`` prompt tokens (attending to
    ``attended`` context pairs) are pending there until its first token, ``extra`` (a
    program's fast-forwards) until it ends; it runs ``weight`` sequences there. ``stored``
    is set at its first token or end: its siblings waiting for its prefix wake then."""

    worker: str
    uncached: int
    attended: int
    extra: int = 0
    weight: int = 1
    stored: asyncio.Event = field(default_factory=asyncio.Event)
    predicted: Predicted | None = None
    share_id: str | None = None
    started: bool = False
    ended: bool = False


class Lifecycle:
    """begin / first_token / withdraw / move / end of a :class:`Stay`, for every front.
    ``predict_ttl_s``: how long a prediction lasts at most (``--predict-ttl-s``)."""

    def __init__(self, registry: WorkerRegistry, mirror: IndexMirror,
                 inflight: InflightPrefixes[asyncio.Event], metrics: RouterMetrics,
                 predict_ttl_s: float) -> None:
        self._registry = registry
        self._mirror = mirror
        self._inflight = inflight
        self._m = metrics
        self._ttl = predict_ttl_s

    def begin(self, request_id: str, worker: str, uncached: int, attended: int,
              keys: Sequence[int] = (), *, extra: int = 0, weight: int = 1,
              predict: bool = False) -> Stay:
        """The request is sent to ``worker``. With ``predict``, its prompt's block ``keys``
        are predicted there and it is their producer until its first token."""
        self._registry.begin(worker, uncached + extra, weight, context=attended)
        stay = Stay(worker, uncached, attended, extra, weight)
        if predict:
            stay.predicted = predict_sent(self._mirror.index, self._inflight, stay.stored,
                                          worker, keys, uncached, self._ttl)
        shared = self._mirror.shared
        if shared is not None:
            keys_sent = stay.predicted.keys if stay.predicted is not None else ()
            stay.share_id = shared.sent(request_id, worker, uncached + extra, attended,
                                        keys_sent)
        return stay

    def first_token(self, stay: Stay) -> None:
        """Its first token came: its prefill is stored, no longer pending."""
        if stay.started or stay.ended:
            return
        stay.started = True
        self._unshare(stay)
        self.release(stay.stored)
        self._registry.first_token(stay.worker, stay.uncached, stay.attended)

    def withdraw(self, stay: Stay) -> None:
        """Nothing it was predicted to store will be (refused, failed, or answered with an
        error before its prefill): those predictions go now, not at their deadline."""
        if stay.predicted is not None:
            self._m.withdrawn.inc(stay.predicted.withdraw(self._mirror.index))
            stay.predicted = None
        self.release(stay.stored)

    def move(self, stay: Stay, worker: str) -> None:
        """It was served by ``worker`` instead (a gateway's fallback): its load moves there,
        its predictions on the first worker are withdrawn."""
        self.withdraw(stay)
        self._unshare(stay)
        self._registry.first_token(stay.worker, 0 if stay.started else stay.uncached,
                                   0 if stay.started else stay.attended)
        self._registry.end(stay.worker, stay.weight)
        stay.worker, stay.attended = worker, 0
        self._registry.begin(worker, 0 if stay.started else stay.uncached, stay.weight)

    def end(self, stay: Stay) -> None:
        """It ended, however it did (served, failed, cancelled): what :meth:`begin` added
        and the first token did not take off is undone."""
        if stay.ended:
            return
        stay.ended = True
        self.release(stay.stored)
        self._unshare(stay)
        pending = 0 if stay.started else stay.uncached
        self._registry.first_token(stay.worker, pending + stay.extra,
                                   0 if stay.started else stay.attended)
        self._registry.end(stay.worker, stay.weight)

    def release(self, stored: asyncio.Event) -> None:
        """A request's prefix is stored (first token) or it ended: wake its siblings."""
        if not stored.is_set():
            stored.set()
            self._inflight.drop(stored)

    def _unshare(self, stay: Stay) -> None:
        shared = self._mirror.shared
        if shared is not None and stay.share_id is not None:
            shared.done(stay.share_id)
            stay.share_id = None
