"""SGLang's KV events, from each supported release's own publisher (executed from its wheel),
followed by the agent's event machinery: the blocks it publishes are the keys the router
computes for the same token ids, salted ones included; a block SGLang keeps in host memory
(HiCache, ``CPU_PINNED``) stays until its last tier drops it; a lost batch is healed from
SGLang's replay socket."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvroute.core.blocks import BlockHasher
from kvroute.core.cache_events import CacheEvent
from kvroute.core.redis_schema import Op
from kvroute.worker_agent.engines.vllm import VllmConfig, VllmEngine
from tests.support import free_port, wait_for
from tests.worker_agent.engines.vllm.vllm_wire import FrameForwarder, struct

B = 4  # SGLang's --page-size, equal to the agent's block size
TOPIC = "kv-events"


def engine(events: str, replay: str) -> tuple[VllmEngine, list[CacheEvent]]:
    eng = VllmEngine(VllmConfig(
        url=f"http://127.0.0.1:{free_port()}", events=events, replay=replay, topic=TOPIC,
        block_size=B, model="m", metrics_interval_s=30, probe_s=0.2, replay_timeout_s=0.5))
    seen: list[CacheEvent] = []
    eng.add_listener(seen.append)
    return eng, seen


def keys(tokens: list[int], salt: str = "") -> list[int]:
    return BlockHasher(B, "m", salt).keys(tokens)


def stored(kv: ModuleType, hashes: list[int], parent: int | None, tokens: list[int],
           **extra: Any) -> Any:
    """SGLang's BlockStored with the fields the release has (0.5.1: no medium, no salt)."""
    return struct(kv.BlockStored, block_hashes=hashes, parent_block_hash=parent,
                  token_ids=tokens, block_size=B, lora_id=None, **extra)


def batch(kv: ModuleType, *events: Any) -> Any:
    return kv.KVEventBatch(ts=time.time(), events=list(events))


def has(kv: ModuleType, field: str) -> bool:
    return field in kv.BlockStored.__struct_fields__


async def test_sglangs_publisher_feeds_the_routers_keys(sglang_kv: ModuleType,
                                                        tmp_path: Path) -> None:
    kv = sglang_kv
    eng, seen = engine(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    pub = kv.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/pub",  # ipc endpoints bind
                               replay_endpoint=f"ipc://{tmp_path}/replay", topic=TOPIC)
    a = list(range(100, 112))  # three blocks
    await eng.start()
    try:
        await asyncio.wait_for(eng.events.ready.wait(), 5)
        # As SGLang's recorder writes a radix node: its pages in one event, then a child
        # node's linked by the parent hash.
        pub.publish(batch(kv, stored(kv, [11, 12], None, a[:8]), stored(kv, [13], 12, a[8:])))
        await wait_for(lambda: set(eng.cached_keys()) == set(keys(a)), what="stored blocks")
        pub.publish(batch(kv, struct(kv.BlockRemoved, block_hashes=[13])))
        await wait_for(lambda: set(eng.cached_keys()) == set(keys(a)[:2]), what="a removal")
        pub.publish(batch(kv, kv.AllBlocksCleared()))
        await wait_for(lambda: not eng.cached_keys(), what="a clear")
        assert CacheEvent(Op.CLEAR) in seen
        st = eng.events.stats
        assert st.complete and st.resets == 0 and not st.rejected
    finally:
        pub.shutdown()
        await eng.stop()


async def test_salted_blocks_and_the_host_tier(sglang_kv: ModuleType, tmp_path: Path) -> None:
    kv = sglang_kv
    if not has(kv, "cache_salt"):
        pytest.skip("this release's events carry no cache salt and no medium")
    eng, _ = engine(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    pub = kv.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/pub",
                               replay_endpoint=f"ipc://{tmp_path}/replay", topic=TOPIC)
    t = [7] * 8
    await eng.start()
    try:
        await asyncio.wait_for(eng.events.ready.wait(), 5)
        pub.publish(batch(kv, stored(kv, [21, 22], None, t, medium="GPU", cache_salt="user-7",
                                     session_id="s1")))
        await wait_for(lambda: set(eng.cached_keys()) == set(keys(t, "user-7")),
                       what="salted blocks under the router's salted keys")
        assert not set(eng.cached_keys()) & set(keys(t))  # not the unsalted prompt's
        # HiCache backs the blocks up to host memory, then the GPU evicts them: still held.
        pub.publish(batch(kv, stored(kv, [21, 22], None, t, medium="CPU_PINNED",
                                     cache_salt="user-7")))
        pub.publish(batch(kv, kv.BlockRemoved(block_hashes=[21, 22], medium="GPU")))
        pub.publish(batch(kv, kv.BlockStored(block_hashes=[99], parent_block_hash=None,
                                             token_ids=[1] * B, block_size=B, lora_id=None)))
        await wait_for(lambda: len(eng.cached_keys()) == 3, what="the marker block")
        assert set(keys(t, "user-7")) <= set(eng.cached_keys())
        pub.publish(batch(kv, kv.BlockRemoved(block_hashes=[21, 22], medium="CPU_PINNED")))
        await wait_for(lambda: eng.cached_keys() == keys([1] * B), what="the host copy gone")
    finally:
        pub.shutdown()
        await eng.stop()


async def test_a_lost_batch_is_healed_from_sglangs_replay(sglang_kv: ModuleType) -> None:
    kv = sglang_kv
    up, down, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    fwd = FrameForwarder(up, down)  # SGLang connects to a concrete host: a lossy wire
    eng, _ = engine(down, replay)
    pub = kv.ZmqEventPublisher(0, endpoint=up, replay_endpoint=replay, topic=TOPIC)
    await eng.start()
    try:
        await asyncio.wait_for(eng.events.ready.wait(), 5)
        pub.publish(batch(kv, stored(kv, [1], None, [1] * B)))
        await wait_for(lambda: len(eng.cached_keys()) == 1, what="the first batch")
        fwd.drop(next_n=1)
        pub.publish(batch(kv, stored(kv, [2], None, [2] * B)))  # lost on the wire
        pub.publish(batch(kv, stored(kv, [3], None, [3] * B)))  # reveals the gap
        want = set(keys([1] * B) + keys([2] * B) + keys([3] * B))
        await wait_for(lambda: set(eng.cached_keys()) == want, what="the gap healed")
        assert fwd.dropped and eng.events.stats.gaps_healed >= 1
        assert eng.events.stats.resets == 0
    finally:
        pub.shutdown()
        await eng.stop()
        fwd.close()
