"""Workers Redis lost but that are still there.

A FLUSHALL, or a Redis Cluster failover whose replica had not yet got the last writes, can
empty the workers set and delete every heartbeat at once, long before the agents write them
again (Redis's default ``cluster-node-timeout`` of 15 s is far above a 3 s heartbeat TTL).
Read naively, every healthy worker's heartbeat has expired.

Contract: a known worker whose heartbeat is missing from a scan leaves the registry only
when it is gone:

* its heartbeat expired while Redis still holds its record (``meta``): the agent stopped
  beating (killed, stopped, its engine down), so it leaves at once, as before; or
* Redis holds no record of it either (Redis lost it), and its agent does not answer its gRPC
  health check SERVING.

A worker Redis lost whose agent answers stays, routed on its last known load, until its
agent beats again (agents rewrite their heartbeat, workers-set entry and snapshot within a
heartbeat; see worker_agent/publisher.py) or fails a probe (one per scan)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.core.redis_schema import RedisKeys
from kvroute.router.registry import WorkerRegistry

log = logging.getLogger("kvroute.router.mirror")

Probe = Callable[[str], Awaitable[bool]]
"""An agent's address -> whether it answers its health check SERVING."""


@dataclass
class LostWorkers:
    probe: Probe
    kept: dict[str, float] = field(default_factory=dict)
    """Workers kept without a record -> since when (monotonic)."""
    kept_total: int = 0  # workers kept at least one scan, counted once per loss
    dropped_total: int = 0  # workers Redis lost whose agent then failed its probe

    async def keep(self, redis: Any, keys: RedisKeys, registry: WorkerRegistry,
                   missing: Sequence[str]) -> set[str]:
        """Of ``missing`` (known heartbeat workers absent from this scan), those to keep."""
        for w in self.kept.keys() - set(missing):
            log.info("worker beats again after Redis lost its record", extra={"kv": {
                "worker": w, "after_s": round(time.monotonic() - self.kept.pop(w), 2)}})
        if not missing:
            return set()
        pipe = redis.pipeline(transaction=False)
        for w in missing:
            pipe.exists(keys.meta(w))
        recorded = await pipe.execute()
        infos = [registry.get(w) for w, n in zip(missing, recorded, strict=True) if not n]
        lost = [i.worker_id for i in infos if i is not None]
        answers = await asyncio.gather(*(self.probe(i.address) for i in infos if i is not None))
        kept: set[str] = set()
        for w, ok in zip(lost, answers, strict=True):
            if ok:
                kept.add(w)
                if w not in self.kept:
                    self.kept[w] = time.monotonic()
                    self.kept_total += 1
                    log.warning("Redis lost this worker's heartbeat and record, but its agent "
                                "answers: routing to it on its last known load until it beats "
                                "again", extra={"kv": {"worker": w}})
            else:
                self.dropped_total += 1
                self.kept.pop(w, None)
                log.warning("Redis lost this worker's record and its agent does not answer; "
                            "forgetting it", extra={"kv": {"worker": w}})
        return kept
