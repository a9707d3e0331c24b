"""Routers share their decisions through Redis (``--share-decisions``, router/shared.py).

Two real routers on one real Redis with two sim agents: a long prefill sent through router A
is counted in router B's view of that worker's pending prefill and its prefix predicted
there (a sibling through B waits for it), until its first token; an entry of a router that
died is dropped after the max age; with the flag off nothing is published."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request

from kvroute.core.redis_schema import RedisKeys, pack_keys
from kvroute.router.app import RouterApp
from tests.support import free_port, generate, route, wait_for

PROMPT = 4096  # at time_scale=10 the sim engine prefills it in seconds


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50000) for _ in range(PROMPT)]


async def both_known(*routers: RouterApp) -> None:
    await wait_for(lambda: all(set(r.registry.loads) == {"w0", "w1"} for r in routers))


def pending(app: RouterApp, worker: str) -> tuple[int, int]:
    info = app.registry.get(worker)
    assert info is not None
    return info.pending_prefill, info.inflight


def coalesced(app: RouterApp) -> float:
    return app.metrics.registry.get_sample_value("kvroute_router_coalesced_total") or 0.0


def metric(app: RouterApp, direction: str) -> float:
    url = f"http://127.0.0.1:{app.cfg.listen.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    line = f'kvroute_router_shared_decisions_total{{direction="{direction}"}} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


async def test_a_decision_through_one_router_is_counted_and_predicted_by_another(
        cluster) -> None:
    for w in ("w0", "w1"):
        await cluster.agent(w, time_scale=10.0)
    a = await cluster.router(metrics_port=free_port())
    b = await cluster.router(metrics_port=free_port())
    await both_known(a, b)
    tokens = prompt(1)
    call = asyncio.create_task(generate(a.port, tokens, max_tokens=1))
    await wait_for(lambda: any(pending(a, w)[0] for w in ("w0", "w1")))
    w = next(w for w in ("w0", "w1") if pending(a, w)[0])
    other = "w1" if w == "w0" else "w0"
    # B counts A's prefill on w, and nothing on the other worker.
    await wait_for(lambda: pending(b, w)[0] >= PROMPT - 16, timeout=5.0)
    assert not call.done(), "the prefill must still be pending for this test to mean much"
    assert pending(b, w)[1] == 1 and pending(b, other) == (0, 0)
    assert b.registry.loads[w].pending_prefill_tokens >= PROMPT - 16
    # ... and predicts its prefix there: the same prompt through B goes to w, cached.
    resp = await route(b.port, tokens)
    assert resp.worker_id == w and resp.cached_tokens >= PROMPT - 16
    # A sibling through B (the prefix and its own short suffix) waits for A's prefill there
    # rather than prefilling the prefix again.
    sibling = asyncio.create_task(generate(b.port, tokens + [7] * 32, max_tokens=1))
    await wait_for(lambda: coalesced(b) == 1 or sibling.done(), timeout=5.0)
    assert coalesced(b) == 1 and not call.done()
    # After A's first token, B stops counting it, and the sibling goes on to w.
    out = await call
    assert out and out[0].worker_id == w
    assert (await sibling)[0].worker_id == w
    await wait_for(lambda: pending(b, w) == (0, 0) and b.mirror.shared.pending() == 0,
                   timeout=5.0)
    assert metric(a, "sent") >= 2 and metric(b, "applied") >= 1
    # B does not apply its own entries: nothing it sent is counted twice.
    await generate(b.port, prompt(2), max_tokens=1)
    assert all(pending(b, x) == (0, 0) for x in ("w0", "w1"))
    assert b.mirror.shared.stats.applied == 1


async def test_a_dead_routers_decision_leaves_no_phantom_load(cluster) -> None:
    await cluster.agent("w0")
    await cluster.agent("w1")
    b = await cluster.router(share_max_age_s=1.0)
    await both_known(b)
    # A router that died after its sent entry: no done entry will ever come.
    r = cluster.redis.client()
    r.xadd(RedisKeys("default").decisions, {
        "r": "dead-router", "op": "sent", "q": "req-1", "w": "w0", "u": 5000, "c": 0,
        "k": pack_keys([1, 2, 3]), "t": int(time.time() * 1000)})
    await wait_for(lambda: pending(b, "w0") == (5000, 1), timeout=5.0)
    # Undone by its max age (1 s here; the default 30 s would outlast this wait).
    await wait_for(lambda: pending(b, "w0") == (0, 0), timeout=5.0)
    assert b.mirror.shared.pending() == 0 and b.mirror.shared.stats.applied == 1
    # Malformed or already too old: dropped, never counted.
    r.xadd(RedisKeys("default").decisions, {"r": "x", "op": "sent", "q": "q", "w": "w0"})
    r.xadd(RedisKeys("default").decisions, {
        "r": "x", "op": "sent", "q": "old", "w": "w0", "u": 100, "c": 0, "k": b"",
        "t": int(time.time() * 1000) - 60_000})
    await wait_for(lambda: b.mirror.shared.stats.dropped >= 2, timeout=5.0)
    assert pending(b, "w0") == (0, 0)


async def test_with_the_flag_off_nothing_is_published(cluster) -> None:
    await cluster.agent("w0")
    await cluster.agent("w1")
    a = await cluster.router(share_decisions=False)
    await both_known(a)
    assert a.mirror.shared is None
    await generate(a.port, prompt(3), max_tokens=1)
    assert cluster.redis.client().xlen(RedisKeys("default").decisions) == 0


async def test_a_redis_that_is_down_drops_the_entries_not_the_request(cluster) -> None:
    await cluster.agent("w0")
    await cluster.agent("w1")
    a = await cluster.router()
    await both_known(a)
    cluster.redis.stop()
    await wait_for(lambda: not a.mirror.available, timeout=5.0)
    out = await generate(a.port, prompt(4), max_tokens=2)
    assert out and out[0].worker_id in ("w0", "w1")
    await wait_for(lambda: a.mirror.shared.stats.dropped >= 2, timeout=10.0)
    assert a.mirror.shared.stats.sent == 0
