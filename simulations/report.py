"""Reporting a replay: the table on the terminal, results.json / results.csv,
requests.csv, PNG plots (with matplotlib, the ``sim`` extra: :func:`plots_skipped`)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from kvroute.simulations.compare import Jittered, Matched, at_matched_load, verdicts
from kvroute.simulations.metrics import REQUEST_COLUMNS, PolicyMetrics, floor_summary, request_rows
from kvroute.simulations.replay import ReplayResult


def table(rows: Sequence[PolicyMetrics], bounds: dict[str, float],
          floor: dict[str, float] | None = None) -> str:
    wide = max(13, *(len(r.policy) for r in rows))  # variants: kvroute:hold=2
    head = (f"{'policy':<{wide}} {'hit':>6} {'moved':>6} {'flight':>6} {'stale':>6} {'evict':>6} "
            f"{'TTFT mean':>9} {'p50':>7} {'p99':>8} {'E2E mean':>8} {'p99':>8} {'req/s':>6} "
            f"{'imbal':>6} {'wall':>6}")
    lines = [head, "-" * len(head)]
    best = min(r.ttft_mean_s for r in rows)
    for r in sorted(rows, key=lambda r: r.ttft_mean_s):
        mark = " *" if r.ttft_mean_s == best else ""
        lines.append(
            f"{r.policy:<{wide}} {r.hit_ratio:>6.1%} {r.moved_ratio:>6.1%} "
            f"{r.inflight_ratio:>6.1%} {r.stale_ratio:>6.1%} {r.evicted_ratio:>6.1%} "
            f"{r.ttft_mean_s:>8.2f}s {r.ttft_p50_s:>6.2f}s {r.ttft_p99_s:>7.2f}s "
            f"{r.e2e_mean_s:>7.2f}s {r.e2e_p99_s:>7.2f}s "
            f"{r.throughput_rps:>6.2f} {r.imbalance:>6.2f} {r.wall_s:>5.1f}s{mark}")
    lines.append("bounds on the hit ratio: " + ", ".join(
        f"{k} {v:.1%}" for k, v in bounds.items()))
    if floor is not None:
        lines.append(f"TTFT floor (each request's own prefill after the infinite cache's hits, "
                     f"nothing queued): mean {floor['mean_s']:.2f}s, p50 {floor['p50_s']:.2f}s, "
                     f"p99 {floor['p99_s']:.2f}s; no policy's TTFT can be lower")
    lines.append("moved: prompt tokens cached on another worker than the one the policy chose "
                 "(hits given up for balance); flight: tokens an earlier request had brought "
                 "but was still prefilling (or, a reply, generating: not with --closed-loop) "
                 "when it arrived "
                 "(--predict-ttl-ms coalesces prefills); "
                 "stale: prefilled, but their cache event not yet at the router "
                 "(--propagation-ms); evict: held by no worker any more (--capacity-blocks); "
                 "hit + moved + flight + stale + evict = the infinite cache's")
    waits = [r for r in rows if r.waited_ratio]
    if waits:
        lines.append("sent when the reply they carry ended, after their trace time: " + ", ".join(
            f"{r.policy} {r.waited_ratio:.1%} of requests, {r.waited_mean_s:.2f}s later on "
            f"average" for r in waits))
    lines += [f"{r.policy} also copied hot prefixes to other workers in the background: "
              f"{r.copies} {'copy' if r.copies == 1 else 'copies'} prefilled "
              f"{r.copied_ratio:.2%} of prompt tokens again (the requests that set them "
              f"off did not wait for them; "
              f"counted as misses, the hit ratio would be "
              f"{r.hit_ratio - r.copied_ratio:.1%})" for r in rows if r.copies]
    tails = [r for r in rows if r.tail_requests]
    if tails:
        lines.append("p99 tail, its requests' own prefill / how many waited longer than that "
                     "on a worker caching half their prompt or more / on one caching less: "
                     + "; ".join(f"{r.policy} {r.tail_own_share:.0%} / {r.tail_held:.3g} / "
                                 f"{r.tail_queued:.3g} of {r.tail_requests:.3g}"
                                 for r in sorted(tails, key=lambda r: r.ttft_p99_s)))
    return "\n".join(lines)


def write_results(out: Path, rows: Sequence[PolicyMetrics], bounds: dict[str, float],
                  floor: np.ndarray, meta: dict[str, object], runs: Sequence[Jittered] = (),
                  focus: str | None = None, matched: Sequence[Matched] = ()) -> None:
    """results.json and results.csv; with jittered ``runs``, ``rows`` are their averages
    and results.json also holds each jitter's metrics and the verdicts, and with
    ``matched`` (``--match-load``) those policies' replays at ``focus``'s load and the
    verdicts there. ``floor`` is the per-request TTFT floor (``metrics.ttft_floor``) of the
    measured requests (the trace's warm-up left out); results.json holds its summary."""
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, object] = {"meta": meta, "bounds": bounds,
                              "ttft_floor": floor_summary(floor),
                              "policies": [r.row() for r in rows]}

    def judged(runs: Sequence[Jittered]) -> list[dict[str, object]]:
        return [asdict(v) | {"consistent": v.consistent, "tie_chance": v.tie_chance}
                for v in verdicts(runs, focus)]

    if runs:
        doc["runs"] = {j.policy: [r.row() for r in j.runs] for j in runs}
        doc["verdicts"] = judged(runs)
    if matched:
        doc["matched"] = [{"policy": m.policy, "target_load": m.target, "rate_factor": m.scale,
                           "sent_load": m.sent, "reached": m.reached,
                           "mean": m.runs.mean().row(), "runs": [r.row() for r in m.runs.runs]}
                          for m in matched]
        doc["matched_verdicts"] = judged(at_matched_load(runs, matched))
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0].row(), "rate_scale", "load"])
        w.writeheader()
        for r in rows:
            w.writerow({**r.row(), "rate_scale": meta.get("rate_scale"),
                        "load": meta.get("load")})


