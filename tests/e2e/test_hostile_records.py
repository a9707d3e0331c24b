"""Records anyone with write access to Redis could forge, against a real router and agents:
one bad record leaves out its worker only, never routing for the whole cluster."""

from __future__ import annotations

import json
import math

import pytest

from kvroute.core.redis_schema import Heartbeat, RedisKeys
from tests.support import generate, route, wait_for

KEYS = RedisKeys("default")


@pytest.mark.parametrize("fields", [
    {"running": 2 * 10 ** 70},
    {"pending_prefill_tokens": 10 ** 40},
    {"capacity_blocks": 10 ** 30, "free_blocks": 10 ** 30},
    {"max_running": 10 ** 25},
    {"ttl_s": 1e300},
    {"ttl_s": math.nan},
], ids=lambda f: ",".join(f))
async def test_a_forged_heartbeat_leaves_every_other_worker_routable(cluster, fields) -> None:
    await cluster.agent("a")
    await cluster.agent("b")
    router = await cluster.router()
    await wait_for(lambda: len(router.registry.loads) == 2, what="both agents joined")
    data = json.loads(Heartbeat("evil", "127.0.0.1:1", "e", ttl_s=1.0).to_json())
    data.update(fields)
    c = cluster.redis.client()
    c.set(KEYS.heartbeat("evil"), json.dumps(data), px=60_000)
    rejected = 'kvroute_router_records_rejected_total'
    await wait_for(lambda: router.metrics.registry.get_sample_value(
        rejected, {"kind": "heartbeat", "reason": "out_of_range"}) == 1,
        what="the forged heartbeat rejected and counted")
    for i in range(6):
        tokens = [(i * 97 + t) % 50000 for t in range(64)]
        resp = await route(router.port, tokens)
        assert resp.worker_id in ("a", "b")
        out = await generate(router.port, tokens)
        assert out[0].worker_id in ("a", "b") and out[-1].usage.completion_tokens == 4
    assert "evil" not in router.registry.loads
    assert router.mirror.available
