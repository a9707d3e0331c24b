"""Comparing policies over rate jitters: averages, and leads that hold or are noise."""

from __future__ import annotations

from dataclasses import replace

import pytest

from simulations.compare import (
    Jittered,
    Verdict,
    at_matched_load,
    match_load,
    match_loads,
    parse_jitters,
    replay_jittered,
    verdicts,
)
from simulations.metrics import PolicyMetrics


def metrics(policy: str, mean: float, p99: float, hit: float) -> PolicyMetrics:
    return PolicyMetrics(policy=policy, requests=10, hit_ratio=hit, ttft_mean_s=mean,
                         ttft_p50_s=mean, ttft_p99_s=p99, e2e_mean_s=mean * 2,
                         e2e_p99_s=p99 * 2, throughput_rps=5.0, imbalance=1.0, wall_s=1.0)


def test_parse_jitters_accepts_factors_and_rejects_nonsense() -> None:
    assert parse_jitters("0.98, 1,1.02") == (0.98, 1.0, 1.02)
    for bad, why in [("", "at least one"), ("a,1", "comma-separated"), ("0.1", r"\[0.5, 2\]"),
                     ("1,1", "must differ")]:
        with pytest.raises(ValueError, match=why):
            parse_jitters(bad)


def test_runs_are_gathered_per_policy_and_averaged() -> None:
    seen: list[float] = []

    def replay(factor: float) -> list[PolicyMetrics]:
        seen.append(factor)
        return [metrics("a", factor, 2 * factor, 0.5), metrics("b", 1.0, 1.0, factor / 2)]

    runs = replay_jittered((0.9, 1.1), replay)
    assert seen == [0.9, 1.1]
    assert [j.policy for j in runs] == ["a", "b"]
    a = runs[0].mean()
    assert a.policy == "a" and a.requests == 10
    assert a.ttft_mean_s == pytest.approx(1.0) and a.ttft_p99_s == pytest.approx(2.0)
    assert a.wall_s == pytest.approx(2.0)  # the time both replays took
    assert runs[1].mean().hit_ratio == pytest.approx(0.5)


def test_a_lead_that_flips_between_jitters_is_within_noise() -> None:
    a = Jittered("a", (metrics("a", 1.0, 5.0, 0.50), metrics("a", 1.0, 5.0, 0.50),
                       metrics("a", 1.0, 5.0, 0.50)))
    # b: better mean on average but worse at one jitter; worse p99 at every jitter;
    # better hit ratio at every jitter.
    b = Jittered("b", (metrics("b", 0.7, 6.0, 0.52), metrics("b", 0.7, 6.0, 0.52),
                       metrics("b", 1.1, 6.0, 0.52)))
    c = Jittered("c", (metrics("c", 2.0, 9.0, 0.1),) * 3)
    by = {v.metric: v for v in verdicts([a, b, c])}
    mean = by["mean TTFT"]
    assert (mean.leader, mean.runner_up, mean.ahead_in, mean.consistent) == ("b", "a", 2, False)
    assert mean.lead == pytest.approx(1 / 6)  # 0.833 s on average against 1.0 s
    assert "within noise" in str(mean)
    p99 = by["p99 TTFT"]
    assert (p99.leader, p99.runner_up, p99.consistent) == ("a", "b", True)
    assert "within noise" not in str(p99) and "3/3" in str(p99)
    # a sign test: equal policies split 3 jitters 3-0 either way 1 time in 4, 2-1 always
    assert p99.tie_chance == pytest.approx(0.25) and "1 time in 4" in str(p99)
    assert mean.tie_chance == 1.0 and "time in" not in str(mean)
    hit = by["hit ratio"]
    assert (hit.leader, hit.lead) == ("b", pytest.approx(0.02))
    assert "2.00 points above a" in str(hit)


def test_focus_compares_one_policy_with_the_best_of_the_others() -> None:
    a = Jittered("a", (metrics("a", 3.0, 9.0, 0.3),))
    b = Jittered("b", (metrics("b", 1.0, 2.0, 0.5),))
    c = Jittered("c", (metrics("c", 2.0, 3.0, 0.4),))
    assert {(v.leader, v.runner_up) for v in verdicts([a, b, c])} == {("b", "c")}
    assert {(v.leader, v.runner_up) for v in verdicts([a, b, c], focus="a")} == {("b", "a")}
    with pytest.raises(ValueError, match="no policy 'z'"):
        verdicts([a, b], focus="z")
    assert verdicts([a]) == []


