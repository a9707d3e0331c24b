"""Hostile programs: every limit is checked against what a request claims before any work
proportional to it, and off the event loop, so one request never stalls the others; each
is refused with INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the limit, and never marks a
worker down. Real agents (tiny engine) and router on loopback ports, real gRPC."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from kvroute.v1 import common_pb2, router_pb2_grpc, worker_agent_pb2_grpc
from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from tests.support import generate, wait_for

TINY = dict(engine="tiny", tokenizer="byte", vocab_size=258, capacity_blocks=64)
PROMPT = list(b"hostile program prompt: ")


def gen(n: int, **kw: Any) -> P.Step:
    return P.Step(gen=P.Gen(max_tokens=n, **kw))


def fork(*subs: list[P.Step], n: int = 0, select: int = 0) -> P.Step:
    return P.Step(fork=P.Fork(branches=[P.ControllerProgram(steps=s) for s in subs], n=n,
                              select=select))


def nested(width: int, depth: int) -> list[P.Step]:
    """A fork of ``width`` copies, ``depth`` levels deep: width**depth branches."""
    steps = [gen(1)]
    for _ in range(depth):
        steps = [fork(steps, n=width)]
    return steps


def deep_schema(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth


REF_LOOP = json.dumps({"$ref": "#/$defs/a",
                       "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}})

HOSTILE: list[tuple[str, list[P.Step], grpc.StatusCode, str]] = [
    ("fork_1e6", [fork([gen(1)], n=10 ** 6)], grpc.StatusCode.RESOURCE_EXHAUSTED,
     "max_program_fanout"),
    ("fork_4e9", [fork([gen(1)], n=4 * 10 ** 9)], grpc.StatusCode.RESOURCE_EXHAUSTED,
     "max_program_fanout"),
    ("fork_10x7", nested(10, 7), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_program_fanout"),
    ("deep_schema", [gen(4, constraint=P.Constraint(json_schema=deep_schema(1200)))],
     grpc.StatusCode.INVALID_ARGUMENT, "max_schema_depth"),
    ("deep_json", [gen(4, constraint=P.Constraint(json_schema="[" * 5000 + "]" * 5000))],
     grpc.StatusCode.INVALID_ARGUMENT, "max_schema_depth"),
    ("ref_loop", [gen(4, constraint=P.Constraint(json_schema=REF_LOOP))],
     grpc.StatusCode.INVALID_ARGUMENT, "constraint"),
    ("choices_20000", [gen(4, constraint=P.Constraint(
        choices=P.Choices(options=[f"o{i}" for i in range(20000)])))],
     grpc.StatusCode.INVALID_ARGUMENT, "max_choices"),
    ("select_unknown", [fork([gen(1)], n=2), P.Step(select=P.Select(mode=77))],
     grpc.StatusCode.INVALID_ARGUMENT, "select"),
    ("fork_select_unknown", [fork([gen(1)], n=2, select=99)],
     grpc.StatusCode.INVALID_ARGUMENT, "select"),
]


def request(steps: list[P.Step]) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(token_ids=PROMPT, program=P.ControllerProgram(steps=steps))


async def call(port: int, steps: list[P.Step], rpc: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        if rpc == "agent":
            stub: Any = worker_agent_pb2_grpc.WorkerAgentStub(ch)
        else:
            stub = router_pb2_grpc.RouterStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if rpc == "route":
                await stub.Route(request(steps), timeout=30)
            else:
                [r async for r in stub.Generate(request(steps), timeout=30)]
        return err.value


@pytest.mark.parametrize(("name", "steps", "code", "limit"), HOSTILE,
                         ids=[h[0] for h in HOSTILE])
async def test_hostile_programs_are_refused_naming_the_limit(cluster, name, steps, code,
                                                             limit) -> None:
    """Through the router (Route and Generate) and straight to the agent: the limit's code
    and name, and the worker stays routable (a request's own error marks nothing down)."""
    a = await cluster.agent("a", **TINY)
    router = await cluster.router(vocab_size=258)
    await wait_for(lambda: "a" in router.registry.loads, what="a registered")
    for rpc in ("agent", "route", "generate"):
        if rpc == "route" and code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            continue  # Route only bounds fan-out (it runs no grammar)
        err = await call(a.port if rpc == "agent" else router.port, steps, rpc)
        assert err.code() == code, (rpc, err.details())
        assert limit in err.details(), (rpc, err.details())
    assert "a" in router.registry.loads  # not marked down
    out = await generate(router.port, PROMPT, max_tokens=2)
    assert out[-1].worker_id == "a"


async def test_a_huge_fork_does_not_stall_other_clients(cluster) -> None:
    """While hostile programs are refused, plain requests on another channel keep being
    answered: the refusals take no time proportional to the claimed fan-out (before the
    fix one 10^6-way fork held the router's loop for seconds)."""
    a = await cluster.agent("a", **TINY)
    router = await cluster.router(vocab_size=258)
    await wait_for(lambda: "a" in router.registry.loads, what="a registered")
    hostile = [fork([gen(1)], n=10 ** 6)], nested(10, 7)
    stop = asyncio.Event()
    refused: list[grpc.StatusCode] = []

    async def attacker() -> None:
        while not stop.is_set():
            for steps in hostile:
                for rpc in ("route", "generate", "agent"):
                    err = await call(a.port if rpc == "agent" else router.port, steps, rpc)
                    refused.append(err.code())

    task = asyncio.create_task(attacker())
    served = 0
    async with asyncio.timeout(60):  # serves on while the attacker runs, until both progress
        while not task.done() and (served < 5 or len(refused) < 6):
            out = await generate(router.port, PROMPT, max_tokens=1)
            assert out[-1].worker_id == "a"
            served += 1
    stop.set()
    await task
    # Both kinds of traffic made progress side by side: each attacker round is six calls.
    assert len(refused) >= 6 and served >= 5, (len(refused), served)
    assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}


