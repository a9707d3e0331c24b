"""Benchmark: a router mirror's bootstrap, in-process, against a real Redis Cluster.

What ``bench/scale.py --boot-only`` times from a router's process start, without the
process: W workers' snapshots of B blocks each (a quarter as many distinct keys as
entries, ~4 holders a key as in scale.py), their metas, heartbeats and the workers set are
written straight to a 3-master cluster (pipelines, not publishers), then the mirror's
``_bootstrap`` is timed. Baseline, in the same run and alternated with it: the same
bootstrap with the index load left out (every snapshot read and parsed, nothing stored),
the floor that reading from the one node holding the model's slot sets.

    python bench/bootstrap.py [--workers 1000] [--blocks 10000] [--repeats 3]

Prints the bootstrap's seconds as the mirror runs it (snapshots read by DUMP), with every
snapshot read by SMEMBERS instead (its fallback, and the read before DUMP), and the
baseline's; their ratios; and that node's Redis CPU per DUMP and per SMEMBERS (INFO
commandstats).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import redis
from scale import BLOCK, redis_cluster

from kvroute.core.index import PrefixIndex
from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import Heartbeat, RedisKeys, pack_keys
from kvroute.core.settings import AT_LEAST_ONE
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
        pipe.set(keys.heartbeat(w), Heartbeat(w, f"127.0.0.1:{i + 1}", "e", ttl_s=3600,
                                              block_size=BLOCK).to_json(), px=3_600_000)
        await pipe.execute()
    await r.aclose()


class StoresNothing:
    """An index that takes each snapshot's members and stores none of them."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def replace_worker_packed(self, worker: str, members: object, lower: object = b"") -> None:
        pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._index, name)


def reads_only(mirror: IndexMirror) -> IndexMirror:
    """The baseline's mirror: the bootstrap as it runs, every snapshot read from Redis and
    parsed, into an index that stores nothing (whichever index the cache makes)."""
    cache = mirror.cache
    reset = cache.reset

    def storing_nothing() -> None:
        reset()
        cache.index = StoresNothing(cache.index)  # type: ignore[assignment]

    cache.reset = storing_nothing  # type: ignore[method-assign]
    return mirror


async def bootstrap(url: str, keys: RedisKeys, mode: str) -> tuple[float, int]:
    """One bootstrap's seconds and entries: ``mode`` "dump" (the mirror as it runs),
    "smembers" (its fallback read for every snapshot) or "reads" (the baseline)."""
    r = connect(url, block_timeout_s=0.5)
    mirror = IndexMirror(r, keys, WorkerRegistry({}, BLOCK))
    if mode == "reads":
        reads_only(mirror)
    mirror.snapshots.dump = mode != "smembers"
    t = time.perf_counter()
    await mirror._bootstrap()
    dt = time.perf_counter() - t
    entries = mirror.index.entries()
    await r.aclose()
    return dt, entries


def read_usec(ports: list[int], workers: int) -> dict[str, float]:
    """Redis CPU per DUMP and per SMEMBERS on the node that served one per worker (resetting
    the stats): the snapshot reads' cost on the side of the node holding the model's slot
    (not the workers set's few SMEMBERS)."""
    best: dict[str, float] = {}
    for p in ports:
        c = redis.Redis(port=p)
        info = c.info("commandstats")
        for cmd in ("dump", "smembers"):
            stats = info.get(f"cmdstat_{cmd}")
            if stats and stats["calls"] >= workers:
                best[cmd] = max(best.get(cmd, 0.0), float(stats["usec_per_call"]))
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
        await bootstrap(url, keys, "dump")  # once unmeasured: imports, first connections
        read_usec(ports, args.workers)
        times: dict[str, list[float]] = {"dump": [], "smembers": [], "reads": []}
        usec: dict[str, list[float]] = {"dump": [], "smembers": []}
        entries = 0
        for _ in range(args.repeats):  # alternated, so a slow spell costs every mode
            for mode in times:
                dt, n = await bootstrap(url, keys, mode)
                times[mode].append(dt)
                entries = n if mode == "dump" else entries
                for cmd, us in read_usec(ports, args.workers).items():
                    usec[cmd].append(us)
        med = {mode: statistics.median(ts) for mode, ts in times.items()}
        labels = {"dump": "mirror bootstrap (DUMP):", "smembers": "same, SMEMBERS reads:",
                  "reads": "baseline, reads only:"}
        for mode, ts in times.items():
            extra = f", {entries:,} entries" if mode == "dump" else ""
            print(f"  {labels[mode]:27s}{med[mode]:6.2f} s median "
                  f"({min(ts):.2f}-{max(ts):.2f}){extra}")
        print(f"  bootstrap / reads only:    {med['dump'] / med['reads']:6.2f}x "
              f"(SMEMBERS reads: {med['smembers'] / med['reads']:.2f}x)")
        for cmd, us in usec.items():
            if us:
                print(f"  Redis CPU per {cmd.upper() + ':':13s}{statistics.median(us):6.0f} us "
                      f"({args.blocks} members; the node holding the model's slot)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=AT_LEAST_ONE.parser(int), default=1000)
    ap.add_argument("--blocks", type=AT_LEAST_ONE.parser(int), default=10_000)
    ap.add_argument("--repeats", type=AT_LEAST_ONE.parser(int), default=3)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
