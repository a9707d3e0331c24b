"""Faults a worker did not cause must not be blamed on it, and faults it did must not be left
to a heartbeat's expiry: request-caused errors pass through without marking a worker down; a
hung (SIGSTOPped) agent is left for the next-best worker before the client's deadline; a
stream that fails after its first token says how much output was already sent. Real agent
subprocesses, redis-server and router on loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvroute.router.app import RouterApp
from kvroute.router.refusal import OUTPUT_SENT
from kvroute.v1 import common_pb2, router_pb2_grpc
from tests.support import AgentProc, LoadLoop, generate, wait_for


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


@contextlib.contextmanager
def agents(url: str, *ids: str, extra: list[str] | None = None) -> Iterator[list[AgentProc]]:
    procs = [AgentProc(url, w, extra=list(extra or [])) for w in ids]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)  # a stopped one cannot act on SIGTERM
            p.stop()


async def call(port: int, req: common_pb2.GenerateRequest,
               timeout: float) -> list[common_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return [r async for r in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=timeout)]


def plain(tokens: list[int], max_tokens: int = 4) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        token_ids=tokens, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def test_a_prompt_larger_than_the_kv_cache_marks_no_worker_down(cluster) -> None:
    """The engine refuses it for its size: RESOURCE_EXHAUSTED, passed back as is, no retry on
    the next worker, both workers still routable (before: UNAVAILABLE, both marked down)."""
    await cluster.agent("a", capacity_blocks=4)
    await cluster.agent("b", capacity_blocks=4)
    router = await cluster.router()
    await wait_for(lambda: {"a", "b"} <= set(router.registry.loads), what="both registered")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(router.port, prompt(200, 1))  # 13 blocks of 16 > 4
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "KV cache" in err.value.details()
    assert {"a", "b"} <= set(router.registry.loads)
    assert router.metrics.registry.get_sample_value("kvroute_router_retries_total") == 0
    assert (await generate(router.port, prompt(20, 2)))[-1].finish_reason


async def test_a_hung_worker_is_left_for_the_next_best_before_the_deadline(cluster) -> None:
    """Heartbeats live 30 s here: only the router's probe can notice the SIGSTOPped agent.
    Every request sent while it is stopped still completes within its 8 s deadline, on the
    other worker; the stopped one is marked down as not answering."""
    url = cluster.redis.url
    with agents(url, "hung", "well", extra=["--heartbeat-s", "1", "--heartbeat-ttl-s",
                                            "30"]) as (hung, _well):
        router = await cluster.router(policy="round_robin", predict_ttl_s=0)
        await wait_for(lambda: {"hung", "well"} <= set(router.registry.loads), 20,
                       "both agents registered")
        for i in range(4):  # channels to both are open: the hang is not at connect
            await call(router.port, plain(prompt(40, i)), timeout=10)
        hung.proc.send_signal(signal.SIGSTOP)
        outs = await asyncio.gather(*(call(router.port, plain(prompt(40, 10 + i)), timeout=8)
                                      for i in range(6)))
        assert all(o[-1].worker_id == "well" for o in outs)
        info = router.registry.get("hung")
        assert "hung" not in router.registry.loads
        assert "no answer" in info.down_error, info.down_error
        hung.proc.send_signal(signal.SIGCONT)


async def served_over_ranking(cluster, order: list[str], workers: list[str],
                              after_decision: Callable[[RouterApp], None] | None = None) -> str:
    """The worker that serves a request the router ranks as ``order`` (names given by hand:
    ``workers`` run, "hung" among them SIGSTOPped after warming up), ``after_decision``
    called with the router as each decision is made."""
    import dataclasses

    from kvroute.core.policies.base import Scored

    with agents(cluster.redis.url, *workers,
                extra=["--heartbeat-s", "1", "--heartbeat-ttl-s", "30"]) as procs:
        router = await cluster.router(policy="round_robin", predict_ttl_s=0)
        await wait_for(lambda: set(workers) <= set(router.registry.loads), 20,
                       "the agents registered")
        for i in range(len(workers)):  # channels to all are open: the hang is not at connect
            await call(router.port, plain(prompt(40, i)), timeout=10)
        service = router.service
        decide = service.decide_request

        def ranked_by_hand(*args, **kw):
            tokens, d = decide(*args, **kw)
            if after_decision is not None:
                after_decision(router)
            ranked = [Scored(w, float(i)) for i, w in enumerate(order)]
            return tokens, dataclasses.replace(d, ranked=ranked)

        service.decide_request = ranked_by_hand
        hung = procs[workers.index("hung")]
        hung.proc.send_signal(signal.SIGSTOP)
        try:
            out = await call(router.port, plain(prompt(40, 5)), timeout=8)
        finally:
            hung.proc.send_signal(signal.SIGCONT)
        return out[-1].worker_id


async def test_a_candidate_gone_since_the_decision_does_not_use_up_the_retry(cluster) -> None:
    """The ranking names a worker that has left the registry (it happens when one leaves
    between decision and send), then a hung one, then a well one. The gone one is skipped
    without counting as an attempt, so the hung one's failure still leaves the retry for the
    well one (before: the retry was spent, UNAVAILABLE)."""
    assert await served_over_ranking(cluster, ["gone", "hung", "well"],
                                     ["hung", "well"]) == "well"


async def test_a_next_best_marked_down_meanwhile_does_not_use_up_the_retry(cluster) -> None:
    """While the first attempt waits on a hung worker, the next-best is marked down (as
    another request's failure would): the retry skips it for the one after (before: the
    retry went to the worker the router had just marked down)."""
    def mark_down_soon(router: RouterApp) -> None:  # after the decision, before the retry
        asyncio.get_running_loop().call_later(
            0.2, router.registry.mark_down, "downed", 30.0, "another request failed")

    assert await served_over_ranking(cluster, ["hung", "downed", "well"],
                                     ["hung", "downed", "well"], mark_down_soon) == "well"


async def test_with_only_a_hung_worker_the_client_hears_before_its_deadline(cluster) -> None:
    with agents(cluster.redis.url, "only", extra=["--heartbeat-s", "1", "--heartbeat-ttl-s",
                                                  "30"]) as (only,):
        router = await cluster.router()
        await wait_for(lambda: "only" in router.registry.loads, 20, "agent registered")
        await call(router.port, plain(prompt(40, 1)), timeout=10)
        only.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(router.port, plain(prompt(40, 2)), timeout=8)
        # Retryable, and said: not the client's own deadline running out.
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "no answer" in err.value.details()
        only.proc.send_signal(signal.SIGCONT)


async def test_a_stream_failing_after_its_first_token_says_output_was_sent(cluster) -> None:
    """UNAVAILABLE stays (the worker failed), but the message and the kvroute-output-sent
    trailer tell the client a blind retry would repeat tokens."""
    with agents(cluster.redis.url, "doomed", extra=["--time-scale", "1"]) as (doomed,):
        router = await cluster.router()
        await wait_for(lambda: "doomed" in router.registry.loads, 20, "agent registered")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            stream = router_pb2_grpc.RouterStub(ch).Generate(
                plain(prompt(40, 3), max_tokens=20000), timeout=60)
            got = 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for r in stream:
                    got += len(r.token_ids)
                    if got >= 3 and doomed.proc.poll() is None:
                        doomed.kill(signal.SIGKILL)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "mid-stream" in err.value.details() and "were sent" in err.value.details()
            trailer = dict(await stream.trailing_metadata())
            assert int(trailer[OUTPUT_SENT]) == got


async def test_a_dead_agents_state_expires_and_the_router_forgets_it(redis_server) -> None:
    """Agents that die (no clean stop) leave their heartbeat, snapshot and meta to expire
    on their own, a TTL after their last write: nobody prunes anything. The router, which
    writes nothing, forgets their blocks: one that beat when its heartbeat expires, one that
    never beat (its engine never could serve) once the registry's scan never finds it. The
    live worker keeps its keys, and its TTL moves on."""
    from kvroute.core.redis_conn import connect
    from kvroute.core.redis_schema import Heartbeat, RedisKeys
    from kvroute.router.mirror import IndexMirror
    from kvroute.router.registry import WorkerRegistry
    from kvroute.worker_agent.engines.base import EngineRequest
    from kvroute.worker_agent.engines.sim import SimConfig, SimEngine
    from kvroute.worker_agent.publisher import CachePublisher

    keys = RedisKeys("default")
    r = redis_server.client()
    pubs: dict[str, CachePublisher] = {}
    for i, w in enumerate(("live", "dead", "mute")):
        engine = SimEngine(SimConfig(capacity_blocks=64, model="default", time_scale=0.0))
        await engine.start()
        [c async for c in engine.generate(EngineRequest(w, [i] * 64, 1))]
        beat = ((lambda w=w: None) if w == "mute" else
                (lambda w=w: Heartbeat(w, "127.0.0.1:1", pubs[w].epoch, ttl_s=0.5)))
        pubs[w] = CachePublisher(connect(redis_server.url), keys, w, engine.cached_keys, beat,
                                 heartbeat_s=0.1, heartbeat_ttl_s=0.5, state_ttl_s=1.5)
    m = IndexMirror(connect(redis_server.url, block_timeout_s=0.05), keys,
                    WorkerRegistry({}, 16), poll_interval_s=0.05, retry_s=0.1)
    task = asyncio.create_task(m.run())
    try:
        for p in pubs.values():
            await p.start()
        await wait_for(lambda: all(m.index.count(w) == 4 for w in pubs), what="all indexed")
        assert "mute" not in m.registry.loads and 0 < r.pttl(keys.meta("dead")) <= 1500
        for w in ("dead", "mute"):
            await pubs[w].stop(deregister=False)  # as a crash: its keys stay, to expire
        await wait_for(lambda: set(m.index.workers()) == {"live"}, what="router forgot them")
        await wait_for(lambda: not r.exists(keys.snapshot("dead"), keys.meta("dead"),
                                            keys.heartbeat("dead"), keys.snapshot("mute"),
                                            keys.meta("mute")), 10, "their state expired")
        assert r.exists(keys.snapshot("live"), keys.meta("live")) == 2
        assert r.pttl(keys.snapshot("live")) > 0  # refreshed by every beat
    finally:
        for p in pubs.values():
            await p.stop()
        await m.stop(task)
        r.close()


async def test_feed_entries_forged_in_a_workers_name_are_undone(redis_server) -> None:
    """Another agent appends entries in w's name at w's next seq, claiming blocks w never
    held (any agent may append to the feed). While w is idle, the mirror holds entries past
    the seq of w's heartbeat, which only w writes: at the second scan it reads w's snapshot
    again. When w writes that seq itself, the router skips w's entry as a duplicate, and
    the chain in w's heartbeat differs from the mirror's: at once, the same. Either way the
    mirror is back to w's own blocks."""
    from kvroute.core.cache_events import CacheEvent
    from kvroute.core.redis_conn import connect
    from kvroute.core.redis_schema import FeedEvent, Heartbeat, Op, RedisKeys
    from kvroute.router.mirror import IndexMirror
    from kvroute.router.registry import WorkerRegistry
    from kvroute.worker_agent.publisher import CachePublisher

    keys = RedisKeys("default")
    r = redis_server.client()
    box: list[CachePublisher] = []
    pub = CachePublisher(connect(redis_server.url), keys, "w", lambda: [1, 2, 3],
                         lambda: Heartbeat("w", "127.0.0.1:1", box[0].epoch, ttl_s=5.0),
                         heartbeat_s=0.1, heartbeat_ttl_s=5.0)
    box.append(pub)
    m = IndexMirror(connect(redis_server.url, block_timeout_s=0.05), keys,
                    WorkerRegistry({}, 16), poll_interval_s=0.3, retry_s=0.1)
    task = asyncio.create_task(m.run())
    apart = m.stats.heartbeat_mismatches
    try:
        await pub.start()
        await wait_for(lambda: m.index.keys_of("w") == {1, 2, 3}, what="w indexed")

        def forge(key: int) -> None:
            ev = FeedEvent("w", pub.epoch, pub.seq + 1, Op.STORE, (key,))
            r.xadd(keys.feed, ev.to_fields())

        forge(111)  # w idle: entries past its heartbeat's seq
        await wait_for(lambda: apart["seq"] == 1 and m.index.keys_of("w") == {1, 2, 3}, 5,
                       "the forged entry undone while w is idle")
        forge(222)
        await wait_for(lambda: 222 in m.index.keys_of("w"), 5, "the second forgery applied")
        pub.on_event(CacheEvent(Op.STORE, (333,)))  # w's own entry of that seq
        await wait_for(lambda: apart["chain"] == 1 and m.index.keys_of("w") == {1, 2, 3, 333},
                       5, "the forged entry undone by w's chain")
        assert apart["seq"] == 1 and apart["epoch"] == 0
    finally:
        await pub.stop()
        await m.stop(task)
        r.close()


