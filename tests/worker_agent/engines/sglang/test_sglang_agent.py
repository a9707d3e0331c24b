"""``--engine sglang`` end to end: a fake SGLang speaking SGLang's real wire protocols
(SGLang's own ZmqEventPublisher + replay, native ``/generate`` SSE, ``/server_info``,
``/metrics``) -> a real agent -> a real Redis -> a real router's mirror. The fake's cache is
the oracle: it computes the kvroute keys of what it holds independently of the agent."""

from __future__ import annotations

import asyncio
import logging
import random

import httpx
import pytest

from kvroute.core.blocks import BlockHasher, adapter_salt
from kvroute.worker_agent.engines.base import EngineRequest, RequestRefusedError
from kvroute.worker_agent.engines.served.engine import EventedConfig
from kvroute.worker_agent.engines.sglang import SglangEngine
from kvroute.worker_agent.engines.sglang.versions import CACHE_SALT_SINCE, SAMPLING_SEED_SINCE
from kvroute.worker_agent.engines.vllm.versions import SUPPORTED as VLLM
from kvroute.worker_agent.engines.vllm.versions import parse_version
from tests.support import generate, wait_for
from tests.worker_agent.engines.vllm.conftest import fake_servers
from tests.worker_agent.engines.vllm.vllm_wire import vllm_sources

W = "s0"
VOCAB = 50257


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def expected(tokens: list[int], n: int, seed: int = 0) -> list[int]:
    """The fake's made-up output (its rule: fake_vllm.FakeVllm.run)."""
    base = (sum(tokens) * 31 + seed) % VOCAB
    return [(base + 7919 * t) % VOCAB for t in range(n)]


def engine(fake, **kw) -> SglangEngine:
    return SglangEngine(EventedConfig(url=fake.url, events=fake.events, replay=fake.replay,
                                      topic="kv-events", block_size=16, model="default",
                                      metrics_interval_s=0.05, **kw))


async def run(eng: SglangEngine, tokens: list[int], n: int, **kw):
    return [c async for c in eng.generate(EngineRequest("r", tokens, n, **kw))]


@pytest.mark.parametrize("stream", ["cumulative", "incremental"])
async def test_generates_reports_hits_and_mirrors_the_cache(fake_sglang, stream: str) -> None:
    fake = fake_sglang(*(["--incremental"] if stream == "incremental" else []))
    eng = engine(fake)
    await eng.start()
    try:
        await wait_for(eng.healthy, what="SGLang answers")
        a = prompt(40, 1)
        first = await run(eng, a, 5, logprobs=True)
        assert [t for c in first for t in c.token_ids] == expected(a, 5)
        assert first[-1].finish_reason == "length" and first[-1].cached_tokens == 0
        assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
                   for c in first)
        await wait_for(lambda: set(eng.cached_keys()) == fake.truth(), what="mirrored")
        assert set(BlockHasher(16, "default").keys(a[:32])) <= set(eng.cached_keys())
        # SGLang's own hit figure lands on the last chunk; the prediction on the others.
        second = await run(eng, a[:32] + prompt(9, 2), 3)
        assert second[-1].cached_tokens == 32 and second[0].cached_tokens == 32
        # SGLang's /flush_cache -> AllBlocksCleared -> nothing left in the agent's view.
        assert httpx.post(fake.url + "/flush_cache").status_code == 200
        await wait_for(lambda: not eng.cached_keys(), what="cleared")
        st = eng.events.stats
        assert st.complete and st.resets == 0 and not st.rejected
    finally:
        await eng.stop()


async def test_server_info_fills_the_load_and_the_version(fake_sglang) -> None:
    fake = fake_sglang("--capacity", "300")
    eng = engine(fake)
    await eng.start()
    try:
        await wait_for(lambda: eng.server_version is not None, what="version read")
        assert eng.server_version == fake.release
        await wait_for(eng.healthy, what="SGLang answers")
        load = eng.load()
        # max_running_requests, max_prefill_tokens and chunked_prefill_size from
        # /server_info; the capacity from /metrics (0.5.12 and later) or /server_info's
        # max_total_num_tokens (older).
        assert load.max_running == 48 and load.max_prefill_chunk == 2048
        assert load.max_batched_tokens == 16384
        assert load.capacity_blocks == 300
        assert load.free_blocks == 300 and load.running == 0
    finally:
        await eng.stop()


