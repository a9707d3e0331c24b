"""Client side of the WorkerAgent service, shared by the router (forwarding requests) and
agents (sending a program's overflow branches to another worker)."""

from __future__ import annotations

import asyncio

import grpc

from kvroute.v1 import worker_agent_pb2_grpc


class AgentChannels:
    """One gRPC channel per agent address, opened lazily, closed on shutdown."""

    def __init__(self) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_agent_pb2_grpc.WorkerAgentStub]] = {}

    def stub(self, address: str) -> worker_agent_pb2_grpc.WorkerAgentStub:
        entry = self._stubs.get(address)
        if entry is None:
            ch = grpc.aio.insecure_channel(address)
            entry = self._stubs[address] = (ch, worker_agent_pb2_grpc.WorkerAgentStub(ch))
        return entry[1]

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch, _ in self._stubs.values()),
                             return_exceptions=True)
        self._stubs.clear()
