"""Benchmark: what sharing routing decisions between routers costs (``--share-decisions``).

Per routed request, with a cold prompt of ``--keys`` blocks, in one run:

* **baseline** -- a router's mirror applying the feed's store event of those blocks (what
  every router already pays per cold prefill)
* **apply a shared decision** -- another router's *sent* entry (counted, its blocks predicted
  and registered as in flight) and its *done* entry, as ``router/shared.py`` applies them
* **publish** -- our *sent* and *done* entries written to a real redis-server by the
  background writer, pipelined, until all are in the stream (wall time per request over a
  burst; the request itself never waits for it)

    python bench/shared_decisions.py [--requests 2000] [--keys 512]

Prints microseconds per request and each row's ratio to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time

from kvroute.core.load import EngineLoad
from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import FeedEvent, Heartbeat, Op, RedisKeys, pack_keys
from kvroute.router.coalesce import InflightPrefixes
from kvroute.router.mirror import IndexMirror
from kvroute.router.registry import WorkerRegistry
from kvroute.router.shared import SharedDecisions

WORKERS = [f"w{i}" for i in range(16)]


def registry() -> WorkerRegistry:
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats({w: Heartbeat(worker_id=w, address="127.0.0.1:9", epoch="e",
                                       block_size=16, load=EngineLoad(capacity_blocks=1 << 20))
                          for w in WORKERS})
    return reg


def offline_mirror() -> IndexMirror:
    """A mirror whose client never connects: these rows apply entries in memory."""
    return IndexMirror(connect("redis://127.0.0.1:1"), RedisKeys("bench"), registry())


def prompts(n: int, keys: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.getrandbits(63) for _ in range(keys)] for _ in range(n)]


async def run_baseline(blocks: list[list[int]]) -> float:
    mirror = offline_mirror()
    seqs = dict.fromkeys(WORKERS, 0)
    events = []
    for i, keys in enumerate(blocks):
        w = WORKERS[i % len(WORKERS)]
        seqs[w] += 1
        events.append(FeedEvent(w, "e", seqs[w], Op.STORE if seqs[w] > 1 else Op.CLEAR,
                                tuple(keys)))
    t0 = time.perf_counter()
    for ev in events:
        await mirror.apply(ev)
    return time.perf_counter() - t0


def run_apply(blocks: list[list[int]]) -> float:
    mirror = offline_mirror()
    shared = SharedDecisions(None, RedisKeys("bench"), mirror, 30.0, 30.0,
                             inflight=InflightPrefixes())
    now_ms = int(time.time() * 1000)
    sent = [{b"r": b"other", b"op": b"sent", b"q": f"q{i}".encode(),
             b"w": WORKERS[i % len(WORKERS)].encode(), b"u": b"8192", b"c": b"0",
             b"k": pack_keys(keys), b"t": str(now_ms).encode()}
            for i, keys in enumerate(blocks)]
    done = [{b"r": b"other", b"op": b"done", b"q": f"q{i}".encode(),
             b"t": str(now_ms).encode()} for i in range(len(blocks))]
    t0 = time.perf_counter()
    for s in sent:
        shared.apply(s)
    for d in done:
        shared.apply(d)
    secs = time.perf_counter() - t0
    assert shared.stats.applied == len(blocks) and shared.pending() == 0
    return secs


async def run_publish(url: str, blocks: list[list[int]]) -> float:
    client = connect(url)
    keys = RedisKeys("bench")
    mirror = IndexMirror(client, keys, registry())
    shared = SharedDecisions(client, keys, mirror, 30.0, 30.0)
    t0 = time.perf_counter()
    for i, k in enumerate(blocks):
        shared.done(shared.sent(f"q{i}", WORKERS[i % len(WORKERS)], 8192, 0, k))
        if i % 64 == 63:
            await asyncio.sleep(0)  # requests arrive over time: let the writer run
    while shared.stats.sent + shared.stats.dropped < 2 * len(blocks):
        await asyncio.sleep(0.001)
    secs = time.perf_counter() - t0
    assert shared.stats.dropped == 0
    await shared.close()
    await client.aclose()
    return secs


async def main_async(args: argparse.Namespace) -> None:
    from kvroute.demo.procs import scratch_redis

    blocks = prompts(args.requests, args.keys)
    rows = [("baseline: feed store event applied", await run_baseline(blocks)),
            ("apply a shared decision (sent+done)", run_apply(blocks))]
    async with scratch_redis() as url:
        rows.append(("publish sent+done to Redis", await run_publish(url, blocks)))
    base = rows[0][1]
    print(f"{args.requests} requests, {args.keys} blocks each, {len(WORKERS)} workers")
    print(f"{'':38} {'us/request':>11} {'vs baseline':>12}")
    for name, s in rows:
        print(f"{name:38} {s / args.requests * 1e6:>11.1f} {s / base:>11.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="routed requests")
    ap.add_argument("--keys", type=int, default=512, help="blocks of each cold prompt")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
