"""The event subscriber over real ZMQ sockets: each supported release's own publisher
restarting, and an older release's publisher (array events, replay replies without the topic
frame) losing a batch."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import zmq

from kvroute.core.blocks import BlockHasher
from kvroute.core.cache_events import CacheEvent
from kvroute.core.redis_schema import Op
from kvroute.worker_agent.engines.served.wire import encode_seq
from kvroute.worker_agent.engines.vllm import VllmConfig, VllmEngine
from tests.support import free_port, wait_for
from tests.worker_agent.engines.vllm.test_wire import V09BlockStored, V09EventBatch
from tests.worker_agent.engines.vllm.vllm_wire import struct

B = 4


def engine(tmp: Path, topic: str = "") -> tuple[VllmEngine, list[CacheEvent]]:
    eng = VllmEngine(VllmConfig(
        url=f"http://127.0.0.1:{free_port()}", events=f"ipc://{tmp}/pub",
        replay=f"ipc://{tmp}/replay", topic=topic, block_size=B, model="m",
        metrics_interval_s=30, probe_s=0.2, replay_timeout_s=0.5))
    seen: list[CacheEvent] = []
    eng.add_listener(seen.append)
    return eng, seen


def keys(tokens: list[int]) -> list[int]:
    return BlockHasher(B, "m").keys(tokens)


async def test_vllm_publisher_restart_resets_the_view(kv_events, tmp_path: Path) -> None:
    kv = kv_events
    eng, seen = engine(tmp_path, topic="kv")

    def publisher():  # vLLM's own class; ipc endpoints bind
        return kv.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/pub",
                                    replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv")

    def batch(h: int, toks: list[int]):
        return kv.KVEventBatch(ts=time.time(), events=[struct(
            kv.BlockStored, block_hashes=[h], parent_block_hash=None, token_ids=toks,
            block_size=B, lora_id=None, medium="GPU", lora_name=None)])

    pub = publisher()
    await eng.start()
    try:
        await asyncio.wait_for(eng.events.ready.wait(), 5)
        for i in range(3):
            pub.publish(batch(i, [i] * B))
        await wait_for(lambda: len(eng.cached_keys()) == 3, what="first publisher's blocks")
        pub.shutdown()
        pub = publisher()  # vLLM restarted: empty cache, seq from 0 again
        # Found before the new vLLM publishes anything: the connection dropped, and its
        # replay socket does not hold the last batch applied.
        await wait_for(lambda: eng.events.stats.restarts == 1, what="restart detected")
        assert eng.cached_keys() == [] and CacheEvent(Op.CLEAR) in seen
        for i in range(3):
            pub.publish(batch(100 + i, [9, 9, 9, i]))
        await wait_for(lambda: len(eng.cached_keys()) == 3, what="new publisher's blocks")
        assert set(eng.cached_keys()) == {keys([9, 9, 9, j])[0] for j in range(3)}
        st = eng.events.stats
        assert st.restarts == 1 and st.resets == 1 and st.complete and st.disconnects >= 1
    finally:
        await eng.stop()
        pub.shutdown()


class OldPublisher:
    """The publisher of vLLM <= 0.10 in substance: PUB ``[topic, seq, payload]``, replay
    replies ``[seq, payload]`` with no topic frame (copied from its ``_service_replay``)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, tmp: Path, topic: bytes) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"ipc://{tmp}/pub")
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.bind(f"ipc://{tmp}/replay")
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=100)
        self.seq = 0
        self.late: list[int] = []  # seqs sent live only after a replay has returned them
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, payload: bytes, *, lose: bool = False, late: bool = False) -> None:
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
            if late:
                self.late.append(seq)
            elif not lose:
                self.pub.send_multipart((self.topic, encode_seq(seq), payload))

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.replay.poll(20):
                continue
            client_id, _, start_seq_bytes = self.replay.recv_multipart()
            start_seq = int.from_bytes(start_seq_bytes, "big")
            with self.lock:
                for seq, buf in self.buffer:
                    if seq >= start_seq:
                        self.replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
            self.replay.send_multipart((client_id, b"", self.END_SEQ, b""))
            with self.lock:
                late = [(seq, buf) for seq, buf in self.buffer
                        if seq in self.late and seq >= start_seq]
                self.late = [seq for seq in self.late if seq < start_seq]
            for seq, buf in late:  # on the wire just after the replay's answer
                self.pub.send_multipart((self.topic, encode_seq(seq), buf))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.pub.close(linger=0)
        self.replay.close(linger=0)
        self.ctx.term()


