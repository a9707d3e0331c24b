"""The demo's noise verdict: RatioSpread on constructed ratios, and the comparison table it
fills from constructed per-repeat reports."""

from __future__ import annotations

import math

import pytest

from kvroute.demo.report import PolicyReport, comparison_table
from kvroute.demo.spread import RatioSpread, Verdict
from kvroute.demo.workload import Summary


@pytest.mark.parametrize(("ratios", "verdict"), [
    ((0.76, 0.74, 0.81), Verdict.LOWER),  # below 1.00 every time, by more than the spread
    ((1.27, 1.22, 1.30), Verdict.HIGHER),
    ((0.94, 1.19, 1.02), Verdict.NOISE),  # the range crosses 1.00
    ((0.81, 0.83, 1.00), Verdict.NOISE),  # touching 1.00 is crossing it
    ((0.90, 0.95, 0.99), Verdict.NOISE),  # all below, but |0.95 - 1| < 0.99 - 0.90
    ((0.90, 0.99), Verdict.NOISE),  # median 0.945: 0.055 from 1.00, less than the 0.09 range
    ((0.92, 0.95), Verdict.LOWER),  # median 0.935: 0.065 > 0.03
    ((0.80,), Verdict.UNKNOWN),  # one repeat: no noise estimate, even far from 1.00
    ((), Verdict.UNDEFINED),
])
def test_verdict(ratios: tuple[float, ...], verdict: Verdict) -> None:
    assert RatioSpread(ratios).verdict is verdict


def test_median_range_and_cell() -> None:
    s = RatioSpread((0.81, 1.00, 0.83))
    assert (s.median, s.lo, s.hi) == (0.83, 0.81, 1.00)
    assert s.cell() == "0.83x (0.81-1.00)"
    assert RatioSpread((1.0, 3.0)).median == 2.0  # an even count: the middle two's mean
    assert RatioSpread((0.5,)).cell() == "0.50x"
    assert RatioSpread(()).cell() == "-" and math.isnan(RatioSpread(()).median)


def test_of_pairs_leaves_out_an_undefined_ratio() -> None:
    assert RatioSpread.of([(1.0, 0.0), (2.0, 4.0), (3.0, 2.0)]).ratios == (0.5, 1.5)
    assert RatioSpread.of([(0.0, 0.0)]).verdict is Verdict.UNDEFINED


def _report(policy: str, repeat: int, repeats: int, hit: float, mean: float,
            p99: float, wall: float = 5.0) -> PolicyReport:
    summary = Summary(requests=100, prompt_tokens=10_000, cached_tokens=round(hit * 10_000),
                      reusable_tokens=7_500, ttft_mean_ms=mean, ttft_p99_ms=p99,
                      per_worker={"w0": 100})
    return PolicyReport(policy, summary, wall, ["w0"], repeat, repeats)


def _row(table: str, name: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(name))


def test_table_names_what_is_beyond_noise_and_what_is_not() -> None:
    # Paired by repeat: hit ratio 1.50x, 1.40x, 1.45x; mean TTFT 0.70x, 0.75x, 0.80x;
    # p99 1.10x, 0.90x, 1.00x (crosses); workload time 1.00x every time (zero range, at 1).
    kv = [(0.75, 70.0, 110.0), (0.70, 75.0, 90.0), (0.725, 80.0, 100.0)]
    reports = []
    for i, (hit, mean, p99) in enumerate(kv, start=1):
        reports.append(_report("kvroute", i, 3, hit, mean, p99))
        reports.append(_report("round_robin", i, 3, 0.5, 100.0, 100.0))
    table = comparison_table(reports)
    assert _row(table, "median of 3").split()[3:] == ["kvroute", "round_robin",
                                                      "kvroute/round_robin", "verdict"]
    hit = _row(table, "prefix-hit ratio")
    assert "72.5%" in hit and "50.0%" in hit  # each policy's median over its repeats
    assert hit.endswith("1.45x (1.40-1.50)   higher, beyond noise")
    assert _row(table, "mean TTFT").endswith("0.75x (0.70-0.80)   lower, beyond noise")
    assert _row(table, "p99 TTFT").endswith("1.00x (0.90-1.10)   within noise")
    assert _row(table, "workload time").endswith("1.00x (1.00-1.00)   within noise")
    assert "x" not in _row(table, "  ceiling*")  # the same for every policy: no ratio
    assert ("Beyond run-to-run noise, kvroute vs round_robin: prefix-hit ratio higher "
            "(1.45x), mean TTFT lower (0.75x).") in table
    assert "Within run-to-run noise (no difference shown): p99 TTFT, workload time." in table


def test_a_ratio_dividing_by_zero_is_left_out() -> None:
    reports = [_report(p, r, 2, hit, 70.0, 90.0) for r in (1, 2)
               for p, hit in (("kvroute", 0.4), ("round_robin", 0.0))]
    assert _row(comparison_table(reports), "prefix-hit ratio").endswith(
        "-   no ratio (divides by 0)")
    reports[1] = _report("round_robin", 1, 2, 0.2, 70.0, 90.0)  # one repeat's ratio defined
    assert _row(comparison_table(reports), "prefix-hit ratio").endswith(
        "2.00x   noise unknown (one ratio)")


def test_one_repeat_says_there_is_no_noise_estimate() -> None:
    table = comparison_table([_report("kvroute", 1, 1, 0.75, 70.0, 90.0),
                              _report("round_robin", 1, 1, 0.5, 100.0, 100.0)])
    assert _row(table, "p99 TTFT").endswith("0.90x   noise unknown (one ratio)")
    assert "One repeat gives no estimate of run-to-run noise" in table
    assert "Beyond run-to-run noise" not in table


def test_without_both_policies_there_is_no_ratio() -> None:
    table = comparison_table([_report("kvroute", r, 2, 0.75, 70.0, 90.0) for r in (1, 2)])
    assert "kvroute/round_robin" not in table and "noise" not in table
    assert _row(table, "p99 TTFT").split()[-1] == "90.0"
