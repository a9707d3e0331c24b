"""Comparing policies over rate jitters: averages, and leads that hold or are noise."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvroute.simulations.compare import (
    Jittered,
    Matched,
    Verdict,
    at_matched_load,
    jittered_from_json,
    jittered_to_json,
    match_load,
    match_loads,
    matched_from_json,
    matched_to_json,
    parse_jitters,
    replay_jittered,
    score_aims,
    score_cell,
    verdicts,
)
from kvroute.simulations.metrics import PolicyMetrics


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


def ten(policy: str, means: list[float], p99s: list[float], hits: list[float]) -> Jittered:
    return Jittered(policy, tuple(metrics(policy, m, p, h)
                                  for m, p, h in zip(means, p99s, hits, strict=True)))


def test_a_cell_is_scored_per_metric_by_average_and_by_the_sign_test() -> None:
    # the focus: lower mean at all 10 jitters (W); higher p99 at 9 of 10 (L); a better hit
    # ratio on average, but at only 6 of 10 jitters (w)
    focus = ten("k", [1.0] * 10, [2.2] * 9 + [1.9], [0.55] * 6 + [0.49] * 4)
    peer = ten("p", [1.1] * 10, [2.0] * 10, [0.5] * 10)
    worse = ten("q", [3.0] * 10, [9.0] * 10, [0.1] * 10)
    s = score_cell([focus, peer, worse], "k")
    assert s.codes() == "WLw"
    assert not s.won_all and not s.won_all_consistently and not s.no_consistent_loss
    # margins against the best other's value: mean 1.0 s vs 1.1 s; p99 2.17 s vs 2.0 s
    assert "mean TTFT -9.1% (p)" in s.margins()
    assert "p99 TTFT +8.5% (p)" in s.margins()
    assert "hit ratio +2.60 pts (p)" in s.margins()  # 0.526 on average against 0.5
    # the same p99 loss at three jitters cannot be told from noise (1 time in 4)
    three = score_cell([ten("k", [1.0] * 3, [2.2] * 3, [0.5] * 3),
                        ten("p", [1.1] * 3, [2.0] * 3, [0.5] * 3)], "k")
    assert three.codes() == "wlw"  # equal hit ratios: a tie counts as won
    assert three.no_consistent_loss and not three.won_all
    assert score_cell([ten("k", [1.0] * 3, [1.0] * 3, [0.6] * 3),
                       ten("p", [1.1] * 3, [2.0] * 3, [0.5] * 3)], "k").won_all
    # equal at every jitter: a tie, won (at least as good) but not consistently
    same = score_cell([ten("k", [1.0] * 10, [2.0] * 10, [0.5] * 10),
                       ten("p", [1.0] * 10, [2.0] * 10, [0.5] * 10)], "k")
    assert same.codes() == "www" and same.won_all and not same.won_all_consistently
    with pytest.raises(ValueError, match="alpha"):
        score_cell([focus, peer], "k", alpha=1.5)


def test_runs_survive_json_and_bad_json_is_named() -> None:
    rows = [ten("k", [1.0, 1.1], [2.0, 2.1], [0.5, 0.6]),
            ten("p", [1.2, 1.3], [2.2, 2.3], [0.4, 0.5])]
    back = jittered_from_json(json.loads(json.dumps(jittered_to_json(rows))), "x")
    assert back == rows
    m = Matched("p", 0.8, 1.5, 0.79, rows[1], True)
    assert matched_from_json(json.loads(json.dumps(matched_to_json([m]))), "x") == [m]
    good = jittered_to_json(rows)
    # A file written before fetched KV left the replay still reads.
    old = {p: [{**r, "fetched_ratio": 0.0} for r in runs] for p, runs in good.items()}
    assert jittered_from_json(old, "x") == back
    cases = [
        ([], "expected an object"),
        ({"k": []}, "non-empty list"),
        ({"k": [1]}, "row 0 is not an object"),
        ({"k": [{**good["k"][0], "speed": 1}]}, "unknown fields speed"),
        ({"k": [{x: v for x, v in good["k"][0].items() if x != "hit_ratio"}]},
         "missing fields hit_ratio"),
        ({"k": [{**good["k"][0], "hit_ratio": "high"}]}, "must be a number"),
        ({"p": good["k"]}, "p: row 0 is 'k'"),
        ({"k": good["k"], "p": good["p"][:1]}, "not replayed at the same jitters"),
    ]
    for bad, why in cases:
        with pytest.raises(ValueError, match=why):
            jittered_from_json(bad, "f.json")
    with pytest.raises(ValueError, match=r"f.json\[0\]: not a matched policy"):
        matched_from_json([{"policy": "p"}], "f.json")


def test_the_aims_are_scored_against_the_best_peer_on_each_metric() -> None:
    # against two peers, each best on something: p has the lower mean and p99, q the hits
    focus = ten("k", [1.0] * 3, [2.03] * 3, [0.496] * 3)
    p = ten("p", [1.0] * 3, [2.0] * 3, [0.40] * 3)
    q = ten("q", [3.0] * 3, [9.0] * 3, [0.50] * 3)
    v1 = ten("kvroute_v1", [0.1] * 3, [0.1] * 3, [0.9] * 3)  # not a peer: ignored
    met = score_aims([focus, p, q, v1], "k", ["p", "q"])
    assert met.failed == ()  # a tie on the mean; p99 +1.5% (< 2%); hits -0.4 points
    assert abs(met.p99_margin - 0.015) < 1e-9 and abs(met.hit_margin + 0.004) < 1e-9
    worse = score_aims([ten("k", [1.01] * 3, [2.05] * 3, [0.49] * 3), p, q], "k", ["p", "q"])
    assert worse.failed == ("mean TTFT", "p99 TTFT", "hit ratio")
    # the non-peer, were it a peer, would fail every aim
    assert len(score_aims([focus, v1], "k", ["kvroute_v1"]).failed) == 3
    with pytest.raises(ValueError, match="none of the peers"):
        score_aims([focus, v1], "k", ["p"])
    with pytest.raises(ValueError, match="no policy 'x'"):
        score_aims([focus, p], "x", ["p"])
