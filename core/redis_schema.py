"""The Redis schema: every key name kvroute uses, and how values are laid out. One module.

All keys of one model share the hash tag ``{<model>}``, so every multi-key command and
transaction (feed + snapshot + meta) touches one slot and works unchanged on a Redis Cluster.
Different models land on different slots: that is how an installation outgrows one Redis.

=================================  ======  ====================================================
key                                type    content
=================================  ======  ====================================================
``kvr:{M}:feed``                   stream  change feed of cache events for model M, one entry
                                           per batch: ``w`` worker, ``e`` epoch, ``s`` seq,
                                           ``op`` (store | evict | clear | resync), ``k`` keys
``kvr:{M}:snap:<worker>``          set     the worker's cached block keys (8-byte big-endian)
``kvr:{M}:meta:<worker>``          hash    ``epoch``, ``seq`` of the last event in the snapshot
``kvr:{M}:hb:<worker>``            string  heartbeat JSON (address, load, block size,
                                           tokenizer and vocabulary size); has TTL
``kvr:{M}:workers``                set     worker ids that have published (pruned on expiry)
=================================  ======  ====================================================

Feed semantics: per worker, ``seq`` counts 1, 2, 3... within an ``epoch``. A new epoch starts
with ``op=clear, seq=1`` (a fresh, empty cache) or ``op=resync, seq=1`` (the snapshot was
rewritten whole: reload it). Snapshot and meta are updated in the same transaction as the feed
entry, so a snapshot read with its meta is always consistent with some feed position.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from kvroute.core.blocks import DEFAULT_BLOCK_SIZE
from kvroute.core.load import PrefillMode

KEY_SCHEME = "kvroute/v1"
_NAME = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,200}$")


def check_name(kind: str, value: str) -> str:
    """Model and worker names go into key names: allow a safe alphabet only."""
    if not _NAME.match(value):
        raise ValueError(
            f"{kind} {value!r} is not valid: use 1-200 of letters, digits and . _ : / @ + = -"
        )
    return value


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names for one model."""

    model: str
    prefix: str = "kvr"

    def __post_init__(self) -> None:
        check_name("model", self.model)

    @property
    def _base(self) -> str:
        return f"{self.prefix}:{{{self.model}}}"

    @property
    def feed(self) -> str:
        return f"{self._base}:feed"

    @property
    def workers(self) -> str:
        return f"{self._base}:workers"

    def snapshot(self, worker: str) -> str:
        return f"{self._base}:snap:{worker}"

    def meta(self, worker: str) -> str:
        return f"{self._base}:meta:{worker}"

    def heartbeat(self, worker: str) -> str:
        return f"{self._base}:hb:{worker}"


class Op(StrEnum):
    STORE = "store"
    EVICT = "evict"
    CLEAR = "clear"
    RESYNC = "resync"


def pack_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f">{len(keys)}Q", *keys)


def unpack_keys(blob: bytes) -> list[int]:
    if len(blob) % 8:
        raise ValueError(f"key blob of {len(blob)} bytes is not a multiple of 8")
    return list(struct.unpack(f">{len(blob) // 8}Q", blob))


class FeedError(ValueError):
    """A feed entry that does not follow the schema."""


@dataclass(frozen=True, slots=True)
class FeedEvent:
    worker: str
    epoch: str
    seq: int
    op: Op
    keys: tuple[int, ...] = ()

    def to_fields(self) -> dict[str, bytes | str | int]:
        return {
            "w": self.worker,
            "e": self.epoch,
            "s": self.seq,
            "op": self.op.value,
            "k": pack_keys(self.keys),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> FeedEvent:
        """Parse a stream entry; FeedError says what is wrong with it."""
        try:
            worker = fields[b"w"].decode()
            epoch = fields[b"e"].decode()
            seq = int(fields[b"s"])
            op = Op(fields[b"op"].decode())
            keys = tuple(unpack_keys(fields.get(b"k", b"")))
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise FeedError(f"malformed feed entry {dict(fields)!r:.200}: {exc}") from exc
        if seq < 1:
            raise FeedError(f"feed entry from {worker!r} has seq {seq} < 1")
        return cls(worker, epoch, seq, op, keys)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What an agent publishes every heartbeat interval, with a TTL."""

    worker_id: str
    address: str
    epoch: str
    running: int = 0
    queued: int = 0
    free_blocks: int = 0
    capacity_blocks: int = 0
    pending_prefill_tokens: int = 0
    max_running: int = 0
    max_batched_tokens: int = 0
    arrival_rate: float = 0.0  # requests per second the agent received lately (all routers)
    prefill_rate: float = 0.0  # prompt tokens per second its engine prefilled lately (uncached)
    prefill_mode: str = PrefillMode.UNKNOWN  # a PrefillMode: "whole", "chunked" or "" (unknown)
    max_prefill_chunk: int = 0  # most tokens of one prefill per iteration (0: none)
    block_size: int = DEFAULT_BLOCK_SIZE
    ttl_s: float = 3.0
    key_scheme: str = KEY_SCHEME
    # The ids the worker speaks: routers leave out a worker whose vocabulary is not theirs
    # (kvroute.router.registry.vocab_mismatch). "" / 0: not reported (an older agent, or an
    # agent whose --tokenizer is not its engine's vocabulary).
    tokenizer: str = ""  # the tokenizer name (kvroute.core.tokenizer): "byte", "gpt2"
    vocab_size: int = 0  # token ids the worker accepts are below this
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        """Parse and validate; ValueError says what is wrong."""
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"heartbeat is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("heartbeat is not a JSON object")
        known = {f: data[f] for f in cls.__dataclass_fields__ if f in data}
        try:
            hb = cls(**known)
        except TypeError as exc:
            raise ValueError(f"heartbeat lacks a field: {exc}") from exc
        for name in ("running", "queued", "free_blocks", "capacity_blocks",
                     "pending_prefill_tokens", "max_running", "max_batched_tokens",
                     "max_prefill_chunk", "block_size", "vocab_size"):
            v = getattr(hb, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"heartbeat field {name} must be a non-negative int, got {v!r}")
        for name in ("arrival_rate", "prefill_rate"):
            rate = getattr(hb, name)
            if isinstance(rate, bool) or not isinstance(rate, int | float) \
                    or not math.isfinite(rate) or rate < 0:
                raise ValueError(f"heartbeat field {name} must be a non-negative finite "
                                 f"number, got {rate!r}")
        PrefillMode.parse(hb.prefill_mode, "heartbeat field prefill_mode")
        if not isinstance(hb.ttl_s, int | float) or hb.ttl_s <= 0:
            raise ValueError(f"heartbeat field ttl_s must be a positive number, got {hb.ttl_s!r}")
        for name in ("worker_id", "address", "epoch", "key_scheme"):
            if not isinstance(getattr(hb, name), str) or not getattr(hb, name):
                raise ValueError(f"heartbeat field {name} must be a non-empty string")
        if not isinstance(hb.tokenizer, str) or len(hb.tokenizer) > 200:
            raise ValueError(f"heartbeat field tokenizer must be a string of at most 200 "
                             f"characters, got {hb.tokenizer!r:.80}")
        return hb
