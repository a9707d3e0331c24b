"""The Redis schema: every key name kvroute uses, and how values are laid out. One module.

All keys of one model share the hash tag ``{<model>}``, so every multi-key command and
transaction (feed + snapshot + meta) touches one slot and works unchanged on a Redis Cluster.
Different models land on different slots: that is how an installation outgrows one Redis.

=================================  ======  ====================================================
key                                type    content
=================================  ======  ====================================================
``kvr:{M}:feed``                   stream  change feed of cache events for model M, one entry
                                           per batch: ``w`` worker, ``e`` epoch, ``s`` seq,
                                           ``op`` (store | lower | evict | clear | resync),
                                           ``k`` keys (kvroute.core.cache_events: store is
                                           held in GPU memory, lower in a lower tier only)
``kvr:{M}:snap:<worker>``          set     the worker's cached block keys (8-byte big-endian);
                                           TTL :data:`STATE_TTL_S` from its agent's last write
``kvr:{M}:low:<worker>``           set     those of its snapshot's keys held only in a lower
                                           tier (CPU offload, HiCache); absent: none. TTL as
                                           the snapshot's
``kvr:{M}:meta:<worker>``          hash    ``epoch``, ``seq`` of the last event in the snapshot,
                                           ``h`` the feed chain at it (FeedEvent.chained);
                                           TTL as the snapshot's
``kvr:{M}:hb:<worker>``            string  heartbeat JSON (address, load, block size,
                                           tokenizer and vocabulary size, the feed's seq and
                                           chain as its agent last wrote); has TTL. It is the
                                           worker's registration: routers find workers by
                                           SCAN over these keys
``kvr:{M}:decisions``              stream  routers' shared decisions (``--share-decisions``):
                                           ``r`` router, ``op`` (sent | done), ``q`` request,
                                           ``t`` wall ms; sent: ``w`` worker, ``u`` uncached
                                           tokens, ``c`` their context, ``k`` predicted keys
=================================  ======  ====================================================

Feed semantics: per worker, ``seq`` counts 1, 2, 3... within an ``epoch``. A new epoch starts
with ``op=clear, seq=1`` (a fresh, empty cache) or ``op=resync, seq=1`` (the snapshot was
rewritten whole: reload it). Snapshot, lower-tier set and meta are updated in the same
transaction as the feed entry, so a snapshot read with its meta is always consistent with some
feed position. Each entry extends the worker's feed chain (:meth:`FeedEvent.chained`), which
its agent writes into its meta and heartbeat in that transaction: any agent may append to the
feed, but only this one writes these, so a router can tell its entries from entries forged in
its name.

Ownership: an agent writes its own snapshot, lower-tier set, meta and heartbeat and appends to
the feed, the one key agents share; its keys expire on their own once it stops writing, so
nothing needs pruning. A router writes nothing but the decisions stream.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from kvroute.core.blocks import DEFAULT_BLOCK_SIZE
from kvroute.core.load import ENGINE_LOAD_FIELDS, EngineLoad, PrefillMode

KEY_SCHEME = "kvroute/v1"
_NAME = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,200}$")
# An engine endpoint a gateway connects to: host:port, the host a DNS name or IPv4 address or
# an IPv6 address in brackets, the port 1-65535 (check_endpoint).
_ENDPOINT = re.compile(r"^(?=.{1,200}$)([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):"
                       r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}"
                       r"|655[0-2][0-9]|6553[0-5])$")


def check_endpoint(value: str, what: str = "engine endpoint") -> str:
    """``value`` if it is host:port (see _ENDPOINT); ValueError naming ``what`` if not."""
    if not _ENDPOINT.match(value):
        raise ValueError(f"{what} must be host:port (an IPv6 host in brackets), got "
                         f"{value!r:.80}")
    return value


def check_name(kind: str, value: str) -> str:
    """Model and worker names go into key names: allow a safe alphabet only."""
    if not _NAME.match(value):
        raise ValueError(
            f"{kind} {value!r} is not valid: use 1-200 of letters, digits and . _ : / @ + = -"
        )
    return value


def heartbeat_workers(keys: RedisKeys, raw: Iterable[bytes]
                      ) -> tuple[list[str], dict[bytes, ValueError]]:
    """The workers named by heartbeat keys as a SCAN of :attr:`RedisKeys.heartbeat_match`
    read them (a key read twice counts once): those that are worker names, and the other keys
    with why each is not (bad UTF-8 or a name outside :func:`check_name`'s alphabet)."""
    prefix = keys.heartbeat("").encode()
    names: list[str] = []
    bad: dict[bytes, ValueError] = {}
    for key in dict.fromkeys(raw):
        try:
            if not key.startswith(prefix):
                raise ValueError(f"key {key!r:.80} is not a heartbeat of model {keys.model}")
            names.append(check_name("worker", key[len(prefix):].decode()))
        except ValueError as exc:  # also bad UTF-8
            bad[key] = exc
    return names, bad


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
    def decisions(self) -> str:
        return f"{self._base}:decisions"

    def snapshot(self, worker: str) -> str:
        return f"{self._base}:snap:{worker}"

    def meta(self, worker: str) -> str:
        return f"{self._base}:meta:{worker}"

    def lower(self, worker: str) -> str:
        return f"{self._base}:low:{worker}"

    def heartbeat(self, worker: str) -> str:
        return f"{self._base}:hb:{worker}"

    @property
    def heartbeat_match(self) -> str:
        """The SCAN pattern of every worker's heartbeat: the model's registry. Model and
        worker names hold no glob character (check_name), so it matches nothing else."""
        return self.heartbeat("*")


class Op(StrEnum):
    STORE = "store"
    LOWER = "lower"
    EVICT = "evict"
    CLEAR = "clear"
    RESYNC = "resync"


def pack_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f">{len(keys)}Q", *keys)


