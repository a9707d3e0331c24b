from __future__ import annotations

import math
import re
import time

import pytest

from kvroute.core.load import (
    ARRIVAL_MIN_WINDOW_S,
    ARRIVAL_TAU_S,
    ArrivalRate,
    EngineLoad,
    PrefillMode,
    prefill_context,
)
from kvroute.core.redis_schema import Heartbeat
from kvroute.router.registry import Vocabulary, WorkerRegistry, parse_static, vocab_mismatch


def test_parse_static() -> None:
    assert parse_static("a=h:1, b=h:2") == {"a": "h:1", "b": "h:2"}
    assert parse_static("") == {}
    with pytest.raises(ValueError, match="id=host:port"):
        parse_static("a=nohostport")


def test_heartbeat_load_merges_with_local_counts() -> None:
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e", load=EngineLoad(
        running=5, pending_prefill_tokens=100, max_running=64, max_batched_tokens=8192,
        prefill_mode=PrefillMode.CHUNKED, max_prefill_chunk=2048))})
    reg.begin("w", 700, context=prefill_context(700, 9000))
    ld = reg.loads["w"]
    assert (ld.inflight, ld.running, ld.pending_prefill_tokens) == (1, 5, 700)
    assert (ld.max_running, ld.max_batched_tokens) == (64, 8192)  # the engine's limits
    assert ld.prefill_mode is PrefillMode.CHUNKED  # and how it admits a long prompt
    assert ld.max_prefill_chunk == 2048  # ... a chunk at a time, at most this long
    # The context its tokens attend to is ours only (the heartbeat reports tokens alone).
    assert ld.pending_prefill_context == 700 * 9000 + 700 * 350
    reg.first_token("w", 700, prefill_context(700, 9000))
    reg.end("w")
    assert reg.loads["w"].pending_prefill_tokens == 100
    assert reg.loads["w"].inflight == 0 and reg.loads["w"].pending_prefill_context == 0


def test_arrival_rate_is_ours_or_the_agents_whichever_is_larger() -> None:
    """The router counts what it sends (exact, immediate); the agent's heartbeat counts what
    every router sent (up to a heartbeat old). A static worker has only ours."""
    reg = WorkerRegistry({"s": "h:9"}, 16)
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e", load=EngineLoad(arrival_rate=0.5))})
    assert reg.loads["w"].arrival_rate == 0.5 and reg.loads["s"].arrival_rate == 0
    # 60 requests at once, in the first second we count: 60/s (2/s over the 30 s window,
    # corrected for having counted only since the registry first saw the workers).
    for _ in range(60):
        reg.begin("w", 10)
        reg.begin("s", 10)
    first = 60 / ARRIVAL_TAU_S / -math.expm1(-ARRIVAL_MIN_WINDOW_S / ARRIVAL_TAU_S)
    assert first == pytest.approx(61.0, rel=0.01)
    assert reg.loads["w"].arrival_rate == pytest.approx(first, rel=0.01)
    assert reg.loads["s"].arrival_rate == pytest.approx(first, rel=0.01)
    reg.begin("s", 10, arrival=False)  # held for s, not sent yet: load, but no arrival
    assert reg.loads["s"].arrival_rate == pytest.approx(first, rel=0.01)
    assert reg.loads["s"].inflight == 61
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e", load=EngineLoad(arrival_rate=90.0))})
    assert reg.loads["w"].arrival_rate == 90.0
    # A static worker without heartbeats is refreshed by each scan, so its rate decays: here
    # its 60 requests are made two windows old.
    old = ArrivalRate()
    old.add(time.monotonic() - 60.0, n=60)
    reg._workers["s"].sent.arrivals = old
    assert reg.loads["s"].arrival_rate == pytest.approx(first, rel=0.01)  # not rebuilt yet
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e")})
    assert reg.loads["s"].arrival_rate == pytest.approx(2.0 / math.e ** 2, rel=0.01)


