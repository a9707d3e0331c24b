"""bench/scale.py bounded: 200 publishers, 3 routers, a real 3-node Redis Cluster.

Every router's mirror converges to the workers' truth after a burst of store/evict events;
a feed lost with entries no router read (the stream deleted) heals from the snapshots; a
router started late bootstraps to the same view. Views are read as the bench reads them,
through ``/debug/mirror`` on the metrics port."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import urllib.request

import redis

from kvroute.core.cache_events import CacheEvent
from kvroute.core.load import EngineLoad
from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import FeedEvent, Heartbeat, Op, RedisKeys, pack_keys
from kvroute.router.app import RouterApp
from kvroute.worker_agent.publisher import CachePublisher
from tests.conftest import router_config
from tests.e2e.test_redis_cluster import redis_cluster  # noqa: F401 - the fixture
from tests.support import free_port, wait_for

MODEL = "scale"
WORKERS = 200


class Worker:
    """One simulated engine: its cache (the truth) and the agent's real publisher."""

    def __init__(self, name: str, client: object, rng: random.Random) -> None:
        self.name = name
        self.keys: dict[int, None] = dict.fromkeys(rng.getrandbits(63) for _ in range(32))
        self.pub = CachePublisher(client, RedisKeys(MODEL), name, lambda: list(self.keys),
                                  self.beat, heartbeat_s=0.5, heartbeat_ttl_s=10.0)

    def beat(self) -> Heartbeat:
        return Heartbeat(worker_id=self.name, address="127.0.0.1:9", epoch="e", block_size=16,
                         ttl_s=10.0, load=EngineLoad(capacity_blocks=64))

    def step(self, rng: random.Random) -> None:
        new = tuple(rng.getrandbits(63) for _ in range(4))
        self.keys.update(dict.fromkeys(new))
        self.pub.on_event(CacheEvent(Op.STORE, new))
        if len(self.keys) > 64:
            old = tuple(list(self.keys)[:4])
            for k in old:
                del self.keys[k]
            self.pub.on_event(CacheEvent(Op.EVICT, old))


def view(app: RouterApp) -> dict[str, set[int]]:
    """The router's mirror, per worker, read over HTTP (``/debug/mirror?keys=1``)."""
    url = f"http://127.0.0.1:{app.cfg.listen.metrics_port}/debug/mirror?keys=1"
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = json.load(resp)
    assert body["available"]
    out = {}
    for w, row in body["workers"].items():
        blob = base64.b64decode(row["keys_b64"])
        out[w] = {int.from_bytes(blob[i:i + 8], "big") for i in range(0, len(blob), 8)}
        assert len(out[w]) == row["blocks"] and sum(out[w]) % (1 << 64) == row["sum"]
    return out


async def converged(routers: list[RouterApp], truth: dict[str, set[int]]) -> bool:
    views = await asyncio.gather(*(asyncio.to_thread(view, r) for r in routers))
    return all({w: k for w, k in v.items() if k} == truth for v in views)


async def load_burst(workers: list[Worker], rng: random.Random, seconds: float) -> None:
    for _ in range(int(seconds * 50)):  # 50 ticks a second, 10 events a tick: 500/s
        for w in rng.sample(workers, 10):
            w.step(rng)
        await asyncio.sleep(0.02)


async def test_routers_converge_heal_and_bootstrap_at_scale(
        redis_cluster: list[int]) -> None:  # noqa: F811 - the fixture
    url = f"redis+cluster://127.0.0.1:{redis_cluster[0]}"
    rng = random.Random(5)
    client = connect(url)
    workers = [Worker(f"w{i:03d}", client, rng) for i in range(WORKERS)]
    routers: list[RouterApp] = []
    keys = RedisKeys(MODEL)
    try:
        for w in workers:
            await w.pub.start()
        await wait_for(lambda: all(w.pub.stats.resyncs for w in workers), 30, "snapshots")
        for _ in range(2):
            app = RouterApp(router_config(url, model=MODEL, metrics_port=free_port(),
                                          block_size=16))
            await app.start(wait_for_redis_s=10)
            routers.append(app)

        def truth() -> dict[str, set[int]]:
            every = {w.name: set(w.keys) for w in workers} | manual_truth
            return {w: k for w, k in every.items() if k}

        manual_truth: dict[str, set[int]] = {}
        # 1. A burst of events: every router ends up holding exactly what the workers do.
        await load_burst(workers, rng, 2.0)
        await wait_for(lambda: converged(routers, truth()), 30, "routers converged")
        assert all(r.mirror.stats.events_applied > 0 for r in routers)

        # 2. The feed lost with an entry no router read: written in one transaction with the
        # stream's deletion (every key of the model is in one slot). A worker written by hand
        # (its heartbeat, snapshot, meta and feed as an agent writes them) sends it.
        rc = redis.RedisCluster(host="127.0.0.1", port=redis_cluster[0])
        hand = "hand"
        stored: list[int] = []

        def publish(seq: int, op: Op, new: tuple[int, ...], lose: bool = False) -> None:
            pipe = rc.pipeline(transaction=True)
            if new:
                pipe.sadd(keys.snapshot(hand), *(pack_keys((k,)) for k in new))
            pipe.hset(keys.meta(hand), mapping={"epoch": "h1", "seq": seq})
            pipe.xadd(keys.feed, FeedEvent(hand, "h1", seq, op, new).to_fields())
            if lose:
                pipe.delete(keys.feed)
            pipe.execute()
            stored.extend(new)
            manual_truth[hand] = set(stored)

        rc.set(keys.heartbeat(hand), Heartbeat(worker_id=hand, address="127.0.0.1:9",
                                               epoch="h1", block_size=16,
                                               ttl_s=60).to_json(), px=60_000)
        publish(1, Op.CLEAR, ())
        publish(2, Op.STORE, (11, 12))
        await wait_for(lambda: converged(routers, truth()), 30, "the hand worker seen")
        gaps = [r.mirror.stats.gaps for r in routers]
        publish(3, Op.STORE, (13, 14), lose=True)  # no router can read it: the feed is gone
        publish(4, Op.STORE, (15,))  # the next entry: a gap (3 missing) every router heals
        await load_burst(workers, rng, 1.0)  # the agents go on writing the new stream
        await wait_for(lambda: converged(routers, truth()), 30, "healed after the feed loss")
        assert all(r.mirror.stats.gaps > g for r, g in zip(routers, gaps, strict=True))
        rc.close()

        # 3. A router started late bootstraps to the same view.
        late = RouterApp(router_config(url, model=MODEL, metrics_port=free_port(),
                                       block_size=16))
        await late.start(wait_for_redis_s=10)
        routers.append(late)
        await wait_for(lambda: converged(routers, truth()), 30, "the late router's view")
        assert late.mirror.stats.bootstraps == 1
    finally:
        for app in routers:
            await app.stop(grace_s=0.5)
        # The publishers share one client: each stop closes it, at most once effectively.
        await asyncio.gather(*(w.pub.stop(deregister=False) for w in workers))
