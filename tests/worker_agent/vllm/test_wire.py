"""Decoding vLLM's KV-event frames: the current release (vLLM's own structs from the wheel)
and the layouts of earlier releases (their struct definitions copied below, verbatim in
substance: field names, order, types and msgspec options)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvroute.worker_agent.engines.vllm.wire import (
    Batch,
    Cleared,
    FrameError,
    Removed,
    Stored,
    decode_batch,
    encode_seq,
    parse_live,
    parse_replay,
)

# -- vLLM 0.9.x (vllm/distributed/kv_events.py): everything array_like, int hashes ----------


class V09EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class V09Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V09BlockStored(V09Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class V09BlockRemoved(V09Event, tag="BlockRemoved"):
    block_hashes: list[int]


class V09AllBlocksCleared(V09Event, tag="AllBlocksCleared"):
    pass


# -- ~0.11/0.12: array_like events with medium, lora_name, extra_keys, group_idx -------------


class V11EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V11Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V11BlockStored(V11Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class V11BlockRemoved(V11Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


# -- a later revision: EventBatch and events as maps --------------------------------------


class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


TOKENS = list(range(100, 132))
H1, H2, P = b"\x01" * 32, b"\x02" * 32, b"\x00" * 32


def _check(batch: Batch, *, medium: str | None, hashes: list[Any], parent: Any) -> None:
    st, rm, cl = batch.events
    assert isinstance(st, Stored) and isinstance(rm, Removed) and isinstance(cl, Cleared)
    assert st.block_hashes == hashes and st.parent == parent
    assert list(st.token_ids) == TOKENS and st.block_size == 16
    assert st.medium == medium and rm.block_hashes == hashes[:1] and rm.medium == medium
    assert batch.unknown_events == 0


def test_current_release_layout_from_vllms_own_structs(kv_events) -> None:
    kv = kv_events
    ev = kv.KVEventBatch(ts=1.5, events=[
        kv.BlockStored(block_hashes=[H1, H2], parent_block_hash=P, token_ids=TOKENS,
                       block_size=16, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=[("salt",), None], group_idx=0),
        kv.BlockRemoved(block_hashes=[H1], medium="GPU", group_idx=0),
        kv.AllBlocksCleared()], data_parallel_rank=0)
    raw = msgspec.msgpack.Encoder().encode(ev)  # exactly what ZmqEventPublisher sends
    assert raw[0] == 0x93  # EventBatch: a 3-item array; events: maps tagged "type"
    batch = decode_batch(raw)
    _check(batch, medium="GPU", hashes=[H1, H2], parent=P)
    assert batch.ts == 1.5 and batch.dp_rank == 0
    assert batch.events[0].extra_keys == [["salt"], None] and batch.events[0].group_idx == 0


def test_v09_all_array_layout_with_int_hashes() -> None:
    raw = msgspec.msgpack.encode(V09EventBatch(ts=2.0, events=[
        V09BlockStored([11, 12], 10, TOKENS, 16, None), V09BlockRemoved([11]),
        V09AllBlocksCleared()]))
    assert raw[:2] == b"\x92\xcb"  # [ts, events], no data_parallel_rank
    batch = decode_batch(raw)
    _check(batch, medium=None, hashes=[11, 12], parent=10)
    assert batch.dp_rank is None


def test_array_events_with_medium_extra_keys_and_group() -> None:
    raw = msgspec.msgpack.encode(V11EventBatch(ts=3.0, data_parallel_rank=1, events=[
        V11BlockStored([H1, H2], None, TOKENS, 16, None, "GPU", "lora-a",
                       [("lora-a", "s"), ("lora-a",)], 2),
        V11BlockRemoved([H1], "GPU", 2), V09AllBlocksCleared()]))
    batch = decode_batch(raw)
    _check(batch, medium="GPU", hashes=[H1, H2], parent=None)
    st = batch.events[0]
    assert (st.lora_name, st.group_idx, batch.dp_rank) == ("lora-a", 2, 1)


def test_map_batch_and_map_events() -> None:
    raw = msgspec.msgpack.encode(MapEventBatch(ts=4.0, events=[
        MapBlockStored([H1, H2], P, TOKENS, 16, None, "CPU", None, kv_cache_spec_kind="full"),
        MapBlockRemoved([H1], "CPU"), MapAllBlocksCleared()]))
    assert raw[0] & 0xF0 == 0x80  # a map
    _check(decode_batch(raw), medium="CPU", hashes=[H1, H2], parent=P)


def test_unknown_event_types_are_skipped_and_counted() -> None:
    raw = msgspec.msgpack.encode([5.0, [{"type": "BlockPinned", "x": 1},
                                        ["SomethingNew", 1, 2], ["AllBlocksCleared"]]])
    batch = decode_batch(raw)
    assert batch.unknown_events == 2 and batch.events == [Cleared()]


@pytest.mark.parametrize(("payload", "reason"), [
    (b"\xc1", "msgpack"),  # a byte msgpack never uses
    (b"\x93\x01", "msgpack"),  # truncated
    (msgspec.msgpack.encode("hello"), "batch"),
    (msgspec.msgpack.encode([1.0]), "batch"),
    (msgspec.msgpack.encode(["now", []]), "batch"),
    (msgspec.msgpack.encode([1.0, {}]), "batch"),
    (msgspec.msgpack.encode([1.0, [42]]), "event"),
    (msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]), "event"),  # no tag
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2], 4]]]), "event"),  # 2 != 4
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [1], 1]]]), "event"),
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [-1], 1]]]), "event"),
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 0]]]), "event"),
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 1, None, 7]]]), "event"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), "event"),
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1, 2], None, [1, 2], 1, None, None, None,
                                    [None]]]]), "event"),  # extra_keys not one per block
])
def test_malformed_payloads_name_their_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(FrameError) as err:
        decode_batch(payload)
    assert err.value.reason == reason


def test_live_and_replay_frames_in_every_layout() -> None:
    f = parse_live([b"kv", encode_seq(7), b"x"])
    assert (f.topic, f.seq, f.payload) == (b"kv", 7, b"x")
    for bad, reason in (([b"kv", encode_seq(7)], "frame_count"),
                        ([b"kv", b"\x00" * 4, b"x"], "seq"),
                        ([b"kv", encode_seq(-1), b"x"], "seq")):
        with pytest.raises(FrameError) as err:
            parse_live(bad)
        assert err.value.reason == reason
    # Current: [b"", topic, seq, payload], end marker [b"", b"", -1, b""].
    assert parse_replay([b"", b"kv", encode_seq(3), b"p"]).seq == 3
    assert parse_replay([b"", b"", encode_seq(-1), b""]) is None
    # Older: no topic frame.
    r = parse_replay([b"", encode_seq(4), b"p"])
    assert (r.topic, r.seq, r.payload) == (b"", 4, b"p")
    assert parse_replay([b"", encode_seq(-1), b""]) is None
    with pytest.raises(FrameError):
        parse_replay([b"", b"a", b"b", b"c", b"d"])
