"""Log-probabilities from a real tiny engine's logits: the tap routes a subscribed request's
logits by step and passes every request's on to the observer that was there before it."""

from __future__ import annotations

import asyncio

import numpy as np

from kvroute.worker_agent.controller.logprobs import LogitsTap, token_logprob
from kvroute.worker_agent.engines.base import EngineRequest
from kvroute.worker_agent.engines.tiny import TinyConfig, TinyEngine


def test_token_logprob_is_the_log_softmax_of_the_token() -> None:
    logits = np.random.default_rng(0).normal(0, 5, 1000).astype(np.float32)
    exact = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
    for t in (0, int(logits.argmax()), 999):
        assert abs(token_logprob(logits, t) - exact[t]) < 1e-4
    assert token_logprob(logits, int(logits.argmax())) == max(
        token_logprob(logits, t) for t in range(1000))
    assert token_logprob(None, 5) == 0.0  # an engine without logits


async def test_the_tap_routes_subscribed_logits_and_chains_the_previous_observer() -> None:
    engine = TinyEngine(TinyConfig(capacity_blocks=64, block_size=16, threaded=False))
    seen: list[tuple[str, int]] = []
    engine.logits_observer = lambda rid, step, lg: seen.append((rid, step))
    tap = LogitsTap(engine)
    await engine.start()
    try:
        async def run(rid: str) -> list[int]:
            req = EngineRequest(rid, [1, 2, 3, 4], 3, seed=7)
            return [t async for c in engine.generate(req) for t in c.token_ids]

        with tap.subscribe("a") as logits:
            out, _ = await asyncio.gather(run("a"), run("b"))
            assert sorted(logits) == [0, 1, 2]  # "a"'s steps only
            assert all(lg.shape == (engine.config.vocab_size,) for lg in logits.values())
            assert len(out) == 3
        await run("a")  # unsubscribed: nothing lands anywhere but the old observer
        assert sorted(logits) == [0, 1, 2]
    finally:
        await engine.stop()
    assert sorted(seen) == sorted([(r, s) for r in ("a", "b", "a") for s in range(3)])
