"""A program whose fork does not fit its worker: the overflow children run on another
worker's agent, relayed into one stream, with the same results as running them all in one
place. Real tiny-engine agents and a real router over gRPC."""

from __future__ import annotations

import re
from typing import Any

import grpc
import pytest

from kvroute.core.redis_schema import Heartbeat, RedisKeys
from kvroute.v1 import common_pb2, router_pb2_grpc, worker_agent_pb2_grpc
from kvroute.v1 import program_pb2 as P  # noqa: N812
from tests.e2e.test_programs import (
    PROMPT,
    TINY,
    cancel_when_all_decode,
    ff,
    fork,
    gen,
    replay,
    results,
    run,
)
from tests.support import free_port, wait_for

BEST = P.SELECT_MODE_BEST_LOGPROB
FIRST = P.SELECT_MODE_FIRST_FINISHED
# Four children that differ, each continuing after the fork (the segment's rest).
FOUR = [fork([ff(" red:")], [ff(" green:")], [ff(" blue:")], [ff(" grey:")]), gen(6)]


def placed(steps: list[P.Step], to: str, address: str, children: list[int],
           prompt: list[int] | None = None, fork_step: int = 0) -> common_pb2.GenerateRequest:
    req = common_pb2.GenerateRequest(token_ids=prompt or PROMPT,
                                     program=P.ControllerProgram(steps=steps))
    req.placement.fork_step = fork_step
    req.placement.overflow.add(worker_id=to, address=address, children=children)
    return req


async def call(port: int, req: common_pb2.GenerateRequest) -> list[common_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(req)]


