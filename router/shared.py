"""Routing decisions shared between router replicas through Redis (``--share-decisions``).

Each router knows exactly the requests it sent itself; the others' reach it in the workers'
heartbeats, up to a heartbeat old, and their prefixes only when the engine stores them. A
burst of siblings spread over several routers is then routed by routers that each think the
prefix is cold (docs/scaling.md). So each router appends every decision to the model's
decisions stream (``RedisKeys.decisions``, beside the feed, in its slot) and reads the others'
in the same XREAD as the feed: a *sent* entry (worker, uncached tokens and their context, the
blocks predicted there) is counted in that worker's pending prefill and in-flight count and
its blocks predicted, as our own decisions are (a request of ours matching them waits for
its first token, as for a sibling of our own: ``router/coalesce.py``), until its *done* entry
(first token, or the request ended or failed) -- the model of the replay's
``--share-inflight`` (which keeps counting it in flight until it ends; here the engine's
heartbeat counts it running after its first token).

Invariants:

* Publishing never blocks or fails a request: entries are queued and written by one
  background task, pipelined, :data:`LINGER_S` after the first of a batch; a Redis that is
  down drops them (``stats.dropped``).
* Every applied sent entry is undone exactly once: by its done entry, by its max age
  (``max_age_s``: a router that died sends no done entry, and leaves no phantom load longer),
  or by :meth:`reset` (the mirror bootstraps again).
* Our own entries are skipped (by router id); a malformed entry is dropped, never applied.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvroute.core.index import PrefixIndex
from kvroute.core.redis_conn import REDIS_ERRORS
from kvroute.core.redis_schema import RedisKeys, pack_keys, unpack_keys
from kvroute.router.registry import WorkerRegistry

if TYPE_CHECKING:
    from kvroute.router.coalesce import InflightPrefixes

log = logging.getLogger("kvroute.router.shared")

STREAM_MAXLEN = 5000
"""Approximate length the decisions stream is trimmed to (XADD MAXLEN ~)."""
MAX_QUEUED = 10000
"""Most entries waiting to be written; beyond it new ones are dropped (Redis is down)."""
LINGER_S = 0.005
"""How long a queued entry waits for those after it before the batch is written. A request's
entries then go while its engine prefills, not on the hop to its agent and the relay of its
first token, which the write (and our own entry read back) would delay on a shared core;
other routers see a decision ~5 ms later, against a heartbeat's hundreds of ms."""
MAX_KEYS = 65536
"""Most block keys one sent entry may carry (a 1M-token prompt at 16 tokens a block)."""
_MAX_TOKENS = 1 << 40


class Mirrored(Protocol):
    """What the others' decisions are applied to: the mirror's registry and index (read at
    each entry: a bootstrap replaces the index). ``router.mirror.IndexMirror`` is one."""

    registry: WorkerRegistry
    index: PrefixIndex


@dataclass
class SharedStats:
    sent: int = 0  # entries written to the stream
    applied: int = 0  # others' sent entries counted here
    dropped: int = 0  # not written (Redis down, queue full) or not applied (malformed, old)


@dataclass
class _Applied:
    worker: str
    uncached: int
    context: int
    until: float  # monotonic: undone then if its done entry has not come
    stored: asyncio.Event | None  # what our siblings of it wait for (set when undone)