async def test_a_worker_publishing_blocks_it_does_not_hold_is_demoted(cluster) -> None:
    """The liar's agent publishes store events for prefixes its engine never computed (what
    a buggy adapter or a forged feed entry does): the router sends those prompts there,
    its engine reports them uncached, and after a few such requests the router stops
    believing its blocks (routed as a worker with no cache), logs it and counts it."""
    from kvroute.core.blocks import BlockHasher
    from kvroute.core.cache_events import CacheEvent
    from kvroute.core.redis_schema import Op
    from tests.support import route

    liar = await cluster.agent("liar")
    await cluster.agent("honest")
    router = await cluster.router(predict_ttl_s=0)
    await wait_for(lambda: {"liar", "honest"} <= set(router.registry.loads), what="both up")
    hasher = BlockHasher(16, "default", "")
    prompts = [prompt(513, 1000 + i) for i in range(16)]
    for p in prompts:  # 32 blocks each, claimed by the liar and never stored by its engine
        liar.publisher.on_event(CacheEvent(Op.STORE, tuple(hasher.keys(p[:512]))))
    await wait_for(lambda: router.mirror.index.count("liar") == 16 * 32, what="claims indexed")

    def demotions() -> float:
        return router.metrics.registry.get_sample_value(
            "kvroute_router_worker_demotions_total", {"worker": "liar"}) or 0.0

    served = []
    for p in prompts[:12]:
        if demotions():
            break
        out = await generate(router.port, p, max_tokens=1)
        served.append(out[-1].worker_id)
        assert out[-1].usage.cached_tokens == 0  # the claim was false
    assert served and set(served) == {"liar"}  # the claims drew the traffic
    assert demotions() == 1
    assert "liar" in router.registry.demoted()
    # Its remaining claims no longer count: a claimed prompt is decided as if cold.
    resp = await route(router.port, prompts[15])
    assert all(not c.cached_tokens for c in resp.candidates), resp
    assert "liar" in router.registry.loads  # still routable, by load
    assert router.metrics.registry.get_sample_value(
        "kvroute_router_worker_demotions_total", {"worker": "honest"}) is None
    # A worker whose claims hold is never demoted: prompts sent twice hit where they went.
    for i in range(10):
        p = prompt(300, 5000 + i)
        first = await generate(router.port, p, max_tokens=1)
        await wait_for(lambda w=first[-1].worker_id: router.mirror.index.count(w) > 0,
                       what="the prefix indexed")
        await asyncio.sleep(0.15)  # its store events reach the mirror
        again = await generate(router.port, p, max_tokens=1)
        assert again[-1].usage.cached_tokens > 0
    assert router.metrics.registry.get_sample_value(
        "kvroute_router_worker_demotions_total", {"worker": "honest"}) is None
    assert demotions() == 1