def write_requests(out: Path, results: Sequence[ReplayResult], floor: np.ndarray) -> Path:
    """requests.csv: every request of every policy's replay (with jitters, the one nearest
    the nominal rate), a row each, warm-up included
    (:func:`~kvroute.simulations.metrics.request_rows`; ``floor``: every request's)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "requests.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS)
        w.writeheader()
        for res in results:
            w.writerows(request_rows(res, floor))
    return path


PLOTS_SKIPPED = "plots skipped: they need matplotlib (pip install 'kvroute[sim]')"


def plots_skipped() -> str | None:
    """None if the plots can be drawn, else the one line to print in their place: they need
    matplotlib (the ``sim`` extra), the tables, JSON and CSV files do not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return PLOTS_SKIPPED
    return None


def _plt():  # returns the matplotlib.pyplot module
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'kvroute[sim]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_replay(out: Path, results: Sequence[ReplayResult], rows: Sequence[PolicyMetrics],
                bounds: dict[str, float], floor: np.ndarray) -> list[Path]:
    """TTFT CDF per policy (measured requests) against the floor's (``floor``: theirs),
    hit ratio per policy against the bounds, load over time."""
    plt = _plt()
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        ttft = np.sort([r.first_token_s - r.arrival_s for r in res.measured])
        ax.plot(ttft, np.linspace(0, 1, len(ttft)), label=res.policy)
    ax.plot(np.sort(floor), np.linspace(0, 1, len(floor)), "k--", linewidth=1,
            label="floor (own prefill, nothing queued)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r.policy for r in rows]
    ax.bar(names, [r.hit_ratio for r in rows], color="tab:blue")
    for (label, v), style in zip(bounds.items(), ("--", ":"), strict=False):
        ax.axhline(v, linestyle=style, color="k", label=f"{label} {v:.1%}")
    ax.set_ylabel("prefix-hit ratio (tokens)")
    ax.set_title("Hit ratio per policy against the bounds")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "hit_ratio.png"))

    fig, axes = plt.subplots(len(results), 1, figsize=(7, 1.6 * len(results) + 1),
                             sharex=True, squeeze=False)
    for ax, res in zip(axes[:, 0], results, strict=True):
        if res.load_samples:
            t = np.array([s[0] for s in res.load_samples])
            loads = np.array([s[1] for s in res.load_samples])
            ax.plot(t - t[0], loads, linewidth=0.6)
        ax.set_ylabel(res.policy, fontsize=8)
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle("Outstanding requests per worker over time")
    paths.append(_save(fig, out / "load_over_time.png"))
    return paths


