"""The demo workload: deterministic generation, chat chaining, concurrency, summaries."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvroute.demo.workload import (
    VOCAB_SIZE,
    Conversation,
    OneOff,
    Request,
    Result,
    WorkloadSpec,
    drive,
    make_workload,
    percentile,
    reusable_tokens,
    summarize,
)


def test_same_seed_same_workload_other_seed_other() -> None:
    spec = WorkloadSpec(conversations=5, turns=3, one_off=4, seed=11)
    assert make_workload(spec) == make_workload(spec)
    other = make_workload(WorkloadSpec(conversations=5, turns=3, one_off=4, seed=12))
    assert other != make_workload(spec)


def test_shape_sizes_and_token_range() -> None:
    spec = WorkloadSpec(conversations=12, turns=3, one_off=7)
    w = make_workload(spec)
    convs = [s for s in w.streams if isinstance(s, Conversation)]
    one_offs = [s for s in w.streams if isinstance(s, OneOff)]
    assert len(convs) == 12 and len(one_offs) == 7
    assert w.requests == 12 * 3 + 7
    assert len(w.system_prompts) == spec.system_prompts
    # The chats share the few system prompts: that is what makes routing matter.
    assert {c.system for c in convs} <= set(range(spec.system_prompts))
    assert len({c.system for c in convs}) > 1
    lo, hi = spec.system_tokens
    assert all(lo <= len(p) <= hi for p in w.system_prompts)
    for c in convs:
        assert len(c.turns) == 3
        for t in c.turns:
            assert spec.user_tokens[0] <= len(t.user) <= spec.user_tokens[1]
            assert spec.max_tokens[0] <= t.max_tokens <= spec.max_tokens[1]
    everything = [*w.system_prompts, *(t.user for c in convs for t in c.turns),
                  *(o.prompt for o in one_offs)]
    assert all(0 <= tok < VOCAB_SIZE for seq in everything for tok in seq)
    # Chats and one-offs interleave rather than all chats first.
    kinds = [isinstance(s, Conversation) for s in w.streams]
    assert kinds != sorted(kinds) and kinds != sorted(kinds, reverse=True)


@pytest.mark.parametrize("bad", [dict(turns=0), dict(conversations=-1),
                                 dict(conversations=0, one_off=0)])
def test_spec_rejects_nonsense(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(**bad)


def _reply(req: Request) -> tuple[int, ...]:
    rng = random.Random(hash(req.prompt))
    return tuple(rng.randrange(VOCAB_SIZE) for _ in range(req.max_tokens))


async def test_drive_chains_turns_in_order_and_bounds_concurrency() -> None:
    w = make_workload(WorkloadSpec(conversations=6, turns=3, one_off=5, seed=3))
    in_flight = 0
    peak = 0
    sent: list[Request] = []
    rng = random.Random(0)

    async def send(req: Request) -> Result:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        sent.append(req)
        await asyncio.sleep(rng.random() * 0.005)
        in_flight -= 1
        return Result(req, f"w{rng.randrange(4)}", len(req.prompt), 0, 1.0, _reply(req))

    seen: list[Result] = []
    results = await drive(w, send, concurrency=3, on_result=seen.append)
    assert peak == 3
    assert len(results) == w.requests == len(sent)
    assert seen == results

    by_label = {r.request.label: r for r in results}
    for c in (s for s in w.streams if isinstance(s, Conversation)):
        expected = w.system_prompts[c.system]
        for k, turn in enumerate(c.turns):
            expected = expected + turn.user
            r = by_label[f"conv {c.cid:02d} turn {k + 1}/3"]
            assert r.request.prompt == expected  # previous prompt + reply + new message
            assert r.request.session_id == f"conv-{c.cid}"
            assert r.request.max_tokens == turn.max_tokens
            expected = expected + r.reply
        order = [sent.index(by_label[f"conv {c.cid:02d} turn {k}/3"].request)
                 for k in (1, 2, 3)]
        assert order == sorted(order)
    for o in (s for s in w.streams if isinstance(s, OneOff)):
        req = by_label[f"one-off {o.oid:02d}"].request
        assert req.prompt == o.prompt and req.session_id == ""


async def test_drive_stops_everything_on_the_first_failure() -> None:
    w = make_workload(WorkloadSpec(conversations=4, turns=3, one_off=0))
    calls = 0

    async def send(req: Request) -> Result:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("boom")
        await asyncio.sleep(0.01)
        return Result(req, "w0", len(req.prompt), 0, 1.0, (1,))

    with pytest.raises(RuntimeError, match="boom"):
        await drive(w, send, concurrency=2)
    await asyncio.sleep(0.05)
    assert calls < w.requests


def _result(prompt: tuple[int, ...], reply: tuple[int, ...], worker: str = "w0",
            cached: int = 0, ttft: float = 1.0) -> Result:
    return Result(Request("x", prompt, len(reply), ""), worker, len(prompt), cached, ttft,
                  reply)


def test_summary_hit_ratio_ttft_and_per_worker() -> None:
    results = [_result(tuple(range(100)), (1,), "w1", cached=50, ttft=float(i))
               for i in range(1, 101)]
    results.append(_result(tuple(range(100)), (1,), "w0", cached=0, ttft=1000.0))
    s = summarize(results)
    assert s.requests == 101
    assert s.prompt_tokens == 10100 and s.cached_tokens == 5000
    assert s.hit_ratio == pytest.approx(5000 / 10100)
    assert s.ttft_mean_ms == pytest.approx((5050 + 1000) / 101)
    assert s.ttft_p99_ms == 100.0
    assert s.per_worker == {"w0": 1, "w1": 100}


def test_percentile_nearest_rank() -> None:
    assert percentile([], 99) == 0.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([float(i) for i in range(1, 11)], 50) == 5.0
    assert percentile([float(i) for i in range(1, 11)], 99) == 10.0


def test_reusable_tokens_is_the_shared_prefix_ceiling() -> None:
    base = tuple(range(64))  # 4 blocks of 16
    first = _result(base + (900,) * 10, tuple(range(200, 216)))
    # Next turn: whole previous exchange + more; the cap keeps one token uncomputed.
    follow = _result(first.request.prompt + first.reply + (7,) * 30, (1,))
    stranger = _result(tuple(range(1000, 1040)), (1,))
    assert reusable_tokens([first]) == 0
    assert reusable_tokens([first, follow]) == 5 * 16  # 90 prompt+reply tokens = 5 blocks
    assert reusable_tokens([first, follow, stranger]) == 5 * 16
    exact = _result(base, (1,))  # 64 tokens: at most 3 blocks, one token is computed
    assert reusable_tokens([first, exact]) == 3 * 16
