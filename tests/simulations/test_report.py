"""The replay's report: where a sweep's points sit."""

from __future__ import annotations

from pathlib import Path

from kvroute.simulations.metrics import PolicyMetrics
from kvroute.simulations.report import plot_sweep, sweep_loads


def metrics(policy: str, mean: float, sent_rps: float) -> PolicyMetrics:
    return PolicyMetrics(policy=policy, requests=10, hit_ratio=0.5, ttft_mean_s=mean,
                         ttft_p50_s=mean, ttft_p99_s=mean * 3, e2e_mean_s=mean * 2,
                         e2e_p99_s=mean * 6, throughput_rps=5.0, imbalance=1.0, wall_s=1.0,
                         sent_rps=sent_rps)


def test_a_closed_loop_sweep_plots_each_policy_at_the_load_its_clients_offered(
        tmp_path: Path) -> None:
    # Capacity 20 req/s; the slower policy's clients send later, so offer less load.
    sweep = {0.5: [metrics("fast", 0.1, 9.0), metrics("slow", 0.2, 8.0)],
             0.95: [metrics("fast", 0.15, 14.0), metrics("slow", 0.4, 11.0)]}
    assert sweep_loads(sweep) == {"fast": [0.5, 0.95], "slow": [0.5, 0.95]}
    assert sweep_loads(sweep, 20.0) == {"fast": [0.45, 0.7], "slow": [0.4, 0.55]}
    # Points follow the nominal loads' order, whatever the policies' order at each load.
    sweep[0.95].reverse()
    assert sweep_loads(sweep, 20.0)["slow"] == [0.4, 0.55]
    png = plot_sweep(tmp_path, sweep, capacity_rps=20.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