def unpack_keys(blob: bytes) -> list[int]:
    if len(blob) % 8:
        raise ValueError(f"key blob of {len(blob)} bytes is not a multiple of 8")
    return list(struct.unpack(f">{len(blob) // 8}Q", blob))


# A snapshot as DUMP serialises it (Redis's RDB value format): the type, the member count,
# each member as its length and bytes, then a 2-byte RDB version and an 8-byte CRC64. Read
# that way, a snapshot of 10k keys reaches the router as one bytes object instead of 10k.
_RDB_TYPE_SET = 2  # a set kept as a hash table; small or all-integer sets use other encodings
_RDB_FOOTER = 10
_KEY_MEMBER = 8  # an 8-byte member's length byte, RDB's 6-bit length encoding


def dumped_keys(payload: bytes | None) -> bytes | None:
    """The snapshot's members end to end (8 bytes each, as ``pack_keys`` wrote them), from
    ``DUMP`` of its key; ``b""`` for a key that does not exist. ``None`` when the payload
    is not a hash-table set of 8-byte members only (Redis keeps a small set, or one of
    numeric members, in another encoding; a key of another type): read it with SMEMBERS,
    which also says WRONGTYPE. The CRC is not checked; the layout is, to the byte."""
    if payload is None:
        return b""
    if len(payload) < 2 + _RDB_FOOTER or payload[0] != _RDB_TYPE_SET:
        return None
    kind, at = payload[1] >> 6, 2
    if kind == 0:
        n = payload[1] & 0x3F
    elif kind == 1:
        n, at = (payload[1] & 0x3F) << 8 | payload[2], 3
    elif payload[1] == 0x80:
        n, at = int.from_bytes(payload[2:6], "big"), 6
    elif payload[1] == 0x81:
        n, at = int.from_bytes(payload[2:10], "big"), 10
    else:
        return None
    end = at + 9 * n
    if end + _RDB_FOOTER != len(payload) or payload[at:end:9] != bytes((_KEY_MEMBER,)) * n:
        return None  # a member not of 8 bytes, or stored as an integer
    import numpy as np  # here: agents, and a router until its first snapshot, never load it

    rows = np.frombuffer(payload, np.uint8, 9 * n, at).reshape(n, 9)
    return rows[:, 1:].tobytes()


