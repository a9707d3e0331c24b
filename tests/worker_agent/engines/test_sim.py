"""SimEngine: prefix hits, capping, determinism, continuous batching, cancellation, events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kvroute.core.blocks import BlockHasher
from kvroute.core.cache_events import CacheEvent
from kvroute.core.config import AgentConfig
from kvroute.core.load import PrefillMode
from kvroute.core.redis_schema import Op
from kvroute.worker_agent.engines.base import EngineError, EngineRequest, TokenChunk
from kvroute.worker_agent.engines.sim import SimConfig, SimEngine, sim_tokens
from kvroute.worker_agent.server import make_engine
from tests.core.test_block_pool import replay

B = 16


@contextlib.asynccontextmanager
async def running_engine(**overrides: object) -> AsyncIterator[tuple[SimEngine, list[CacheEvent]]]:
    cfg = SimConfig(**{"time_scale": 0.0, "block_size": B, **overrides})  # type: ignore[arg-type]
    engine = SimEngine(cfg)
    events: list[CacheEvent] = []
    engine.add_listener(events.append)
    await engine.start()
    try:
        yield engine, events
    finally:
        await engine.stop()


def req(tokens: list[int], max_tokens: int = 4, rid: str = "r", **kw: object) -> EngineRequest:
    return EngineRequest(rid, tokens, max_tokens, **kw)  # type: ignore[arg-type]


async def collect(engine: SimEngine, request: EngineRequest) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(request)]


def out_tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def until(cond, limit: int = 10_000) -> None:
    """Yield to the event loop until ``cond()`` (no wall-clock waits)."""
    for _ in range(limit):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.asyncio
async def test_output_is_deterministic_one_token_per_chunk() -> None:
    async with running_engine() as (engine, _):
        p = prompt(40)
        first = await collect(engine, req(p, 10, seed=7))
        again = await collect(engine, req(p, 10, seed=7))  # now with a cache hit
        other = await collect(engine, req(p, 10, seed=8))
    assert all(len(c.token_ids) == 1 for c in first)
    assert [c.finish_reason for c in first] == [None] * 9 + ["length"]
    assert out_tokens(first) == sim_tokens(p, 7, 10, 50257)
    assert out_tokens(again) == out_tokens(first)
    assert first[0].cached_tokens == 0 and again[0].cached_tokens == 32
    assert all(c.cached_tokens == 32 for c in again)  # constant per request
    assert out_tokens(other) != out_tokens(first)
    assert all(0 <= t < 50257 for t in out_tokens(first))


@pytest.mark.asyncio
async def test_second_request_hits_the_longest_shared_prefix() -> None:
    async with running_engine() as (engine, _):
        a = prompt(64)
        b = a[:48] + prompt(30, start=5)  # shares 3 full blocks, then diverges
        await collect(engine, req(a, 1))
        chunks = await collect(engine, req(b, 1))
        assert chunks[0].cached_tokens == 48
        assert engine.stats.cached_tokens == 48
        assert engine.stats.prefill_tokens == 64 + (78 - 48)
        # A partial shared block (47 tokens) does not count.
        c = a[:47] + prompt(30, start=5)
        assert (await collect(engine, req(c, 1)))[0].cached_tokens == 32


@pytest.mark.asyncio
async def test_cache_hit_is_capped_so_one_prompt_token_is_computed() -> None:
    async with running_engine() as (engine, _):
        p = prompt(33)
        await collect(engine, req(p, 1))
        # 2 full blocks cached; a 32-token prompt must still compute its last token.
        assert (await collect(engine, req(p[:32], 1)))[0].cached_tokens == 16
        assert (await collect(engine, req(p, 1)))[0].cached_tokens == 32
        assert (await collect(engine, req(p[:16], 1)))[0].cached_tokens == 0
        assert (await collect(engine, req(p[:17], 1)))[0].cached_tokens == 16


@pytest.mark.asyncio
async def test_cache_salt_separates_caches() -> None:
    async with running_engine() as (engine, _):
        p = prompt(64)
        await collect(engine, req(p, 1, cache_salt="lora-a"))
        assert (await collect(engine, req(p, 1)))[0].cached_tokens == 0
        assert (await collect(engine, req(p, 1, cache_salt="lora-a")))[0].cached_tokens == 48
        expected = set(BlockHasher(B, "sim-model", "lora-a").keys(p))
        assert expected <= set(engine.cached_keys())


@pytest.mark.asyncio
async def test_prompt_blocks_are_stored_with_block_keys_after_prefill() -> None:
    async with running_engine() as (engine, events):
        p = prompt(50)
        gen = engine.generate(req(p, 5))
        first = await anext(gen)
        keys = BlockHasher(B, "sim-model").keys(p)
        # One STORE event for the 3 full prompt blocks, sent before the first token arrives.
        assert events == [CacheEvent(Op.STORE, tuple(keys))]
        assert first.cached_tokens == 0
        rest = [c async for c in gen]
        assert rest[-1].finish_reason == "length"
        assert set(engine.cached_keys()) == set(keys)


@pytest.mark.asyncio
async def test_generated_blocks_are_cached_for_the_next_chat_turn() -> None:
    async with running_engine() as (engine, events):
        p = prompt(20)
        out = out_tokens(await collect(engine, req(p, 30)))
        # KV computed for prompt + all but the last output token: 49 tokens, 3 full blocks.
        convo = p + out
        keys = BlockHasher(B, "sim-model").keys(convo[:48])
        assert set(engine.cached_keys()) == set(keys)
        assert replay(events) == set(keys)
        next_turn = convo + prompt(10, start=7)
        chunks = await collect(engine, req(next_turn, 1))
        assert chunks[0].cached_tokens == 48


@pytest.mark.asyncio
async def test_stop_token_ends_the_request() -> None:
    p = prompt(10)
    expected = sim_tokens(p, 0, 20, 50257)
    stop = next(t for i, t in enumerate(expected) if i >= 3 and t not in expected[:i])
    idx = expected.index(stop)
    async with running_engine() as (engine, _):
        chunks = await collect(engine, req(p, 20, stop_token_ids=frozenset({stop})))
    assert out_tokens(chunks) == expected[: idx + 1]
    assert chunks[-1].finish_reason == "stop"
    assert all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.asyncio
async def test_continuous_batching_completes_all_and_respects_max_batch() -> None:
    async with running_engine(max_batch=4) as (engine, _):
        reqs = [req(prompt(20 + i, start=100 * i), max_tokens=3 + i, rid=f"r{i}")
                for i in range(12)]
        results = await asyncio.gather(*(collect(engine, r) for r in reqs))
        for r, chunks in zip(reqs, results, strict=True):
            assert out_tokens(chunks) == sim_tokens(r.token_ids, 0, r.max_tokens, 50257)
            assert chunks[-1].finish_reason == "length"
        assert engine.stats.max_running == 4  # batched, never more than max_batch
        assert engine.stats.finished == 12
        # Batching: far fewer steps than the 12 requests' tokens run one after another.
        assert engine.stats.steps < sum(r.max_tokens for r in reqs)
        load = engine.load()
        assert (load.running, load.queued) == (0, 0)
        assert load.free_blocks == load.capacity_blocks


@pytest.mark.asyncio
async def test_admission_waits_for_blocks_and_evicts_lru() -> None:
    # 8 blocks; each request needs ceil((32 + 16 - 1) / 16) = 3 blocks: at most 2 run at once.
    async with running_engine(capacity_blocks=8) as (engine, events):
        reqs = [req(prompt(32, start=1000 * i), 16, rid=f"r{i}") for i in range(6)]
        results = await asyncio.gather(*(collect(engine, r) for r in reqs))
        assert all(len(out_tokens(c)) == 16 for c in results)
        assert engine.stats.max_running == 2
        assert any(ev.op is Op.EVICT for ev in events)
        assert replay(events) == set(engine.cached_keys())
        assert engine.pool.free_blocks == 8
        # r0 and r1 finish in the same step, r0 freed first: r0's cached blocks (2 prompt
        # blocks; 47 tokens of KV) are the least recently freed, so they are evicted first.
        r0_keys = BlockHasher(B, "sim-model").keys(reqs[0].token_ids)
        evicted = [k for ev in events if ev.op is Op.EVICT for k in ev.keys]
        assert evicted[:2] == r0_keys[::-1]  # tail block before head block


@pytest.mark.asyncio
async def test_cancelling_a_running_consumer_frees_its_blocks() -> None:
    async with running_engine() as (engine, _):
        got: list[TokenChunk] = []

        async def consume() -> None:
            async for chunk in engine.generate(req(prompt(40), 100_000)):
                got.append(chunk)

        task = asyncio.create_task(consume())
        await until(lambda: len(got) >= 3)
        assert engine.load().running == 1
        assert engine.pool.free_blocks < engine.pool.capacity_blocks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        load = engine.load()
        assert (load.running, load.queued) == (0, 0)
        assert load.free_blocks == load.capacity_blocks
        assert engine.stats.aborted == 1
        # The prompt blocks stay cached after the abort.
        assert len(engine.cached_keys()) >= 2


@pytest.mark.asyncio
async def test_closing_the_generator_early_frees_blocks() -> None:
    async with running_engine() as (engine, _):
        async with contextlib.aclosing(engine.generate(req(prompt(40), 1000))) as gen:
            async for _chunk in gen:
                break
        load = engine.load()
        assert load.running == 0 and load.free_blocks == load.capacity_blocks


@pytest.mark.asyncio
async def test_queued_requests_report_load_and_can_be_cancelled() -> None:
    async with running_engine(max_batch=1) as (engine, _):
        a = prompt(64)
        hog = engine.generate(req(a, 100_000, rid="hog"))
        await anext(hog)  # a's prompt blocks are cached now
        b = a[:32] + prompt(20, start=9)  # 2 blocks hit
        tasks = [asyncio.create_task(collect(engine, req(p, 2, rid=f"q{i}")))
                 for i, p in enumerate([b, prompt(25, start=3)])]
        await until(lambda: engine.load().queued == 2)
        load = engine.load()
        assert load.running == 1
        assert load.pending_prefill_tokens == (52 - 32) + 25
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        assert engine.load().queued == 1
        await hog.aclose()
        assert len(out_tokens(await tasks[1])) == 2
        load = engine.load()
        assert (load.running, load.queued, load.pending_prefill_tokens) == (0, 0, 0)
        assert load.free_blocks == load.capacity_blocks


@pytest.mark.asyncio
async def test_prompt_larger_than_the_cache_raises_engine_error() -> None:
    async with running_engine(capacity_blocks=4) as (engine, _):
        with pytest.raises(EngineError, match="more than the engine's whole KV cache"):
            await collect(engine, req(prompt(4 * B + 1), 1))
        with pytest.raises(EngineError, match="empty prompt"):
            await collect(engine, req([], 1))
        with pytest.raises(EngineError, match="max_tokens"):
            await collect(engine, req(prompt(3), 0))
        # A prompt that fits exactly still runs; its output is limited to the pool's room.
        chunks = await collect(engine, req(prompt(4 * B - 3), 100))
        assert len(chunks) == 4 and chunks[-1].finish_reason == "length"
        assert engine.load().free_blocks == 4


@pytest.mark.asyncio
async def test_stop_fails_pending_requests_and_rejects_new_ones() -> None:
    cfg = SimConfig(time_scale=0.0, max_batch=1)
    engine = SimEngine(cfg)
    with pytest.raises(EngineError, match="not started"):
        await collect(engine, req(prompt(5), 1))
    await engine.start()
    running = engine.generate(req(prompt(20), 100_000, rid="a"))
    await anext(running)
    queued = asyncio.create_task(collect(engine, req(prompt(20, start=7), 2, rid="b")))
    await until(lambda: engine.load().queued == 1)
    await engine.stop()
    with pytest.raises(EngineError, match="stopped"):
        async for chunk in running:  # tokens generated before stop() are still delivered
            assert chunk.finish_reason is None
    with pytest.raises(EngineError, match="stopped"):
        await queued
    with pytest.raises(EngineError, match="stopped"):
        await collect(engine, req(prompt(5), 1))
    assert engine.pool.free_blocks == cfg.capacity_blocks


@pytest.mark.asyncio
async def test_clear_cache_emits_clear_and_drops_hits() -> None:
    async with running_engine() as (engine, events):
        p = prompt(40)
        await collect(engine, req(p, 1))
        assert engine.clear_cache() == 2
        assert events[-1] == CacheEvent(Op.CLEAR)
        assert engine.cached_keys() == []
        assert (await collect(engine, req(p, 1)))[0].cached_tokens == 0


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SimConfig(capacity_blocks=0)
    with pytest.raises(ValueError):
        SimConfig(time_scale=-1)
    cfg = SimConfig()
    assert (cfg.capacity_blocks, cfg.block_size, cfg.max_batch) == (4096, 16, 64)


@pytest.mark.asyncio
async def test_default_sim_admits_whole_prompts_and_reports_it() -> None:
    async with running_engine() as (engine, _):
        load = engine.load()
        assert (load.prefill_mode, load.max_batched_tokens, load.max_prefill_chunk) == \
            (PrefillMode.WHOLE, 0, 0)
        # No budget: a prompt far over any default budget prefills in its first step.
        await collect(engine, req(prompt(2000), 1))
        assert engine.stats.steps == 1


@pytest.mark.asyncio
async def test_chunked_prefill_stores_each_chunk_and_decodes_between_chunks() -> None:
    # Budget 32, chunks capped at 16: a 64-token prompt takes 4 steps (its blocks stored one a
    # step, before its first token), while a running request keeps decoding beside it.
    async with running_engine(prefill_budget=32, chunked_prefill=True,
                              long_prefill_threshold=16) as (engine, events):
        load = engine.load()
        assert (load.prefill_mode, load.max_batched_tokens, load.max_prefill_chunk) == \
            (PrefillMode.CHUNKED, 32, 16)
        short = engine.generate(req(prompt(8, start=5000), 20, rid="short"))
        await anext(short)  # decoding from now on
        long_p = prompt(64)
        long = engine.generate(req(long_p, 2, rid="long"))
        first = asyncio.ensure_future(anext(long))
        keys = BlockHasher(B, "sim-model").keys(long_p)
        await until(lambda: replay(events) >= set(keys[:2]))
        # Two chunks stored, its first token not out yet; the short one decoded meanwhile.
        assert not first.done() and not set(keys[2:]) & replay(events)
        assert engine.load().pending_prefill_tokens == 32
        got = [await anext(short) for _ in range(3)]
        assert all(len(c.token_ids) == 1 for c in got)
        assert (await first).cached_tokens == 0
        assert set(keys) <= replay(events)
        assert [c async for c in long][-1].finish_reason == "length"
        assert [c async for c in short][-1].finish_reason == "length"
    assert engine.stats.prefill_tokens == 72


def test_chunk_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="chunked_prefill needs a prefill_budget"):
        SimConfig(chunked_prefill=True)
    with pytest.raises(ValueError, match=r"long_prefill_threshold .* needs chunked_prefill"):
        SimConfig(prefill_budget=64, long_prefill_threshold=16)
    with pytest.raises(ValueError, match="prefill_budget must be >= 0"):
        SimConfig(prefill_budget=-1)


def test_agent_flags_set_the_sim_engines_scheduler() -> None:
    default = make_engine(AgentConfig.of(engine="sim")).load()
    assert (default.prefill_mode, default.max_batched_tokens, default.max_prefill_chunk) == \
        (PrefillMode.WHOLE, 0, 0)
    chunked = make_engine(AgentConfig.of(engine="sim", max_batched_tokens=512,
                                      sim_chunked_prefill=True,
                                      sim_long_prefill_threshold=128)).load()
    assert (chunked.prefill_mode, chunked.max_batched_tokens, chunked.max_prefill_chunk) == \
        (PrefillMode.CHUNKED, 512, 128)
