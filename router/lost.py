"""Workers whose heartbeat Redis no longer holds but that are still there.

A heartbeat can go missing with its agent alive: a FLUSHALL deletes every heartbeat (the
registry) at once, and a Redis Cluster failover takes longer than a heartbeat's TTL
(Redis's default ``cluster-node-timeout`` is 15 s, the TTL 3 s), so every heartbeat has
expired on the promoted replica before any agent can write again. Read naively, every
healthy worker has died.

Contract: a known worker missing from a heartbeat scan leaves the registry only when its
agent does not answer its gRPC health check SERVING. It answers NOT_SERVING while its engine
is down, and not at all once it is stopped, killed or frozen. A worker whose agent answers
stays, routed on its last known load, until it beats again (agents write their heartbeat
and record together; worker_agent/publisher.py) or fails a probe (one per
scan, concurrently)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvroute.router.registry import WorkerRegistry

log = logging.getLogger("kvroute.router.mirror")

Probe = Callable[[str], Awaitable[bool]]
"""An agent's address -> whether it answers its health check SERVING."""


@dataclass
class LostWorkers:
    probe: Probe
    kept: dict[str, float] = field(default_factory=dict)
    """Workers kept without a heartbeat -> since when (monotonic)."""
    kept_total: int = 0  # workers kept at least one scan, counted once per loss
    dropped_total: int = 0  # workers without a heartbeat whose agent then failed its probe

    async def keep(self, registry: WorkerRegistry, missing: Sequence[str]) -> set[str]:
        """Of ``missing`` (known heartbeat workers absent from this scan), those to keep."""
        for w in self.kept.keys() - set(missing):
            log.info("worker beats again", extra={"kv": {
                "worker": w, "after_s": round(time.monotonic() - self.kept.pop(w), 2)}})
        infos = [i for i in map(registry.get, missing) if i is not None]
        answers = await asyncio.gather(*(self.probe(i.address) for i in infos))
        kept: set[str] = set()
        for info, ok in zip(infos, answers, strict=True):
            w = info.worker_id
            if ok:
                kept.add(w)
                if w not in self.kept:
                    self.kept[w] = time.monotonic()
                    self.kept_total += 1
                    log.warning("worker's heartbeat is gone from Redis but its agent answers: "
                                "routing to it on its last known load until it beats again",
                                extra={"kv": {"worker": w, "address": info.address}})
            else:
                self.dropped_total += 1
                self.kept.pop(w, None)
        return kept