async def test_salt_and_seed_go_only_to_releases_that_take_them(fake_sglang) -> None:
    fake = fake_sglang()
    version = parse_version(fake.release)
    eng = engine(fake)
    await eng.start()
    try:
        await wait_for(lambda: eng.server_version is not None, what="version read")
        a = prompt(40, 3)
        out = await run(eng, a, 2, seed=7)
        assert [t for c in out for t in c.token_ids] == \
            expected(a, 2, 7 if version >= SAMPLING_SEED_SINCE else 0)
        sent = fake.requests()[-1]["sampling_params"]
        assert ("sampling_seed" in sent) == (version >= SAMPLING_SEED_SINCE)
        if version >= CACHE_SALT_SINCE:
            await run(eng, a, 2, cache_salt="tenant")
            assert fake.requests()[-1]["cache_salt"] == "tenant"
            salted = set(BlockHasher(16, "default", "tenant").keys(a[:32]))
            await wait_for(lambda: salted <= set(eng.cached_keys()) and
                           set(eng.cached_keys()) == fake.truth(), what="salted blocks")
        else:
            with pytest.raises(RequestRefusedError) as err:
                await run(eng, a, 2, cache_salt="tenant")
            assert err.value.code == "FAILED_PRECONDITION" and "0.5.18" in str(err.value)
        assert not fake.state()["ignored_fields"]
    finally:
        await eng.stop()


async def test_constraints_go_as_sglang_grammars(fake_sglang) -> None:
    fake = fake_sglang()
    eng = engine(fake)
    await eng.start()
    try:
        chunks = [c async for c in eng.generate(EngineRequest("c", prompt(20, 4), 8),
                                                constraint=("choices", ["yes", "no"]))]
        assert bytes(t for c in chunks for t in c.token_ids) == b"yes"
        assert chunks[-1].finish_reason == "stop"
        assert fake.requests()[-1]["sampling_params"]["regex"] == "yes|no"
        schema = '{"type": "object", "examples": [{"a": 1}]}'
        [c async for c in eng.generate(EngineRequest("j", prompt(20, 5), 12),
                                       constraint=("json_schema", schema))]
        assert fake.requests()[-1]["sampling_params"]["json_schema"] == schema
    finally:
        await eng.stop()


async def test_a_refused_request_and_a_bad_setting_are_named(fake_sglang, caplog) -> None:
    fake = fake_sglang("--page-size", "32", "--context-len", "64")
    eng = engine(fake)
    caplog.set_level(logging.ERROR, "kvroute.agent.sglang")
    await eng.start()
    try:
        await wait_for(lambda: eng.server_version is not None, what="version read")
        assert "--page-size 32" in caplog.text and "--page-size 16" in caplog.text
        # The caller's doing (a prompt past the context): refused, not a worker failure.
        with pytest.raises(RequestRefusedError) as err:
            await run(eng, prompt(70, 6), 2)
        assert err.value.code == "INVALID_ARGUMENT" and "context length" in str(err.value)
        # Sampling fields every supported release takes.
        out = await run(eng, prompt(20, 6), 2, top_k=5, top_p=0.5, temperature=0.5)
        assert out[-1].finish_reason == "length"
        sent = fake.requests()[-1]["sampling_params"]
        assert (sent["top_k"], sent["top_p"], sent["temperature"]) == (5, 0.5, 0.5)
    finally:
        await eng.stop()


async def test_a_dead_sglang_withdraws_its_blocks(fake_sglang) -> None:
    fake = fake_sglang()
    eng = engine(fake, down_after_s=0.3)
    await eng.start()
    try:
        await wait_for(eng.healthy, what="SGLang answers")
        await run(eng, prompt(40, 7), 2)
        await wait_for(lambda: len(eng.cached_keys()) >= 2, what="blocks")
        fake.stop()
        await wait_for(lambda: not eng.healthy() and not eng.cached_keys(), what="withdrawn")
    finally:
        await eng.stop()