def test_prefill_rate_counts_the_uncached_tokens_we_send() -> None:
    """Each request sent counts its uncached tokens (with or without a heartbeat), a held
    one only once it is sent; the heartbeat's rate (every router's traffic) counts when it
    is the larger."""
    reg = WorkerRegistry({"s": "h:9"}, 16)
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e", load=EngineLoad(arrival_rate=0.5))})
    assert reg.loads["w"].prefill_rate == 0 and reg.loads["s"].prefill_rate == 0
    reg.begin("w", 3000)
    reg.begin("w", 0)  # all cached: an arrival, no prefill
    reg.begin("s", 1000)
    reg.begin("s", 5000, arrival=False)  # held, not sent yet
    per_token = 1 / ARRIVAL_TAU_S / -math.expm1(-ARRIVAL_MIN_WINDOW_S / ARRIVAL_TAU_S)
    assert reg.loads["w"].prefill_rate == pytest.approx(3000 * per_token, rel=0.01)
    assert reg.loads["s"].prefill_rate == pytest.approx(1000 * per_token, rel=0.01)
    assert reg.loads["w"].arrival_rate == pytest.approx(2 * per_token, rel=0.01)
    # It decays as the arrival rate does.
    old = ArrivalRate()
    old.add(time.monotonic() - 60.0, n=3000)
    reg._workers["w"].sent.prefills = old
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e")})
    assert reg.loads["w"].prefill_rate == pytest.approx(100.0 / math.e ** 2, rel=0.01)
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e", load=EngineLoad(prefill_rate=5000.0))})
    assert reg.loads["w"].prefill_rate == 5000.0


def test_expiry_spares_static_workers_and_can_be_suspended() -> None:
    reg = WorkerRegistry({"s": "h:9"}, 16)
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e")})
    assert reg.apply_heartbeats({}, expire=False) == ([], [])
    assert set(reg.loads) == {"s", "w"}
    assert reg.apply_heartbeats({}) == ([], ["w"])
    assert set(reg.loads) == {"s"}


def test_mark_down_then_revive() -> None:
    reg = WorkerRegistry({"s": "h:9"}, 16)
    reg.mark_down("s", 0.0)
    assert "s" not in reg.loads
    reg.revive_due()
    assert "s" in reg.loads


def test_program_fanout_weighs_forks() -> None:
    from kvroute.core.placement import program_fanout
    from kvroute.v1 import program_pb2 as pb

    def gen() -> pb.Step:
        return pb.Step(gen=pb.Gen(max_tokens=4))

    plain = pb.ControllerProgram(steps=[gen()])
    best_of_4 = pb.ControllerProgram(steps=[pb.Step(fork=pb.Fork(
        branches=[plain], n=4, select=pb.SELECT_MODE_BEST_LOGPROB)), gen()])
    nested = pb.ControllerProgram(steps=[pb.Step(fork=pb.Fork(branches=[
        pb.ControllerProgram(steps=[pb.Step(fork=pb.Fork(n=3))]), plain]))])
    assert program_fanout(plain) == 1
    assert program_fanout(best_of_4) == 4
    assert program_fanout(nested) == 4  # 3 grandchildren + 1 child at once


def test_a_program_weighs_as_its_fanout() -> None:
    reg = WorkerRegistry({"s": "h:9"}, 16)
    reg.begin("s", 100, sequences=4)
    assert reg.loads["s"].inflight == 4
    reg.end("s", sequences=4)
    assert reg.loads["s"].inflight == 0


def test_matches_of_workers_whose_keys_cannot_match_are_dropped() -> None:
    from kvroute.core.index import PrefixIndex
    from kvroute.core.policies import Kvroute
    from kvroute.router.decide import Decider

    reg = WorkerRegistry({}, 16)
    good = {w: Heartbeat(w, f"127.0.0.1:{i}", "e") for i, w in enumerate(("a", "b"))}
    reg.apply_heartbeats(good)
    assert reg.match_filter is None  # all compatible: no call per matched worker
    decider = Decider("m", 16, Kvroute())
    tokens = list(range(64))
    index = PrefixIndex()
    index.add("b", decider.hasher("").keys(tokens))
    assert decider.decide(tokens, index, reg).query.matched_blocks == {"b": 4}
    # b restarts with another block size: its index entries cannot be trusted.
    reg.apply_heartbeats({**good, "b": Heartbeat("b", "127.0.0.1:1", "e", block_size=32)})
    assert reg.match_filter is not None and not reg.match_filter("b")
    assert decider.decide(tokens, index, reg).query.matched_blocks == {}
    assert "b" in reg.loads  # still routable, by load
    reg.apply_heartbeats(good)  # fixed
    assert reg.match_filter is None
    assert decider.decide(tokens, index, reg).query.matched_blocks == {"b": 4}
    reg.apply_heartbeats({**good, "b": Heartbeat("b", "127.0.0.1:1", "e", key_scheme="v0")})
    assert reg.match_filter is not None
    reg.apply_heartbeats({"a": good["a"]})  # b's heartbeat expires: forgotten
    assert reg.match_filter is None