async def test_a_hung_overflow_worker_costs_its_fork_children_nothing(cluster) -> None:
    """An agent sending a program's fork children to another agent that hangs (SIGSTOPped,
    its heartbeat still live) notices within about 2 s and runs them itself."""
    from kvroute.v1 import program_pb2 as P  # noqa: N812
    from kvroute.v1 import worker_agent_pb2_grpc

    tiny = ["--engine", "tiny", "--tokenizer", "byte", "--vocab-size", "258",
            "--capacity-blocks", "64", "--heartbeat-s", "1", "--heartbeat-ttl-s", "30"]
    a = await cluster.agent("a", engine="tiny", tokenizer="byte", vocab_size=258,
                            capacity_blocks=64)
    with agents(cluster.redis.url, "b", extra=tiny) as (b,):
        await wait_for(lambda: cluster.redis.client().exists("kvr:{default}:hb:b"), 20,
                       "b's heartbeat")
        b.proc.send_signal(signal.SIGSTOP)
        gen = P.Step(gen=P.Gen(max_tokens=3))
        req = common_pb2.GenerateRequest(
            token_ids=list(b"fork across agents: "),
            program=P.ControllerProgram(steps=[P.Step(fork=P.Fork(
                branches=[P.ControllerProgram(steps=[gen])] * 4))]))
        req.placement.fork_step = 0
        req.placement.overflow.add(worker_id="b", address=f"127.0.0.1:{b.port}",
                                   children=[2, 3])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
            out = [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(
                req, timeout=20)]
        assert len(out[-1].results) == 4
        assert {r.worker_id for r in out if r.token_ids} == {"a"}
        assert a.programs.stats.overflow_fallback == 2
        b.proc.send_signal(signal.SIGCONT)


