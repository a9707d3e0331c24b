"""Controller programs on the sim engine: constraints through its masks (no logits; the sim's
deterministic token moves to the first allowed id), behind a real router."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from kvroute.worker_agent.engines.base import EngineError, EngineRequest
from kvroute.worker_agent.engines.sim import SimConfig, SimEngine, masked_token, sim_tokens
from tests.e2e.test_programs import REGEX, SCHEMA, back, fork, gen, results, run, valid_json
from tests.support import wait_for

SIM = dict(engine="sim", tokenizer="byte", vocab_size=258, capacity_blocks=256)


@pytest.mark.parametrize(("constraint", "check"), [
    (P.Constraint(json_schema=json.dumps(SCHEMA)), valid_json),
    (P.Constraint(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
], ids=["json_schema", "regex"])
async def test_constrained_programs_on_sim_agents_behind_a_router_match(cluster, constraint,
                                                                        check) -> None:
    await cluster.agent("s0", **SIM)
    await cluster.agent("s1", **SIM)
    router = await cluster.router(vocab_size=258)
    await wait_for(lambda: len(router.registry.loads) == 2, what="agents registered")
    seen = set()
    for seed in (1, 2, 3, 4):
        body = [gen(64, constraint=constraint, capture="v")]
        resps = await run(router.port, [fork(body, n=4)], seed=seed, router=True)
        assert {r.worker_id for r in resps} <= {"s0", "s1"}
        res = results(resps)
        assert len(res) == 4
        for r in res.values():
            v = r.variables["v"]
            assert v.complete, v.text
            assert check(v.text), v.text
            assert bytes(r.token_ids).decode() == v.text
            assert r.logprob == 0.0  # the sim has no logits
            seen.add(v.text)
    assert len(seen) > 3  # branches and seeds give different (deterministic) outputs
    # Deterministic: the same program and seed give the same outputs.
    again = results(await run(router.port, [fork(body, n=4)], seed=4, router=True))
    assert {k: v.variables["v"].text for k, v in again.items()} == \
        {k: v.variables["v"].text for k, v in res.items()}


async def test_sim_runs_constraints_with_backtrack_and_continue(cluster) -> None:
    s = await cluster.agent("s", **SIM)
    digits = P.Constraint(regex="[0-9]{12}")
    res = results(await run(s.port, [gen(5, constraint=digits), back(2),
                                     gen(20, continue_constraint=True, capture="d")]))
    assert re.fullmatch(r"[0-9]{12}", res["0"].variables["d"].text)
    assert res["0"].variables["d"].complete


def _sim(vocab: int = 258) -> SimEngine:
    return SimEngine(SimConfig(capacity_blocks=64, vocab_size=vocab, time_scale=0.0))


async def _collect(engine: SimEngine, req: EngineRequest) -> list[int]:
    return [t async for c in engine.generate(req) for t in c.token_ids]


async def test_sim_mask_picks_the_first_allowed_id_at_or_after_its_token_cycling() -> None:
    allowed = np.zeros(258, dtype=bool)
    allowed[[10, 200]] = True
    assert [masked_token(t, allowed) for t in (0, 10, 11, 200, 201, 257)] == \
        [10, 10, 200, 200, 10, 10]
    assert masked_token(5, np.zeros(258, dtype=bool)) is None
    engine = _sim()
    await engine.start()
    try:
        prompt = list(range(40))
        free = await _collect(engine, EngineRequest("a", prompt, 8, seed=3))
        assert free == sim_tokens(prompt, 3, 8, 258)
        same = await _collect(engine, EngineRequest("b", prompt, 8, seed=3,
                                                    mask_fn=lambda *_: None))
        assert same == free
        masked = await _collect(engine, EngineRequest("c", prompt, 8, seed=3,
                                                      mask_fn=lambda *_: allowed))
        assert masked == [masked_token(t, allowed) for t in free]
        steps: list[tuple[int, list[int]]] = []

        def record(step: int, generated: object) -> None:
            steps.append((step, list(generated)))  # type: ignore[call-overload]

        await _collect(engine, EngineRequest("d", prompt, 3, seed=3, mask_fn=record))
        assert steps == [(0, []), (1, free[:1]), (2, free[:2])]
    finally:
        await engine.stop()


@pytest.mark.parametrize("mask_fn", [
    lambda *_: np.zeros(258, dtype=bool),
    lambda *_: np.ones(10, dtype=bool),
    lambda *_: 1 / 0,
], ids=["all_false", "too_short", "raises"])
async def test_a_bad_mask_fails_only_its_request_on_sim(mask_fn) -> None:
    engine = _sim()
    await engine.start()
    try:
        with pytest.raises(EngineError):
            await _collect(engine, EngineRequest("bad", list(range(20)), 4, mask_fn=mask_fn))
        assert len(await _collect(engine, EngineRequest("ok", list(range(20)), 4))) == 4
        assert engine.load().running == 0
    finally:
        await engine.stop()
