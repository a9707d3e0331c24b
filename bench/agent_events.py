"""Benchmark: vLLM KV events per second the agent ingests and publishes to a real Redis.

A sender process publishes N batches in vLLM 0.33's wire layout (``[topic, seq, msgpack
EventBatch]``, EventBatch an array, events maps tagged ``type``, 32-byte SHA-256-style block
hashes) over ZMQ PUB on loopback, as fast as it can. Each batch is one step of a busy engine:
a ``BlockStored`` of 4 blocks (64 tokens, chained to the previous step of the same sequence)
and, once the cache (4096 blocks) is full, a ``BlockRemoved`` of the 4 least recently stored.

Three receivers, in one run, each against a fresh sender:

* **baseline** -- raw ZMQ receive + msgpack decode, nothing else (the floor any consumer pays)
* **agent ingest** -- the vllm adapter: receive, validate, seq tracking, kvroute keys from
  token ids, engine-hash map, cache events to a no-op listener
* **agent ingest + Redis** -- the same plus the agent's publisher writing the feed, snapshot
  and meta to a real redis-server, until every event is in Redis

    python bench/agent_events.py [--batches 20000]

Prints events/s and blocks/s per row and each row's ratio to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import subprocess
import sys
import time

import msgpack
import zmq

BLOCK = 16
BLOCKS_PER_STORE = 4
CAPACITY = 4096
SEQ_LEN_STEPS = 8  # a sequence stores 8 x 4 blocks over 8 steps, then a new one starts


def make_payloads(n: int) -> list[bytes]:
    """n EventBatch payloads of a deterministic busy engine (see the module doc)."""
    out: list[bytes] = []
    lru: list[bytes] = []
    parent: bytes | None = None
    tok = 0
    for i in range(n):
        if i % SEQ_LEN_STEPS == 0:
            parent = None
        hashes = []
        h = parent
        tokens = list(range(tok, tok + BLOCK * BLOCKS_PER_STORE))
        tok += BLOCK * BLOCKS_PER_STORE
        for b in range(BLOCKS_PER_STORE):
            h = hashlib.sha256((h or b"") + repr(tokens[b * BLOCK:(b + 1) * BLOCK]).encode()
                               ).digest()
            hashes.append(h)
        events: list[dict[str, object]] = [{
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
            "lora_name": None, "group_idx": 0}]
        lru.extend(hashes)
        if len(lru) > CAPACITY:
            gone, lru = lru[:BLOCKS_PER_STORE], lru[BLOCKS_PER_STORE:]
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU",
                           "group_idx": 0})
        parent = hashes[-1]
        out.append(msgpack.packb([time.time(), events, 0], use_bin_type=True))
    return out


def events_in(payloads: list[bytes]) -> tuple[int, int]:
    """(events, blocks) the payloads carry."""
    ev = bl = 0
    for p in payloads:
        for e in msgpack.unpackb(p)[1]:
            ev += 1
            bl += len(e["block_hashes"])
    return ev, bl


# -- the sender process ---------------------------------------------------------------------


def sender_main(port: int, n: int) -> None:
    payloads = make_payloads(n)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the receiver's speed is what is measured
    pub.bind(f"tcp://127.0.0.1:{port}")
    print("READY", flush=True)
    sys.stdin.readline()  # "go": the subscriber is connected
    t0 = time.monotonic()
    for seq, p in enumerate(payloads):
        pub.send_multipart((b"", seq.to_bytes(8, "big"), p), copy=False)
    print(f"SENT {t0} {time.monotonic()}", flush=True)
    sys.stdin.readline()  # wait until the receiver is done before closing
    pub.close(linger=0)
    ctx.term()


class Sender:
    def __init__(self, n: int) -> None:
        with zmq.Context.instance().socket(zmq.REQ) as s:
            self.port = s.bind_to_random_port("tcp://127.0.0.1")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--sender", str(self.port), "--batches", str(n)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        assert self.proc.stdout.readline().strip() == "READY"

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def start_time(self) -> float:
        assert self.proc.stdout is not None
        _, t0, _ = self.proc.stdout.readline().split()
        return float(t0)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("done\n")
        self.proc.stdin.close()
        self.proc.wait(10)


# -- receivers ------------------------------------------------------------------------------


def run_baseline(n: int) -> float:
    """Seconds from the first send to the last frame received and decoded."""
    sender = Sender(n)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sender.endpoint)
    time.sleep(0.3)  # subscription reaches the PUB socket
    sender.go()
    got = 0
    while got < n:
        _topic, _seq, payload = sub.recv_multipart()
        msgpack.unpackb(payload, raw=False)
        got += 1
    t_end = time.monotonic()
    t0 = sender.start_time()
    sender.close()
    sub.close(linger=0)
    ctx.term()
    return t_end - t0


async def run_agent(n: int, redis_url: str | None) -> tuple[float, int]:
    """Seconds from the first send until every batch is applied (and, with Redis, every
    cache event is written); and the blocks the agent holds at the end."""
    from kvroute.core.redis_conn import connect
    from kvroute.core.redis_schema import Heartbeat, RedisKeys
    from kvroute.worker_agent.engines.vllm import VllmConfig, VllmEngine
    from kvroute.worker_agent.publisher import CachePublisher

    sender = Sender(n)
    eng = VllmEngine(VllmConfig(url="http://127.0.0.1:9", events=sender.endpoint,
                                block_size=BLOCK, model="bench", metrics_interval_s=3600))
    emitted = 0

    def count(_ev: object) -> None:
        nonlocal emitted
        emitted += 1

    eng.add_listener(count)
    pub = None
    if redis_url:
        pub = CachePublisher(connect(redis_url), RedisKeys("bench"), "w0", eng.cached_keys,
                             lambda: Heartbeat("w0", "127.0.0.1:1", pub.epoch),
                             heartbeat_s=1.0)
        eng.add_listener(pub.on_event)
        await pub.start()
        while pub.seq == 0:  # the epoch is declared
            await asyncio.sleep(0.01)
    await eng.start()
    await asyncio.sleep(0.3)
    sender.go()
    while eng.events.stats.batches < n:
        await asyncio.sleep(0.001)
    if pub is not None:
        while pub.stats.events_published < emitted or pub.stats.pending:
            await asyncio.sleep(0.001)
    t_end = time.monotonic()
    t0 = sender.start_time()
    held = len(eng.cached_keys())
    if pub is not None:
        assert pub.stats.resyncs == 1, "the publisher overflowed: raise --publish-buffer"
        await pub.stop()
    await eng.stop()
    sender.close()
    return t_end - t0, held


async def main_async(args: argparse.Namespace) -> None:
    from kvroute.demo.procs import scratch_redis

    n = args.batches
    n_events, n_blocks = events_in(make_payloads(n))
    async with scratch_redis() as url:
        rows = [("baseline: zmq recv + msgpack decode", run_baseline(n)),
                ("agent ingest (vllm adapter)", (await run_agent(n, None))[0])]
        secs, held = await run_agent(n, url)
        rows.append(("agent ingest + publish to Redis", secs))
    base = rows[0][1]
    print(f"{n} batches = {n_events} vLLM events ({n_blocks} blocks), "
          f"{os.cpu_count()} CPUs, held at the end: {held} blocks")
    print(f"{'':38} {'events/s':>10} {'blocks/s':>10} {'vs baseline':>12}")
    for name, s in rows:
        print(f"{name:38} {n_events / s:>10,.0f} {n_blocks / s:>10,.0f} {base / s:>11.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=20000, help="EventBatches to send")
    ap.add_argument("--sender", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sender:
        sender_main(args.sender, args.batches)
        return
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