# What the router's mirror reads (a member is a key the registry's SCAN found), and why it may
# refuse a record: the labels of kvroute_router_records_rejected_total.
RECORD_KINDS = ("heartbeat", "feed", "snapshot", "member")
REJECT_REASONS = ("not_json", "too_large", "missing_field", "bad_type", "out_of_range",
                  "bad_name", "wrong_type", "mismatch")


class RecordError(ValueError):
    """A Redis record (feed entry, snapshot, heartbeat) that does not follow the schema.

    ``reason`` is one of :data:`REJECT_REASONS`, a fixed word for metrics
    (``kvroute_router_records_rejected_total``); the message says the rest."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _number(v: float) -> str:
    """A number for a message, short even when it is a 4,000-digit int (no float overflow)."""
    if isinstance(v, int) and abs(v) > 1 << 53:
        return f"{'-' if v < 0 else ''}about 2^{abs(v).bit_length() - 1}"
    return f"{v:.6g}"


class FeedError(RecordError):
    """A feed entry that does not follow the schema."""


INT64_MAX = (1 << 63) - 1
CHAIN_MAX = (1 << 64) - 1  # a feed chain: 64 bits (FeedEvent.chained)
MAX_EPOCH_CHARS = 200
MAX_HEARTBEAT_BYTES = 64 * 1024
MAX_TTL_S = 3600.0
STATE_TTL_S = 60.0
"""How long a worker's snapshot and meta outlive its agent's last write (each write and
heartbeat sets it again): long past any heartbeat TTL, so only a dead agent's state expires;
one that stalled this long finds it gone and rewrites it under a new epoch."""
# The most each numeric heartbeat field may claim: far above any real engine, and small
# enough that the policy's products of them (tokens times context, squared) stay finite
# floats. A record outside them is refused whole, never clamped: its other numbers are suspect.
HEARTBEAT_INT_MAX = {
    "running": 1 << 24, "queued": 1 << 24, "max_running": 1 << 24,
    "free_blocks": 1 << 40, "capacity_blocks": 1 << 40,
    "pending_prefill_tokens": 1 << 48, "max_batched_tokens": 1 << 32,
    "max_prefill_chunk": 1 << 32, "block_size": 1 << 16, "vocab_size": 1 << 32,
    "feed_seq": INT64_MAX, "feed_chain": CHAIN_MAX,
}
HEARTBEAT_RATE_MAX = 1e12  # arrival_rate (requests/s) and prefill_rate (tokens/s)
# The float fields and their bounds (a second per token is far beyond any real tier).
HEARTBEAT_FLOAT_MAX = {"arrival_rate": HEARTBEAT_RATE_MAX, "prefill_rate": HEARTBEAT_RATE_MAX,
                       "lower_tier_s_per_token": 1.0}


@dataclass(frozen=True, slots=True)
class FeedEvent:
    worker: str
    epoch: str
    seq: int
    op: Op
    keys: tuple[int, ...] = ()

    def chained(self, prev: int) -> int:
        """The worker's feed chain after this entry, ``prev`` the chain before it (0 before
        an epoch's first entry): 64 bits of BLAKE2b over ``prev``, seq, op and keys. The
        agent writes it into its meta and heartbeat with each entry; a router that applied
        an entry the agent never wrote (another agent's, in this worker's name) holds
        another chain from there on (kvroute.router.mirror.heartbeats)."""
        h = hashlib.blake2b(prev.to_bytes(8, "big"), digest_size=8)
        h.update(self.seq.to_bytes(8, "big"))
        h.update(self.op.value.encode())
        h.update(pack_keys(self.keys))
        return int.from_bytes(h.digest(), "big")

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
        except KeyError as exc:
            raise FeedError(f"malformed feed entry {dict(fields)!r:.200}: lacks {exc}",
                            "missing_field") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise FeedError(f"malformed feed entry {dict(fields)!r:.200}: {exc}",
                            "bad_type") from exc
        if not 1 <= seq <= INT64_MAX:
            raise FeedError(f"feed entry from {worker!r:.80} has seq {_number(seq)} outside "
                            f"[1, 2^63)", "out_of_range")
        if not _NAME.match(worker) or not 0 < len(epoch) <= MAX_EPOCH_CHARS:
            raise FeedError(f"feed entry has a bad worker {worker!r:.80} or epoch "
                            f"{epoch!r:.80}", "bad_name")
        return cls(worker, epoch, seq, op, keys)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What an agent publishes every heartbeat interval, with a TTL."""

    worker_id: str
    address: str
    epoch: str
    # In the JSON, its fields are the record's own (an agent's record is one flat object).
    load: EngineLoad = field(default_factory=EngineLoad)
    block_size: int = DEFAULT_BLOCK_SIZE
    ttl_s: float = 3.0
    key_scheme: str = KEY_SCHEME
    # The ids the worker speaks: routers leave out a worker whose vocabulary is not theirs
    # (kvroute.router.registry.vocab_mismatch). "" / 0: not reported (an older agent, or an
    # agent whose --tokenizer is not its engine's vocabulary).
    tokenizer: str = ""  # the tokenizer name (kvroute.core.tokenizer): "byte", "gpt2"
    vocab_size: int = 0  # token ids the worker accepts are below this
    # Where a gateway sends this worker's HTTP traffic (its engine's OpenAI server, the pod's
    # IP and vLLM port), host:port; "": not reported (kvroute epp then uses the agent's host
    # and --epp-target-port). See check_endpoint.
    engine_endpoint: str = ""
    # The feed's seq and chain (FeedEvent.chained) as its agent had last written them in
    # ``epoch``; 0: not reported (an older agent).
    feed_seq: int = 0
    feed_chain: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        record = asdict(self)
        record.update(record.pop("load"))
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        """Parse and validate; :class:`RecordError` (a ValueError) says what is wrong.

        Every number must be finite and within its bound (:data:`HEARTBEAT_INT_MAX`,
        :data:`HEARTBEAT_FLOAT_MAX`, ``0 < ttl_s <=`` :data:`MAX_TTL_S`): one absurd record
        must not overflow the routing arithmetic for the whole cluster."""
        if len(raw) > MAX_HEARTBEAT_BYTES:
            raise RecordError(f"heartbeat of {len(raw)} bytes exceeds "
                              f"{MAX_HEARTBEAT_BYTES}", "too_large")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
            raise RecordError(f"heartbeat is not JSON: {exc}", "not_json") from exc
        if not isinstance(data, dict):
            raise RecordError("heartbeat is not a JSON object", "not_json")
        known = {f: data[f] for f in cls.__dataclass_fields__ if f in data and f != "load"}
        load = {f: data[f] for f in ENGINE_LOAD_FIELDS if f in data}
        try:
            load["prefill_mode"] = PrefillMode.parse(load.get("prefill_mode", ""),
                                                     "heartbeat field prefill_mode")
        except ValueError as exc:
            raise RecordError(str(exc), "bad_type") from exc
        try:
            hb = cls(**known, load=EngineLoad(**load))
        except TypeError as exc:
            raise RecordError(f"heartbeat lacks a field: {exc}", "missing_field") from exc
        _check_numbers(hb)
        _check_strings(hb)
        return hb