async def test_an_sglang_and_a_vllm_worker_serve_one_pool(cluster, fake_sglang) -> None:
    """One router, two engines: each request goes where its prefix is cached, and each
    worker's mirror equals its server's own cache."""
    sg = fake_sglang()
    vllm_gen = fake_servers("tests.worker_agent.engines.vllm.fake_vllm",
                            ["--vllm-src", str(vllm_sources(VLLM[-1])), "--vllm-version",
                             VLLM[-1]])
    start_vllm = next(vllm_gen)
    vl = start_vllm()
    try:
        s_agent = await cluster.agent("s0", engine="sglang", sglang_url=sg.url,
                                      sglang_events=sg.events, sglang_replay=sg.replay,
                                      sglang_topic="kv-events")
        v_agent = await cluster.agent("v0", engine="vllm", vllm_url=vl.url,
                                      vllm_events=vl.events, vllm_replay=vl.replay,
                                      vllm_model="fake-model")
        router = await cluster.router()
        await wait_for(lambda: {"s0", "v0"} <= set(router.registry.loads), what="both joined")
        systems = [prompt(160, 10 + i) for i in range(4)]
        # At once, so that the load spreads them over both workers.
        firsts = await asyncio.gather(*(generate(router.port, s + prompt(20, 20 + i),
                                                 max_tokens=16)
                                        for i, s in enumerate(systems)))
        homes = [f[0].worker_id for f in firsts]
        assert set(homes) == {"s0", "v0"}, homes
        for agent, fake, w in ((s_agent, sg, "s0"), (v_agent, vl, "v0")):
            await wait_for(lambda a=agent, f=fake, w=w: set(a.engine.cached_keys()) ==
                           f.truth() == router.mirror.index.keys_of(w), what=f"{w} mirrored")
        for i, s in enumerate(systems):
            again = await generate(router.port, s + prompt(20, 40 + i), max_tokens=2)
            assert again[0].worker_id == homes[i]
            assert again[-1].cached_tokens == 160  # the engine's own figure, both kinds
    finally:
        await asyncio.to_thread(vl.stop)
        for _ in vllm_gen:
            pass


async def test_one_agent_per_data_parallel_rank(cluster, fake_sglang) -> None:
    """SGLang with two DP ranks, an agent per rank given the same endpoints: each follows its
    rank's events and load and pins its requests there, so the router routes between ranks
    by their caches."""
    fake = fake_sglang("--dp-size", "2")
    agents = [await cluster.agent(f"r{rank}", engine="sglang", sglang_url=fake.url,
                                  sglang_events=fake.events, sglang_replay=fake.replay,
                                  sglang_topic="kv-events", sglang_dp_rank=rank)
              for rank in (0, 1)]
    router = await cluster.router()
    await wait_for(lambda: {"r0", "r1"} <= set(router.registry.loads), what="both ranks")
    systems = [prompt(160, 50 + i) for i in range(4)]
    firsts = await asyncio.gather(*(generate(router.port, s + prompt(20, 60 + i),
                                             max_tokens=16) for i, s in enumerate(systems)))
    homes = [f[0].worker_id for f in firsts]
    assert set(homes) == {"r0", "r1"}, homes
    for rank, agent in enumerate(agents):
        w = f"r{rank}"
        # The rank's own cache, and only its requests, each pinned by the release's field.
        await wait_for(lambda a=agent, r=rank, w=w: set(a.engine.cached_keys()) ==
                       fake.truth(r) == router.mirror.index.keys_of(w), what=f"{w} mirrored")
        sent = fake.requests(rank)
        assert len(sent) == homes.count(w)
        assert all(agent.engine.client.features.dp_rank_field in b for b in sent)
        assert agent.engine.load().capacity_blocks == 256  # its rank's, not the server's
    for i, s in enumerate(systems):
        again = await generate(router.port, s + prompt(20, 70 + i), max_tokens=2)
        assert again[0].worker_id == homes[i] and again[-1].cached_tokens == 160


async def test_a_lora_adapters_blocks_are_keyed_as_the_router_keys_them(fake_sglang,
                                                                         caplog) -> None:
    fake = fake_sglang("--lora-modules", "ad1")
    eng = engine(fake)
    caplog.set_level(logging.WARNING, "kvroute.agent.sglang")
    await eng.start()
    try:
        await wait_for(lambda: eng.server_version is not None, what="version read")
        a = prompt(40, 9)
        for _ in range(2):
            await run(eng, a, 2, cache_salt=adapter_salt("ad1", ""))
        assert fake.requests()[-1]["lora_path"] == "ad1"
        ours = set(BlockHasher(16, "default", adapter_salt("ad1", "")).keys(a[:32]))
        await converged_quiet(fake, eng)
        if eng.client.features.lora_events:
            # The events name the adapter: its blocks get the adapter's keys, as the router's.
            assert set(eng.cached_keys()) == fake.truth() and ours <= fake.truth()
            assert "do not name LoRA adapters" not in caplog.text
        else:
            # The events do not: published as the base model's, and said so once.
            assert not ours & set(eng.cached_keys())
            assert set(BlockHasher(16, "default").keys(a[:32])) <= set(eng.cached_keys())
            assert caplog.text.count("do not name LoRA adapters") == 1
    finally:
        await eng.stop()


async def converged_quiet(fake, eng) -> None:
    await wait_for(lambda: eng.events.stats.last_seq == fake.state()["published"] - 1,
                   what="all batches applied")
