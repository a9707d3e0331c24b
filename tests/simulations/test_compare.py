"""Comparing policies over rate jitters: averages, and leads that hold or are noise."""

from __future__ import annotations

import pytest

from simulations.compare import Jittered, Verdict, parse_jitters, replay_jittered, verdicts
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
