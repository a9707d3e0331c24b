"""vLLM's KV-event wire format, decoded for every released layout.

Reference: ``vllm/distributed/kv_events.py`` of both ends of
:data:`~kvroute.worker_agent.engines.vllm.versions.SUPPORTED` (0.10.2 and 0.34.0, from their
wheels on PyPI; the tests run each release's own publisher). What goes over the wire:

* **Live (PUB/SUB):** multipart ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian
  counter from 0 per publisher process (one per data-parallel rank); ``payload`` is a msgpack
  ``EventBatch``.
* **Replay (ROUTER):** a DEALER sends ``[b"", start_seq as 8 bytes big-endian]``; the
  publisher answers every buffered batch with ``seq >= start_seq`` as
  ``[b"", topic, seq, payload]`` (0.10.2 and 0.11: ``[b"", seq, payload]``), then an end
  marker whose seq is -1 (signed): ``[b"", b"", -1, b""]`` (older: ``[b"", -1, b""]``).
* **EventBatch** ``(ts, events, data_parallel_rank=None)``: a msgpack array (``array_like``;
  the rank is omitted when None) in 0.10.2 and 0.34.0; a map with those field names is
  accepted too.
* **Events** are msgspec tagged structs with ``omit_defaults``: an array
  ``[tag, field, ...]`` (``array_like``: 0.10.2 .. at least 0.12) or a map
  ``{"type": tag, field: ...}`` (0.34.0, where defaulted fields still None are left out).
  Fields were only ever appended, so one declaration order serves every array layout::

      BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                  lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None,
                  kv_cache_spec_sliding_window=None, locality=None, ownership=None,
                  session_id=None, lookahead_token_ids=None)
      BlockRemoved(block_hashes, medium, group_idx=None, locality=None, ownership=None)
      AllBlocksCleared()

  0.10.2 has the first six ``BlockStored`` fields and the first two ``BlockRemoved`` ones;
  0.34.0 all of them.  Block hashes are 64-bit ints (the default of both ends,
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64 bits of vLLM's hash) or bytes (``=0``:
  the whole digest).

SGLang's publisher (``sglang/srt/disaggregation/kv_events.py``, 0.5.1 and 0.5.23 from their
wheels) is a copy of vLLM's design and decodes here too: ``[topic, seq, payload]`` frames and
replay replies with the topic frame; ``EventBatch(ts, events, attn_dp_rank=None)`` as an
array; events as arrays with vLLM's first five ``BlockStored`` fields (0.5.1) or as tagged
maps that add ``medium`` (``GPU``, ``CPU_PINNED`` for HiCache, ``DISK``, ``EXTERNAL``),
``cache_salt``, ``session_id`` and ``lora_name`` (0.5.23). Its ``cache_salt`` is read
(:attr:`Stored.cache_salt`); the other fields it adds are ignored.

An unknown event tag is skipped and counted (a newer vLLM may add events); anything else that
does not fit raises :class:`FrameError` with a short ``reason`` (a metric label) and detail.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

EngineHash = int | bytes
END_SEQ = -1

STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_STORED_REQUIRED = 4  # block_hashes .. block_size; lora_id/medium/lora_name came later


class FrameError(ValueError):
    """A frame or payload that does not follow vLLM's format. ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[EngineHash]
    parent: EngineHash | None
    # validated uint32 token ids, len == len(block_hashes) * block_size; empty for a lower
    # tier's copies named by hash alone (then block_size may be 0)
    token_ids: array.array
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # one entry (list or None) per block
    group_idx: int | None = None
    cache_salt: str | None = None  # SGLang names the salt itself (vLLM: in extra_keys)


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None
    unknown_events: int = 0  # events of a type this adapter does not know, skipped


@dataclass(frozen=True, slots=True)
class Frame:
    topic: bytes
    seq: int
    payload: bytes


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def _seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise FrameError("seq", f"seq frame of {len(raw)} bytes, expected 8")
    # Live seqs are unsigned counters; only the replay end marker is -1 (all ones).
    return -1 if raw == b"\xff" * 8 else int.from_bytes(raw, "big")


def parse_live(frames: Sequence[bytes]) -> Frame:
    """``[topic, seq, payload]`` from the PUB socket."""
    if len(frames) != 3:
        raise FrameError("frame_count", f"{len(frames)} frames, expected 3")
    topic, raw_seq, payload = frames
    seq = _seq(raw_seq)
    if seq < 0:
        raise FrameError("seq", "negative seq on the live stream")
    return Frame(bytes(topic), seq, bytes(payload))


def parse_replay(frames: Sequence[bytes]) -> Frame | None:
    """One reply on a DEALER socket, with or without the topic frame; None = end marker."""
    parts = list(frames)
    if parts and parts[0] == b"":
        parts = parts[1:]  # the envelope delimiter the ROUTER adds
    if len(parts) == 3:
        topic, raw_seq, payload = parts
    elif len(parts) == 2:
        topic, (raw_seq, payload) = b"", parts
    else:
        raise FrameError("frame_count", f"replay reply of {len(frames)} frames")
    seq = _seq(raw_seq)
    if seq == END_SEQ:
        return None
    return Frame(bytes(topic), seq, bytes(payload))


