"""What a real vLLM itself says it caches, read without kvroute's subscriber: every batch its
replay socket still buffers, decoded here with msgpack, folded into the live block set, and
keyed with kvroute's block-key scheme (the one thing shared with the code under test).

vLLM 0.32's wire: ``[seq (8 bytes, big-endian), msgpack EventBatch]`` per replayed batch and
``seq = -1`` at the end; an EventBatch is ``[ts, events, dp_rank]``; events are maps tagged by
``type`` (``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, ...``;
``BlockRemoved``: ``block_hashes, medium``; ``AllBlocksCleared``)."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from kvroute.core.blocks import BlockHasher


def replayed_batches(replay: str, timeout_s: float = 5.0) -> list[Any]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(replay)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            frames = sock.recv_multipart()
            if int.from_bytes(frames[-2], "big", signed=True) == -1:
                return batches
            batches.append(msgpack.unpackb(frames[-1], raw=False, strict_map_key=False))
    finally:
        sock.close(linger=0)


def cached_keys(replay: str, model: str, block_size: int) -> set[int]:
    """kvroute's keys of the blocks vLLM holds now, by its own events."""
    hasher = BlockHasher(block_size=block_size, model=model)
    key_of: dict[Any, int] = {}  # vLLM's block hash -> kvroute's key
    live: set[Any] = set()
    for batch in replayed_batches(replay):
        for ev in batch[1]:
            assert isinstance(ev, dict), f"expected a tagged map, got {ev!r:.200}"
            kind = ev["type"]
            if kind == "BlockStored":
                assert ev["block_size"] == block_size
                hashes, tokens = ev["block_hashes"], ev["token_ids"]
                parent = ev.get("parent_block_hash")
                keys = hasher.keys(tokens, None if parent is None else key_of[_h(parent)])
                assert len(keys) == len(hashes)
                for h, k in zip(hashes, keys, strict=True):
                    key_of[_h(h)] = k
                    live.add(_h(h))
            elif kind == "BlockRemoved":
                live.difference_update(_h(h) for h in ev["block_hashes"])
            elif kind == "AllBlocksCleared":
                live.clear()
    return {key_of[h] for h in live}


def _h(block_hash: Any) -> Any:
    return bytes(block_hash) if isinstance(block_hash, bytearray | list) else block_hash