def sent_loads(rows: Sequence[PolicyMetrics], capacity_rps: float) -> str:
    """The load each policy's clients offered in a closed-loop replay (they send a turn when
    its reply has ended, so a slower policy is measured at a lighter load than it was given):
    ``closed loop: requests were sent at 73% of capacity (kvroute), ...``."""
    return "closed loop: requests were sent at " + ", ".join(
        f"{r.offered_load(capacity_rps):.0%} of capacity ({r.policy})" for r in rows)


def sweep_loads(sweep: dict[float, list[PolicyMetrics]],
                capacity_rps: float | None = None) -> dict[str, list[float]]:
    """Per policy, the load of each point of a sweep, in its order: the nominal loads, or
    with ``capacity_rps`` (a closed-loop replay, whose clients set the pace) the load each
    policy's clients offered (``PolicyMetrics.offered_load``)."""
    loads = sorted(sweep)
    if capacity_rps is None:
        return {r.policy: loads for r in sweep[loads[0]]}
    out: dict[str, list[float]] = {}
    for ld in loads:
        for r in sweep[ld]:
            out.setdefault(r.policy, []).append(r.offered_load(capacity_rps))
    return out


def plot_sweep(out: Path, sweep: dict[float, list[PolicyMetrics]],
               runs: dict[float, list[Jittered]] | None = None,
               floor: np.ndarray | None = None, capacity_rps: float | None = None) -> Path:
    """Mean and p99 TTFT against load per policy, and the floor's (the same at every load);
    with jittered ``runs``, bars span the jitters' range (where the lines cross inside the
    bars, the ranking is noise). With ``capacity_rps`` (closed loop) each point sits at the
    load its policy's clients offered (:func:`sweep_loads`)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    loads = sorted(sweep)
    rows = {ld: {r.policy: r for r in sweep[ld]} for ld in loads}
    xs = sweep_loads(sweep, capacity_rps)
    jittered = {ld: {j.policy: j.runs for j in runs[ld]} for ld in loads} \
        if runs and all(runs.get(ld) for ld in loads) else None
    for name in rows[loads[0]]:
        for ax, field in ((a1, "ttft_mean_s"), (a2, "ttft_p99_s")):
            vals = [getattr(rows[ld][name], field) for ld in loads]
            spans = None if jittered is None else \
                [[getattr(m, field) for m in jittered[ld][name]] for ld in loads]
            ax.errorbar(xs[name], vals, yerr=_bars(vals, spans), marker="o", capsize=3,
                        label=name)
    if floor is not None:
        summary = floor_summary(floor)
        for ax, key in ((a1, "mean_s"), (a2, "p99_s")):
            ax.axhline(summary[key], linestyle="--", color="k", linewidth=1, label="floor")
    for ax, title in ((a1, "mean TTFT"), (a2, "p99 TTFT")):
        ax.set_yscale("log")
        ax.set_xlabel("offered load (fraction of cluster capacity)" if capacity_rps is None
                      else "load the clients offered (fraction of capacity; closed loop)")
        ax.set_ylabel("seconds")
        ax.set_title(title + (" (bars: range over rate jitters)" if jittered else ""))
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    return _save(fig, out / "sweep_ttft.png")


def _bars(vals: list[float], spans: list[list[float]] | None) -> list[list[float]] | None:
    """Error bars from each value down to its span's least and up to its greatest."""
    if spans is None:
        return None
    return [[v - min(sp) for v, sp in zip(vals, spans, strict=True)],
            [max(sp) - v for v, sp in zip(vals, spans, strict=True)]]


def _save(fig, path: Path) -> Path:  # fig: a matplotlib Figure
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
