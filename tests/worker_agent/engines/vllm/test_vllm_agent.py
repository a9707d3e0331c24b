"""``--engine vllm`` end to end: a fake vLLM speaking vLLM's real wire protocols (vLLM's own
ZmqEventPublisher + ROUTER replay, OpenAI SSE, /metrics) -> a real agent -> a real Redis ->
a real router's mirror. The fake's cache is the oracle: it computes the kvroute keys of what
it holds independently of the agent."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import msgspec
import pytest

from kvroute.core.blocks import BlockHasher
from kvroute.core.load import EngineLoad, PrefillMode
from kvroute.core.redis_schema import FeedEvent, Op, RedisKeys, unpack_keys
from kvroute.worker_agent.engines.base import EngineError, EngineRequest
from kvroute.worker_agent.engines.served.wire import encode_seq
from kvroute.worker_agent.engines.vllm import VllmConfig, VllmEngine
from tests.support import free_port, generate, wait_for

KEYS = RedisKeys("default")
W = "v0"


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


async def start(cluster, fake, **kw):
    agent = await cluster.agent(W, engine="vllm", vllm_url=fake.url, vllm_events=fake.events,
                                vllm_replay=fake.replay, vllm_model="fake-model", **kw)
    await asyncio.wait_for(agent.engine.events.ready.wait(), 5)
    router = await cluster.router()
    await wait_for(lambda: W in router.registry.loads, what="agent registered")
    return agent, router


def snapshot(redis_server) -> set[int]:
    return {unpack_keys(m)[0] for m in redis_server.client().smembers(KEYS.snapshot(W))}


def feed_ops(redis_server) -> list[Op]:
    return [FeedEvent.from_fields(f).op for _, f in redis_server.client().xrange(KEYS.feed)]


async def converged(fake, agent, router, redis_server, what: str = "converged") -> set[int]:
    async def ok() -> bool:
        truth = await asyncio.to_thread(fake.truth)
        return (truth == set(agent.engine.cached_keys()) == router.mirror.index.keys_of(W)
                and agent.publisher.stats.pending == 0 and snapshot(redis_server) == truth)
    try:
        await wait_for(ok, 10, what)
    except AssertionError:
        truth = fake.truth()
        raise AssertionError(
            f"{what}: truth {len(truth)} agent {len(set(agent.engine.cached_keys()))} "
            f"(missing {len(truth - set(agent.engine.cached_keys()))}, extra "
            f"{len(set(agent.engine.cached_keys()) - truth)}) mirror "
            f"{len(router.mirror.index.keys_of(W))} available {router.mirror.available} "
            f"snapshot {len(snapshot(redis_server))} pending {agent.publisher.stats.pending} "
            f"events {agent.engine.events.stats} blocks {agent.engine.blocks.stats}") from None
    return router.mirror.index.keys_of(W)


async def converged_quiet(fake, agent) -> None:
    """Every batch the fake published has been applied by the agent."""
    await wait_for(lambda: agent.engine.events.stats.last_seq == fake.state()["published"] - 1,
                   what="all batches applied")


async def test_generate_stored_removed_cleared_end_to_end(cluster, fake_vllm) -> None:
    fake = fake_vllm("--capacity", "40")
    agent, router = await start(cluster, fake, vllm_long_prefill_threshold=1024)
    # vLLM's cap on a prefill's chunk reaches the router through the heartbeat.
    assert router.registry.loads[W].max_prefill_chunk == 1024
    assert router.metrics.registry.get_sample_value(
        "kvroute_router_worker_max_prefill_chunk", {"worker": W}) == 1024
    system = prompt(160, 1)  # 10 blocks
    first = await generate(router.port, system + prompt(40, 2), max_tokens=4)
    assert [r.worker_id for r in first] == [W] * 4
    assert all(len(r.token_ids) == 1 for r in first) and first[0].cached_tokens == 0
    keys = await converged(fake, agent, router, cluster.redis, "first request's blocks")
    assert set(BlockHasher(16, "default").keys(system)) <= keys
    # A follow-up sharing the prefix hits vLLM's cache; cached_tokens is vLLM's own figure.
    second = await generate(router.port, system + prompt(40, 3), max_tokens=4)
    assert second[0].cached_tokens == 160 and second[-1].usage.cached_tokens == 160
    assert second[-1].cached_tokens == 160  # the exact value from usage.prompt_tokens_details
    # Pressure on a 40-block cache: vLLM evicts, the router's mirror follows.
    for i in range(4):
        await generate(router.port, prompt(200, 10 + i), max_tokens=2)
    await converged(fake, agent, router, cluster.redis, "after evictions")
    assert agent.engine.blocks.stats.removed_blocks > 0
    # vLLM's reset_prefix_cache -> AllBlocksCleared -> Op.CLEAR -> nothing left anywhere.
    assert fake.reset_prefix_cache() == 200
    await wait_for(lambda: not router.mirror.index.keys_of(W), what="mirror cleared")
    assert not snapshot(cluster.redis) and Op.CLEAR in feed_ops(cluster.redis)[1:]
    ev = agent.engine.events.stats
    assert ev.complete and ev.resets == 0 and not ev.rejected and ev.gaps_healed == 0


async def test_dropped_batch_is_healed_from_the_replay_socket(cluster, fake_vllm) -> None:
    fake = fake_vllm("--int-hashes")  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
    agent, router = await start(cluster, fake)
    await generate(router.port, prompt(100, 1), max_tokens=2)
    fake.drop(next_n=1)  # the next request's prompt blocks never reach the agent live
    await generate(router.port, prompt(100, 2), max_tokens=20)  # later batches reveal the gap
    await converged(fake, agent, router, cluster.redis)
    assert fake.state()["dropped"]
    ev = agent.engine.events.stats
    assert ev.gaps_healed == 1 and ev.replayed_batches >= 1 and ev.resets == 0 and ev.complete
    # A lost *last* batch has no later frame to reveal it: the idle probe finds it.
    fake.drop(next_n=1)
    await generate(router.port, prompt(40, 3), max_tokens=1)  # one batch only
    await converged(fake, agent, router, cluster.redis, "tail recovered")
    assert agent.engine.events.stats.gaps_healed == 2


async def test_gap_past_the_replay_buffer_resets_and_never_over_reports(cluster, fake_vllm
                                                                      ) -> None:
    fake = fake_vllm("--buffer-steps", "2", "--capacity", "400", "--topic", "kv")
    agent, router = await start(cluster, fake, vllm_topic="kv")
    prompts = [prompt(64 + 16 * i, 100 + i) for i in range(6)]
    await generate(router.port, prompts[0], max_tokens=1)
    await converged(fake, agent, router, cluster.redis)
    fake.drop(next_n=3)  # three batches lost; vLLM keeps only the last two
    for p in prompts[1:4]:
        await generate(router.port, p, max_tokens=1)
    await generate(router.port, prompts[4], max_tokens=1)  # reveals the gap
    hasher = BlockHasher(16, "default")
    await wait_for(lambda: agent.engine.events.stats.resets == 1, what="view reset")
    await asyncio.sleep(0.3)
    truth = fake.truth()
    mirror = router.mirror.index.keys_of(W)
    assert mirror <= truth  # under-reports, never over-reports
    assert set(hasher.keys(prompts[1])) & mirror == set()  # lost with the dropped batches
    assert set(hasher.keys(prompts[4])) <= mirror  # learned after the reset
    ops = feed_ops(cluster.redis)
    assert ops.count(Op.CLEAR) == 2  # the epoch declaration and the reset
    # While the view is incomplete the agent asks vLLM to re-report reused blocks: touching
    # the lost prefixes again re-learns them, from releases that honour it. 0.10.2 ignores
    # the request: the lost prefixes stay under-reported until stored again.
    assert not agent.engine.events.stats.complete
    for p in prompts[1:4]:
        await generate(router.port, [*p, 1], max_tokens=1)
    if fake.release.reports_reused:
        await wait_for(lambda: all(set(hasher.keys(p)) <= router.mirror.index.keys_of(W)
                                   for p in prompts[1:4]), what="lost prefixes re-learned")
    else:
        await converged_quiet(fake, agent)
        assert set(hasher.keys(prompts[1])) & router.mirror.index.keys_of(W) == set()
    assert router.mirror.index.keys_of(W) <= fake.truth()


async def test_malformed_and_out_of_order_frames_are_counted_not_fatal(cluster, fake_vllm
                                                                    ) -> None:
    fake = fake_vllm()
    port = free_port()
    agent, router = await start(cluster, fake, metrics_port=port)
    for i in range(3):
        await generate(router.port, prompt(40, i), max_tokens=1)
    await converged(fake, agent, router, cluster.redis)
    ok = msgspec.msgpack.encode([time.time(), [], 0])
    fake.inject([b"only-one-frame"])
    fake.inject([b"", b"\x00\x01", ok])  # 2-byte seq
    fake.inject([b"", encode_seq(900), b"\xc1"])  # not msgpack
    fake.inject([b"", encode_seq(901), msgspec.msgpack.encode({"nothing": 1})])
    fake.inject([b"", encode_seq(902), msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1], None, [1, 2, 3], 16]]])])  # 3 tokens for one block of 16
    fake.inject([b"", encode_seq(1), ok])  # stale: seq 1 long after seq 2
    want = {"frame_count": 1, "seq": 1, "msgpack": 1, "batch": 1, "event": 1, "out_of_order": 1}
    await wait_for(lambda: dict(agent.engine.events.stats.rejected) == want, what="rejections")
    # The stream is intact: nothing reset, and new events still flow.
    await generate(router.port, prompt(40, 9), max_tokens=1)
    await converged(fake, agent, router, cluster.redis)
    ev = agent.engine.events.stats
    assert ev.resets == 0 and ev.gaps_healed == 0 and ev.complete
    text = (await httpx.AsyncClient().get(f"http://127.0.0.1:{port}/metrics")).text
    assert 'kvroute_agent_vllm_frames_rejected_total{reason="out_of_order"} 1.0' in text
    assert 'kvroute_agent_vllm_frames_rejected_total{reason="msgpack"} 1.0' in text
    assert "kvroute_agent_vllm_view_resets_total 0.0" in text


async def test_redis_restart_leaves_no_lasting_divergence(cluster, fake_vllm) -> None:
    """Measures how long the router's mirror holds a block the engine does not (sampled
    every 20 ms while the mirror is in use) and how long after Redis returns the mirror
    equals the engine again."""
    fake = fake_vllm("--capacity", "48")
    agent, router = await start(cluster, fake)
    pool = [prompt(96, 500 + i) for i in range(12)]  # 6 blocks each: evictions throughout
    stale_since: dict[int, float] = {}
    worst = 0.0
    stop_load = asyncio.Event()
    sampling = True

    async def load() -> None:
        rng = random.Random(1)
        while not stop_load.is_set():
            try:
                await generate(router.port, rng.choice(pool) + prompt(8, rng.randrange(99)),
                               max_tokens=2)
            except Exception:  # routing may fail while Redis is down
                await asyncio.sleep(0.05)

    async def sample() -> None:
        nonlocal worst
        async with httpx.AsyncClient() as http:
            while sampling:
                truth = set((await http.get(fake.url + "/control/state")).json()["keys"])
                now = time.monotonic()
                stale = router.mirror.index.keys_of(W) - truth if router.mirror.available \
                    else set()
                for k in list(stale_since):
                    if k not in stale:
                        worst = max(worst, now - stale_since.pop(k))
                for k in stale:
                    stale_since.setdefault(k, now)
                await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    loader = asyncio.create_task(load())
    try:
        await asyncio.sleep(1.0)
        cluster.redis.stop()
        await asyncio.sleep(1.0)  # vLLM keeps storing and evicting meanwhile
        cluster.redis.start()
        t_up = time.monotonic()
        stop_load.set()
        await loader
        await converged(fake, agent, router, cluster.redis, "converged after the restart")
        recovered_s = time.monotonic() - t_up
        stop_load.clear()
        loader = asyncio.create_task(load())
        await asyncio.sleep(1.0)
        stop_load.set()
        await loader
        await converged(fake, agent, router, cluster.redis, "converged at the end")
    finally:
        stop_load.set()
        sampling = False
        await asyncio.gather(loader, sampler, return_exceptions=True)
    now = time.monotonic()
    worst = max([worst, *(now - t for t in stale_since.values())])
    print(f"\nredis restart: mirror == engine {recovered_s:.2f}s after redis came back; "
          f"longest over-report while routing by cache: {worst * 1000:.0f} ms; "
          f"resyncs {agent.publisher.stats.resyncs}; vLLM view resets "
          f"{agent.engine.events.stats.resets}")
    assert agent.publisher.stats.resyncs >= 2  # the start, and the rewrite after the restart
    assert agent.engine.events.stats.resets == 0
    assert recovered_s < 8.0
    assert worst < 1.0


async def test_older_servers_token_ids_via_logprobs_and_old_metric_names(fake_vllm) -> None:
    fake = fake_vllm("--no-return-token-ids", "--old-metrics", "--no-prompt-tokens-details")
    eng = VllmEngine(VllmConfig(url=fake.url, events=fake.events, served_model="fake-model",
                                metrics_interval_s=0.05, max_num_seqs=32,
                                max_num_batched_tokens=4096, chunked_prefill=False,
                                long_prefill_token_threshold=1024))
    await eng.start()
    try:
        p = prompt(50, 1)
        chunks = [c async for c in eng.generate(EngineRequest("a", p, 3))]
        base = (sum(p) * 31) % 50257
        assert [c.token_ids[0] for c in chunks] == [(base + 7919 * t) % 50257 for t in range(3)]
        assert chunks[-1].finish_reason == "length" and eng.client.token_mode == "logprobs"
        # The request finished: nothing running, its blocks cached but free (as vLLM counts).
        # The engine's limits are reported as given (vLLM's --max-num-seqs,
        # --max-num-batched-tokens and --no-enable-chunked-prefill): routers use them. A
        # long-prefill threshold caps chunks, so without chunking none is reported.
        await wait_for(lambda: eng.load() == EngineLoad(0, 0, 256, 256, 0, 32, 4096,
                                                        PrefillMode.WHOLE, 0),
                       what="metrics read")
    finally:
        await eng.stop()


async def test_vllm_unreachable_is_an_engine_error() -> None:
    eng = VllmEngine(VllmConfig(url=f"http://127.0.0.1:{free_port()}",
                                events=f"tcp://127.0.0.1:{free_port()}",
                                long_prefill_token_threshold=2048))
    await eng.start()
    try:
        with pytest.raises(EngineError, match="vllm request failed"):
            async for _ in eng.generate(EngineRequest("a", [1, 2, 3], 2)):
                pass
        assert eng.load().running == 0
        assert eng.load().prefill_mode is PrefillMode.CHUNKED  # vLLM V1's default
        assert eng.load().max_prefill_chunk == 2048  # its --long-prefill-token-threshold
    finally:
        await eng.stop()
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        VllmConfig(long_prefill_token_threshold=-1)


async def test_a_dead_vllm_leaves_the_router_at_once_and_rejoins_when_back(
        cluster, fake_vllm) -> None:
    fake = fake_vllm("--capacity", "40")
    agent, router = await start(cluster, fake, heartbeat_s=0.5)
    system = prompt(160, 1)
    await generate(router.port, system + prompt(40, 2), max_tokens=2)
    assert await converged(fake, agent, router, cluster.redis, "first blocks")
    assert agent.engine.healthy()
    assert fake.proc is not None
    fake.proc.kill()  # SIGKILL: no goodbye on any socket
    fake.proc.wait()
    t0 = time.monotonic()
    await wait_for(lambda: not router.mirror.index.keys_of(W) and W not in router.registry.loads,
                   timeout=5, what="its blocks and the worker gone from the router")
    gone_s = time.monotonic() - t0
    assert not snapshot(cluster.redis) and not agent.engine.healthy()
    assert any(f.name == "kvroute_agent_vllm_up" and f.samples[0].value == 0
               for f in agent.engine.metric_families())
    with pytest.raises(Exception, match="no routable workers"):
        await generate(router.port, system + prompt(40, 3), max_tokens=2)
    fake.start()  # vLLM back on the same ports, its cache empty
    await wait_for(lambda: W in router.registry.loads, timeout=10, what="the worker back")
    await generate(router.port, system + prompt(40, 4), max_tokens=2)
    await converged(fake, agent, router, cluster.redis, "re-learned after the restart")
    again = await generate(router.port, system + prompt(40, 5), max_tokens=2)
    assert again[-1].usage.cached_tokens == 160  # its cache serves the turn again
    print(f"\ndead vLLM: out of the router's mirror and registry {gone_s:.2f} s after SIGKILL")


@pytest.mark.parametrize("int_hashes", [False, True], ids=["bytes", "int"])
async def test_an_offloading_tier_is_published_as_the_lower_tier(cluster, fake_vllm,
                                                                  redis_server,
                                                                  int_hashes: bool) -> None:
    """vLLM with its OffloadingConnector (a CPU tier written through, named by the whole
    digest alone): its copies reach the router as lower-tier blocks, the GPU's evictions
    demote them, a prompt hitting them is counted cached; nothing is rejected."""
    args = ["--capacity", "24", "--offload-blocks", "64"] + (["--int-hashes"] * int_hashes)
    fake = fake_vllm(*args)
    agent, router = await start(cluster, fake)
    doc = prompt(160, 1)  # 10 blocks
    await generate(router.port, doc, max_tokens=2)
    for seed in (2, 3):  # other prompts through a 24-block GPU cache: doc's blocks leave it
        await generate(router.port, prompt(160, seed), max_tokens=2)

    def lower() -> set[int]:
        return set(fake.state()["lower"])

    await wait_for(lambda: lower() and set(agent.engine.lower_keys()) == lower()
                   and router.mirror.index.lower_keys_of(W) == lower()
                   and router.mirror.index.keys_of(W) == fake.truth() | lower(),
                   10, "the CPU tier mirrored as the lower tier")
    doc_keys = BlockHasher(16, "default").keys(doc)
    assert set(doc_keys[:9]) & lower(), "doc's blocks were demoted to the CPU tier"
    stats = agent.engine.events.stats
    assert not stats.rejected, stats.rejected  # no batch refused for its CPU events
    assert agent.engine.blocks.stats.unknown_copies == 0
    out = await generate(router.port, doc + prompt(20, 9), max_tokens=2)
    assert out[-1].usage.cached_tokens >= 144  # loaded from the CPU tier, not computed
    await wait_for(lambda: not set(doc_keys[:9]) & router.mirror.index.lower_keys_of(W),
                   10, "loaded blocks back in GPU memory at the router")
