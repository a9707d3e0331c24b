"""Background copies of hot prefixes: the router prefills a prefix in demand on a second
worker while the request that showed the demand stays on the prefix's holder.

The policy decides (``replica(query, worker)``, for a policy that places replicas): a request for a
prefix many requests want lately goes to the worker holding it, and where the policy would
otherwise have moved that request to make a second copy, the router sends the copy itself: a
one-token request of the prefix's whole blocks, with the request's model and cache salt (so
the blocks' keys are the same), to the worker the policy named. No request waits for it;
later requests find two holders. The simulator models the same copy
(``kvroute.simulations.replay.Replayer._copy``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvroute.core.agent_client import AgentChannels
from kvroute.core.load import prefill_context
from kvroute.core.policies import RouteQuery
from kvroute.router.coalesce import InflightPrefixes, predict_sent
from kvroute.router.decide import Decision
from kvroute.router.metrics import RouterMetrics
from kvroute.router.mirror import IndexMirror
from kvroute.router.registry import WorkerRegistry
from kvroute.v1 import common_pb2

log = logging.getLogger("kvroute.router")

Replica = Callable[[RouteQuery, str], "tuple[str, int] | None"]  # a policy's ``replica``


def copy_blocks(prefix_tokens: int, keys: Sequence[int], block_size: int) -> int:
    """How many leading blocks of a prompt (block ``keys``) a copy of its ``prefix_tokens``
    cached tokens carries: the prefix's whole blocks (the router and the replay alike)."""
    return min(prefix_tokens // block_size, len(keys))


@dataclass
class PrefixCopier:
    """Sends the policy's background copies and keeps their accounting.

    Invariants: at most ``limit`` copies in flight, and at most one per (worker, last block
    of the prefix); each copy counts on its worker's load (``registry.begin``) until it ends,
    however it ends (at its ``timeout_s`` deadline at the latest); with ``predict_ttl_s``,
    later requests routed to the copy's worker on its predicted blocks wait for its first
    token, as for any request's prefill (``inflight``);
    a copy that fails is logged and counted, never raised: no request depends on it.
    """

    replica: Replica | None  # the policy's; None: it makes no copies
    registry: WorkerRegistry
    channels: AgentChannels
    mirror: IndexMirror
    inflight: InflightPrefixes[asyncio.Event]
    release: Callable[[asyncio.Event], None]  # the prefix is stored: wake its waiters
    metrics: RouterMetrics
    block_size: int
    predict_ttl_s: float
    limit: int
    # The deadline of each copy's call: no request waits for a copy, but its load and
    # predicted blocks stay on the worker until it ends, so a hung worker must not hold it.
    timeout_s: float = 30.0
    _running: dict[tuple[str, int], asyncio.Task[None]] = field(default_factory=dict)

    def maybe_copy(self, d: Decision, tokens: Sequence[int],
                   request: common_pb2.GenerateRequest, rid: str) -> None:
        """Start the copy the policy names for ``d`` (``replica(d.query, d.best)``), if any
        and if allowed."""
        if self.replica is None or not self.limit or not d.keys or not self.mirror.available:
            return
        if (plan := self.replica(d.query, d.best)) is None:
            return
        target, prefix = plan
        nb = copy_blocks(prefix, d.keys, self.block_size)
        info = self.registry.get(target)
        if not nb or info is None:
            return
        key = (target, d.keys[nb - 1])
        if key in self._running:
            return  # the same copy is on its way
        if len(self._running) >= self.limit:
            self.metrics.copies.labels("skipped").inc()
            return
        n = nb * self.block_size
        copy = common_pb2.GenerateRequest(
            request_id=f"{rid}/copy", model=request.model, cache_salt=request.cache_salt,
            sampling=common_pb2.SamplingParams(max_tokens=1))
        copy.token_ids.extend(tokens[:n])
        uncached = n - min(d.query.cached_tokens(target), n)
        task = asyncio.create_task(self._send(target, info.address, copy, d.keys[:nb],
                                              uncached, prefill_context(uncached, n - uncached)),
                                   name=f"copy {rid} -> {target}")
        self._running[key] = task
        task.add_done_callback(lambda _t, key=key: self._running.pop(key, None))

    async def _send(self, worker: str, address: str, copy: common_pb2.GenerateRequest,
                    keys: Sequence[int], uncached: int, context: int) -> None:
        self.metrics.copies.labels("sent").inc()
        self.metrics.copied_tokens.inc(len(copy.token_ids))
        self.registry.begin(worker, uncached, context=context)
        stored = asyncio.Event()
        predicted = None
        if self.predict_ttl_s > 0 and self.mirror.available:
            predicted = predict_sent(self.mirror.index, self.inflight, stored, worker, keys,
                                     uncached, self.predict_ttl_s)
        started = False
        try:
            async for _ in self.channels.stub(address).Generate(copy, timeout=self.timeout_s):
                if not started:
                    started = True
                    self.release(stored)
                    self.registry.first_token(worker, uncached, context)
            self.metrics.copies.labels("ok").inc()
            log.info("hot prefix copied", extra={"kv": {
                "worker": worker, "request": copy.request_id, "tokens": len(copy.token_ids)}})
        except grpc.aio.AioRpcError as exc:
            self.metrics.copies.labels("failed").inc()
            if predicted is not None and not started:
                self.metrics.withdrawn.inc(predicted.withdraw(self.mirror.index))
            log.warning("hot prefix copy failed", extra={"kv": {
                "worker": worker, "request": copy.request_id, "code": exc.code().name,
                "details": exc.details()}})
        finally:
            self.release(stored)
            if not started:
                self.registry.first_token(worker, uncached, context)
            self.registry.end(worker)

    async def close(self) -> None:
        """Cancel the copies in flight (the router is stopping) and wait for them."""
        tasks = list(self._running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
