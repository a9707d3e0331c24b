"""What the demo reports: each run's summary, and the policies side by side with the
kvroute/round_robin ratio of each metric and whether it is beyond run-to-run noise."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.demo.spread import RatioSpread, Verdict
from kvroute.demo.workload import Summary


@dataclass(frozen=True)
class PolicyReport:
    policy: str
    summary: Summary
    wall_s: float
    worker_ids: list[str]
    repeat: int = 1  # 1-based
    repeats: int = 1

    @property
    def label(self) -> str:
        return run_label(self.policy, self.repeat, self.repeats)


def run_label(policy: str, repeat: int, repeats: int) -> str:
    """The policy, with the repeat when there are several: ``kvroute 2/3``."""
    return policy if repeats == 1 else f"{policy} {repeat}/{repeats}"


def print_summary(r: PolicyReport) -> None:
    s = r.summary
    per_worker = "  ".join(f"{w} {s.per_worker.get(w, 0)}" for w in r.worker_ids)
    print(f"\n== {r.label}: {s.requests} requests in {r.wall_s:.1f} s\n"
          f"   prefix-hit ratio  {100 * s.hit_ratio:5.1f}%  ({s.cached_tokens:,} of "
          f"{s.prompt_tokens:,} prompt tokens cached; ceiling {100 * s.reusable_ratio:.1f}%)\n"
          f"   TTFT              mean {s.ttft_mean_ms:.1f} ms  p99 {s.ttft_p99_ms:.1f} ms\n"
          f"   requests/worker   {per_worker}", flush=True)


@dataclass(frozen=True)
class Metric:
    name: str
    fmt: str
    get: Callable[[PolicyReport], float]
    compared: bool = True  # False: the same for every policy by construction (no ratio)


METRICS = (
    Metric("prefix-hit ratio", "{:.1%}", lambda r: r.summary.hit_ratio),
    Metric("  ceiling*", "{:.1%}", lambda r: r.summary.reusable_ratio, compared=False),
    Metric("mean TTFT (ms)", "{:.1f}", lambda r: r.summary.ttft_mean_ms),
    Metric("p99 TTFT (ms)", "{:.1f}", lambda r: r.summary.ttft_p99_ms),
    Metric("workload time (s)", "{:.1f}", lambda r: r.wall_s),
)
RATIO_HEAD = "kvroute/round_robin"


def comparison_table(reports: Sequence[PolicyReport]) -> str:
    """Each policy's median over its repeats side by side; when kvroute and round_robin both
    ran, each metric's kvroute/round_robin ratio (one per repeat, paired by repeat): median
    (min-max) and its :class:`~kvroute.demo.spread.Verdict`, then a plain sentence naming
    what differs beyond run-to-run noise and what does not."""
    runs: dict[str, list[PolicyReport]] = {}
    for r in sorted(reports, key=lambda r: r.repeat):
        runs.setdefault(r.policy, []).append(r)
    policies = list(runs)
    repeats = max(len(v) for v in runs.values())
    ratio = "kvroute" in runs and "round_robin" in runs
    rows, beyond, noise = _rows(runs, ratio)
    widths = [max(12, len(p)) for p in policies]
    first = f"median of {repeats}" if repeats > 1 else ""
    head = f"{first:<18}" + "".join(f"{p:>{w + 2}}" for p, w in zip(policies, widths,
                                                                     strict=True))
    ratio_w = max(len(RATIO_HEAD), *(len(c) for _, _, c, _ in rows)) + 3
    if ratio:
        head += f"{RATIO_HEAD:>{ratio_w}}   verdict"
    lines = [head]
    for name, cells, cell, verdict in rows:
        line = f"{name:<18}" + "".join(f"{c:>{w + 2}}" for c, w in zip(cells, widths,
                                                                      strict=True))
        lines.append((line + (f"{cell:>{ratio_w}}   {verdict}" if ratio else "")).rstrip())
    lines.append("* share of prompt tokens an earlier request had already computed, on any "
                 "worker:\n  the best any policy can do (new user messages and one-off "
                 "prompts never hit)")
    if ratio:
        lines += _reading(repeats, beyond, noise)
    return "\n".join(lines)


def _rows(runs: dict[str, list[PolicyReport]], ratio: bool
          ) -> tuple[list[tuple[str, list[str], str, str]], list[str], list[str]]:
    """Per metric: its name, each policy's median, and (``ratio``) the kvroute/round_robin
    spread and verdict; the metrics beyond noise, and those within it."""
    rows: list[tuple[str, list[str], str, str]] = []
    beyond: list[str] = []
    noise: list[str] = []
    for m in METRICS:
        cells = [m.fmt.format(statistics.median(m.get(r) for r in rs)) for rs in runs.values()]
        cell = verdict = ""
        if ratio and m.compared:
            spread = RatioSpread.of([(m.get(a), m.get(b)) for a, b in
                                     zip(runs["kvroute"], runs["round_robin"], strict=True)])
            cell, verdict = spread.cell(), spread.verdict.value
            name = m.name.split(" (")[0]
            if spread.verdict in (Verdict.LOWER, Verdict.HIGHER):
                beyond.append(f"{name} {spread.verdict.name.lower()} ({spread.median:.2f}x)")
            elif spread.verdict is Verdict.NOISE:
                noise.append(name)
        rows.append((m.name, cells, cell, verdict))
    return rows, beyond, noise


def _reading(repeats: int, beyond: list[str], noise: list[str]) -> list[str]:
    """How to read the ratios, and what they say."""
    if repeats <= 1:
        return ["One repeat gives no estimate of run-to-run noise: run with --repeats 2 "
                "or more before reading a difference into the ratios."]
    return [f"The ratio is kvroute's value over round_robin's in the same repeat: "
            f"median (min-max) of {repeats}.\nA ratio is within run-to-run noise "
            "when its min-max range crosses 1.00x or its distance from\n1.00x is "
            "smaller than that range. The repeats run back to back: a slow spell "
            "of the\nmachine that lasts the whole demo is not in the range.",
            "Beyond run-to-run noise, kvroute vs round_robin: "
            f"{', '.join(beyond) or 'nothing'}.",
            f"Within run-to-run noise (no difference shown): "
            f"{', '.join(noise) or 'nothing'}."]
