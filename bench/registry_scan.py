"""Benchmark: what finding the registry's workers costs Redis, by the keys beside them.

Routers find workers by ``SCAN MATCH kvr:{M}:hb:*`` (router/mirror/heartbeats.py), which
examines every key of the node, kvroute's or not. Between SCANs (at least 1 s and 20 of
their durations apart) a scan reads only the heartbeats of the workers it knows, one MGET
per 100. This times both against a real redis-server holding W workers' keys (a heartbeat,
snapshot, lower-tier set and meta each) and F other keys (``DEBUG POPULATE``), and prints
the SCAN's cost over the MGETs' (the baseline, in the same run) and the share of Redis's
time the spacing leaves to SCANs.

    python bench/registry_scan.py [--workers 1000] [--foreign 0,100000,1000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import redis
import redis.asyncio as aioredis

from kvroute.core.ports import PortPool
from kvroute.core.redis_schema import Heartbeat, RedisKeys, pack_keys
from kvroute.core.settings import AT_LEAST_ONE, NON_NEGATIVE
from kvroute.demo.procs import find_redis_server
from kvroute.router.mirror.heartbeats import (
    FULL_SCAN_COST,
    FULL_SCAN_MIN_S,
    SCAN_CHUNK,
    SCAN_COUNT,
)


async def timings(port: int, keys: RedisKeys, workers: int, repeats: int
                  ) -> tuple[float, float, int]:
    """The best of ``repeats``: one SCAN of the heartbeat keys (s), the MGETs of every
    worker's heartbeat (s), and the workers the SCAN found."""
    client = aioredis.Redis(port=port)
    names = [keys.heartbeat(f"w{i}") for i in range(workers)]
    scan = mget = float("inf")
    found = 0
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            got = {k async for k in client.scan_iter(match=keys.heartbeat_match,
                                                     count=SCAN_COUNT)}
            scan = min(scan, time.perf_counter() - t)
            found = len(got)
            t = time.perf_counter()
            for i in range(0, workers, SCAN_CHUNK):
                await client.mget(names[i:i + SCAN_CHUNK])
            mget = min(mget, time.perf_counter() - t)
    finally:
        await client.aclose()
    return scan, mget, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=AT_LEAST_ONE.parser(int), default=1000)
    ap.add_argument("--foreign", type=NON_NEGATIVE.list_parser(int),
                    default=[0, 100_000, 1_000_000],
                    help="other keys on the node, comma-separated (each a row)")
    ap.add_argument("--repeats", type=AT_LEAST_ONE.parser(int), default=5)
    args = ap.parse_args()
    port = PortPool().take()
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--enable-debug-command",
                             "yes"], stdout=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        keys = RedisKeys("default")
        pipe = r.pipeline(transaction=False)
        for i in range(args.workers):
            w = f"w{i}"
            pipe.set(keys.heartbeat(w), Heartbeat(w, "127.0.0.1:1", "e").to_json())
            pipe.sadd(keys.snapshot(w), pack_keys((i,)))
            pipe.sadd(keys.lower(w), pack_keys((i,)))
            pipe.hset(keys.meta(w), mapping={"epoch": "e", "seq": 1})
        pipe.execute()
        print(f"{args.workers} workers' keys, and other keys beside them; best of "
              f"{args.repeats}")
        print("other keys   SCAN ms  MGETs ms  SCAN/MGETs  SCANs apart s  Redis time on SCANs")
        for foreign in sorted(args.foreign):
            r.execute_command("DEBUG", "POPULATE", foreign, "other")  # adds up to `foreign`
            scan, mget, found = asyncio.run(timings(port, keys, args.workers, args.repeats))
            if found != args.workers:
                sys.exit(f"the SCAN found {found} workers of {args.workers}")
            apart = max(FULL_SCAN_MIN_S, FULL_SCAN_COST * scan)
            print(f"{foreign:>10,}  {scan * 1000:8.1f}  {mget * 1000:8.2f}  "
                  f"{scan / mget:9.1f}x  {apart:13.1f}  {scan / apart:18.1%}")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
