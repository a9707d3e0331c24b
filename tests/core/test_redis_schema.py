from __future__ import annotations

import pytest

from kvroute.core.load import EngineLoad, PrefillMode
from kvroute.core.redis_schema import (
    FeedError,
    FeedEvent,
    Heartbeat,
    Op,
    RedisKeys,
    pack_keys,
    unpack_keys,
)


def test_all_keys_of_a_model_share_one_hash_tag() -> None:
    k = RedisKeys("meta-llama/Llama-3-8B")
    names = [k.feed, k.decisions, k.snapshot("w1"), k.lower("w1"), k.meta("w1"),
             k.heartbeat("w1")]
    tags = {n[n.index("{") + 1 : n.index("}")] for n in names}
    assert tags == {"meta-llama/Llama-3-8B"}
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("bad", ["", "a b", "x{y}", "a\nb", "z" * 201])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="model"):
        RedisKeys(bad)


def test_feed_event_round_trip() -> None:
    ev = FeedEvent("w1", "e1", 7, Op.STORE, (1, 2**64 - 1))
    fields = {k.encode(): (v if isinstance(v, bytes) else str(v).encode())
              for k, v in ev.to_fields().items()}
    assert FeedEvent.from_fields(fields) == ev


@pytest.mark.parametrize("fields", [
    {b"w": b"w", b"e": b"e", b"s": b"x", b"op": b"store"},
    {b"w": b"w", b"e": b"e", b"s": b"1", b"op": b"explode"},
    {b"w": b"w", b"e": b"e", b"s": b"0", b"op": b"store"},
    {b"w": b"w", b"e": b"e", b"s": b"1", b"op": b"store", b"k": b"123"},
    {b"e": b"e", b"s": b"1", b"op": b"store"},
])
def test_malformed_feed_entries_are_named(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(FeedError):
        FeedEvent.from_fields(fields)


def test_key_packing() -> None:
    keys = [0, 1, 2**63, 2**64 - 1]
    assert unpack_keys(pack_keys(keys)) == keys
    with pytest.raises(ValueError):
        unpack_keys(b"1234567")


def test_heartbeat_validation() -> None:
    hb = Heartbeat("w1", "127.0.0.1:1", "e", load=EngineLoad(running=2))
    assert Heartbeat.from_json(hb.to_json()) == hb
    with pytest.raises(ValueError, match="JSON"):
        Heartbeat.from_json("{")
    with pytest.raises(ValueError, match="running"):
        Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e","running":-1}')
    with pytest.raises(ValueError, match="max_batched_tokens"):
        Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e",'
                            '"max_batched_tokens":"8192"}')
    with pytest.raises(ValueError, match="address"):
        Heartbeat.from_json('{"worker_id":"w","address":"","epoch":"e"}')
    with pytest.raises(ValueError, match="lacks"):
        Heartbeat.from_json('{"worker_id":"w"}')
    hb = Heartbeat("w1", "127.0.0.1:1", "e", load=EngineLoad(arrival_rate=2.5))
    assert Heartbeat.from_json(hb.to_json()).load.arrival_rate == 2.5
    # An older agent sends none: unknown, 0.
    old = Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e"}')
    assert old.load.arrival_rate == 0
    for field in ("arrival_rate", "prefill_rate"):
        for bad in ("-1", "NaN", "Infinity", '"2"', "true", "null"):
            with pytest.raises(ValueError, match=field):
                Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e",'
                                    f'"{field}":{bad}}}')
    hb = Heartbeat("w1", "127.0.0.1:1", "e", load=EngineLoad(prefill_rate=1250.5))
    assert Heartbeat.from_json(hb.to_json()).load.prefill_rate == 1250.5
    # How the engine admits a long prompt: named in the JSON, unknown when an older agent
    # does not say, anything else refused.
    hb = Heartbeat("w1", "127.0.0.1:1", "e", load=EngineLoad(prefill_mode=PrefillMode.CHUNKED))
    assert '"prefill_mode":"chunked"' in hb.to_json()
    assert Heartbeat.from_json(hb.to_json()).load.prefill_mode == "chunked"
    assert Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e"}'
                               ).load.prefill_mode is PrefillMode.UNKNOWN
    for bad in ('"Chunked"', '"partial"', "1", "null", "[]"):
        with pytest.raises(ValueError, match="prefill_mode must be one of"):
            Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e",'
                                f'"prefill_mode":{bad}}}')
    assert old.load.prefill_rate == 0
    # The engine's cap on one prefill's chunk: carried, 0 (none) from an older agent.
    hb = Heartbeat("w1", "127.0.0.1:1", "e", load=EngineLoad(max_prefill_chunk=2048))
    assert Heartbeat.from_json(hb.to_json()).load.max_prefill_chunk == 2048
    assert Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e"}'
                               ).load.max_prefill_chunk == 0
    for bad in ("-1", '"2048"', "2.5", "null"):
        with pytest.raises(ValueError, match="max_prefill_chunk"):
            Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e",'
                                f'"max_prefill_chunk":{bad}}}')