def _check_numbers(hb: Heartbeat) -> None:
    """Every number of ``hb`` an int or finite float within its bound, else RecordError."""
    for name, high in HEARTBEAT_INT_MAX.items():
        v = getattr(hb.load if name in ENGINE_LOAD_FIELDS else hb, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise RecordError(f"heartbeat field {name} must be a non-negative int, "
                              f"got {v!r:.80}", "bad_type")
        if not 0 <= v <= high:
            raise RecordError(f"heartbeat field {name} must be a non-negative int at "
                              f"most {high}, got {_number(v)}", "out_of_range")
    for name, high in HEARTBEAT_FLOAT_MAX.items():
        rate = getattr(hb.load, name)
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise RecordError(f"heartbeat field {name} must be a non-negative finite "
                              f"number, got {rate!r:.80}", "bad_type")
        if not (math.isfinite(rate) and 0 <= rate <= high):
            raise RecordError(f"heartbeat field {name} must be a non-negative finite "
                              f"number at most {high:g}, got {_number(rate)}",
                              "out_of_range")
    if isinstance(hb.ttl_s, bool) or not isinstance(hb.ttl_s, int | float):
        raise RecordError(f"heartbeat field ttl_s must be a number, got {hb.ttl_s!r:.80}",
                          "bad_type")
    if not (math.isfinite(hb.ttl_s) and 0 < hb.ttl_s <= MAX_TTL_S):
        raise RecordError(f"heartbeat field ttl_s must be in (0, {MAX_TTL_S:g}] seconds, "
                          f"got {_number(hb.ttl_s)}", "out_of_range")


def _check_strings(hb: Heartbeat) -> None:
    """Every string of ``hb`` (and ``extra``) of its form and length, else RecordError."""
    for name in ("worker_id", "address", "epoch", "key_scheme"):
        v = getattr(hb, name)
        if not isinstance(v, str) or not 0 < len(v) <= MAX_EPOCH_CHARS:
            raise RecordError(f"heartbeat field {name} must be a non-empty string of at "
                              f"most {MAX_EPOCH_CHARS} characters", "bad_type")
    if not _NAME.match(hb.worker_id):
        raise RecordError(f"heartbeat field worker_id {hb.worker_id!r} is not a valid "
                          "worker name", "bad_name")
    if not isinstance(hb.tokenizer, str) or len(hb.tokenizer) > 200:
        raise RecordError(f"heartbeat field tokenizer must be a string of at most 200 "
                          f"characters, got {hb.tokenizer!r:.80}", "bad_type")
    if not isinstance(hb.engine_endpoint, str) or (
            hb.engine_endpoint and not _ENDPOINT.match(hb.engine_endpoint)):
        raise RecordError(f"heartbeat field engine_endpoint must be host:port or empty, "
                          f"got {hb.engine_endpoint!r:.80}", "bad_type")
    if not isinstance(hb.extra, dict) or len(hb.extra) > 64 or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in hb.extra.items()):
        raise RecordError("heartbeat field extra must be an object of at most 64 string "
                          "values", "bad_type")


