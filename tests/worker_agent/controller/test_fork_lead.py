"""A fork's children on a real tiny engine: the first leads, the others start once its
prefill is out and find the parent's prefix cached; a cached prefix starts all at once; a
leader that never prefills releases them after one warm-up request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kvroute.worker_agent.controller.branch import Branch
from kvroute.worker_agent.controller.fork_lead import Runner, Unit, lead, prefix_cached
from kvroute.worker_agent.controller.stats import ProgramStats
from kvroute.worker_agent.engines.base import EngineRequest
from kvroute.worker_agent.engines.tiny import TinyConfig, TinyEngine

B = 16
PREFIX = [(7 * i) % 250 for i in range(40)]  # 2 full blocks a child can share


@pytest.fixture
async def engine() -> AsyncIterator[TinyEngine]:
    e = TinyEngine(TinyConfig(capacity_blocks=64, block_size=B, threaded=False))
    await e.start()
    try:
        yield e
    finally:
        await e.stop()


def children(n: int) -> tuple[Branch, list[Branch]]:
    parent = Branch("0", list(PREFIX), len(PREFIX))
    return parent, [parent.child(f"0.{i}") for i in range(n)]


def gen_runner(engine: TinyEngine, b: Branch, log: list[tuple[str, str, int]]) -> Runner:
    """One engine request of ``b``'s sequence plus a suffix, accounted as a gen step does."""

    async def run() -> list[Branch]:
        log.append(("start", b.id, 0))
        b.tokens.append(100 + int(b.id.rpartition(".")[2]))
        req = EngineRequest(f"r/{b.id}", list(b.tokens), 2, seed=1)
        async with contextlib.aclosing(engine.generate(req)) as stream:
            async for chunk in stream:
                if b.first_cached is None:
                    b.first_cached = chunk.cached_tokens
                    b.prefilled()
                    log.append(("prefilled", b.id, chunk.cached_tokens))
        return [b]

    return run


def idle_runner(b: Branch, log: list[tuple[str, str, int]]) -> Runner:
    async def run() -> list[Branch]:
        log.append(("start", b.id, 0))
        return [b]

    return run


async def run_all(units: list[Unit]) -> list[list[Branch]]:
    return list(await asyncio.gather(*(u.run() for u in units)))


async def test_the_leader_prefills_the_prefix_and_the_others_find_it_cached(
        engine: TinyEngine) -> None:
    parent, kids = children(3)
    log: list[tuple[str, str, int]] = []
    stats = ProgramStats()
    assert not prefix_cached(engine, parent, "")
    units = lead(parent, [Unit([c], gen_runner(engine, c, log)) for c in kids], engine,
                 "p", "", stats)
    assert await run_all(units) == [[c] for c in kids]
    assert (stats.forks_led, stats.forks_cached, stats.forks_warmed) == (1, 0, 0)
    # Nobody else starts before the leader's first token is out...
    assert log[:2] == [("start", "0.0", 0), ("prefilled", "0.0", 0)]
    # ...and then they hit the prefix it computed, once.
    hits = {bid: n for what, bid, n in log if what == "prefilled"}
    assert hits["0.1"] >= 2 * B and hits["0.2"] >= 2 * B
    assert parent.first_cached == 0  # the prompt's hit: what the leader's request found
    assert prefix_cached(engine, parent, "")
    assert not prefix_cached(engine, parent, "other salt")


async def test_a_cached_prefix_starts_every_child_at_once(engine: TinyEngine) -> None:
    parent, kids = children(2)
    stats = ProgramStats()
    await run_all(lead(parent, [Unit([c], gen_runner(engine, c, [])) for c in kids], engine,
                       "warm", "", stats))
    parent, kids = children(3)
    log: list[tuple[str, str, int]] = []
    units = [Unit([c], gen_runner(engine, c, log)) for c in kids]
    led = lead(parent, units, engine, "p", "", stats)
    assert led[1:] == units[1:]  # not gated
    await run_all(led)
    assert (stats.forks_led, stats.forks_cached) == (1, 1)
    assert [e[:2] for e in log[:3]] == [("start", "0.0"), ("start", "0.1"), ("start", "0.2")]


async def test_a_leader_that_never_prefills_releases_the_others_after_one_warm_up(
        engine: TinyEngine) -> None:
    parent, kids = children(3)
    log: list[tuple[str, str, int]] = []
    stats = ProgramStats()
    units = [Unit([kids[0]], idle_runner(kids[0], log)),
             *(Unit([c], gen_runner(engine, c, log)) for c in kids[1:])]
    await run_all(lead(parent, units, engine, "p", "", stats))
    assert (stats.forks_led, stats.forks_warmed) == (1, 1)
    assert parent.engine_requests == 1  # the warm-up, counted on the parent, run once
    assert parent.prefill_tokens == len(PREFIX)
    hits = [n for what, _, n in log if what == "prefilled"]
    assert len(hits) == 2 and all(n >= 2 * B for n in hits)


async def test_no_units_or_one_counts_no_fork(engine: TinyEngine) -> None:
    parent, kids = children(1)
    stats = ProgramStats()
    assert lead(parent, [], engine, "p", "", stats) == []
    await run_all(lead(parent, [Unit(kids, gen_runner(engine, kids[0], []))], engine, "p", "",
                       stats))
    assert stats == ProgramStats()
