"""Trace transformations a comparison replays: nudged arrivals."""

from __future__ import annotations

import json

import pytest

from kvroute.simulations.compare import at_rate
from kvroute.simulations.generators import generate
from kvroute.simulations.trace import Trace, parse


@pytest.fixture(scope="module")
def chat() -> Trace:
    return parse([json.dumps(r) for r in generate("chat", 300, 20.0, seed=3)])


def test_nudged_arrivals_move_within_half_their_gaps_in_the_same_order(chat: Trace) -> None:
    nudged = chat.nudged(1.0, "a")
    before = [r.arrival_s for r in chat.requests]
    after = [r.arrival_s for r in nudged.requests]
    assert after == sorted(after) and len(set(after)) == len(set(before))
    assert after != before
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        gaps = [abs(before[j] - b) for j in (i - 1, i + 1) if 0 <= j < len(before)]
        assert abs(a - b) < min(gaps) / 2 or a == b
    # Only the times move: the requests, their continuations and replies are the same.
    assert [r.keys for r in nudged.requests] == [r.keys for r in chat.requests]
    assert [r.session for r in nudged.requests] == [r.session for r in chat.requests]
    assert nudged.continuations() == chat.continuations()
    assert nudged.reply_keys() == chat.reply_keys()
    # Half the spread, moves within a quarter of the gaps.
    half = chat.nudged(0.5, "a")
    for i, r in enumerate(half.requests[1:-1], start=1):
        gap = min(before[i] - before[i - 1], before[i + 1] - before[i])
        assert abs(r.arrival_s - before[i]) <= gap / 4 + 1e-12


def test_nudges_are_fixed_by_their_seed(chat: Trace) -> None:
    a = [r.arrival_s for r in chat.nudged(1.0, "a").requests]
    assert a == [r.arrival_s for r in chat.nudged(1.0, "a").requests]
    assert a != [r.arrival_s for r in chat.nudged(1.0, "b").requests]
    assert chat.nudged(0.0, "a") is chat
    with_warmup = chat.with_warmup(50).nudged(1.0, "a")
    assert with_warmup.warmup == 50
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="spread"):
            chat.nudged(bad, "a")


def test_each_rate_gets_nudges_of_its_own(chat: Trace) -> None:
    """at_rate: the scaled trace, nudged with a seed per (seed, rate): two jitters differ
    beyond their scale, the same jitter is the same replay on every run."""
    def offsets(t: Trace, scale: float) -> list[float]:
        t0 = chat.requests[0].arrival_s
        plain = [t0 + (r.arrival_s - t0) / scale for r in chat.requests]
        return [r.arrival_s - p for r, p in zip(t.requests, plain, strict=True)]

    assert at_rate(chat, 1.0) is chat
    assert [r.arrival_s for r in at_rate(chat, 2.0).requests] == \
        [r.arrival_s for r in chat.scaled(2.0).requests]
    one, other = offsets(at_rate(chat, 2.0, 1.0), 2.0), offsets(at_rate(chat, 2.02, 1.0), 2.02)
    assert any(abs(x) > 1e-9 for x in one)
    assert [round(x * 2.0, 9) for x in one] != [round(x * 2.02, 9) for x in other]
    assert offsets(at_rate(chat, 2.0, 1.0), 2.0) == one
    assert offsets(at_rate(chat, 2.0, 1.0, seed=1), 2.0) != one