def parse_meta(meta: Mapping[bytes, bytes]) -> tuple[str, int, int]:
    """(epoch, seq, chain) of a worker's snapshot meta (chain 0: not written, an older
    agent); RecordError says what is wrong. (The snapshot's members are checked, one 8-byte
    key each, where the index decodes them: ``PrefixIndex.replace_worker_packed``.)"""
    try:
        epoch = meta[b"epoch"].decode()
        seq = int(meta[b"seq"])
        chain = int(meta.get(b"h", b"0"))
    except KeyError as exc:
        raise RecordError(f"snapshot meta lacks {exc}", "missing_field") from exc
    except ValueError as exc:  # also bad UTF-8
        raise RecordError(f"snapshot meta is malformed: {exc}", "bad_type") from exc
    if (not 0 <= seq <= INT64_MAX or not 0 < len(epoch) <= MAX_EPOCH_CHARS
            or not 0 <= chain <= CHAIN_MAX):
        raise RecordError(f"snapshot meta has seq {_number(seq)}, chain {_number(chain)} or "
                          f"an epoch of {len(epoch)} characters out of range", "out_of_range")
    return epoch, seq, chain


# -- access control ---------------------------------------------------------------------------

# Commands every client sends: a transaction's MULTI/EXEC/DISCARD; SELECT for a URL's /db;
# what redis-py's cluster client needs to map slots (CLUSTER SLOTS/SHARDS, COMMAND, ASKING).
# (AUTH is always allowed; kvroute.core.redis_conn turns redis-py's CLIENT SETINFO off.)
_ACL_COMMON = ("+multi", "+exec", "+discard", "+select", "+cluster|slots", "+cluster|shards",
               "+command", "+asking")