@pytest.mark.parametrize(("ours", "theirs", "clash"), [
    # A router with a tokenizer: the same tokenizer and size, each when reported.
    (("byte", 258), ("byte", 258), False),
    (("byte", 258), ("gpt2", 50257), True),
    (("gpt2", 50257), ("byte", 50257), True),  # same size, another tokenizer
    (("byte", 258), ("", 50257), True),  # the sim engine: a size only
    (("byte", 258), ("", 258), False),
    (("byte", 258), ("", 0), False),  # an older agent: not judged
    # A router without one (token-id clients): the same size.
    (("", 50257), ("gpt2", 50257), False),
    (("", 50257), ("byte", 258), True),
    (("", 258), ("gpt2", 50257), True),
    (("", 50257), ("", 0), False),
    (("", 0), ("byte", 258), False),  # nothing to compare with
])
def test_the_vocabulary_rule(ours: tuple[str, int], theirs: tuple[str, int],
                             clash: bool) -> None:
    why = vocab_mismatch(Vocabulary(*ours), Vocabulary(*theirs))
    assert bool(why) is clash
    if clash:  # names both sides
        assert why == f"tokenizer {Vocabulary(*theirs)}, router {Vocabulary(*ours)}"
    assert str(Vocabulary("", 50257)) == "token-ids/50257"
    assert str(Vocabulary("gpt2", 0)) == "gpt2/?"


def test_a_worker_of_another_vocabulary_is_excluded_and_said_once(caplog) -> None:
    reg = WorkerRegistry({}, 16, Vocabulary("byte", 258))
    byte = Heartbeat("b", "h:1", "e", tokenizer="byte", vocab_size=258)
    gpt2 = Heartbeat("g", "h:2", "e", tokenizer="gpt2", vocab_size=50257)
    with caplog.at_level("INFO", "kvroute.router.registry"):
        for _ in range(3):  # three heartbeat scans
            reg.apply_heartbeats({"b": byte, "g": gpt2})
    assert set(reg.loads) == {"b"}
    info = reg.get("g")
    assert info is not None and info.excluded == "tokenizer"
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1  # once per change, not per scan
    assert warned[0].kv == {"worker": "g", "its_vocabulary": "gpt2/50257",
                            "our_vocabulary": "byte/258"}
    # Its load still changes nothing: no request may go there.
    reg.begin("g", 10)
    assert "g" not in reg.loads
    reg.end("g")
    # The agent restarts with the router's vocabulary: routed to, and said.
    caplog.clear()
    with caplog.at_level("INFO", "kvroute.router.registry"):
        reg.apply_heartbeats({"b": byte, "g": Heartbeat("g", "h:2", "e", tokenizer="byte",
                                                        vocab_size=258)})
    assert set(reg.loads) == {"b", "g"} and info.excluded == ""
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_unroutable_says_why_for_each_worker() -> None:
    assert WorkerRegistry({}, 16).unroutable() == (
        "no routable workers: none registered (no live heartbeat for this model in Redis, "
        "and no --workers)")
    reg = WorkerRegistry({"s": "h:9"}, 16, Vocabulary("byte", 258))
    reg.apply_heartbeats({"g": Heartbeat("g", "h:2", "e", tokenizer="gpt2",
                                         vocab_size=50257)})
    reg.mark_down("s", 60.0, "UNAVAILABLE: engine: out of blocks")
    msg = reg.unroutable()
    assert msg.startswith("no routable workers: ")
    assert "g excluded (tokenizer gpt2/50257, router byte/258)" in msg
    assert re.search(r"s down since \d+\.\d s ago after: UNAVAILABLE: engine: out of blocks",
                     msg), msg
    reg.mark_down("s", 0.0)
    reg.revive_due()
    assert "s" in reg.loads