async def test_after_a_flushall_every_mirror_equals_its_engine_within_5_s(cluster) -> None:
    workers = {w: await cluster.agent(w, engine="sim", capacity_blocks=512, time_scale=0.0,
                                      heartbeat_s=0.5) for w in ("a", "b")}
    router = await cluster.router()
    await wait_for(lambda: set(router.registry.loads) == set(workers), what="registered")

    def truthful() -> bool:
        return all(router.mirror.index.keys_of(w) == set(app.engine.cached_keys())
                   for w, app in workers.items())

    for i in range(8):
        await generate(router.port, prompt(160, i), max_tokens=2)
    await wait_for(truthful, what="mirror equals the engines")
    cluster.redis.client().flushall()
    t0 = asyncio.get_running_loop().time()
    # Traffic goes on: its writes land in the emptied Redis first.
    for i in range(8, 12):
        with contextlib.suppress(grpc.aio.AioRpcError):  # a worker forgotten meanwhile
            await generate(router.port, prompt(160, i), max_tokens=2)
    # Each agent finds its state gone (at its next heartbeat at the latest) and writes it
    # again; until then a mirror may still equal its engine from before the flush.
    await wait_for(lambda: truthful() and all(app.publisher.stats.state_losses >= 1
                                              for app in workers.values()),
                   timeout=5 - (asyncio.get_running_loop().time() - t0),
                   what="every agent's state rewritten, every mirror equal to its engine")
    assert all((app.metrics.registry.get_sample_value("kvroute_agent_redis_state_losses")
                or 0) >= 1 for app in workers.values())


