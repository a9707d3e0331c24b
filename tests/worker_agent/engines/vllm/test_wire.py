"""Decoding vLLM's KV-event frames: both ends of the supported range, from each release's
own structs (executed from its wheel) and from their transcriptions below (checked equal to
the release's own), and the layouts of other releases (struct definitions copied below, in
substance: field names, order, types and msgspec options)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvroute.worker_agent.engines.served.wire import (
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
from kvroute.worker_agent.engines.vllm.versions import SUPPORTED
from tests.worker_agent.engines.vllm.vllm_wire import struct

# -- vLLM 0.10.2, vllm/distributed/kv_events.py: batch and events array_like ---------------


class V0102EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V0102Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V0102BlockStored(V0102Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class V0102BlockRemoved(V0102Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class V0102AllBlocksCleared(V0102Event, tag="AllBlocksCleared"):
    pass


# -- vLLM 0.34.0, vllm/distributed/kv_events.py: batch array_like, events maps -------------


class V0340EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V0340Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class V0340BlockStored(V0340Event, tag="BlockStored"):
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
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class V0340BlockRemoved(V0340Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class V0340AllBlocksCleared(V0340Event, tag="AllBlocksCleared"):
    pass


# (EventBatch, BlockStored, BlockRemoved, AllBlocksCleared) of each end of SUPPORTED.
TRANSCRIBED: dict[str, tuple[type, type, type, type]] = {
    "0.10.2": (V0102EventBatch, V0102BlockStored, V0102BlockRemoved, V0102AllBlocksCleared),
    "0.34.0": (V0340EventBatch, V0340BlockStored, V0340BlockRemoved, V0340AllBlocksCleared),
}

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


def test_the_transcriptions_cover_the_supported_range() -> None:
    assert set(TRANSCRIBED) == set(SUPPORTED), "transcribe each end's structs from its wheel"


def _full_batch(kinds: tuple[type, type, type, type], hashes: list[Any], parent: Any) -> Any:
    """A batch with every field of the release's events set (struct() keeps those it has)."""
    batch, stored, removed, cleared = kinds
    return batch(ts=1.5, data_parallel_rank=3, events=[
        struct(stored, block_hashes=hashes, parent_block_hash=parent, token_ids=TOKENS,
               block_size=16, lora_id=7, medium="CPU", lora_name="adapter",
               extra_keys=[("adapter", "salt"), ("adapter",)], group_idx=2,
               kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096,
               locality="LOCAL", ownership="tier-1", session_id="s-1",
               lookahead_token_ids=[[1, 2], [3, 4]]),
        struct(removed, block_hashes=hashes[:1], medium="CPU", group_idx=2, locality="REMOTE",
               ownership="tier-1"),
        cleared()])


def _check_full(batch: Batch, kinds: tuple[type, type, type, type], hashes: list[Any],
                parent: Any) -> None:
    _check(batch, medium="CPU", hashes=hashes, parent=parent)
    st, rm, _ = batch.events
    assert (batch.ts, batch.dp_rank, st.lora_id) == (1.5, 3, 7)
    newer = "lora_name" in kinds[1].__struct_fields__
    assert st.lora_name == ("adapter" if newer else None)
    assert st.extra_keys == ([["adapter", "salt"], ["adapter"]] if newer else None)
    assert st.group_idx == rm.group_idx == (2 if newer else None)


@pytest.mark.parametrize("version", SUPPORTED)
@pytest.mark.parametrize(("hashes", "parent"), [([H1, H2], P), ([11, 12], None)],
                         ids=["bytes", "int"])
def test_every_field_of_each_supported_release(version: str, hashes: list[Any], parent: Any
                                               ) -> None:
    kinds = TRANSCRIBED[version]
    raw = msgspec.msgpack.encode(_full_batch(kinds, hashes, parent))
    assert raw[0] == 0x93  # EventBatch: [ts, events, data_parallel_rank] in both
    _check_full(decode_batch(raw), kinds, hashes, parent)
    # Defaulted fields left at None are omitted (omit_defaults): still a valid event.
    bare = kinds[0](ts=2.0, events=[struct(
        kinds[1], block_hashes=hashes, parent_block_hash=parent, token_ids=TOKENS,
        block_size=16, lora_id=None, medium=None, lora_name=None)])
    raw = msgspec.msgpack.encode(bare)
    (st,) = decode_batch(raw).events
    assert isinstance(st, Stored) and st.block_hashes == hashes and st.extra_keys is None
    event = msgspec.msgpack.decode(raw)[1][0]
    if version == "0.10.2":
        assert event == ["BlockStored", hashes, parent, TOKENS, 16, None, None]  # an array
    else:
        assert event == {"type": "BlockStored", "block_hashes": hashes,  # a map, no defaults
                         "parent_block_hash": parent, "token_ids": TOKENS, "block_size": 16,
                         "lora_id": None, "medium": None, "lora_name": None}


def test_transcriptions_are_the_releases_own_structs(kv_events, vllm_version: str) -> None:
    """Field names, order, defaults and msgspec options as the release's own code has them;
    the same batch encodes byte for byte alike, and decodes (every field)."""
    kv = kv_events
    theirs = (kv.KVEventBatch, kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared)
    ours = TRANSCRIBED[vllm_version]
    for a, b in zip(ours, theirs, strict=True):
        assert a.__struct_fields__ == b.__struct_fields__, b.__name__
        assert a.__struct_defaults__ == b.__struct_defaults__, b.__name__
        ca, cb = a.__struct_config__, b.__struct_config__
        assert (ca.array_like, ca.omit_defaults, ca.tag, ca.tag_field) == \
            (cb.array_like, cb.omit_defaults, cb.tag, cb.tag_field), b.__name__
    for hashes, parent in (([H1, H2], P), ([11, 12], 10)):
        raw = msgspec.msgpack.Encoder().encode(_full_batch(theirs, hashes, parent))
        assert raw == msgspec.msgpack.encode(_full_batch(ours, hashes, parent))
        _check_full(decode_batch(raw), theirs, hashes, parent)


@pytest.mark.parametrize("version", SUPPORTED)
def test_an_offloading_connectors_copies_by_hash_alone_decode(version: str) -> None:
    """vLLM's OffloadingConnector sends its CPU copies with no token ids and no parent,
    block_size 0 (or its own), in the batch beside the GPU's events: the batch decodes."""
    batch, stored, removed, _ = TRANSCRIBED[version]
    for size in (0, 32):
        raw = msgspec.msgpack.encode(batch(ts=1.0, events=[
            struct(stored, block_hashes=[11, 12], parent_block_hash=None, token_ids=TOKENS,
                   block_size=16, lora_id=None, medium="GPU", lora_name=None),
            struct(stored, block_hashes=[H1], parent_block_hash=None, token_ids=[],
                   block_size=size, lora_id=None, medium="CPU", lora_name=None),
            struct(removed, block_hashes=[H1], medium="CPU")]))
        gpu, copy, gone = decode_batch(raw).events
        assert isinstance(copy, Stored) and copy.block_hashes == [H1]
        assert (copy.block_size, len(copy.token_ids), copy.medium) == (size, 0, "CPU")
        assert gpu.block_size == 16 and gone == Removed([H1], medium="CPU")


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
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], 0]]]), "event"),  # GPU
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], -1, None, "CPU"]]]),
     "event"),
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
