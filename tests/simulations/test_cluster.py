"""One simulated worker: held requests (coalesced siblings, program branches), chunked
prefill."""

from __future__ import annotations

import math

import pytest

from kvroute.core.cache_events import CacheEvent
from kvroute.core.load import prefill_context
from kvroute.core.policies.cost_model import CostModel
from kvroute.core.redis_schema import Op
from kvroute.simulations.cluster import SimRequest, SimWorker


def worker() -> SimWorker:
    return SimWorker("w", 1000, 16, CostModel(), lambda *a: None)


def test_a_held_request_joins_the_queue_at_its_parents_first_token_and_hits() -> None:
    w = worker()
    parent = SimRequest(0, 0.0, 1600, 4, tuple(range(100)))
    w.submit(parent, 0.0)
    child = SimRequest(1, 0.0, 1616, 4, tuple(range(101)))
    child.after = parent
    w.submit(child, 0.0)
    other = SimRequest(2, 0.0, 160, 4, tuple(range(1000, 1010)))
    w.submit(other, 0.0)
    assert (len(w.held), len(w.waiting)) == (1, 2)
    assert w.load(0, 0.0).inflight == 3  # held is the router's load, not the engine queue
    w.advance(math.inf)
    assert other.first_token_s == parent.first_token_s  # the held one blocked no one
    assert child.first_token_s > parent.first_token_s
    assert child.cached_tokens == 1600  # admitted after the prefix was stored
    assert all(math.isfinite(r.finished_s) for r in (parent, child, other))


def test_only_held_requests_left_idle_until_their_release() -> None:
    """A held request's parent may run elsewhere and get its first token later than
    anything here: the worker idles until then, it does not give up."""
    w = worker()
    parent = SimRequest(0, 0.0, 160, 1, tuple(range(10)))
    parent.first_token_s = 5.0  # on another worker
    child = SimRequest(1, 0.001, 160, 2, tuple(range(10)))
    child.after = parent
    w.submit(child, 0.001)
    w.advance(1.0)
    assert w.held == [child]  # not yet: its parent's first token is at 5 s
    w.advance(math.inf)
    assert child.first_token_s > 5.0 and math.isfinite(child.finished_s)


def chunked_run(chunked: bool, until: float = math.inf
                ) -> tuple[SimRequest, SimRequest, SimRequest, list[float], SimWorker]:
    """A decoding request, then a 4096-token prompt and a short one behind it, budget 1024,
    run until ``until``. Returns them, the times the long prompt's blocks were stored and
    the worker."""
    stores: list[float] = []

    def sink(t: float, worker: str, ev: CacheEvent) -> None:
        if ev.op is Op.STORE and ev.keys[0] < 256:  # the long prompt's keys are 0..255
            stores.append(t)

    w = SimWorker("w", 4000, 16, CostModel(), sink, prefill_budget=1024,
                  chunked_prefill=chunked)
    decoder = SimRequest(0, 0.0, 32, 400, tuple(range(5000, 5002)))
    w.submit(decoder, 0.0)
    w.advance(0.001)  # its prefill is done: it decodes from here on
    long = SimRequest(1, 0.001, 4096, 2, tuple(range(256)))
    short = SimRequest(2, 0.001, 64, 2, tuple(range(9000, 9004)))
    w.submit(long, 0.001)
    w.submit(short, 0.001)
    w.advance(until)
    if until == math.inf:
        assert w.prefill_tokens == 32 + 4096 + 64
    return decoder, long, short, stores, w


def test_chunked_prefill_decodes_between_chunks_and_stores_each_chunk() -> None:
    d0, long0, short0, stores0, _ = chunked_run(False)
    d1, long1, short1, stores1, _ = chunked_run(True)
    # Whole: one iteration prefills the long prompt and the decoder gets one token; the
    # short one follows in the next iteration. Chunked: 1023 tokens an iteration (the
    # decoder's token takes one), five iterations, the decoder gets a token in each, and
    # the short one is admitted into the fifth's leftover budget.
    assert len(stores0) == 1 and len(stores1) == 5  # each chunk stored its full blocks
    assert stores1 == sorted(set(stores1)) and stores1[-1] == long1.first_token_s
    assert long1.first_token_s > long0.first_token_s  # the interleaved decode steps
    assert short1.first_token_s == long1.first_token_s  # the same (last) iteration
    assert short0.first_token_s > long0.first_token_s  # the next one
    # The decoder kept decoding through the long prefill: by the time the whole prefill
    # ends, four chunk iterations gave it four tokens, the whole prefill one.
    at = long0.first_token_s - 1e-9
    (whole, *_, w0), (chunked, *_, w1) = chunked_run(False, at), chunked_run(True, at)
    assert w0.tokens_left(whole) - w1.tokens_left(chunked) == 3
    for r in (d0, long0, short0, d1, long1, short1):
        assert math.isfinite(r.finished_s) and r.cached_tokens == 0