@dataclass
class SharedDecisions:
    """One model's shared decisions: publish ours, apply the others' to ``mirror``."""

    client: Any
    keys: RedisKeys
    mirror: Mirrored
    predict_ttl_s: float
    max_age_s: float
    router_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    stats: SharedStats = field(default_factory=SharedStats)
    last_id: bytes = b"0-0"
    # The router service's in-flight prefixes (set when it starts): a request of ours that
    # matches another router's predicted prefix waits for its first token, as for our own.
    inflight: InflightPrefixes[asyncio.Event] | None = None

    def __post_init__(self) -> None:
        self._queue: list[dict[str, bytes | str | int]] = []
        self._writer: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._applied: dict[tuple[bytes, bytes], _Applied] = {}

    @property
    def key(self) -> str:
        return self.keys.decisions

    # -- publishing ------------------------------------------------------------------------

    def sent(self, request_id: str, worker: str, uncached: int, context: int,
             keys: Sequence[int]) -> str:
        """We sent a request to ``worker``; returns the id its :meth:`done` takes."""
        rid = f"{request_id[:160]}#{next(self._ids)}"
        self._put({"r": self.router_id, "op": "sent", "q": rid, "w": worker, "u": uncached,
                   "c": context, "k": pack_keys(keys[:MAX_KEYS]), "t": _now_ms()})
        return rid

    def done(self, rid: str) -> None:
        """The request :meth:`sent` returned ``rid`` for has its first token, or ended."""
        self._put({"r": self.router_id, "op": "done", "q": rid, "t": _now_ms()})

    def _put(self, entry: dict[str, bytes | str | int]) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self.stats.dropped += 1
            return
        self._queue.append(entry)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        await asyncio.sleep(LINGER_S)
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                pipe = self.client.pipeline(transaction=False)
                for entry in batch:
                    pipe.xadd(self.key, entry, maxlen=STREAM_MAXLEN, approximate=True)
                await pipe.execute()
                self.stats.sent += len(batch)
            except REDIS_ERRORS as exc:
                # Degrade: the others route as without sharing until Redis is back.
                self.stats.dropped += len(batch)
                log.debug("shared decisions not written", extra={"kv": {
                    "entries": len(batch), "error": str(exc)}})

    async def close(self, grace_s: float = 0.5) -> None:
        """Write what is queued (the done entries of the last requests: else the others
        count them until their max age), for at most ``grace_s``; then stop."""
        writer = self._writer
        if writer is not None and not writer.done():
            done, _ = await asyncio.wait({writer}, timeout=grace_s)
            if not done:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)

    # -- applying the others' ----------------------------------------------------------------

    def apply(self, fields: dict[bytes, bytes]) -> None:
        """Apply one entry of the decisions stream (ours skipped)."""
        router = fields.get(b"r", b"")
        if router == self.router_id.encode():
            return
        try:
            op, rid = fields[b"op"], fields[b"q"]
            if op == b"done":
                self._undo(self._applied.pop((router, rid), None))
                return
            if op != b"sent":
                raise ValueError(f"op {op!r:.40}")
            worker = fields[b"w"].decode()
            uncached, context, t = int(fields[b"u"]), int(fields[b"c"]), int(fields[b"t"])
            keys = unpack_keys(fields[b"k"])
            if not (0 <= uncached < _MAX_TOKENS and 0 <= context < _MAX_TOKENS
                    and len(keys) <= MAX_KEYS and len(rid) <= 200):
                raise ValueError("out of range")
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            self.stats.dropped += 1
            log.debug("malformed shared decision dropped", extra={"kv": {"error": str(exc)}})
            return
        age_s = (_now_ms() - t) / 1000
        registry = self.mirror.registry
        if age_s > self.max_age_s or worker not in registry or (router, rid) in self._applied:
            self.stats.dropped += 1  # too old to still be pending, or no worker we know
            return
        now = time.monotonic()
        registry.begin(worker, uncached, context=context)
        stored = None
        if keys and self.predict_ttl_s > 0:
            predicted = self.mirror.index.predict(worker, keys, now + self.predict_ttl_s)
            if self.inflight is not None and predicted:
                stored = asyncio.Event()
                self.inflight.add(stored, worker, predicted, uncached)
        self._applied[(router, rid)] = _Applied(worker, uncached, context,
                                                now + self.max_age_s - max(age_s, 0.0), stored)
        self.stats.applied += 1

    def _undo(self, a: _Applied | None) -> None:
        if a is None:
            return
        self.mirror.registry.first_token(a.worker, a.uncached, a.context)
        self.mirror.registry.end(a.worker)
        if a.stored is not None:
            a.stored.set()
            if self.inflight is not None:
                self.inflight.drop(a.stored)

    def expire(self, now: float) -> None:
        """Undo the others' entries older than ``max_age_s`` (their router died, or its
        done entry was lost)."""
        if not self._applied:
            return
        old = [k for k, a in self._applied.items() if a.until <= now]
        for k in old:
            self._undo(self._applied.pop(k))

    def reset(self) -> None:
        """The mirror bootstraps again: undo everything applied."""
        for a in self._applied.values():
            self._undo(a)
        self._applied.clear()

    def pending(self) -> int:
        """How many of the others' requests are counted here now."""
        return len(self._applied)


def _now_ms() -> int:
    return int(time.time() * 1000)
