"""TinyEngine: cached = uncached logits, sim-identical cache events, batching, sampling, masks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.core.blocks import BlockHasher
from kvroute.core.cache_events import CacheEvent
from kvroute.core.config import AgentConfig
from kvroute.core.redis_schema import Op
from kvroute.worker_agent.engines.base import EngineError, EngineRequest, TokenChunk
from kvroute.worker_agent.engines.sim import SimConfig, SimEngine
from kvroute.worker_agent.engines.tiny import (
    TinyConfig,
    TinyEngine,
    from_agent_config,
    sample_token,
)
from tests.core.test_block_pool import replay

B = 16
Logits = dict[str, list[np.ndarray]]


@contextlib.asynccontextmanager
async def running_engine(**overrides: Any) -> AsyncIterator[tuple[TinyEngine, list[CacheEvent],
                                                                  Logits]]:
    engine = TinyEngine(TinyConfig(**{"capacity_blocks": 64, "block_size": B, **overrides}))
    events: list[CacheEvent] = []
    logits: Logits = {}
    engine.add_listener(events.append)
    engine.logits_observer = lambda rid, step, lg: logits.setdefault(rid, []).append(lg.copy())
    await engine.start()
    try:
        yield engine, events, logits
    finally:
        await engine.stop()


def req(tokens: list[int], max_tokens: int = 4, rid: str = "r", **kw: Any) -> EngineRequest:
    return EngineRequest(rid, tokens, max_tokens, **kw)


async def collect(engine: Any, request: EngineRequest) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(request)]


def out_tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


async def test_cached_and_uncached_runs_give_identical_logits() -> None:
    p1 = prompt(70, 1)
    async with running_engine() as (warm, _, warm_logits):
        out1 = out_tokens(await collect(warm, req(p1, 20, rid="p1")))
        # p2 shares 3 prompt blocks with p1; p3 is the next chat turn, so its cached prefix
        # includes blocks whose K/V were written by decode steps.
        p2 = p1[:48] + prompt(30, 2)
        p3 = p1 + out1 + prompt(9, 3)
        c2 = await collect(warm, req(p2, 6, rid="p2"))
        c3 = await collect(warm, req(p3, 6, rid="p3"))
    assert c2[0].cached_tokens == 48
    assert c3[0].cached_tokens == (70 + 20 - 1) // B * B == 80
    async with running_engine() as (cold, _, cold_logits):
        d2 = await collect(cold, req(p2, 6, rid="p2"))
        cold.clear_cache()  # p3 shares p2's first 3 blocks: keep its run uncached too
        d3 = await collect(cold, req(p3, 6, rid="p3"))
    assert d2[0].cached_tokens == 0 and d3[0].cached_tokens == 0
    assert out_tokens(c2) == out_tokens(d2) and out_tokens(c3) == out_tokens(d3)
    for rid in ("p2", "p3"):
        assert len(warm_logits[rid]) == len(cold_logits[rid]) == 6
        for a, b in zip(warm_logits[rid], cold_logits[rid], strict=True):
            assert a.dtype == np.float32 and np.array_equal(a, b)  # bit for bit
    # ... and equal to the model's own one-shot prefill of the prompt.
    ref = TinyEngine(TinyConfig()).transformer.reference_logits(p3, B)[-1]
    assert np.array_equal(warm_logits["p3"][0], ref)
    # Greedy by default: every token is the argmax of its logits.
    assert out_tokens(c3) == [int(np.argmax(lg)) for lg in warm_logits["p3"]]


async def test_emits_the_same_cache_events_as_the_sim_engine() -> None:
    # max_tokens=1: no output token gets K/V, so the keys depend on the prompts alone and
    # both engines must store, hit and evict identically (8 blocks force evictions).
    prompts = [prompt(40, 1), prompt(40, 1)[:32] + prompt(20, 2), prompt(33, 3), prompt(64, 4),
               prompt(40, 1), prompt(17, 5)]
    common = dict(capacity_blocks=8, block_size=B, model="m", max_batch=2)
    sim = SimEngine(SimConfig(**common, time_scale=0.0))  # type: ignore[arg-type]
    tiny = TinyEngine(TinyConfig(**common))  # type: ignore[arg-type]
    logs: list[list[CacheEvent]] = [[], []]
    cached: list[list[int]] = [[], []]
    for engine, log, hits in zip((sim, tiny), logs, cached, strict=True):
        engine.add_listener(log.append)
        await engine.start()
        for i, p in enumerate(prompts):
            hits.append((await collect(engine, req(p, 1, rid=f"s{i}")))[0].cached_tokens)
        # A concurrent burst: same admission, steps and commits.
        burst = await asyncio.gather(*(collect(engine, req(prompt(30 + i, 10 + i), 1,
                                                           rid=f"b{i}")) for i in range(4)))
        hits.extend(c[0].cached_tokens for c in burst)
        await engine.stop()
    assert logs[0] == logs[1]
    assert cached[0] == cached[1]
    assert any(ev.op is Op.EVICT for ev in logs[1]) and any(cached[1])
    assert replay(logs[1]) == set(tiny.cached_keys())
    assert set(BlockHasher(B, "m").keys(prompts[-1])) <= set(tiny.cached_keys())


async def test_continuous_batching_gives_every_request_its_solo_tokens() -> None:
    reqs = [req(prompt(10 + 7 * i, 20 + i), 3 + i, rid=f"r{i}") for i in range(6)]
    async with running_engine(max_batch=3) as (engine, _, _):
        solo = [out_tokens(await collect(engine, r)) for r in reqs]
        engine.clear_cache()
        batched = await asyncio.gather(*(collect(engine, r) for r in reqs))
        assert engine.stats.max_running == 3
        assert [out_tokens(c) for c in batched] == solo
        assert all(len(s) == r.max_tokens for s, r in zip(solo, reqs, strict=True))
        load = engine.load()
        assert (load.running, load.queued, load.free_blocks) == (0, 0, 64)


async def test_temperature_sampling_is_seeded() -> None:
    p = prompt(50, 7)
    async with running_engine() as (engine, _, _):
        a = out_tokens(await collect(engine, req(p, 12, temperature=1.0, seed=1)))
        again = await collect(engine, req(p, 12, temperature=1.0, seed=1))  # cache hit now
        b = out_tokens(await collect(engine, req(p, 12, temperature=1.0, seed=2)))
        greedy = out_tokens(await collect(engine, req(p, 12)))
        implicit = [out_tokens(await collect(engine, req(p, 12, temperature=1.0)))
                    for _ in range(2)]
    assert again[0].cached_tokens == 48 and out_tokens(again) == a
    assert a != b and a != greedy
    assert implicit[0] == implicit[1]  # seed 0: derived from the prompt


@given(st.lists(st.integers(-40, 40), min_size=2, max_size=40, unique=True),
       st.floats(0, 0.999), st.integers(0, 8), st.floats(0.05, 1.0), st.floats(0.2, 3.0))
def test_top_k_and_top_p_draw_only_from_the_most_likely_tokens(
        raw: list[int], u: float, k: int, top_p: float, t: float) -> None:
    logits = np.asarray(raw, dtype=np.float32) / 2  # distinct: no ties at the k-th
    tok = sample_token(logits, t, u, top_p=top_p, top_k=k)
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    # vLLM's order: the top k (ties at the k-th kept), then the nucleus of what is left.
    p = np.exp((logits - logits.max()) / t).astype(np.float64)
    if 0 < k < len(p):
        p[p < np.sort(p)[-k]] = 0
    p /= p.sum()
    mass_before = sum(p[i] for i in order if p[i] > p[tok])
    assert p[tok] > 0 and mass_before < top_p + 1e-9
    # top_k 1 (or a tiny top_p) is greedy whatever u is.
    assert sample_token(logits, t, u, top_k=1) == int(np.argmax(logits))
    assert sample_token(logits, t, u, top_p=1e-9) == int(np.argmax(logits))


async def test_top_k_1_at_temperature_1_is_the_greedy_output() -> None:
    p = prompt(40, 3)
    async with running_engine() as (engine, _, _):
        greedy = out_tokens(await collect(engine, req(p, 10)))
        top1 = out_tokens(await collect(engine, req(p, 10, temperature=1.0, top_k=1, seed=5)))
        wide = out_tokens(await collect(engine, req(p, 10, temperature=1.0, seed=5)))
    assert top1 == greedy != wide


async def test_mask_constrains_and_can_force_tokens() -> None:
    digits = np.zeros(258, bool)
    digits[list(b"0123456789")] = True
    calls: list[tuple[int, list[int]]] = []

    def only_digits(step: int, generated: Any) -> np.ndarray:
        calls.append((step, list(generated)))
        return digits

    target = list(b"kvroute!")

    def force(step: int, generated: Any) -> np.ndarray:
        m = np.zeros(260, bool)  # longer than the vocabulary: the tail is ignored
        m[target[step]] = True
        return m

    p = prompt(30, 8)
    async with running_engine() as (engine, _, logits):
        d = out_tokens(await collect(engine, req(p, 10, rid="d", mask_fn=only_digits)))
        f = out_tokens(await collect(engine, req(p, len(target), rid="f", mask_fn=force)))
        s = out_tokens(await collect(engine, req(p, 10, rid="s", temperature=2.0,
                                                 mask_fn=only_digits)))
        free = out_tokens(await collect(engine, req(p, 3, rid="n", mask_fn=lambda *_: None)))
        plain = out_tokens(await collect(engine, req(p, 3)))
    assert all(t in b"0123456789" for t in d + s)
    assert calls[:10] == [(i, d[:i]) for i in range(10)]
    # Greedy under a mask = the best allowed token of the real logits.
    assert d == [int(np.flatnonzero(digits)[np.argmax(lg[digits])]) for lg in logits["d"]]
    assert f == target
    assert free == plain


async def test_a_bad_mask_fails_only_its_request() -> None:
    def boom(step: int, generated: Any) -> None:
        raise RuntimeError("grammar broke")

    cases = {
        "allows no token": lambda step, gen: np.zeros(258, bool),
        "mask of shape": lambda step, gen: np.ones(10, bool),
        "grammar broke": boom,
    }
    async with running_engine() as (engine, _, _):
        ok = asyncio.create_task(collect(engine, req(prompt(40, 9), 30, rid="ok")))
        for needle, fn in cases.items():
            with pytest.raises(EngineError, match=needle):
                await collect(engine, req(prompt(20, 10), 5, rid=needle, mask_fn=fn))
        assert len(out_tokens(await ok)) == 30
        load = engine.load()
        assert (load.running, load.free_blocks) == (0, 64)


async def test_rejects_what_the_model_cannot_run() -> None:
    async with running_engine() as (engine, _, _):
        with pytest.raises(EngineError, match="out of range"):
            await collect(engine, req([1, 258], 1))
        with pytest.raises(EngineError, match="temperature"):
            await collect(engine, req([1, 2], 1, temperature=-1.0))
        with pytest.raises(EngineError, match="empty prompt"):
            await collect(engine, req([], 1))
        assert len(await collect(engine, req([257, 1, 2], 2))) == 2  # specials are tokens too


async def test_closing_the_generator_early_frees_blocks() -> None:
    async with running_engine() as (engine, _, _):
        async with contextlib.aclosing(engine.generate(req(prompt(40, 11), 1000))) as gen:
            async for _chunk in gen:
                break
        load = engine.load()
        assert load.running == 0 and load.free_blocks == load.capacity_blocks
        assert engine.stats.aborted == 1


def test_from_agent_config() -> None:
    engine = from_agent_config(AgentConfig.of(engine="tiny", capacity_blocks=32, vocab_size=258,
                                           tiny_dim=32, tiny_layers=1, tiny_seed=3))
    mc = engine.transformer.config
    assert (engine.vocab_size, engine.eos_token_id) == (258, 256)
    assert (mc.dim, mc.heads, mc.layers, mc.seed) == (32, 2, 1, 3)
    assert engine.kv.data.shape == (32, 1, 2, 16, 2, 16)
    gpt2 = from_agent_config(AgentConfig.of(engine="tiny", capacity_blocks=4, tokenizer="gpt2"))
    assert (gpt2.vocab_size, gpt2.eos_token_id) == (50257, 50256)
    with pytest.raises(SystemExit, match="tokenizer"):
        from_agent_config(AgentConfig.of(engine="tiny", tokenizer="nope"))
    with pytest.raises(SystemExit, match="heads"):
        from_agent_config(AgentConfig.of(engine="tiny", tiny_dim=33))


async def test_stop_during_a_forward_then_restart() -> None:
    p = prompt(600, 12)  # a prefill long enough to be in flight when stop() comes
    engine = TinyEngine(TinyConfig(capacity_blocks=64))
    await engine.start()
    task = asyncio.create_task(collect(engine, req(p, 3)))
    for _ in range(1000):
        if engine.stats.steps:
            break
        await asyncio.sleep(0)
    await engine.stop()  # returns once the forward thread is done with the cache
    with pytest.raises(EngineError, match="stopped"):
        await task
    assert engine.pool.free_blocks == 64
    await engine.start()
    try:
        again = out_tokens(await collect(engine, req(p, 3)))
    finally:
        await engine.stop()
    ref = engine.transformer.reference_logits(p, B)[-1]
    assert again[0] == int(np.argmax(ref))
