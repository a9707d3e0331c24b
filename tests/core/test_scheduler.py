"""Scheduler: admission (FIFO, max_batch, reservation, prefill budget), chunked prefill and its
cap, stores, and how they meet the pool's eviction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvroute.core.block_pool import BlockPool
from kvroute.core.cache_events import CacheEvent
from kvroute.core.redis_schema import Op
from kvroute.core.scheduler import Iteration, Scheduler, blocks_needed

B = 4


@dataclass(eq=False)
class Req:
    prompt_tokens: int
    output_tokens: int
    keys: Sequence[int]
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prefill_left: int = 0
    stored_blocks: int = 0


def req(prompt: int, output: int = 2, base: int = 0) -> Req:
    """A request whose prompt's full blocks have keys ``base, base + 1, ...``."""
    return Req(prompt, output, [base + i for i in range(prompt // B)])


def make(capacity: int = 64, **kw: object) -> tuple[Scheduler[Req], list[CacheEvent]]:
    events: list[CacheEvent] = []
    pool = BlockPool(capacity, events.append)
    return Scheduler(pool, B, **{"max_batch": 8, **kw}), events  # type: ignore[arg-type]


def run(sched: Scheduler[Req]) -> tuple[Iteration[Req], list[Req]]:
    """One iteration: schedule, complete, flush."""
    it = sched.schedule()
    first = sched.complete(it)
    sched.flush()
    return it, first


def takes(it: Iteration[Req]) -> list[tuple[Req, int]]:
    return list(it.chunks)


def test_reservation_covers_every_token_but_the_last_output() -> None:
    assert blocks_needed(8, 1, B) == 2  # the first output's KV is never computed
    assert blocks_needed(8, 2, B) == 3
    assert blocks_needed(7, 2, B) == 2
    sched, _ = make()
    r = req(10, 7)  # KV of 10 + 7 - 1 = 16 tokens: 4 blocks
    sched.add(r)
    run(sched)
    assert len(r.blocks) == 4 == blocks_needed(10, 7, B)
    assert sched.pool.free_blocks == 60


def test_the_cache_hit_leaves_one_prompt_token_to_compute() -> None:
    sched, _ = make()
    a = req(8)
    sched.add(a)
    run(sched)
    sched.finish(a)
    b = req(8)  # the same two full blocks, both cached: only one may be a hit
    sched.add(b)
    it, first = run(sched)
    assert (b.cached_tokens, takes(it)) == (4, [(b, 4)]) and first == [b]
    c = req(9)  # two full blocks and one token more: both are hits
    sched.add(c)
    it, _ = run(sched)
    assert (c.cached_tokens, takes(it)) == (8, [(c, 1)])


def test_fifo_head_of_line_blocking_on_blocks() -> None:
    sched, _ = make(capacity=6)
    running = req(8, 9)  # 4 blocks
    sched.add(running)
    run(sched)
    big, small = req(8, 5, base=100), req(4, 1, base=200)  # 3 blocks, then 1
    sched.add(big)
    sched.add(small)
    it, _ = run(sched)
    # 2 free: big does not fit, and small (which would) waits behind it.
    assert it.chunks == [] and list(sched.waiting) == [big, small]
    sched.finish(running)
    it, _ = run(sched)
    assert [r for r, _ in it.chunks] == [big, small]


def test_max_batch_counts_decoding_and_prefilling() -> None:
    sched, _ = make(max_batch=2, prefill_budget=64, chunked=True, long_prefill_threshold=32)
    long, a, b = req(100, base=0), req(4, base=500), req(4, base=600)
    for r in (long, a, b):
        sched.add(r)
    it = sched.schedule()
    assert takes(it) == [(long, 32), (a, 4)]  # b: the batch is full, not the budget
    sched.complete(it)
    sched.flush()
    assert sched.num_prefilling == 1 and sched.num_running == 1
    it = sched.schedule()
    assert takes(it) == [(long, 32)] and list(sched.waiting) == [b]


def test_whole_prompts_share_the_budget_but_the_first_is_always_admitted() -> None:
    sched, _ = make(prefill_budget=10)
    huge, a, b, c = req(40, base=0), req(6, base=100), req(4, base=200), req(4, base=300)
    for r in (huge, a, b, c):
        sched.add(r)
    it, first = run(sched)
    assert takes(it) == [(huge, 40)] and first == [huge]  # alone, over the budget
    it, _ = run(sched)
    assert takes(it) == [(a, 6), (b, 4)]  # 10 tokens; c would be 14
    assert it.decodes == 1  # huge decodes beside them, spending no budget
    it, _ = run(sched)
    assert takes(it) == [(c, 4)]


def test_budget_head_of_line_blocking() -> None:
    sched, _ = make(prefill_budget=10)
    a, big, small = req(8, base=0), req(9, base=100), req(2, base=200)
    for r in (a, big, small):
        sched.add(r)
    it, _ = run(sched)
    assert takes(it) == [(a, 8)]  # big does not fit the 2 left; small waits behind it
    it, _ = run(sched)
    assert takes(it) == [(big, 9)]  # first of its iteration; small's 2 would make 11


def test_chunked_budget_decodes_first_then_prefills_oldest_first_then_admissions() -> None:
    sched, events = make(prefill_budget=16, chunked=True)
    d = req(4, 10, base=900)
    sched.add(d)
    run(sched)  # d decodes from now on
    long, short = req(30, base=0), req(6, base=100)
    sched.add(long)
    it, first = run(sched)
    assert takes(it) == [(long, 15)] and it.decodes == 1 and first == []  # 16 - 1 decode
    assert long.prefill_left == 15 and long.stored_blocks == 3  # 15 tokens: 3 full blocks
    assert events[-1] == CacheEvent(Op.STORE, (0, 1, 2))
    sched.add(short)
    it, first = run(sched)
    # long continues first (its last 15 tokens); no budget left for short.
    assert takes(it) == [(long, 15)] and first == [long] and list(sched.waiting) == [short]
    assert long.stored_blocks == 7 and events[-1] == CacheEvent(Op.STORE, (3, 4, 5, 6))
    it, first = run(sched)
    assert takes(it) == [(short, 6)] and it.decodes == 2 and first == [short]


def test_a_chunk_left_unfinished_continues_before_new_admissions() -> None:
    sched, _ = make(prefill_budget=8, chunked=True)
    a, b = req(12, base=0), req(12, base=100)
    sched.add(a)
    sched.add(b)
    it, _ = run(sched)
    assert takes(it) == [(a, 8)]
    it, first = run(sched)
    assert takes(it) == [(a, 4), (b, 4)] and first == [a]
    it, first = run(sched)
    assert takes(it) == [(b, 7)] and first == []  # 8 - a's decode; 1 token left
    it, first = run(sched)
    assert takes(it) == [(b, 1)] and first == [b]


def test_long_prefill_threshold_caps_each_prefill_so_others_join() -> None:
    sched, _ = make(prefill_budget=16, chunked=True, long_prefill_threshold=6)
    long, short = req(20, base=0), req(5, base=100)
    sched.add(long)
    sched.add(short)
    it, first = run(sched)
    assert takes(it) == [(long, 6), (short, 5)] and first == [short]
    it, _ = run(sched)
    assert takes(it) == [(long, 6)]  # capped though 15 are left in the budget
    uncapped, _ = make(prefill_budget=16, chunked=True)
    long2, short2 = req(20, base=0), req(5, base=100)
    uncapped.add(long2)
    uncapped.add(short2)
    it, _ = run(uncapped)
    assert takes(it) == [(long2, 16)] and list(uncapped.waiting) == [short2]


def test_freed_blocks_stay_cached_until_an_allocation_evicts_them_lru() -> None:
    sched, events = make(capacity=4)
    a = req(8, 1, base=0)  # blocks_needed 2, both full prompt blocks: stored
    sched.add(a)
    run(sched)
    sched.finish(a)
    assert sorted(sched.pool.cached_keys()) == [0, 1] and sched.pool.free_blocks == 4
    b = req(9, 1, base=0)  # hits both, needs one fresh block
    sched.add(b)
    run(sched)
    assert b.cached_tokens == 8 and not any(e.op is Op.EVICT for e in events)
    sched.finish(b)
    c = req(12, 5, base=100)  # 4 fresh blocks: every cached one is evicted
    sched.add(c)
    run(sched)
    evicted = [k for e in events if e.op is Op.EVICT for k in e.keys]
    assert sorted(evicted) == [0, 1]
    assert sched.hit_blocks(req(9, 1, base=0)) == []


def test_blocks_of_running_sequences_are_never_evicted() -> None:
    sched, events = make(capacity=4)
    a = req(8, 3, base=0)  # 3 blocks, 2 of them stored
    sched.add(a)
    run(sched)
    b = req(8, 2, base=100)  # 3 blocks: only 1 free, a's cached ones are pinned
    sched.add(b)
    it, _ = run(sched)
    assert it.chunks == [] and not any(e.op is Op.EVICT for e in events)
    sched.finish(a)
    it, _ = run(sched)
    assert takes(it) == [(b, 8)]


def test_store_and_flush_commit_decoded_blocks_in_one_event() -> None:
    sched, events = make()
    a, b = req(6, 8, base=0), req(6, 8, base=100)  # 1 full prompt block each
    sched.add(a)
    sched.add(b)
    run(sched)
    assert events == [CacheEvent(Op.STORE, (0, 100))]
    # Output token 3 of each computes the KV of 6 + 3 - 1 = 8 tokens: block 1 is full.
    sched.store(a, 2, [10], offset=1)
    sched.store(b, 2, [100, 110])
    assert sched.flush() == [10, 110]
    assert events[-1] == CacheEvent(Op.STORE, (10, 110))
    assert (a.stored_blocks, b.stored_blocks) == (2, 2)
    sched.store(a, 2, [10], offset=1)  # nothing new: no event
    assert sched.flush() == [] and len(events) == 2
    with pytest.raises(ValueError, match="holds 4"):
        sched.store(a, 5, [10, 11, 12, 13], offset=1)


def test_abort_frees_wherever_the_sequence_is_and_complete_skips_it() -> None:
    sched, _ = make(prefill_budget=8, chunked=True)
    running, chunking, waiting = req(4, 4, base=0), req(40, base=100), req(4, base=200)
    sched.add(running)
    run(sched)
    sched.add(chunking)
    it = sched.schedule()
    sched.add(waiting)
    assert sched.abort(chunking)  # mid-iteration, as a cancelled request is
    assert sched.complete(it) == [] and chunking.blocks == []
    assert sched.abort(waiting) and not sched.waiting
    assert sched.abort(running) and running.blocks == []
    assert not sched.abort(running)
    assert sched.idle() and sched.pool.free_blocks == sched.pool.capacity_blocks


def test_pending_prefill_counts_queued_prompts_and_unfinished_chunks() -> None:
    sched, _ = make(prefill_budget=8, chunked=True)
    warm = req(8, 1, base=0)
    sched.add(warm)
    run(sched)
    sched.finish(warm)
    long, again = req(20, base=100), req(9, base=0)  # again: 8 of its 9 cached
    sched.add(long)
    run(sched)
    sched.add(again)
    assert sched.pending_prefill_tokens() == (20 - 8) + 1


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_batch": 0}, "max_batch"),
    ({"prefill_budget": -1}, "prefill_budget"),
    ({"chunked": True}, "chunked prefill needs a prefill_budget > 0"),
    ({"chunked": True, "prefill_budget": 8, "long_prefill_threshold": -2},
     "long_prefill_threshold"),
])
def test_bad_settings_are_named(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_blocks_in_the_host_tier_are_loaded_not_computed() -> None:
    events: list[CacheEvent] = []
    pool = BlockPool(5, events.append, host_blocks=16)
    sched = Scheduler(pool, B, max_batch=8)
    first = req(16, output=1, base=100)  # 4 blocks
    sched.add(first)
    run(sched)
    sched.finish(first)
    other = req(20, output=1, base=200)  # 5 blocks: evicts first's into the host tier
    sched.add(other)
    run(sched)
    sched.finish(other)
    assert set(first.keys) <= set(pool.lower_keys())
    again = req(20, output=1, base=100)  # first's 4 blocks, then a new one
    sched.add(again)
    it, _ = run(sched)
    assert it.loaded_tokens == 16 and again.cached_tokens == 16  # loaded, counted cached
    assert it.prefill_tokens == 4  # only the new block's tokens computed
    assert not set(first.keys) & set(pool.lower_keys())  # in GPU memory again
    assert pool.lookup(first.keys) != []
