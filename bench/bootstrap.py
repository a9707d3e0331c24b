"""Benchmark: a router mirror's bootstrap, in-process, against a real Redis Cluster.

What ``bench/scale.py --boot-only`` times from a router's process start, without the
process: W workers' snapshots of B blocks each (a quarter as many distinct keys as
entries, ~4 holders a key as in scale.py), their metas, heartbeats and the workers set are
written straight to a 3-master cluster (pipelines, not publishers), then the mirror's
``_bootstrap`` is timed. Baseline, in the same run and alternated with it: the same
bootstrap with the index load left out (every snapshot read and parsed, nothing stored),
the floor that reading from the one node holding the model's slot sets.

    python bench/bootstrap.py [--workers 1000] [--blocks 10000] [--repeats 3]

Prints the bootstrap and baseline seconds, their ratio, and that node's Redis CPU per
SMEMBERS (INFO commandstats).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import redis
from scale import BLOCK, redis_cluster

from kvroute.core.config import AT_LEAST_ONE
from kvroute.core.index import PrefixIndex
from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import Heartbeat, RedisKeys, pack_keys
from kvroute.router.mirror import IndexMirror
from kvroute.router.registry import WorkerRegistry

MODEL = "bench"


async def write(url: str, keys: RedisKeys, workers: int, blocks: int) -> None:
    r = connect(url)
    rng = random.Random(1)
    distinct = [rng.getrandbits(63) for _ in range(max(blocks, blocks * workers // 4))]
    for i in range(workers):
        w = f"w{i}"
        members = [pack_keys((k,)) for k in rng.sample(distinct, blocks)]
        pipe = r.pipeline(transaction=False)
        for j in range(0, blocks, 5000):
            pipe.sadd(keys.snapshot(w), *members[j:j + 5000])
        pipe.hset(keys.meta(w), mapping={"epoch": "e", "seq": 1})
        pipe.sadd(keys.workers, w)
        pipe.set(keys.heartbeat(w), Heartbeat(w, f"127.0.0.1:{i + 1}", "e", ttl_s=3600,
                                              block_size=BLOCK).to_json(), px=3_600_000)
        await pipe.execute()
    await r.aclose()


class StoresNothing:
    """An index that takes each snapshot's members and stores none of them."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def replace_worker_packed(self, worker: str, members: object) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._index, name)


class ReadsOnly(IndexMirror):
    """The baseline's mirror: the bootstrap as it runs, every snapshot read from Redis and
    parsed, into an index that stores nothing (whichever index the mirror makes)."""

    @property
    def index(self) -> PrefixIndex:
        return self._index

    @index.setter
    def index(self, value: PrefixIndex) -> None:
        self._index = StoresNothing(value)  # type: ignore[assignment]


async def bootstrap(url: str, keys: RedisKeys, store: bool) -> tuple[float, int]:
    r = connect(url, block_timeout_s=0.5)
    mirror = (IndexMirror if store else ReadsOnly)(r, keys, WorkerRegistry({}, BLOCK))
    t = time.perf_counter()
    await mirror._bootstrap()
    dt = time.perf_counter() - t
    entries = mirror.index.entries()
    await r.aclose()
    return dt, entries


def smembers_usec(ports: list[int]) -> float:
    """Redis CPU per SMEMBERS on the node that served them (resetting the stats)."""
    best = 0.0
    for p in ports:
        c = redis.Redis(port=p)
        stats = c.info("commandstats").get("cmdstat_smembers")
        if stats:
            best = max(best, float(stats["usec_per_call"]))
        c.config_resetstat()
        c.close()
    return best


async def main_async(args: argparse.Namespace) -> None:
    keys = RedisKeys(MODEL)
    with redis_cluster() as ports:
        url = f"redis+cluster://127.0.0.1:{ports[0]}"
        t = time.perf_counter()
        await write(url, keys, args.workers, args.blocks)
        print(f"{args.workers} workers x {args.blocks} blocks written in "
              f"{time.perf_counter() - t:.1f} s (3-master cluster)", flush=True)
        smembers_usec(ports)
        full, base, usec = [], [], []
        for _ in range(args.repeats):
            dt, entries = await bootstrap(url, keys, store=True)
            full.append(dt)
            usec.append(smembers_usec(ports))
            base.append((await bootstrap(url, keys, store=False))[0])
            smembers_usec(ports)
        ratio = statistics.median(full) / statistics.median(base)
        print(f"  mirror bootstrap:          {statistics.median(full):6.2f} s median "
              f"({min(full):.2f}-{max(full):.2f}), {entries:,} entries")
        print(f"  baseline, reads only:      {statistics.median(base):6.2f} s median "
              f"({min(base):.2f}-{max(base):.2f})")
        print(f"  bootstrap / reads only:    {ratio:6.2f}x")
        print(f"  Redis CPU per SMEMBERS:    {statistics.median(usec):6.0f} us "
              f"({args.blocks} members; the node holding the model's slot)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=AT_LEAST_ONE.parser(int), default=1000)
    ap.add_argument("--blocks", type=AT_LEAST_ONE.parser(int), default=10_000)
    ap.add_argument("--repeats", type=AT_LEAST_ONE.parser(int), default=3)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
