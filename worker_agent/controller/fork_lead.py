"""A fork's local children scheduled so that the engine computes their parent's prefix once.

Children submitted together would all miss the prefix (an engine shares blocks only once
they are computed). So the first child leads: its first engine request prefills the prefix
with its own suffix, and the others start once that request's first token is out
(``Branch.prefilled``), finding the prefix cached -- as the router coalesces requests on a
prefix in flight. (A separate 1-token warm-up request instead put every child's suffix an
engine iteration after the prefix: 3-4% later first tokens on fork traffic in the replay
simulator.) Under ``FIRST_FINISHED`` the leader thereby starts that one prefill ahead.

Contract of :func:`lead`:
- When the prefix is cached already (:func:`prefix_cached`), every unit starts at once.
- A leader that ends before its first prefill (a program of fast-forwards only, or a
  failure) releases the others after one warm-up request (:func:`warm`), run once per fork.
- A parent that leads a fork itself is prefilled when its own leader is.
- The parent's first hit (the prompt's, for the root) is the leader's first request's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvroute.core.blocks import BlockHasher
from kvroute.worker_agent.controller.branch import Branch
from kvroute.worker_agent.controller.stats import ProgramStats
from kvroute.worker_agent.engines.base import EngineRequest

Runner = Callable[[], Awaitable[list[Branch]]]
"""One unit's work: runs its members' programs and returns their live branches."""


@dataclass(frozen=True, slots=True)
class Unit:
    """What a fork runs as one task: one local child, or children on another worker."""

    members: list[Branch]
    run: Runner


def prefix_cached(engine: Any, b: Branch, cache_salt: str) -> bool:
    """Whether the engine holds every full block of ``b``'s sequence (vllm: by its
    published cache view)."""
    pool, bs = getattr(engine, "pool", None), getattr(engine, "block_size", 0)
    full = (len(b.tokens) - 1) // bs if bs else 0
    if not full:
        return True  # nothing a child could share
    if pool is not None:
        keys = BlockHasher(bs, engine.model, cache_salt).keys(b.tokens)
        return bool(pool.longest_cached_prefix(keys[:full]) >= full)
    return hasattr(engine, "cached_blocks") and engine.cached_blocks(
        b.tokens[: full * bs], cache_salt) >= full


async def warm(engine: Any, b: Branch, request_id: str, cache_salt: str) -> None:
    """Make the engine cache ``b``'s full blocks: one 1-token request (``request_id``)
    whose token is discarded; its figures count as ``b``'s."""
    ereq = EngineRequest(request_id=request_id, token_ids=list(b.tokens), max_tokens=1,
                         cache_salt=cache_salt)
    async with contextlib.aclosing(engine.generate(ereq)) as stream:
        async for chunk in stream:
            b.prefilled()
            b.engine_requests += 1
            b.prefill_tokens += len(ereq.token_ids) - chunk.cached_tokens
            b.last_cached = chunk.cached_tokens
            if b.first_cached is None:
                b.first_cached = chunk.cached_tokens
            break  # one token: this chunk is the last (vllm: with its exact hit)


def lead(parent: Branch, units: list[Unit], engine: Any, request_id: str, cache_salt: str,
         stats: ProgramStats) -> list[Unit]:
    """``units`` (a fork's local children, the first leading) as they are to run: see the
    module doc. ``request_id`` is the program's (the warm-up request is
    ``{request_id}/{parent.id}/warm``); ``stats`` counts the fork as led, cached or warmed."""
    if not units:
        return units  # every child moved to other workers
    leader, lead_run = units[0].members[0], units[0].run
    gated = len(units) > 1 and not prefix_cached(engine, parent, cache_salt)
    if len(units) > 1:
        if gated:
            stats.forks_led += 1
        else:
            stats.forks_cached += 1
    ready = asyncio.Event()
    # A parent that leads a fork itself is prefilled when its own leader is.
    leader.on_prefill = [ready, *(e for e in parent.on_prefill if not e.is_set())]
    warming = asyncio.Lock()
    cold = warmed = False  # the leader ended before a prefill; a warm-up has run

    async def first() -> list[Branch]:
        nonlocal cold
        try:
            return await lead_run()
        finally:
            if not ready.is_set():
                cold = True
                ready.set()
            if parent.first_cached is None and leader.first_cached is not None:
                # The prompt's hit is what the first engine request after it found.
                parent.first_cached = min(leader.first_cached, len(parent.tokens))

    async def follow(run: Runner) -> list[Branch]:
        nonlocal warmed
        await ready.wait()
        if cold:
            async with warming:
                if not warmed:
                    stats.forks_warmed += 1
                    await warm(engine, parent, f"{request_id}/{parent.id}/warm",
                               cache_salt)
                    warmed = True
        return await run()

    return [Unit(units[0].members, first),
            *(Unit(u.members, lambda r=u.run: follow(r)) if gated else u
              for u in units[1:])]