def test_mark_down_keeps_the_failure() -> None:
    reg = WorkerRegistry({"s": "h:9"}, 16)
    t0 = time.monotonic()
    reg.mark_down("s", 2.0, "UNAVAILABLE: boom")
    info = reg.get("s")
    assert info is not None and info.down_error == "UNAVAILABLE: boom"
    assert t0 <= info.down_since <= time.monotonic()
    assert info.down_until == pytest.approx(info.down_since + 2.0)


def test_the_reconnect_reprieve_is_capped_whatever_a_heartbeat_claims() -> None:
    """A record claiming the longest TTL Redis records may carry (an hour) would keep dead
    and fake workers candidates that long after a reconnect: the reprieve is capped."""
    from kvroute.core.redis_schema import MAX_TTL_S
    from kvroute.router.registry import REPRIEVE_CAP_S

    reg = WorkerRegistry({}, 16)
    assert reg.max_ttl_s() == 3.0  # none known: the default
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e", ttl_s=5.0)})
    assert reg.max_ttl_s() == 5.0
    reg.apply_heartbeats({"w": Heartbeat("w", "h:1", "e", ttl_s=5.0),
                          "evil": Heartbeat("evil", "127.0.0.1:1", "e", ttl_s=MAX_TTL_S)})
    assert REPRIEVE_CAP_S < MAX_TTL_S
    assert reg.max_ttl_s() == REPRIEVE_CAP_S


def test_a_scan_applied_in_parts_equals_one_applied_whole() -> None:
    """The mirror applies a scan of many heartbeats in parts (update_heartbeats), then ends
    it (expire_missing): the same workers added, expired and loads as apply_heartbeats."""
    def beats(names: list[str], running: int) -> dict[str, Heartbeat]:
        return {w: Heartbeat(w, f"h:{i + 1}", "e", block_size=32 if w == "w3" else 16,
                             load=EngineLoad(running=running + i))
                for i, w in enumerate(names)}

    whole, parts = WorkerRegistry({"s": "h:9"}, 16), WorkerRegistry({"s": "h:9"}, 16)
    first = beats([f"w{i}" for i in range(10)], 1)
    whole.apply_heartbeats(first)
    parts.apply_heartbeats(first)
    second = beats([f"w{i}" for i in range(3, 14)], 2)  # w0-w2 gone, w10-w13 new
    second["w5"] = first["w5"]  # an unchanged record: the very object applied before
    added, expired = whole.apply_heartbeats(second)
    names = list(second)
    got = parts.update_heartbeats({w: second[w] for w in names[:4]})
    got += parts.update_heartbeats({w: second[w] for w in names[4:]})
    assert (got, parts.expire_missing(second.keys())) == (added, expired)
    assert (added, expired) == (["w10", "w11", "w12", "w13"], ["w0", "w1", "w2"])
    assert parts.loads == whole.loads and set(parts.loads) == {"s", *names}
    assert not parts.compatible("w3") and parts.get("w5").heartbeat is first["w5"]


def test_a_heartbeat_back_at_an_address_it_left_is_two_agents_under_one_id(caplog) -> None:
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats({"w": Heartbeat("w", "10.0.0.1:50061", "e1")})
    reg.apply_heartbeats({"w": Heartbeat("w", "10.0.0.2:50061", "e2")})  # moved: one agent
    info = reg.get("w")
    assert info is not None and info.id_conflicts == 0
    assert not [r for r in caplog.records if "one worker id" in r.message]
    for _ in range(3):  # and back, and forth: two agents
        reg.apply_heartbeats({"w": Heartbeat("w", "10.0.0.1:50061", "e1")})
        reg.apply_heartbeats({"w": Heartbeat("w", "10.0.0.2:50061", "e2")})
    assert info.id_conflicts == 6
    warned = [r for r in caplog.records if "two live agents beat under one worker id" in r.message]
    assert len(warned) == 1  # at most once per 30 s
    assert warned[0].kv["addresses"] == ["10.0.0.1:50061", "10.0.0.2:50061"]  # type: ignore[attr-defined]