def test_heartbeat_carries_the_workers_vocabulary() -> None:
    hb = Heartbeat("w1", "127.0.0.1:1", "e", tokenizer="gpt2", vocab_size=50257)
    back = Heartbeat.from_json(hb.to_json())
    assert (back.tokenizer, back.vocab_size) == ("gpt2", 50257)
    # An older agent says nothing: not reported ("" and 0), not refused.
    old = Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e"}')
    assert (old.tokenizer, old.vocab_size) == ("", 0)
    for bad in ("-1", '"258"', "2.5", "true", "null"):
        with pytest.raises(ValueError, match="vocab_size"):
            Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e",'
                                f'"vocab_size":{bad}}}')
    for bad in ("1", "null", "[]", '"' + "t" * 201 + '"'):
        with pytest.raises(ValueError, match="tokenizer"):
            Heartbeat.from_json('{"worker_id":"w","address":"a:1","epoch":"e",'
                                f'"tokenizer":{bad}}}')


def test_heartbeat_numbers_are_bounded() -> None:
    from kvroute.core.load import ENGINE_LOAD_FIELDS
    from kvroute.core.redis_schema import HEARTBEAT_INT_MAX, MAX_TTL_S, RecordError

    base = '{"worker_id":"w","address":"a:1","epoch":"e",'
    for name, high in HEARTBEAT_INT_MAX.items():
        hb = Heartbeat.from_json(base + f'"{name}":{high}}}')
        assert getattr(hb.load if name in ENGINE_LOAD_FIELDS else hb, name) == high
        for bad in (high + 1, 2 * 10 ** 70, 10 ** 4000):
            with pytest.raises(RecordError, match=f"{name} must be .* at most") as err:
                Heartbeat.from_json(base + f'"{name}":{bad}}}')
            assert err.value.reason == "out_of_range"
    assert Heartbeat.from_json(base + f'"ttl_s":{MAX_TTL_S}}}').ttl_s == MAX_TTL_S
    for bad in ("NaN", "Infinity", "1e300", "3600.5", "0", "-1"):
        with pytest.raises(RecordError, match=r"ttl_s must be in \(0, 3600\]"):
            Heartbeat.from_json(base + f'"ttl_s":{bad}}}')
    for bad, reason in (("[" * 50_000, "not_json"), (b"\xff", "not_json"),
                        ("x" * 70_000, "too_large"), ('"s"', "not_json"),
                        (base + '"worker_id":"a b"}', "bad_name"),
                        (base + '"extra":{"k":1}}', "bad_type")):
        with pytest.raises(RecordError) as err:
            Heartbeat.from_json(bad)
        assert err.value.reason == reason


def test_feed_and_snapshot_numbers_are_bounded() -> None:
    from kvroute.core.redis_schema import FeedError, RecordError, parse_meta

    ok = {b"w": b"w", b"e": b"e", b"op": b"store", b"k": pack_keys([1])}
    assert FeedEvent.from_fields({**ok, b"s": str((1 << 63) - 1).encode()}).seq == (1 << 63) - 1
    for s, reason in ((str(1 << 63).encode(), "out_of_range"), (b"2e70", "bad_type"),
                      (b"9" * 5000, "bad_type")):
        with pytest.raises(FeedError) as err:
            FeedEvent.from_fields({**ok, b"s": s})
        assert err.value.reason == reason
    with pytest.raises(FeedError, match="bad worker") as err:
        FeedEvent.from_fields({**ok, b"s": b"1", b"w": b"two words"})
    assert parse_meta({b"epoch": b"e", b"seq": b"3"}) == ("e", 3, 0)  # an older agent's
    assert parse_meta({b"epoch": b"e", b"seq": b"3", b"h": b"%d" % ((1 << 64) - 1)}) == (
        "e", 3, (1 << 64) - 1)
    for meta, reason in (({b"seq": b"1"}, "missing_field"),
                         ({b"epoch": b"\xff", b"seq": b"1"}, "bad_type"),
                         ({b"epoch": b"e", b"seq": str(1 << 64).encode()}, "out_of_range"),
                         ({b"epoch": b"e", b"seq": b"1", b"h": b"%d" % (1 << 64)},
                          "out_of_range"),
                         ({b"epoch": b"e", b"seq": b"1", b"h": b"x"}, "bad_type")):
        with pytest.raises(RecordError) as err:
            parse_meta(meta)
        assert err.value.reason == reason


