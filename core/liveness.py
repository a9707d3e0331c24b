"""Noticing a hung worker while a request waits for its first token (the router's calls to
agents, and an agent's calls to the overflow workers of a program's fork).

A SIGSTOPped (or wedged) agent keeps its TCP connections open: calls to it neither fail nor
answer, and its heartbeat only expires seconds later. While a request has no first token
yet, the caller asks the agent for its load (``GetLoad``, a cheap call its event loop answers
at once even while the engine computes) every ``wait_s``; an agent that does not answer
within ``probe_s`` is hung, and the request moves to the next-best worker, or the fork's
children run on the calling agent (the attempt is cancelled; nothing reached the client
yet). Probes are shared: however many requests wait on
one worker, one probe at a time asks it. Once a stream has its first token it is left alone
(a retry would repeat tokens); the worker's heartbeat decides about it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from kvroute.core.agent_client import AgentChannels
from kvroute.v1 import common_pb2, worker_agent_pb2


class HungWorkerError(Exception):
    """The worker did not answer a probe in time (reported like a transport failure)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self.message


@dataclass(slots=True)
class LivenessProbe:
    channels: AgentChannels
    probe_s: float
    """How long a probe waits for the agent's answer."""
    _inflight: dict[str, asyncio.Task[bool]] = field(default_factory=dict)

    async def alive(self, address: str) -> bool:
        task = self._inflight.get(address)
        if task is None:
            task = self._inflight[address] = asyncio.create_task(self._probe(address))
            task.add_done_callback(lambda _t: self._inflight.pop(address, None))
        # shield: one waiter cancelled (its client gone) must not cancel the others' probe.
        return await asyncio.shield(task)

    async def _probe(self, address: str) -> bool:
        try:
            await self.channels.stub(address).GetLoad(worker_agent_pb2.GetLoadRequest(),
                                                      timeout=self.probe_s)
        except grpc.aio.AioRpcError as exc:
            # Only silence means hung: a refused connection fails the request's own call.
            return exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
        return True


async def watched(call: grpc.aio.UnaryStreamCall, probe: LivenessProbe, address: str,
                  wait_s: float) -> AsyncIterator[common_pb2.GenerateResponse]:
    """``call``'s responses; until the first one, the agent at ``address`` is probed every
    ``wait_s`` and :class:`HungWorkerError` raised (the call cancelled) if it is hung. A
    first response within ``wait_s`` costs one timer, no task (the common case)."""
    it = call.__aiter__()
    hung: list[str] = []
    checker: asyncio.Task[None] | None = None

    async def check() -> None:
        while True:
            if not await probe.alive(address):
                hung.append(f"no answer from {address} within {probe.probe_s:g} s (hung?)")
                call.cancel()
                return
            await asyncio.sleep(wait_s)

    def start() -> None:
        nonlocal checker
        checker = asyncio.create_task(check())

    timer = asyncio.get_running_loop().call_later(wait_s, start)
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        if hung:  # our own cancel: the worker's fault, not the client's
            raise HungWorkerError(hung[0]) from None
        raise
    finally:
        timer.cancel()
        if checker is not None:
            checker.cancel()
    yield first
    async for resp in it:
        yield resp