def decode_batch(payload: bytes) -> Batch:
    """A msgpack EventBatch in any released layout; FrameError if it is not one."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises a zoo of types (ExtraData, ValueError, ...)
        raise FrameError("msgpack", f"{type(exc).__name__}: {exc}"[:200]) from None
    if isinstance(obj, list | tuple):
        if len(obj) < 2:
            raise FrameError("batch", f"EventBatch array of {len(obj)} items")
        ts, events = obj[0], obj[1]
        dp = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        ts, events, dp = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    else:
        raise FrameError("batch", f"EventBatch is a msgpack {type(obj).__name__}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise FrameError("batch", f"ts is {type(ts).__name__}")
    if not isinstance(events, list | tuple):
        raise FrameError("batch", f"events is {type(events).__name__}")
    if dp is not None and not _is_int(dp):
        raise FrameError("batch", f"data_parallel_rank is {type(dp).__name__}")
    out: list[Event] = []
    unknown = 0
    for i, raw in enumerate(events):
        try:
            ev = _event(raw)
        except FrameError as exc:
            raise FrameError(exc.reason, f"event {i}: {exc.detail}") from None
        if ev is None:
            unknown += 1
        else:
            out.append(ev)
    return Batch(float(ts), out, dp, unknown)


# -- events ---------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _event(raw: Any) -> Event | None:
    if isinstance(raw, list | tuple):
        if not raw:
            raise FrameError("event", "empty event array")
        tag, vals = raw[0], raw[1:]
        if not isinstance(tag, str):
            raise FrameError("event", f"tag is {type(tag).__name__}")
        if tag == "BlockStored":
            if len(vals) < _STORED_REQUIRED or len(vals) > len(STORED_FIELDS):
                raise FrameError("event", f"BlockStored array of {len(vals)} fields")
            return _stored(dict(zip(STORED_FIELDS, vals, strict=False)))
        if tag == "BlockRemoved":
            if len(vals) < 1 or len(vals) > len(REMOVED_FIELDS):
                raise FrameError("event", f"BlockRemoved array of {len(vals)} fields")
            return _removed(dict(zip(REMOVED_FIELDS, vals, strict=False)))
        if tag == "AllBlocksCleared":
            return Cleared()
        return None
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise FrameError("event", "event map without a string 'type' tag")
        if tag == "BlockStored":
            for name in STORED_FIELDS[:_STORED_REQUIRED]:
                if name not in raw:
                    raise FrameError("event", f"BlockStored lacks {name}")
            return _stored(raw)
        if tag == "BlockRemoved":
            if "block_hashes" not in raw:
                raise FrameError("event", "BlockRemoved lacks block_hashes")
            return _removed(raw)
        if tag == "AllBlocksCleared":
            return Cleared()
        return None
    raise FrameError("event", f"event is a msgpack {type(raw).__name__}")


def _hashes(v: Any) -> list[EngineHash]:
    if not isinstance(v, list | tuple):
        raise FrameError("event", f"block_hashes is {type(v).__name__}")
    for h in v:
        if not (isinstance(h, bytes) or _is_int(h)):
            raise FrameError("event", f"block hash is {type(h).__name__}")
    return list(v)


def _opt(v: Any, kind: type, name: str) -> Any:
    if v is None:
        return None
    if kind is int:
        if not _is_int(v):
            raise FrameError("event", f"{name} is {type(v).__name__}")
    elif not isinstance(v, kind):
        raise FrameError("event", f"{name} is {type(v).__name__}")
    return v


def _stored(f: dict[str, Any]) -> Stored:
    hashes = _hashes(f["block_hashes"])
    parent = f.get("parent_block_hash")
    if parent is not None and not (isinstance(parent, bytes) or _is_int(parent)):
        raise FrameError("event", f"parent_block_hash is {type(parent).__name__}")
    bs = f.get("block_size")
    tokens = f.get("token_ids")
    if not isinstance(tokens, list | tuple):
        raise FrameError("event", f"token_ids is {type(tokens).__name__}")
    medium = _opt(f.get("medium"), str, "medium")
    # A lower tier's copies named by hash alone (vLLM's offloading connector): no token ids,
    # block_size 0 (older releases) or the tier's own.
    copies = not tokens and medium not in (None, "GPU")
    if not _is_int(bs) or bs < 0 or (bs == 0 and not copies):
        raise FrameError("event", f"block_size is {bs!r}")
    if len(tokens) != len(hashes) * bs and not copies:
        raise FrameError("event", f"{len(tokens)} token ids for {len(hashes)} blocks of {bs}")
    try:
        toks = array.array("I", tokens)  # C-speed check: every id an int in uint32
    except (TypeError, OverflowError) as exc:
        raise FrameError("event", f"token_ids: {exc}") from None
    extra = f.get("extra_keys")
    if extra is not None and (not isinstance(extra, list | tuple) or len(extra) != len(hashes)):
        raise FrameError("event", "extra_keys is not one entry per block")
    return Stored(
        block_hashes=hashes,
        parent=parent,
        token_ids=toks,
        block_size=bs,
        lora_id=_opt(f.get("lora_id"), int, "lora_id"),
        medium=medium,
        lora_name=_opt(f.get("lora_name"), str, "lora_name"),
        extra_keys=list(extra) if extra is not None else None,
        group_idx=_opt(f.get("group_idx"), int, "group_idx"),
        cache_salt=_opt(f.get("cache_salt"), str, "cache_salt"),
    )


def _removed(f: dict[str, Any]) -> Removed:
    return Removed(
        block_hashes=_hashes(f["block_hashes"]),
        medium=_opt(f.get("medium"), str, "medium"),
        group_idx=_opt(f.get("group_idx"), int, "group_idx"),
    )