def by_worker(resps: list[common_pb2.GenerateResponse]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in resps[:-1]:
        if r.token_ids:
            out.setdefault(r.branch_id, set()).add(r.worker_id)
    return out


async def two_agents(cluster: Any, **kw: Any) -> tuple[Any, Any]:
    a = await cluster.agent("a", **TINY, **kw)
    b = await cluster.agent("b", **TINY, **kw)
    return a, b


async def test_the_router_splits_a_fork_that_does_not_fit_and_results_are_unchanged(
        cluster) -> None:
    a, b = await two_agents(cluster, max_batch=2)
    alone = results(await run(a.port, FOUR))  # reference: every child on one worker
    router = await cluster.router(vocab_size=258)
    # Idle as the router sees them: a heartbeat from during the reference run would leave the
    # primary less room, and the split would move other children.
    await wait_for(lambda: len(router.registry.loads) == 2
                   and all(ld.max_running == 2 and ld.occupied == 0
                           for ld in router.registry.loads.values()),
                   what="agents registered with their batch size, idle")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        decision = await router_pb2_grpc.RouterStub(ch).Route(common_pb2.GenerateRequest(
            token_ids=PROMPT, program=P.ControllerProgram(steps=FOUR)))
    assert decision.placement.fork_step == 0 and len(decision.placement.overflow) == 1
    moved_to = decision.placement.overflow[0]
    assert moved_to.worker_id != decision.worker_id and list(moved_to.children) == [2, 3]
    resps = await run(router.port, FOUR, router=True)
    res = results(resps)
    assert sorted(res) == ["0.0", "0.1", "0.2", "0.3"]
    for bid, r in res.items():
        assert list(r.token_ids) == list(alone[bid].token_ids), bid
        assert replay(resps, bid) == list(r.token_ids)  # the relayed stream adds up
    where = by_worker(resps)
    primary = resps[-1].worker_id
    other = "b" if primary == "a" else "a"
    assert where["0.0"] == where["0.1"] == {primary}
    assert where["0.2"] == where["0.3"] == {other}
    # The moved children ran as one fork there: its shared part was prefilled once.
    full = (len(PROMPT) - 1) // 16 * 16
    assert res["0.2"].cached_tokens >= full and res["0.3"].cached_tokens >= full
    moved = a if other == "a" else b
    assert moved.engine.stats.admitted >= 2
    assert router.metrics.overflow._value.get() == 2
    assert (a if primary == "a" else b).programs.stats.overflow_sent == 2
    await wait_for(lambda: all(router.registry.loads[w].inflight == 0
                               and router.registry.loads[w].pending_prefill_tokens == 0
                               for w in (primary, other)), what="accounting ended")


@pytest.mark.parametrize("mode", [BEST, FIRST], ids=["best_logprob", "first_finished"])
async def test_a_split_forks_select_sees_every_child(cluster, mode) -> None:
    a, b = await two_agents(cluster)
    steps = [fork([ff(" red:"), gen(5)], [ff(" green:"), gen(5)], [ff(" blue:"), gen(5)],
                  select=mode)]
    alone = results(await run(a.port, steps))
    res = results(await call(a.port, placed(steps, "b", f"127.0.0.1:{b.port}", [1, 2])))
    kept = [k for k, r in res.items() if r.selected]
    assert len(kept) == 1 and len(res) == 3
    if mode == BEST:  # the best of all three, wherever it ran
        assert kept == [k for k, r in alone.items() if r.selected]
        assert res[kept[0]].logprob == pytest.approx(alone[kept[0]].logprob, abs=1e-4)
        assert len(res[kept[0]].token_logprobs) == len(res[kept[0]].token_ids)
    for k, r in res.items():
        if mode == BEST:
            assert list(r.token_ids) == list(alone[k].token_ids)
        elif r.selected:
            # The first to finish ran to its end. Alone, the same child may have lost the race
            # and been cancelled part way: its tokens are then a prefix of these.
            got, ref = list(r.token_ids), list(alone[k].token_ids)
            assert got[:len(ref)] == ref and len(ref) > 0
            assert len(got) == len(ref) or not alone[k].selected


async def test_an_unreachable_overflow_worker_costs_nothing(cluster) -> None:
    a = await cluster.agent("a", **TINY)
    alone = results(await run(a.port, FOUR))
    # A worker still live in Redis (its heartbeat not yet expired) but gone: the agent
    # places only onto live workers, and this one's call then fails at once.
    gone = f"127.0.0.1:{free_port()}"
    cluster.redis.client().set(RedisKeys("default").heartbeat("gone"),
                               Heartbeat("gone", gone, "e").to_json(), px=30_000)
    resps = await call(a.port, placed(FOUR, "gone", gone, [2, 3]))
    res = results(resps)
    assert {k: list(r.token_ids) for k, r in res.items()} == \
        {k: list(r.token_ids) for k, r in alone.items()}
    assert {w for ws in by_worker(resps).values() for w in ws} == {"a"}
    assert a.programs.stats.overflow_fallback == 2


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda r: setattr(r.placement, "fork_step", 1), "placement.fork_step"),
    (lambda r: r.placement.overflow[0].children.append(9), "placement.overflow[0].children"),
    (lambda r: setattr(r.placement.overflow[0], "address", "nowhere"),
     "placement.overflow[0].address"),
    (lambda r: setattr(r.placement.overflow[0], "worker_id", "a"),
     "placement.overflow[0].worker_id"),
    (lambda r: r.placement.overflow[0].children.extend([0, 1]), "placement.overflow"),
], ids=["fork_step", "child_range", "address", "self", "moves_all"])
async def test_a_bad_placement_is_rejected_before_any_engine_work(cluster, mutate,
                                                                  field) -> None:
    a = await cluster.agent("a", **TINY)
    req = placed(FOUR, "b", "127.0.0.1:1", [2, 3])
    mutate(req)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(a.port, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()
    assert a.engine.stats.admitted == 0


async def test_an_open_constraint_keeps_the_children_here(cluster) -> None:
    a, b = await two_agents(cluster)
    steps = [gen(4, constraint=P.Constraint(regex="a{1,9}")),
             fork([gen(3, continue_constraint=True, capture="v")], n=2)]
    res = results(await call(a.port, placed(steps, "b", f"127.0.0.1:{b.port}", [1],
                                            fork_step=1)))
    assert len(res) == 2 and b.engine.stats.admitted == 0
    assert a.programs.stats.overflow_kept == 1
    for r in res.values():
        assert re.fullmatch("a{1,9}", bytes(r.token_ids).decode()), bytes(r.token_ids)


async def test_cancelling_a_split_program_frees_every_branch_on_both_workers(cluster) -> None:
    a, b = await two_agents(cluster)
    req = placed([fork([gen(600)], n=4)], "b", f"127.0.0.1:{b.port}", [2, 3])
    async with cancel_when_all_decode(a.port, req, 4):
        assert a.engine.load().running == 2 and b.engine.load().running == 2
    for app in (a, b):
        cap = app.engine.load().capacity_blocks
        await wait_for(lambda app=app, cap=cap: app.engine.load().running == 0
                       and app.engine.load().free_blocks == cap, what="branches freed")


async def test_an_overflow_worker_dying_mid_program_fails_it_cleanly(cluster) -> None:
    a = await cluster.agent("a", **TINY)
    # b decodes in real time (the sim engine's cost model: seconds for these tokens), so
    # however busy the machine, its branches are still running when their first token
    # reaches the client (the tiny engine could finish them first).
    b = await cluster.agent("b", **{**TINY, "engine": "sim"}, time_scale=1.0)
    req = placed([fork([gen(300)], n=4)], "b", f"127.0.0.1:{b.port}", [2, 3])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
        call = worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(req)
        stopped = False
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for r in call:
                if r.token_ids and r.worker_id == "b" and not stopped:
                    ld = b.engine.load()
                    assert ld.running + ld.queued == 2  # neither of its branches ended
                    await cluster.stop(b)  # tokens of its branches reached the client
                    stopped = True
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "overflow worker b failed mid-program" in err.value.details()
    cap = a.engine.load().capacity_blocks
    await wait_for(lambda: a.engine.load().running == 0 and a.engine.load().free_blocks == cap,
                   what="the local branches freed")
