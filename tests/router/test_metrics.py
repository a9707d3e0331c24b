"""The router's metrics that are read at scrape time."""

from __future__ import annotations

import pytest

from kvroute.core.load import PrefillTail
from kvroute.router.metrics import RouterMetrics


def test_the_prefill_tail_is_reported_as_the_decider_reads_it() -> None:
    metrics = RouterMetrics()
    tail = PrefillTail(window=100, min_samples=10, attn=1e-3)
    metrics.watch_tail(tail)

    def scraped() -> float | None:
        return metrics.registry.get_sample_value("kvroute_router_prefill_tail_work")

    assert scraped() == 0  # no tail yet
    for n in range(1, 11):
        tail.observe(100 * n, 0)
    assert tail.current() == pytest.approx(1000 + 1e-3 * 1000 * 500)  # the largest of 10
    assert scraped() == tail.current()
    tail.observe(5, 0)
    assert scraped() == tail.current()  # read anew at every scrape
