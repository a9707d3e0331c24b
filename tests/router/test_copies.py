"""Background copies of hot prefixes, over a real redis-server and real agents: a request
for a prefix in demand stays on its busy holder, and the router copies the prefix to an idle
worker lacking it (kvroute's ``replica``); with ``--max-copies 0`` nothing is copied."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from kvroute.core.blocks import BlockHasher
from tests.support import generate, wait_for

# Tokens of the shared prefix (512 blocks of 16), long enough that redoing it elsewhere
# costs more than waiting out half of BUSY's prefill on its holder.
SYSTEM = 8192
BUSY = 8000  # uncached tokens of the request that keeps the holder busy
POLICY = "kvroute"


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(n)]


def copies(router: Any, outcome: str) -> float:
    return router.metrics.registry.get_sample_value(
        "kvroute_router_prefix_copies_total", {"outcome": outcome}) or 0.0


async def hot_prefix_on_a_busy_holder(cluster: Any, policy: str, *,
                                      y: dict[str, Any] | None = None, **router_kw: Any
                                      ) -> tuple[Any, list[int], list[Any]]:
    """The shared prefix cached on x only, x prefilling a long prompt, and a third request
    for the prefix routed meanwhile: returns the router, the prefix and that request's
    responses."""
    await cluster.agent("x", time_scale=2.0)  # B's prefill takes ~1.4 s
    router = await cluster.router(policy=policy, **router_kw)
    await wait_for(lambda: set(router.registry.loads) == {"x"}, what="x registered")
    system = prompt(SYSTEM, 1)
    await generate(router.port, system + prompt(64, 2), max_tokens=1)  # A: caches it on x
    await wait_for(lambda: router.mirror.index.count("x") >= SYSTEM // 16, what="x's feed")
    await cluster.agent("y", **(y or {}))
    await wait_for(lambda: set(router.registry.loads) == {"x", "y"}, what="y registered")
    busy = asyncio.create_task(generate(router.port, system + prompt(BUSY, 3), max_tokens=1))
    await wait_for(lambda: router.registry.loads["x"].pending_prefill_tokens >= BUSY,
                   what="B pending on x")
    # ... with the context its tokens attend to (the system prompt at least): the policy
    # weighs a backlog by its attention too.
    assert router.registry.loads["x"].pending_prefill_context >= BUSY * SYSTEM
    assert router.metrics.registry.get_sample_value(
        "kvroute_router_worker_pending_prefill_context", {"worker": "x"}) >= BUSY * SYSTEM
    c = await generate(router.port, system + prompt(64, 4), max_tokens=1)
    b = await busy
    assert b[0].worker_id == "x" and b[0].cached_tokens >= SYSTEM
    return router, system, c


async def test_the_request_stays_and_the_prefix_is_copied(cluster: Any) -> None:
    router, system, c = await hot_prefix_on_a_busy_holder(cluster, POLICY)
    assert c[0].worker_id == "x" and c[0].cached_tokens >= SYSTEM  # a hit on its holder
    keys = BlockHasher(16, "default").keys(system)
    # The copy's store events reach the router: both workers hold the prefix now.
    await wait_for(lambda: router.mirror.index.match(keys).get("y", 0) == len(keys),
                   what="the prefix copied to y")
    await wait_for(lambda: copies(router, "ok") == 1, what="the copy ended")
    assert copies(router, "sent") == 1 and copies(router, "failed") == 0
    assert router.metrics.copied_tokens._value.get() == SYSTEM
    # Its load came and went: nothing left pending or in flight on y.
    y = router.registry.loads["y"]
    assert y.pending_prefill_tokens == 0 and y.pending_prefill_context == 0 and y.inflight == 0
    # ... but its prefill counts in y's prefill rate, gauge included.
    assert y.prefill_rate >= SYSTEM / 30.0
    assert router.metrics.registry.get_sample_value(
        "kvroute_router_worker_prefill_rate", {"worker": "y"}) == pytest.approx(
        router.registry.loads["y"].prefill_rate, rel=0.05)
    # The next request for the prefix finds two holders and takes the idle one.
    d = await generate(router.port, system + prompt(64, 5), max_tokens=1)
    assert d[0].cached_tokens >= SYSTEM


async def test_with_copies_off_the_request_stays_and_nothing_is_copied(cluster: Any) -> None:
    router, _, c = await hot_prefix_on_a_busy_holder(cluster, POLICY, max_copies=0)
    assert c[0].worker_id == "x" and c[0].cached_tokens >= SYSTEM
    await asyncio.sleep(0.5)
    assert copies(router, "sent") == 0 and router.mirror.index.count("y") == 0


async def test_a_failed_copy_is_counted_and_leaves_no_load(cluster: Any) -> None:
    # y refuses prompts as long as the prefix: the copy fails, the request it came with not.
    router, system, c = await hot_prefix_on_a_busy_holder(cluster, POLICY,
                                                          y={"max_prompt_tokens": SYSTEM - 1})
    assert c[0].worker_id == "x" and c[0].cached_tokens >= SYSTEM
    await wait_for(lambda: copies(router, "failed") == 1, what="the copy failed")
    assert copies(router, "ok") == 0
    # Nothing will store the prefix on y: its predictions are gone at once, not at their
    # deadline (30 s), so no request is routed to y for a prefix it does not hold.
    keys = BlockHasher(16, "default").keys(system)
    assert router.mirror.index.match(keys).get("y", 0) == 0
    assert router.mirror.index.predicted("y") == 0
    assert router.metrics.withdrawn._value.get() == len(keys)
    ld = router.registry.loads["y"]
    assert ld.pending_prefill_tokens == 0 and ld.pending_prefill_context == 0
    assert ld.inflight == 0


async def test_a_copy_to_a_hung_worker_ends_at_its_deadline(cluster: Any) -> None:
    # y takes ages to prefill (a worker that hangs): the copy's call has a deadline, so its
    # load and predicted blocks leave y then, not when (if ever) y answers.
    router, _, c = await hot_prefix_on_a_busy_holder(
        cluster, POLICY, y={"time_scale": 10_000.0}, copy_timeout_s=0.5)
    assert c[0].worker_id == "x" and c[0].cached_tokens >= SYSTEM
    await wait_for(lambda: copies(router, "sent") == 1, what="the copy sent")
    await wait_for(lambda: copies(router, "failed") == 1, what="the copy's deadline")
    assert copies(router, "ok") == 0
    assert router.mirror.index.predicted("y") == 0
    ld = router.registry.loads["y"]
    assert ld.pending_prefill_tokens == 0 and ld.pending_prefill_context == 0
    assert ld.inflight == 0