TOKS = list(range(1, 13))  # three blocks, stored one per batch, chained by int hashes


def stored(i: int) -> bytes:
    """An old-layout batch storing block ``i`` of ``TOKS``."""
    return msgspec.msgpack.encode(V09EventBatch(ts=time.time(), events=[V09BlockStored(
        [i + 1], i if i else None, TOKS[i * B:(i + 1) * B], B, None)]))


@contextlib.asynccontextmanager
async def old_stream(tmp: Path) -> AsyncIterator[tuple[OldPublisher, VllmEngine]]:
    """An old-layout publisher and an engine subscribed to it (topic ``kv``)."""
    pub = OldPublisher(tmp, b"kv")
    eng, _ = engine(tmp, topic="kv")
    await eng.start()
    try:
        await asyncio.wait_for(eng.events.ready.wait(), 5)
        await asyncio.sleep(0.1)  # let the subscription reach the PUB socket
        yield pub, eng
    finally:
        await eng.stop()
        pub.close()


async def test_old_layout_stream_gap_healed_by_replay_without_topic(tmp_path: Path) -> None:
    async with old_stream(tmp_path) as (pub, eng):
        pub.publish(stored(0))
        pub.publish(stored(1), lose=True)
        pub.publish(stored(2))
        await wait_for(lambda: len(eng.cached_keys()) == 3, what="chain complete")
        assert sorted(eng.cached_keys()) == sorted(keys(TOKS))
        st = eng.events.stats
        assert st.gaps_healed == 1 and st.resets == 0 and not st.rejected


async def test_a_batch_the_replay_returns_before_it_arrives_live_is_no_gap(
        tmp_path: Path, caplog) -> None:
    # vLLM buffers a batch as it publishes it: an idle probe can find a batch whose live
    # frame is still on its way. Neither a healed gap nor a silent stream.
    async with old_stream(tmp_path) as (pub, eng):
        for i in range(2):
            pub.publish(stored(i), late=True)  # live just after the probe's replay
            await wait_for(lambda n=i + 1: len(eng.cached_keys()) == n, what="the late batch")
        st = eng.events.stats
        assert st.frames == 2 and st.batches == 2 and st.duplicates == 0
        assert st.gaps_healed == 0 and st.silent_recoveries == 0 and st.replayed_batches == 0
        assert not [r for r in caplog.records if r.name == "kvroute.agent.vllm"
                    and r.levelname == "WARNING"]


async def test_a_publisher_that_connects_instead_of_binding_is_loud(kv_events, tmp_path: Path,
                                                                     caplog) -> None:
    # vLLM's publisher given tcp://HOST:PORT connects; the agent's SUB connects too, so no
    # live frame ever arrives and only the replay socket (tcp://*:PORT binds) has them.
    kv = kv_events
    live, replay = free_port(), free_port()
    pub = kv.ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{live}",
                               replay_endpoint=f"tcp://*:{replay}", topic="kv")
    eng = VllmEngine(VllmConfig(
        url=f"http://127.0.0.1:{free_port()}", events=f"tcp://127.0.0.1:{live}",
        replay=f"tcp://127.0.0.1:{replay}", topic="kv", block_size=B, model="m",
        metrics_interval_s=30, probe_s=0.2, replay_timeout_s=0.5))
    await eng.start()
    try:
        await asyncio.wait_for(eng.events.ready.wait(), 5)
        toks = list(range(1, 9))
        for i in range(2):
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[struct(
                kv.BlockStored, block_hashes=[i + 1], parent_block_hash=i or None,
                token_ids=toks[i * B:(i + 1) * B], block_size=B, lora_id=None, medium="GPU",
                lora_name=None)]))
        await wait_for(lambda: len(eng.cached_keys()) == 2, what="recovered by replay")
        st = eng.events.stats
        assert st.frames == 0 and st.silent_recoveries >= 1
        assert any("connects instead of binding" in r.getMessage() and r.levelname == "WARNING"
                   for r in caplog.records)
        assert any(f.name == "kvroute_agent_vllm_silent_recoveries"
                   and f.samples[0].value >= 1 for f in eng.metric_families())
    finally:
        await eng.stop()
        pub.shutdown()