async def test_a_flushall_under_load_forgets_no_live_worker_and_fails_no_request(
        cluster) -> None:
    workers = {w: await cluster.agent(w, engine="sim", capacity_blocks=512, time_scale=0.0,
                                      heartbeat_s=1.0, heartbeat_ttl_s=2.5)
               for w in ("a", "b", "c")}
    router = await cluster.router()
    await wait_for(lambda: set(router.registry.loads) == set(workers), what="registered")
    await asyncio.sleep(2.6)  # past the router's start-up reprieve (one heartbeat TTL)
    load = LoadLoop(router.port, router).start()
    await asyncio.sleep(0.3)
    redis = cluster.redis.client()
    # Empty, then hold the agents' writes for 1.5 s while the router reads on, as a failover
    # to a replica that lost the last writes does until the agents write again.
    redis.flushall()
    redis.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
    await asyncio.sleep(3.0)
    await load.stop()
    assert not load.failed, load.failed[:3]
    assert all(s == set(workers) for s in load.seen), "a live worker was forgotten"
    assert router.mirror.lost is not None and router.mirror.lost.kept_total == 3
    assert not router.mirror.lost.kept  # all three beat again


async def test_a_worker_redis_lost_whose_agent_is_gone_is_forgotten(cluster) -> None:
    await cluster.agent("a", engine="sim", time_scale=0.0, heartbeat_s=1.0,
                        heartbeat_ttl_s=2.5)
    b = await cluster.agent("b", engine="sim", time_scale=0.0, heartbeat_s=1.0,
                            heartbeat_ttl_s=2.5)
    router = await cluster.router()
    await wait_for(lambda: set(router.registry.loads) == {"a", "b"}, what="registered")
    await asyncio.sleep(2.6)  # past the router's start-up reprieve
    b_address = router.registry.get("b").address
    await cluster.stop(b)
    # Its heartbeat went with it; a flush then takes its record too, before any scan.
    cluster.redis.client().flushall()
    await wait_for(lambda: set(router.registry.loads) == {"a"}, timeout=2,
                   what="the gone worker forgotten")
    assert router.mirror.lost is not None and router.mirror.lost.dropped_total >= 1
    assert not await router.channels.serving(b_address)


async def test_a_second_agent_under_a_live_worker_id_refuses_to_start(cluster) -> None:
    first = await cluster.agent("w", engine="sim", time_scale=0.0)
    with pytest.raises(SystemExit, match=r"worker id 'w' belongs to a live agent at "
                                         rf"127\.0\.0\.1:{first.port}"):
        await cluster.agent("w", engine="sim", time_scale=0.0)
    # The first one is untouched: its heartbeat still names it.
    assert await first.publisher.peer_address("w") == f"127.0.0.1:{first.port}"


async def test_an_agent_restarted_elsewhere_waits_out_its_former_runs_heartbeat(
        redis_server) -> None:
    old = AgentProc(redis_server.url, "w", extra=["--engine", "sim"])
    old.start()
    try:
        await wait_for(lambda: redis_server.client().get("kvr:{default}:hb:w") is not None,
                       what="the first run's heartbeat")
        old.kill()  # SIGKILL: its heartbeat lives on for its TTL (1 s)
        new = AgentProc(redis_server.url, "w", extra=["--engine", "sim"])
        new.start()
        try:
            await wait_for(lambda: (raw := redis_server.client().get("kvr:{default}:hb:w"))
                           is not None and f":{new.port}".encode() in raw, timeout=10,
                           what="the new run's heartbeat")
            assert new.proc is not None and new.proc.poll() is None
        finally:
            new.stop()
    finally:
        old.stop()