def test_the_security_doc_shows_the_acl_the_code_grants() -> None:
    """docs/security.md's ACL lines are acl_rules' output (the TLS test runs with them)."""
    from pathlib import Path

    from kvroute.core.redis_schema import acl_rules

    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    block = doc.split("<!-- acl:begin -->")[1].split("<!-- acl:end -->")[0]
    lines = [ln for ln in block.splitlines() if ln.startswith("user ")]
    assert lines == [
        "user kvr-router on >ROUTER_PASSWORD " + " ".join(acl_rules("router", "MODEL")),
        "user kvr-agent-WORKER on >AGENT_PASSWORD "
        + " ".join(acl_rules("agent", "MODEL", "WORKER")),
        "user kvr-agent on >AGENT_PASSWORD " + " ".join(acl_rules("agent", "MODEL")),
    ]
    with pytest.raises(ValueError, match="role 'admin'"):
        acl_rules("admin", "m")
    with pytest.raises(ValueError, match="worker 'a\\*'"):
        acl_rules("agent", "m", "a*")  # a glob would grant other agents' keys


@pytest.mark.parametrize("n", [1, 63, 64, 1000, 16383, 16384])  # each length encoding's edges
def test_a_dumped_snapshot_gives_its_members_end_to_end(redis_server, n: int) -> None:
    import random

    from kvroute.core.redis_schema import dumped_keys, pack_keys, unpack_keys

    c = redis_server.client()
    rng = random.Random(n)
    keys = list({rng.getrandbits(64) for _ in range(n)})
    c.sadd("snap", *(pack_keys((k,)) for k in keys))
    blob = dumped_keys(c.dump("snap"))
    if c.object("encoding", "snap") != b"hashtable":
        assert blob is None  # Redis >= 7.2 keeps up to 128 members as a listpack: SMEMBERS
    else:
        assert blob is not None and sorted(unpack_keys(blob)) == sorted(keys)
    assert dumped_keys(c.dump("absent")) == b""  # no snapshot: no keys


def test_a_dump_in_another_encoding_or_malformed_is_left_to_smembers(redis_server) -> None:
    from kvroute.core.redis_schema import dumped_keys, pack_keys

    c = redis_server.client()
    c.sadd("digits", b"12345678", b"87654321")  # numeric members: Redis keeps an intset
    c.sadd("short", b"1234567", pack_keys((5,)))  # a member not one 8-byte key
    c.set("string", pack_keys((5,)))
    c.sadd("good", *(pack_keys((k,)) for k in range(1, 200)))
    for key in ("digits", "short", "string"):
        assert dumped_keys(c.dump(key)) is None, key
    good = c.dump("good")
    assert dumped_keys(good) is not None
    for bad in (good[:-1], good + b"\0", good[:20], b"", bytes([2, 0xC0]) + good[2:]):
        assert dumped_keys(bad) is None  # cut, padded or of an unknown length encoding


def test_a_dump_of_64_bit_length_is_read() -> None:
    """The 8-byte count encoding (a set of 2^32 members or more is out of reach here)."""
    from kvroute.core.redis_schema import dumped_keys, pack_keys

    body = b"".join(b"\x08" + pack_keys((k,)) for k in (3, 4))
    footer = b"\x0a\x00" + bytes(8)
    assert dumped_keys(bytes([2, 0x81]) + (2).to_bytes(8, "big") + body + footer) == \
        pack_keys((3, 4))
    assert dumped_keys(bytes([2, 0x80]) + (2).to_bytes(4, "big") + body + footer) == \
        pack_keys((3, 4))
    assert dumped_keys(bytes([2, 0x80]) + (3).to_bytes(4, "big") + body + footer) is None


def test_the_feed_chain_depends_on_every_part_of_every_entry() -> None:
    """An agent and a router computing a worker's chain from the same entries agree; any
    other entry on the way (seq, op or keys) gives another chain from there on."""
    first = FeedEvent("w", "e", 1, Op.CLEAR)
    entries = [FeedEvent("w", "e", 2, Op.STORE, (5, 6)), FeedEvent("w", "e", 3, Op.EVICT, (5,))]
    chain = first.chained(0)
    for ev in entries:
        chain = ev.chained(chain)
    assert 0 <= chain < 1 << 64
    again = first.chained(0)
    for ev in entries:
        again = ev.chained(again)
    assert again == chain
    base = entries[0].chained(first.chained(0))
    others = {FeedEvent("w", "e", 2, Op.STORE, (5, 7)).chained(first.chained(0)),
              FeedEvent("w", "e", 2, Op.LOWER, (5, 6)).chained(first.chained(0)),
              FeedEvent("w", "e", 2, Op.STORE, (5, 6)).chained(first.chained(0) ^ 1),
              FeedEvent("w", "e", 3, Op.STORE, (5, 6)).chained(first.chained(0))}
    assert base not in others and len(others) == 4