# What kvroute.worker_agent.publisher sends: the heartbeat (SET PX, HGET of its meta, SCARD of
# its snapshot, PEXPIRE of its snapshot, lower-tier set and meta), feed batches (HGET and SCARD
# first, XADD MAXLEN ~, SADD/SREM/DEL of its snapshot and lower-tier set, HSET of its meta),
# the resync, DEL of its keys on a clean stop, and GET of another worker's heartbeat (a
# program's placement may send fork children only to a live worker, at its heartbeat's
# address).
_ACL_AGENT = ("+set", "+sadd", "+srem", "+scard", "+del", "+hget", "+hset", "+xadd", "+get",
              "+pexpire")
# What kvroute.router.mirror sends: feed reads (XREVRANGE, XREAD BLOCK), the heartbeat scan
# (SCAN MATCH of the heartbeat keys, MGET), snapshot reads (HGETALL of the meta and DUMP of the
# set, SMEMBERS for a set DUMP gives in another encoding; the EVAL_RO running HGETALL and
# SMEMBERS), and the shared decisions (XADD MAXLEN ~ to the decisions stream:
# kvroute.router.shared).
_ACL_ROUTER = ("+xrevrange", "+xread", "+scan", "+smembers", "+mget", "+eval_ro", "+hgetall",
               "+dump", "+xadd")


def acl_rules(role: str, model: str, worker: str = "", prefix: str = "kvr") -> list[str]:
    """The least Redis ACL (``ACL SETUSER`` / aclfile rules, after the user's name and
    password) a ``role`` ("agent" or "router") needs for ``model``: no command or key beyond
    what kvroute sends, no pub/sub channel.

    An agent given its ``worker`` id may write only its own snapshot, lower-tier set, meta
    and heartbeat (its registration), append to the feed and GET the others' heartbeats (a
    program's placement), nothing else. The feed is one stream per model that every agent
    appends to, so an ACL cannot stop one agent from writing an entry in another's name
    (docs/security.md bounds what that can do).
    A router reads the model's keys and appends to the decisions stream: it writes nothing
    else. Needs Redis >= 7.0 (``%R~`` read-only keys, EVAL_RO)."""
    k = RedisKeys(model, prefix)
    base = f"{prefix}:{{{model}}}"
    head = ["resetkeys", "resetchannels", "-@all", *_ACL_COMMON]
    if role == "agent":
        own = ([k.snapshot(check_name("worker", worker)), k.lower(worker), k.meta(worker),
                k.heartbeat(worker)]
               if worker else [f"{base}:snap:*", f"{base}:low:*", f"{base}:meta:*",
                               f"{base}:hb:*"])
        # Selectors (Redis >= 7.0) grant one command on one shared key: the feed takes only
        # appends (not DEL, SET or PEXPIRE, which would take it from every router), others'
        # heartbeats only GET (a program's placement reads them).
        shared = [f"(~{k.feed} +xadd)"]
        if worker:
            shared.append(f"(%R~{k.heartbeat_match} +get)")
        return [*head, *_ACL_AGENT, *(f"~{key}" for key in own), *shared]
    if role == "router":
        # Everything read-only but the one key it writes.
        return [*head, *_ACL_ROUTER, f"%R~{base}:*", f"~{k.decisions}"]
    raise ValueError(f"ACL role {role!r} is not one of: agent, router")