def test_a_long_prefill_threshold_lets_a_short_request_in_beside_a_long_prefill() -> None:
    """vLLM's --long-prefill-token-threshold: each prefill computes at most that many tokens
    an iteration, so a short request queued behind a long one is admitted into the first
    iteration's leftover budget instead of waiting out every chunk; the worker reports the
    cap."""
    def run(threshold: int) -> tuple[SimRequest, SimRequest, int, SimWorker]:
        stores = []
        w = SimWorker("w", 4000, 16, CostModel(),
                      lambda t, _, ev: stores.append(t) if ev.keys[0] < 256 else None,
                      prefill_budget=1024, chunked_prefill=True,
                      long_prefill_threshold=threshold)
        long = SimRequest(0, 0.0, 4096, 2, tuple(range(256)))
        short = SimRequest(1, 0.0, 64, 2, tuple(range(9000, 9004)))
        w.submit(long, 0.0)
        w.submit(short, 0.0)
        w.advance(math.inf)
        return long, short, len(stores), w

    long0, short0, chunks0, _ = run(0)
    long1, short1, chunks1, w = run(256)
    assert (chunks0, chunks1) == (4, 16)  # 1024 tokens an iteration, then 256
    assert short0.first_token_s > long0.first_token_s  # after its last chunk (a full one)
    cost = CostModel()
    # Capped: in the first iteration, beside the long prompt's first 256 tokens.
    assert short1.first_token_s == pytest.approx(
        cost.prefill_s(256, 0) + cost.prefill_s(64, 0) + cost.decode_step_s(0))
    assert short1.first_token_s < long0.first_token_s / 3
    assert long1.first_token_s > long0.first_token_s  # the long one takes longer
    assert long1.cached_tokens == short1.cached_tokens == 0
    assert w.load(0, w.t).max_prefill_chunk == 256
    whole = SimWorker("w", 4000, 16, CostModel(), lambda *a: None, long_prefill_threshold=256)
    assert whole.load(0, 0.0).max_prefill_chunk == 0  # no chunks to cap


def test_a_chunked_prefill_stays_pending_until_its_first_token() -> None:
    w = SimWorker("w", 4000, 16, CostModel(), lambda *a: None, prefill_budget=1024,
                  chunked_prefill=True)
    long = SimRequest(0, 0.0, 4096, 2, tuple(range(256)))
    long.routed_uncached = 4096
    w.submit(long, 0.0)
    w.advance(0.2)  # two or three chunks in
    assert 0 < long.prefill_left < 4096 and w.prefilling == [long]
    view = w.load(0, 0.2)
    # As the router counts it: prefill tokens not yet turned into a first token.
    assert view.pending_prefill_tokens == 4096 and view.running == 1 and view.queued == 0
    assert view.pending_prefill_context == prefill_context(4096, 0)  # and what it attends to
    w.advance(math.inf)
    done = w.load(0, w.t)
    assert done.pending_prefill_tokens == 0 and done.pending_prefill_context == 0
    assert not w.prefilling


def test_each_reply_block_is_stored_at_the_step_that_fills_it_and_the_next_turn_hits_it(
        ) -> None:
    """Engines cache generated tokens as they go: each full block of a reply is stored (an
    event) at the decode step whose KV completes it, so a router sees it before the reply
    ends, and the next turn, which carries the reply, hits it."""
    stored: list[tuple[float, tuple[int, ...]]] = []

    def sink(t: float, worker: str, ev: CacheEvent) -> None:
        if ev.op is Op.STORE:
            stored.append((t, ev.keys))

    cost = CostModel()
    step = cost.decode_step_s(1)  # the turn decodes alone, its 39 steps in one jump
    for replies, hit in (((100, 101), 11 * 16), ((), 9 * 16)):
        stored.clear()
        w = SimWorker("w", 1000, 16, cost, sink)
        # 150 prompt tokens (9 full blocks) + 40 generated. The step producing token n
        # computes the KV of 149 + n tokens: block 9 (tokens 144-159) is full at token 11,
        # 10 steps after the first token; block 10 (160-175) at token 27; 189 computed
        # tokens in all, so block 11 never fills.
        turn = SimRequest(0, 0.0, 150, 40, tuple(range(9)), replies)
        w.submit(turn, 0.0)
        w.advance(math.inf)
        t0 = turn.first_token_s
        if replies:
            # Interpolated inside the jump: equal to the step times up to float rounding.
            assert [keys for _, keys in stored[-2:]] == [(100,), (101,)]
            at = [t0 + 10 * step, t0 + 26 * step]
            assert [t for t, _ in stored[-2:]] == pytest.approx(at, rel=1e-12)
            assert turn.reply_stored_s == pytest.approx(at, rel=1e-12)
            assert turn.finished_s == pytest.approx(t0 + 39 * step, rel=1e-12)
        else:
            assert stored[-1] == (t0, tuple(range(9)))
        nxt = SimRequest(1, 10.0, 240, 4, (*range(9), 100, 101, *range(200, 204)))
        w.submit(nxt, 10.0)
        w.advance(math.inf)
        assert nxt.cached_tokens == hit
        assert w.pool.free_blocks == w.pool.capacity_blocks  # nothing leaked


def test_a_worker_reserves_blocks_for_every_token_but_the_last_output() -> None:
    """The scheduler's reservation rule, ceil((prompt + output - 1) / B): the KV of the last
    output token is never computed, so a request filling the pool to that token fits and
    two such requests run one after the other, the second evicting the first's blocks."""
    events: list[CacheEvent] = []
    w = SimWorker("w", 2, 16, CostModel(), lambda t, _, ev: events.append(ev))
    a = SimRequest(0, 0.0, 31, 2, (1,))  # 31 + 2 - 1 = 32 tokens of KV: 2 blocks
    b = SimRequest(1, 0.0, 31, 2, (2,))
    w.submit(a, 0.0)
    w.submit(b, 0.0)
    with pytest.raises(ValueError, match="cannot fit a worker of 2 blocks"):
        w.submit(SimRequest(2, 0.0, 31, 3, (3,)), 0.0)
    w.advance(math.inf)
    assert a.finished_s < b.first_token_s  # b waited for a's blocks
    assert [ev.op for ev in events] == [Op.STORE, Op.EVICT, Op.STORE]
    assert w.pool.free_blocks == 2
