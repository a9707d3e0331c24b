"""The mirrored cache's contract: entries apply only in order, a duplicate is skipped, a gap
or an unannounced epoch asks for the snapshot, a malformed snapshot leaves no state."""

from __future__ import annotations

from kvroute.core.redis_schema import FeedEvent, Op, pack_keys
from kvroute.router.mirror.cache import MirroredCache
from kvroute.router.mirror.stats import MirrorStats, Rejects


def cache() -> tuple[MirroredCache, MirrorStats]:
    stats = MirrorStats()
    return MirroredCache(stats, Rejects(stats)), stats


def store(seq: int, *keys: int, epoch: str = "e1") -> FeedEvent:
    return FeedEvent("w", epoch, seq, Op.STORE, keys)


def test_entries_apply_in_order_and_a_duplicate_is_skipped() -> None:
    c, stats = cache()
    c.install("w", {b"epoch": b"e1", b"seq": b"3"}, pack_keys((1, 2)))
    assert c.apply(store(4, 3)) and c.apply(store(3, 99))  # 3: already in the snapshot
    assert c.apply(FeedEvent("w", "e1", 5, Op.EVICT, (1,)))
    assert c.index.keys_of("w") == {2, 3} and c.positions["w"].seq == 5
    assert stats.events_applied == 2 and stats.gaps == 0


def test_a_gap_or_an_unknown_epoch_asks_for_the_snapshot_and_changes_nothing() -> None:
    c, stats = cache()
    c.install("w", {b"epoch": b"e1", b"seq": b"1"}, pack_keys((1,)))
    assert not c.apply(store(3, 7))  # seq 2 never came
    assert not c.apply(store(2, 7, epoch="e2"))  # an epoch not started at seq 1
    assert c.index.keys_of("w") == {1} and stats.gaps == 2
    assert not c.apply(FeedEvent("w", "e2", 1, Op.RESYNC))  # a resync: read, not a gap
    assert stats.gaps == 2


def test_clear_at_seq_one_starts_a_new_epoch_without_a_read() -> None:
    c, _ = cache()
    c.install("w", {b"epoch": b"e1", b"seq": b"9"}, pack_keys((1, 2)))
    assert c.apply(FeedEvent("w", "e2", 1, Op.CLEAR)) and c.apply(store(2, 5, epoch="e2"))
    assert c.index.keys_of("w") == {5}
    assert c.view()["w"] == {"epoch": "e2", "seq": 2, "blocks": 1, "sum": 5}


def test_a_malformed_snapshot_is_rejected_and_leaves_no_state() -> None:
    c, stats = cache()
    c.install("w", {b"epoch": b"e1", b"seq": b"1"}, pack_keys((1,)))
    c.install("w", {b"epoch": b"e1", b"seq": b"x"}, pack_keys((2,)))
    assert not c.holds("w") and c.index.count("w") == 0
    c.install("v", {b"epoch": b"e1", b"seq": b"1"}, [b"short"])
    assert not c.holds("v")
    assert stats.rejected == {("snapshot", "bad_type"): 2} and stats.snapshot_loads == 3