async def test_an_agent_places_fork_children_only_onto_live_workers(cluster) -> None:
    """A client calling an agent directly with a placement naming any host:port would have
    it send the whole prompt there: only a worker with a live heartbeat, at its heartbeat's
    address, is accepted; a real peer still gets its children."""
    a = await cluster.agent("a", **TINY)
    b = await cluster.agent("b", **TINY)
    steps = [fork([gen(2)], [gen(3)], [gen(2)], [gen(3)])]

    def placed(worker: str, address: str) -> common_pb2.GenerateRequest:
        req = request(steps)
        req.placement.fork_step = 0
        req.placement.overflow.add(worker_id=worker, address=address, children=[2, 3])
        return req

    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
        stub = worker_agent_pb2_grpc.WorkerAgentStub(ch)
        for worker, address in (("evil", "127.0.0.1:1"), ("b", "127.0.0.1:1")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in stub.Generate(placed(worker, address))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a live worker" in err.value.details(), err.value.details()
        out = [r async for r in stub.Generate(placed("b", f"127.0.0.1:{b.port}"))]
    assert {r.worker_id for r in out if r.token_ids} == {"a", "b"}
    assert a.engine.stats.admitted > 0 and b.engine.stats.admitted > 0


@pytest.mark.parametrize("name", ["model", "session_id"])
async def test_a_giant_name_is_refused_in_a_message_that_fits_a_trailer(cluster, name) -> None:
    """A 100 KB model name was echoed whole into the status message, past gRPC's 16 KiB
    metadata cap: the client saw RESOURCE_EXHAUSTED "Stream removed" instead of the reason."""
    await cluster.agent("a")
    router = await cluster.router()
    await wait_for(lambda: "a" in router.registry.loads, what="a registered")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(router.port, [1, 2, 3], **{name: "y" * 100_000})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()[:200]
    assert err.value.details().startswith(f"{name}: ") and len(err.value.details()) < 300


async def test_a_fork_of_many_copies_of_a_long_branch_is_weighed_once(cluster) -> None:
    """Within the router's limits (1000 branches, 4001 steps) but once weighed copy by copy
    for placement: 4M step visits, 7 s of the router's loop per Route. Each copy is the same
    sub-program: weighed once, and plain requests are served meanwhile."""
    await cluster.agent("a", **TINY)
    router = await cluster.router(vocab_size=258, router_max_program_steps=4096)
    await wait_for(lambda: "a" in router.registry.loads, what="a registered")
    steps = [fork([gen(1)] * 4000, n=1000)]
    stop = asyncio.Event()
    routed = 0

    async def attacker() -> None:
        nonlocal routed
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            while not stop.is_set():
                resp = await router_pb2_grpc.RouterStub(ch).Route(request(steps), timeout=30)
                assert resp.worker_id == "a"
                routed += 1

    task = asyncio.create_task(attacker())
    served = 0
    async with asyncio.timeout(60):  # serves on while the attacker runs, until both progress
        while not task.done() and (served < 5 or routed < 2):
            await generate(router.port, PROMPT, max_tokens=1)
            served += 1
    stop.set()
    await task
    assert routed >= 2 and served >= 5, (routed, served)
