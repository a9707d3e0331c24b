"""The load view's derived fields and the arrival rate behind ``WorkerLoad.arrival_rate``."""

from __future__ import annotations

import math

import pytest

from kvroute.core.load import (
    ARRIVAL_MIN_WINDOW_S,
    ArrivalRate,
    PrefixDemand,
    prefill_context,
)
from kvroute.core.policies.kvroute import own_prefill


def test_a_steady_stream_reads_its_rate_and_silence_fades() -> None:
    rate = ArrivalRate(tau_s=10.0)
    assert rate.at(0.0) == 0.0
    for i in range(2000):  # 4 requests a second for 500 s: many windows
        rate.add(i * 0.25)
    assert rate.at(499.75) == pytest.approx(4.0, rel=0.05)
    # No arrival for one window: down by e; reading does not change it (a read that moved
    # the reference time would make the earlier instant read the decayed rate).
    latest = rate.at(499.75)
    assert rate.at(509.75) == pytest.approx(latest / math.e)
    assert rate.at(499.75) == latest
    assert rate.at(700.0) < 0.01
    # A burst at one instant counts whole; a time before the latest arrival reads the latest.
    burst = ArrivalRate(tau_s=10.0)
    burst.add(5.0, n=3)
    burst.add(5.0)
    assert burst.at(5.0) == pytest.approx(0.4) and burst.at(1.0) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="tau_s"):
        ArrivalRate(tau_s=0)


def test_a_rate_counted_from_a_start_reads_a_stream_from_its_first_seconds() -> None:
    """From ``start``, the sum holds only 1 - e^(-t / tau) of a steady rate after t seconds;
    the reading divides that out (over at least ARRIVAL_MIN_WINDOW_S), so a router that has
    just started sees its workers' traffic at once instead of tau_s later."""
    cold, plain = ArrivalRate(tau_s=30.0, start=100.0), ArrivalRate(tau_s=30.0)
    for i in range(9):  # 4 requests a second, from 100 s to 102 s
        cold.add(100.0 + i * 0.25)
        plain.add(100.0 + i * 0.25)
    assert cold.at(102.0) == pytest.approx(4.0, rel=0.15)  # 9 requests over 2 s
    assert plain.at(102.0) == pytest.approx(0.3, rel=0.05)  # ~9 / 30: 15x too low
    assert cold.at(102.0) == pytest.approx(plain.at(102.0) / -math.expm1(-2.0 / 30.0))
    # Long after the start the correction fades: both read the same.
    for i in range(1, 1201):  # 2 per second for 600 s
        cold.add(102.0 + i * 0.5)
        plain.add(102.0 + i * 0.5)
    assert cold.at(702.0) == pytest.approx(plain.at(702.0), rel=1e-8)
    assert cold.at(702.0) == pytest.approx(2.0, rel=0.02)
    # One request just after the start reads as one in the shortest window, not 1 / 0.1 s.
    early = ArrivalRate(tau_s=30.0, start=0.0)
    early.add(0.1)
    assert early.at(0.1) == pytest.approx(1.0 / ARRIVAL_MIN_WINDOW_S, rel=0.02)
    assert ArrivalRate(start=0.0).at(5.0) == 0.0  # nothing sent: nothing to correct
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="start"):
            ArrivalRate(start=bad)


def test_prefill_context_is_what_new_tokens_attend_to() -> None:
    assert prefill_context(0, 5000) == 0
    assert prefill_context(10, 0) == 50  # each new token sees half the others on average
    assert prefill_context(10, 100) == 1050
    # A prefill's work is its tokens plus attn x this: kvroute's own_prefill, to rounding.
    assert 100 + 3.3e-5 * prefill_context(100, 7000) == pytest.approx(
        own_prefill(100, 7000, 3.3e-5))


def test_prefix_demand_counts_the_requests_before_and_forgets_the_oldest_keys() -> None:
    d = PrefixDemand(tau_s=10.0, max_keys=2)
    assert d.observe(7, 0.0) == 0.0  # the first request for a prefix finds no demand
    assert d.observe(7, 0.0) == pytest.approx(0.1)  # one before it, 1/tau
    assert d.observe(7, 10.0) == pytest.approx(0.2 / math.e)  # two, decayed over tau
    assert d.observe(8, 10.0) == 0.0
    d.observe(9, 10.0)  # a third key: the least recently observed (7) is forgotten
    assert len(d) == 2 and d.observe(7, 10.0) == 0.0
    assert d.observe(9, 10.0) == pytest.approx(0.1)  # 9 was kept (8 went for 7)
    with pytest.raises(ValueError):
        PrefixDemand(tau_s=0)
    # Counted from a start, a prefix read early is corrected as ArrivalRate is; one first read
    # long after the start had no requests before it, and reads as its count says.
    fresh = PrefixDemand(tau_s=30.0, start=0.0)
    for t in (0.0, 0.5, 1.0, 1.5):
        fresh.observe(1, t)
    assert fresh.observe(1, 2.0) == pytest.approx(2.0, rel=0.1)  # 4 in 2 s, not 4 / 30
    fresh.observe(2, 600.0)
    assert fresh.observe(2, 600.0) == pytest.approx(1 / 30.0, rel=0.01)