def test_the_tie_chance_is_a_two_sided_sign_test() -> None:
    def chance(ahead: int, n: int) -> float:
        return Verdict("mean TTFT", "a", 1.0, "b", 0.01, ahead, n).tie_chance

    assert chance(10, 10) == pytest.approx(2 / 1024)
    assert chance(9, 10) == pytest.approx(2 * 11 / 1024)
    assert chance(1, 10) == chance(9, 10)  # as one-sided the other way
    assert chance(6, 10) == pytest.approx(2 * 386 / 1024)
    assert chance(5, 10) == 1.0  # an even split: capped, no evidence either way
    assert "1 time in 512" in str(Verdict("mean TTFT", "a", 1.0, "b", 0.01, 10, 10))


def loaded(policy: str, sent: float, mean: float = 1.0, p99: float = 2.0,
           hit: float = 0.5) -> Jittered:
    """Two jitters of a closed-loop replay whose clients sent ``sent`` of capacity (1 rps)."""
    m = replace(metrics(policy, mean, p99, hit), sent_rps=sent)
    return Jittered(policy, (m, m))


def sent_of(j: Jittered) -> float:
    return j.mean().sent_rps


def test_a_lighter_policy_is_replayed_at_the_least_rate_that_reaches_the_load() -> None:
    # its clients send 0.3 x the rate factor, up to 0.6: 0.45 needs 1.5x, 0.58 about 1.93x
    tried: list[float] = []

    def replay(scale: float) -> Jittered:
        tried.append(scale)
        return loaded("b", min(0.3 * scale, 0.6), mean=scale)

    m = match_load(0.45, sent_of, replay, loaded("b", 0.3))
    assert m.reached and m.scale == pytest.approx(1.5) and tried == [1.5, 1.25, 1.375, 1.4375]
    assert "sent 45% at 1.5x the rate" in str(m)
    tried.clear()
    m = match_load(0.58, sent_of, replay, loaded("b", 0.3))
    # grows 1.5x, 2.25x, then bisects between them: never past what reaches the load
    assert m.reached and tried[:2] == [1.5, 2.25] and len(tried) == 5
    assert 0.57 / 0.3 <= m.scale <= 2.25 and m.runs.mean().ttft_mean_s == m.scale
    tried.clear()
    m = match_load(0.7, sent_of, replay, loaded("b", 0.3), max_scale=3.0)
    assert not m.reached and m.sent == pytest.approx(0.6) and tried == [1.5, 2.25, 3.0]
    assert m.scale == 2.25  # the first rate that sent the most
    assert "could not send 70% of capacity (at most 60%, at 2.25x" in str(m)
    tried.clear()
    m = match_load(0.305, sent_of, replay, loaded("b", 0.3))  # within a point: as it is
    assert m.reached and m.scale == 1.0 and tried == []


def test_only_lighter_leaders_are_matched_and_the_unreached_are_left_out() -> None:
    mine = loaded("k", 0.5, mean=1.0, p99=2.0, hit=0.5)
    equal = loaded("e", 0.495, mean=0.5)  # leads, but at the same load within a point
    trailing = loaded("t", 0.3, mean=2.0, p99=3.0, hit=0.4)  # lighter, behind on all
    leading = loaded("l", 0.3, mean=1.0, p99=1.5, hit=0.5)  # lighter, ahead on p99
    stuck = loaded("s", 0.3, mean=0.9)  # lighter, ahead on the mean, cannot get there
    asked: list[str] = []

    def replay(name: str, scale: float) -> Jittered:
        asked.append(name)
        if name == "s":
            return loaded("s", 0.3, mean=0.9)
        return loaded(name, 0.3 * scale, p99=1.5 * scale)

    rows = [mine, equal, trailing, leading, stuck]
    matched = match_loads(rows, "k", sent_of, replay)
    assert [m.policy for m in matched] == ["l", "s"] and set(asked) == {"l", "s"}
    assert [m.reached for m in matched] == [True, False]
    again = at_matched_load(rows, matched)
    assert [j.policy for j in again] == ["k", "e", "t", "l"]
    assert again[3].mean().ttft_p99_s > 2.0  # at k's load it no longer leads on p99
    with pytest.raises(ValueError, match="no policy 'x'"):
        match_loads(rows, "x", sent_of, replay)
