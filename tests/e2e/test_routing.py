"""End to end over a real redis-server and real gRPC servers on loopback ports."""

from __future__ import annotations

import asyncio
import math
import random
import signal
import time
from typing import Any

import grpc
import pytest

from kvroute.core.blocks import BlockHasher
from kvroute.core.load import ARRIVAL_MIN_WINDOW_S, ARRIVAL_TAU_S, PrefillMode
from kvroute.core.policies import Kvroute
from kvroute.v1 import common_pb2, router_pb2_grpc
from tests.support import AgentProc, generate, raw_rpc, request_wire, route, wait_for


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(n)]


def keys_of(tokens: list[int]) -> set[int]:
    return set(BlockHasher(16, "default").keys(tokens))


async def test_shared_prefix_lands_on_the_same_worker_with_cache_hits(cluster) -> None:
    for i in range(4):
        await cluster.agent(f"w{i}")
    router = await cluster.router()
    await wait_for(lambda: len(router.registry.loads) == 4, what="4 workers registered")
    system = prompt(2048, 1)
    first = await generate(router.port, system + prompt(100, 2))
    w = first[0].worker_id
    assert first[0].cached_tokens == 0
    # The agent's store events reach the router's mirror through Redis.
    await wait_for(lambda: router.mirror.index.count(w) >= 2048 // 16, what="feed applied")
    second = await generate(router.port, system + prompt(300, 3))
    assert second[0].worker_id == w
    assert second[0].cached_tokens >= 2048
    assert second[-1].usage.cached_tokens == second[0].cached_tokens
    assert all(r.worker_id == w for r in second)


async def test_router_started_after_agents_routes_by_cache_at_once(cluster) -> None:
    a = await cluster.agent("a")
    await cluster.agent("b")
    tokens = prompt(1024, 5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
        from kvroute.v1 import common_pb2, worker_agent_pb2_grpc

        req = common_pb2.GenerateRequest(token_ids=tokens,
                                         sampling=common_pb2.SamplingParams(max_tokens=2))
        [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(req)]
    await wait_for(lambda: a.publisher.stats.pending == 0 and a.publisher.seq >= 2,
                   what="agent published")
    router = await cluster.router()  # bootstraps from snapshots
    assert router.mirror.index.count("a") >= 1024 // 16 - 1
    out = await generate(router.port, tokens + prompt(40, 6))
    assert out[0].worker_id == "a"
    assert out[0].cached_tokens >= 1008


async def test_malformed_requests_get_invalid_argument(cluster) -> None:
    await cluster.agent("a")
    router = await cluster.router(max_prompt_tokens=1000)
    cases = {
        "token_ids": dict(tokens=[]),
        "sampling.max_tokens": dict(tokens=[1, 2], max_tokens=0),
        "out of range": dict(tokens=[1, 50257]),
        "exceeds the limit": dict(tokens=[1] * 1001),
        "no tokenizer": dict(text="hello"),
        "model": dict(tokens=[1], model="other-model"),
    }
    for needle, kw in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(router.port, kw.pop("tokens", None), **kw)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
        assert needle in err.value.details(), err.value.details()
    # Floats the JSON front cannot carry but protobuf can: NaN and infinity.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        for bad in (math.nan, math.inf):
            req = common_pb2.GenerateRequest(token_ids=[1, 2], sampling=common_pb2.SamplingParams(
                max_tokens=2, temperature=bad))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in router_pb2_grpc.RouterStub(ch).Generate(req)]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.temperature" in err.value.details(), err.value.details()


async def test_a_request_refused_before_its_prefill_leaves_no_prediction(cluster) -> None:
    """The worker refuses the prompt (too long for it): the blocks the router predicted it
    would store are withdrawn at once, so a sibling is not sent after a prefix nobody is
    computing for the rest of --predict-ttl-s."""
    await cluster.agent("a", max_prompt_tokens=500)
    router = await cluster.router()
    await wait_for(lambda: set(router.registry.loads) == {"a"}, what="a registered")
    tokens = prompt(1024, 90)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(router.port, tokens)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert router.mirror.index.predicted("a") == 0
    assert router.mirror.index.match(BlockHasher(16, "default").keys(tokens)) == {}
    assert router.metrics.withdrawn._value.get() == 1024 // 16
    assert len(router.service._inflight) == 0


async def test_every_encoding_of_token_ids_routes_alike(cluster) -> None:
    # The router reads the ids from the bytes gRPC received (core/wire.py); a client
    # may write them unpacked or in several packed records, and must get the same answer.
    from kvroute.v1 import common_pb2, router_pb2

    for w in ("a", "b"):
        await cluster.agent(w)
    router = await cluster.router()
    await wait_for(lambda: len(router.registry.loads) == 2, what="2 workers registered")
    system = prompt(1024, 11)
    first = await generate(router.port, system + prompt(50, 12))
    holder = first[0].worker_id
    await wait_for(lambda: router.mirror.index.count(holder) >= 1024 // 16, what="indexed")
    tokens = system + prompt(200, 13)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        raw_route = raw_rpc(ch, "Router/Route", router_pb2.RouteResponse, stream=False)
        raw_generate = raw_rpc(ch, "Router/Generate", common_pb2.GenerateResponse,
                               stream=True)
        encodings = ("packed", "unpacked", "split")
        for how in encodings:  # Route first: it changes no cache
            r = await raw_route(request_wire(tokens, how))
            assert (r.worker_id, r.prompt_tokens, r.cached_tokens) == (holder, 1224, 1024), how
        for how in encodings:
            out = [x async for x in raw_generate(request_wire(tokens, how))]
            assert out[0].worker_id == holder and out[-1].usage.prompt_tokens == 1224, how
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw_route(request_wire([1, 50257, 2], how))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "token id 50257 is out of range" in err.value.details(), how
        for call in (raw_route, lambda b: raw_generate(b).read()):
            with pytest.raises(grpc.aio.AioRpcError) as err:  # not a message at all
                await call(b"\x0a\x05\x01")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed GenerateRequest (3 bytes)" in err.value.details()
    invalid = router.metrics.registry.get_sample_value(
        "kvroute_router_requests_total", {"api": "grpc", "rpc": "Route", "outcome": "invalid"})
    assert invalid == 4  # three bad ids (one per encoding), one malformed message


async def test_text_prompts_with_a_tokenizer(cluster) -> None:
    await cluster.agent("a", vocab_size=258)  # the byte tokenizer's ids (else excluded)
    router = await cluster.router(tokenizer="byte")
    out = await generate(router.port, text="hello world " * 10, max_tokens=3)
    assert out[-1].usage.prompt_tokens == 120
    assert sum(len(r.token_ids) for r in out) == 3


async def test_killed_worker_leaves_routing_and_index(cluster) -> None:
    a = AgentProc(cluster.redis.url, "doomed")
    b = AgentProc(cluster.redis.url, "survivor")
    a.start()
    b.start()
    try:
        router = await cluster.router()
        await wait_for(lambda: {"doomed", "survivor"} <= set(router.registry.loads), 20,
                       "both subprocess agents registered")
        # Warm the doomed worker through the router so its blocks enter the index.
        served = None
        for i in range(8):
            out = await generate(router.port, prompt(640, 100 + i))
            if out[0].worker_id == "doomed":
                served = out
                break
        assert served is not None, "round of requests never reached 'doomed'"
        await wait_for(lambda: router.mirror.index.count("doomed") > 0, what="doomed indexed")
        a.kill(signal.SIGKILL)
        await wait_for(lambda: "doomed" not in router.registry.loads, 10,
                       "heartbeat expiry")
        assert router.mirror.index.count("doomed") == 0
        assert "doomed" not in router.mirror.index.workers()
        r = await route(router.port, prompt(100, 8))
        assert [c.worker_id for c in r.candidates] == ["survivor"]
    finally:
        a.stop()
        b.stop()


async def test_agent_restart_leaves_no_stale_blocks(cluster) -> None:
    a = AgentProc(cluster.redis.url, "phoenix")
    a.start()
    try:
        router = await cluster.router()
        await wait_for(lambda: "phoenix" in router.registry.loads, 20, "agent registered")
        await generate(router.port, prompt(800, 9))
        await wait_for(lambda: router.mirror.index.count("phoenix") >= 49, what="indexed")
        old = router.mirror.index.keys_of("phoenix")
        a.kill(signal.SIGKILL)
        a.start()  # same id, same port, before its heartbeat expires: a new epoch
        await wait_for(lambda: router.mirror.index.count("phoenix") == 0, 20,
                       "the new epoch's clear reached the mirror")
        out = await generate(router.port, prompt(320, 10))
        assert out[0].worker_id == "phoenix" and out[0].cached_tokens == 0
        await wait_for(lambda: router.mirror.index.count("phoenix") >= 20, what="new blocks")
        assert not (router.mirror.index.keys_of("phoenix") & old)
    finally:
        a.stop()


async def test_redis_restart_mid_run_loses_no_request(cluster) -> None:
    for i in range(2):
        await cluster.agent(f"w{i}")
    router = await cluster.router()
    await wait_for(lambda: len(router.registry.loads) == 2, what="workers registered")
    system = prompt(512, 11)
    results: list[object] = []
    errors: list[BaseException] = []

    async def client(n: int) -> None:
        for i in range(n):
            try:
                out = await generate(router.port, system + prompt(64, 1000 * n + i))
                results.append(out)
            except grpc.aio.AioRpcError as exc:
                errors.append(exc)
            await asyncio.sleep(0.01)

    task = asyncio.create_task(client(60))
    await asyncio.sleep(0.2)
    cluster.redis.stop()
    await wait_for(lambda: not router.mirror.available, what="router noticed redis down")
    await asyncio.sleep(0.3)  # requests keep flowing, routed by load alone
    cluster.redis.start()
    await wait_for(lambda: router.mirror.available, 10, "router resynced")
    await task
    assert not errors
    assert len(results) == 60
    assert all(out[-1].HasField("usage") for out in results)
    # The agents notice the empty Redis and republish; the router's mirror heals.
    await wait_for(lambda: router.mirror.index.count("w0") + router.mirror.index.count("w1")
                   >= 512 // 16, 10, "snapshots republished after the restart")


async def test_failed_agent_is_retried_on_the_next_best_worker(cluster) -> None:
    from tests.support import free_port

    await cluster.agent("live")
    dead = f"dead=127.0.0.1:{free_port()}"
    router = await cluster.router(workers=dead, policy="round_robin")
    await wait_for(lambda: len(router.registry.loads) == 2, what="both workers known")
    outs = [await generate(router.port, prompt(64, 20 + i)) for i in range(4)]
    assert all(o[0].worker_id == "live" for o in outs)
    assert router.metrics.retries._value.get() >= 1


async def test_predicted_entries_keep_a_burst_together(cluster) -> None:
    """With --predict-ttl-s, a sibling sent before the first request's store events reach
    the router still goes where the first went."""
    for i in range(4):
        await cluster.agent(f"w{i}", time_scale=0.2)  # a visible prefill: events come later
    router = await cluster.router(predict_ttl_s=5.0)
    await wait_for(lambda: len(router.registry.loads) == 4, what="4 workers registered")
    shared = prompt(2048, 40)
    first = asyncio.create_task(generate(router.port, shared + prompt(32, 41)))
    await wait_for(lambda: any(router.mirror.index.predicted(w) for w in router.registry.loads),
                   what="prediction placed")
    predicted = next(w for w in router.registry.loads if router.mirror.index.predicted(w))
    r = await route(router.port, shared + prompt(32, 42))
    assert r.worker_id == predicted and r.cached_tokens >= 2048
    assert (await first)[0].worker_id == predicted


async def start_burst(cluster, workers: int, time_scale: float, seed: int, max_tokens: int,
                      **router_kw: Any) -> tuple[Any, dict[str, Any], list[int],
                                             asyncio.Task[list[object]], str]:
    """Agents with a visible prefill, a router predicting for 5 s, and a burst's first
    request (a 4096-token shared prefix) in flight: returns the router, the agents, the
    shared prefix, the first request's task and the worker its prediction names."""
    agents = {f"w{i}": await cluster.agent(f"w{i}", time_scale=time_scale)
              for i in range(workers)}
    router = await cluster.router(predict_ttl_s=5.0, **router_kw)
    await wait_for(lambda: len(router.registry.loads) == workers, what="workers registered")
    shared = prompt(4096, seed)
    first = asyncio.create_task(generate(router.port, shared + prompt(32, seed + 1),
                                         max_tokens=max_tokens))
    await wait_for(lambda: any(router.mirror.index.predicted(w) for w in router.registry.loads),
                   what="prediction placed")
    predicted = next(w for w in router.registry.loads if router.mirror.index.predicted(w))
    return router, agents, shared, first, predicted


async def test_a_sibling_routed_on_a_prediction_waits_for_that_prefill(cluster) -> None:
    """Coalescing: a sibling sent while the first request's prefill is in flight goes where
    the first went, is held by the router until the first's first token (the prefix is then
    stored), and is served from the cache; a request whose prefix is really cached is not
    held."""
    router, _, shared, first, predicted = await start_burst(cluster, 3, 0.5, 50, 2)
    sibling = await generate(router.port, shared + prompt(32, 52), max_tokens=2)
    out = await first
    assert sibling[0].worker_id == out[0].worker_id == predicted
    assert sibling[-1].usage.cached_tokens >= 4096  # the engine's own hit, not a prediction
    assert router.metrics.coalesced._value.get() == 1
    assert router.metrics.coalesce_wait._sum.get() > 0
    await wait_for(lambda: router.mirror.index.count(predicted) >= 4096 // 16,
                   what="the prefix's store events")
    again = await generate(router.port, shared + prompt(32, 53), max_tokens=2)
    assert again[0].worker_id == predicted
    assert router.metrics.coalesced._value.get() == 1  # really cached: nothing to wait for
    # Every request's entry is gone with it; a prefix asked for three times in the router's
    # first seconds is hot, and its background copy holds an entry until it ends too.
    await wait_for(lambda: len(router.service._inflight) == 0, what="every entry gone")
    assert router.registry.loads[predicted].inflight == 0  # the hold's load released too


async def test_a_held_sibling_is_sent_anyway_after_coalesce_wait(cluster, caplog) -> None:
    """A sibling held for an in-flight prefill that takes longer than --coalesce-wait-s is
    sent after that wait, not lost, and the wait is what the metric reports."""
    # A 4k-token prefill takes ~2 s at time scale 5.
    router, _, shared, first, _ = await start_burst(cluster, 2, 5.0, 60, 1, coalesce_wait_s=0.3)
    sibling = await generate(router.port, shared + prompt(32, 62), max_tokens=1)
    out = await first
    assert sibling[0].worker_id == out[0].worker_id
    assert router.metrics.coalesced._value.get() == 1
    assert router.metrics.coalesce_wait._sum.get() >= 0.3  # it did wait that long
    assert any("sending anyway" in r.getMessage() for r in caplog.records)  # then gave up
    assert len(router.service._inflight) == 0


async def test_a_request_is_not_held_for_a_prefill_that_is_mostly_anothers(cluster) -> None:
    """Parallel agent calls share a short prefix and each add a long suffix: the second is
    routed on what workers really hold instead of waiting out the first's own suffix
    (--coalesce-share), and nothing is left behind."""
    await cluster.agent("w0", time_scale=5.0)  # a 4k-token prefill takes ~2 s
    router = await cluster.router(predict_ttl_s=5.0)
    await wait_for(lambda: len(router.registry.loads) == 1, what="worker registered")
    shared = prompt(512, 80)
    first = asyncio.create_task(generate(router.port, shared + prompt(4096, 81), max_tokens=1))
    await wait_for(lambda: router.mirror.index.predicted("w0"), what="prediction placed")
    second = await generate(router.port, shared + prompt(32, 82), max_tokens=1)
    out = await first
    assert second[0].worker_id == out[0].worker_id == "w0"
    assert router.metrics.coalesce_declined._value.get() == 1
    assert router.metrics.coalesced._value.get() == 0  # it did not wait
    assert len(router.service._inflight) == 0
    assert router.registry.loads["w0"].inflight == 0


async def test_held_siblings_skip_the_worker_their_producer_failed_on(cluster) -> None:
    """The worker running a burst's first request dies before its first token: the first
    request is retried on the next-best worker, and the held sibling wakes at once and goes
    straight to a live worker instead of trying the dead one first."""
    router, agents, shared, first, doomed = await start_burst(cluster, 3, 5.0, 70, 1)
    sibling = asyncio.create_task(generate(router.port, shared + prompt(32, 72), max_tokens=1))
    await wait_for(lambda: router.metrics.coalesced._value.get() == 1, what="sibling held")
    await agents[doomed].stop(grace_s=0)
    out, sib = await first, await sibling
    assert out[0].worker_id != doomed and sib[0].worker_id != doomed
    assert router.metrics.retries._value.get() == 1  # the first request's retry only
    assert len(router.service._inflight) == 0


async def test_router_replicas_share_one_view(cluster) -> None:
    """Two router replicas on one Redis: a prefix cached through one is routed to by the
    other, and both count the same workers and blocks."""
    for i in range(3):
        await cluster.agent(f"w{i}")
    r1 = await cluster.router()
    r2 = await cluster.router()
    await wait_for(lambda: len(r1.registry.loads) == len(r2.registry.loads) == 3,
                   what="both replicas see 3 workers")
    tokens = prompt(1536, 50)
    first = await generate(r1.port, tokens + prompt(20, 51))
    w = first[0].worker_id
    await wait_for(lambda: r2.mirror.index.count(w) >= 96, what="replica 2 saw the blocks")
    second = await generate(r2.port, tokens + prompt(20, 52))
    assert second[0].worker_id == w and second[0].cached_tokens >= 1536
    await wait_for(lambda: r1.mirror.index.keys_of(w) == r2.mirror.index.keys_of(w),
                   what="identical mirrors")


async def test_a_replica_sees_the_arrivals_another_sent(cluster) -> None:
    """The agent counts every request it receives, and the prompt tokens its engine
    prefilled, and its heartbeat carries both rates, so a router replica that sent a worker
    nothing still sees the traffic the others sent, and how fast that worker's cache turns
    over (the churn term's)."""
    a = await cluster.agent("a")
    r1 = await cluster.router()
    r2 = await cluster.router()
    await wait_for(lambda: "a" in r1.registry.loads and "a" in r2.registry.loads,
                   what="both replicas see a")
    for i in range(3):
        await generate(r1.port, prompt(64, 60 + i))
    # 3 requests within seconds of r1 first seeing a: more than 3 per 30 s window (the count
    # is corrected for having started just now), at most 3 in the shortest window.
    most = 3 / (ARRIVAL_TAU_S * -math.expm1(-ARRIVAL_MIN_WINDOW_S / ARRIVAL_TAU_S))
    assert 3 / ARRIVAL_TAU_S < r1.registry.loads["a"].arrival_rate <= most
    assert a.service is not None and a.service.arrivals.at(time.monotonic()) > 0
    await wait_for(lambda: r2.registry.loads["a"].arrival_rate > 0.09,
                   what="replica 2 saw the agent's arrival rate")
    # The heartbeat also says how the engine admits a long prompt (the sim engine: whole).
    assert r2.registry.loads["a"].prefill_mode is PrefillMode.WHOLE
    scraped = {m: r2.metrics.registry.get_sample_value(
        "kvroute_router_worker_prefill_mode", {"worker": "a", "mode": m})
        for m in ("whole", "chunked", "unknown")}
    assert scraped == {"whole": 1, "chunked": 0, "unknown": 0}
    # 3 prompts of 64 new tokens each (one token is always computed, so at least 63 each)
    await wait_for(lambda: r2.registry.loads["a"].prefill_rate > 3 * 63 / ARRIVAL_TAU_S,
                   what="replica 2 saw the agent's prefill rate")
    assert r2.registry.loads["a"].prefill_rate <= 64 * most
    assert r1.registry.loads["a"].prefill_rate > 3 * 63 / ARRIVAL_TAU_S  # its own count


async def test_policy_parameters_set_on_the_command_line_take_effect(cluster) -> None:
    await cluster.agent("a")
    await cluster.agent("b")
    default = await cluster.router()
    tuned = await cluster.router(policy="kvroute:attn=0")
    for r in (default, tuned):
        await wait_for(lambda r=r: len(r.registry.loads) == 2, what="2 workers registered")
    tokens = prompt(300, 77)
    plain, linear = await route(default.port, tokens), await route(tuned.port, tokens)
    assert (plain.policy, linear.policy) == ("kvroute", "kvroute:attn=0")
    # Idle workers, nothing sent yet, a cold prompt: every cost is the prompt's own prefill,
    # 300 tokens plus, by default, their attention to each other.
    costs = {c.worker_id: c.cost for c in plain.candidates}
    assert {c.worker_id for c in linear.candidates} == set(costs) == {"a", "b"}
    for c in linear.candidates:
        assert c.cost == 300
        assert costs[c.worker_id] == pytest.approx(300 * (1 + Kvroute().attn * 300 / 2))


async def test_route_candidates_caps_the_list_best_first(cluster) -> None:
    for w in ("a", "b", "c"):
        await cluster.agent(w)
    every = await cluster.router()
    capped = await cluster.router(route_candidates=2)
    for r in (every, capped):
        await wait_for(lambda r=r: len(r.registry.loads) == 3, what="3 workers registered")
    tokens = prompt(300, 78)
    full, short = await route(every.port, tokens), await route(capped.port, tokens)
    assert len(full.candidates) == 3
    assert [c.worker_id for c in short.candidates] == [c.worker_id for c in full.candidates[:2]]
    assert short.worker_id == full.worker_id == short.candidates[0].worker_id
    assert short.address == short.candidates[0].address


async def test_the_router_says_which_c_builds_run(cluster, caplog, monkeypatch) -> None:
    import logging

    from kvroute.core import holders

    caplog.set_level(logging.INFO, "kvroute.router")
    await cluster.router()
    serving = [r for r in caplog.records if r.getMessage() == "router serving"]
    assert serving[-1].kv["native"] == {"chainhash": True, "holders": True, "wire": True,
                                        "costs": True}
    assert not [r for r in caplog.records if "C builds missing" in r.getMessage()]
    monkeypatch.setattr(holders, "NATIVE_AVAILABLE", False)  # as a build without a compiler
    await cluster.router()
    warned = [r for r in caplog.records if "C builds missing" in r.getMessage()]
    assert warned and warned[-1].kv["missing"] == ["holders"]


async def test_the_agent_reads_every_encoding_and_refuses_garbage(cluster) -> None:
    from kvroute.v1 import common_pb2, worker_agent_pb2, worker_agent_pb2_grpc

    a = await cluster.agent("a")
    tokens = prompt(300, 79)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
        raw = raw_rpc(ch, "WorkerAgent/Generate", common_pb2.GenerateResponse, stream=True)
        for how in ("packed", "unpacked", "split"):
            out = [x async for x in raw(request_wire(tokens, how))]
            assert out[-1].usage.prompt_tokens == 300, how
            assert sum(len(x.token_ids) for x in out) == 2, how
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(b"\x0a\x05\x01").read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed GenerateRequest" in err.value.details()
        load = await worker_agent_pb2_grpc.WorkerAgentStub(ch).GetLoad(
            worker_agent_pb2.GetLoadRequest())
        assert load.worker_id == "a"
        # The sim engine admits whole prompts; the proto's enum numbers are PrefillMode.code.
        assert load.prefill_mode == common_pb2.PREFILL_MODE_WHOLE == PrefillMode.WHOLE.code
    assert a.metrics.registry.get_sample_value(
        "kvroute_agent_requests_total", {"outcome": "invalid"}) == 1


async def test_generate_relays_the_request_as_it_came_in(cluster) -> None:
    # A plain request goes on to the agent as the bytes the router received, with the
    # router's request id appended when it had none (kvroute.core.wire.with_string_field).
    from kvroute.v1 import common_pb2, worker_agent_pb2_grpc

    a = await cluster.agent("a")
    router = await cluster.router()
    await wait_for(lambda: len(router.registry.loads) == 1, what="worker registered")
    tokens = prompt(500, 80)
    out = await generate(router.port, tokens, max_tokens=4)
    rid = out[0].request_id
    assert len(rid) == 32 and all(r.request_id == rid for r in out)
    named = await generate(router.port, tokens, max_tokens=4, request_id="mine-1")
    assert {r.request_id for r in named} == {"mine-1"}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
        direct = [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(
            common_pb2.GenerateRequest(token_ids=tokens,
                                       sampling=common_pb2.SamplingParams(max_tokens=4)))]
    # The sim engine's tokens are a function of the prompt: the agent got the same one.
    def ids(rs: list[Any]) -> list[int]:
        return [t for r in rs for t in r.token_ids]

    assert ids(out) == ids(named) == ids(direct) and len(ids(out)) == 4
    assert out[-1].usage.prompt_tokens == 500
