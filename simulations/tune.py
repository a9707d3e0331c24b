"""kvroute tune: search a policy's parameters on a trace for the variant that beats the
peers, and print the spec to deploy.

A user's traffic is not the generators': the parameters that win on one workload are not
those that win on another. This replays the peers once, then the policy's start (its
defaults, or --policy's overrides) and variants of it, each at every load and rate jitter
(averaged, so a lead is not a coin toss: simulations/compare.py), and keeps the variant that
beats the best peer at the most loads. Tuning on several traces at once (--also) finds a
variant for all of them rather than one that fits a single trace's accidents. kvroute's
policy is tuned by default; the peers that declare a grid (--policy llmd, sglang, dynamo,
chwbl) can be tuned too, against kvroute's default and the other peers: does a tuned peer
beat kvroute on this traffic?

Scoring, at each load L of each trace tuned on (a cell), against the best peer there on
each metric separately:

    mean_L = 1 - ttft_mean / min_peers(ttft_mean)          # > 0: lower mean TTFT
    p99_L  = 1 - ttft_p99 / min_peers(ttft_p99)
    hit_L  = 100 * (hit_ratio - max_peers(hit_ratio))       # points; > 0: more hits
    won_L  = mean_L >= 0 and p99_L >= 0 and hit_L >= 0     # the README policy table's test
    worst  = min over cells of min(mean_L, p99_L, hit_L * hit_weight / 100)

Variants are ranked by cells won, then by worst (hit_weight: how many percent of TTFT one
point of hit ratio is worth, default 10). The search: the start, then random draws from the
policy's TUNING grid (half the budget), then steps from the best so far to the neighbouring
grid values of one parameter at a time, while a step improves on it. Every replay is
deterministic, so the result depends only on --seed and the budget, not on --jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.queues
import os
import queue
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvroute.core.policies import REGISTRY, make_policy, parameters
from kvroute.core.policies.spec import SEPARATOR, parse_spec
from kvroute.simulations.cli import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    SWEEP_LOADS,
    Setup,
    add_cluster_arguments,
    make_policies,
    parse_loads,
    prepare,
    progress_bar,
)
from kvroute.simulations.compare import DEFAULT_JITTERS, Jittered, parse_jitters
from kvroute.simulations.metrics import PolicyMetrics, measure
from kvroute.simulations.replay import Replayer

DEFAULT_PEERS = "llmd,preble,chwbl,sglang,dynamo,mooncake_local"
NEVER = 1000.0  # a grid value this large means "never" (kvroute's hold): no edge beyond it


def default_peers(tuned: str) -> list[str]:
    """What ``tuned`` is scored against without --peers: the six peers, and kvroute's
    default in place of the tuned policy when that is a peer."""
    return [p for p in ("kvroute", *DEFAULT_PEERS.split(",")) if p != tuned]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p)
    p.add_argument("--policy", default="kvroute",
                   help="the policy to tune (one with a TUNING grid), optionally with "
                        "overrides to start from, e.g. kvroute:hold=5")
    p.add_argument("--peers", default=None,
                   help=f"comma-separated policies to beat (specs, as --policies of replay; "
                        f"default {DEFAULT_PEERS}, with kvroute instead of the tuned policy "
                        f"when that is one of them)")
    p.add_argument("--loads", type=parse_loads, default=",".join(map(str, SWEEP_LOADS)),
                   help="fractions of the cluster's capacity to replay at")
    p.add_argument("--jitter", default=",".join(map(str, DEFAULT_JITTERS)), metavar="F,F,...",
                   help="rate factors each load is replayed at; metrics are their averages")
    p.add_argument("--trials", type=AT_LEAST_ONE, default=32,
                   help="variants to replay, the default included")
    p.add_argument("--hit-weight", type=NON_NEGATIVE, default=10.0,
                   help="percent of TTFT one point of hit ratio is worth in the worst margin")
    p.add_argument("--jobs", type=AT_LEAST_ONE, default=os.cpu_count() or 1,
                   help="replays run at once (processes)")
    p.add_argument("--also", action="append", default=[], metavar="TRACE",
                   help="tune on this trace too: every variant is scored at each load of "
                        "each trace (repeatable)")
    p.add_argument("--check", action="append", default=[], metavar="TRACE",
                   help="after the search, replay the start and the best variant (and the "
                        "peers) on this other trace too, and recommend the best only if it "
                        "holds up there (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="write tune.json here")


Cell = tuple[str, float]  # (trace label, load): where a variant is scored


@dataclass(frozen=True)
class Margins:
    """One variant against the best peer on each metric in one cell."""

    trace: str
    load: float
    mean: float  # 1 - mean TTFT / best peer's: > 0 is faster
    p99: float  # 1 - p99 TTFT / best peer's
    hit: float  # hit ratio minus the best peer's, in points

    @property
    def won(self) -> bool:
        return self.mean >= 0 and self.p99 >= 0 and self.hit >= 0

    def worst(self, hit_weight: float) -> float:
        return min(self.mean, self.p99, self.hit * hit_weight / 100)


def margins(mine: PolicyMetrics, peers: Sequence[PolicyMetrics], cell: Cell) -> Margins:
    """``mine`` against the best of ``peers`` on each metric (see the module docstring)."""
    if not peers:
        raise ValueError("no peers to compare with")
    best_mean = min(p.ttft_mean_s for p in peers)
    best_p99 = min(p.ttft_p99_s for p in peers)
    best_hit = max(p.hit_ratio for p in peers)
    return Margins(*cell, 1 - mine.ttft_mean_s / best_mean if best_mean else 0.0,
                   1 - mine.ttft_p99_s / best_p99 if best_p99 else 0.0,
                   100 * (mine.hit_ratio - best_hit))


@dataclass(frozen=True)
class Trial:
    spec: str
    params: Mapping[str, float]  # every tuned parameter's value
    metrics: Mapping[Cell, PolicyMetrics]  # jitter-averaged
    margins: tuple[Margins, ...]

    @property
    def wins(self) -> int:
        return sum(m.won for m in self.margins)

    def worst(self, hit_weight: float) -> float:
        return min(m.worst(hit_weight) for m in self.margins)

    def score(self, hit_weight: float) -> tuple[int, float]:
        return self.wins, self.worst(hit_weight)

    def to_json(self, hit_weight: float) -> dict[str, object]:
        return {"spec": self.spec, "params": self.params, "wins": self.wins,
                "worst": self.worst(hit_weight), "margins": [asdict(m) for m in self.margins],
                "metrics": [{"trace": c[0], "load": c[1], **m.row()}
                            for c, m in self.metrics.items()]}


def best_of(trials: Iterable[Trial], hit_weight: float) -> Trial:
    """The variant with the most cells won, then the best worst margin (the first drawn
    among equals)."""
    return max(trials, key=lambda t: t.score(hit_weight))


@dataclass(frozen=True)
class Grid:
    """What is searched: a registry policy's ``TUNING`` values per parameter, its defaults,
    the values the search starts from, and overrides of parameters it does not tune (kept in
    every variant)."""

    name: str
    values: Mapping[str, tuple[float, ...]]
    defaults: Mapping[str, object]
    start: Mapping[str, float]
    fixed: Mapping[str, str]

    def spec(self, params: Mapping[str, float]) -> str:
        """The spec of the variant with ``params``: the fixed overrides, then the tuned
        values that differ from the policy's defaults, in the grid's order."""
        changed = [f"{k}={v:g}" for k, v in params.items() if v != self.defaults[k]]
        return SEPARATOR.join([self.name, *(f"{k}={v}" for k, v in self.fixed.items()),
                               *changed])

    def edges(self, params: Mapping[str, float]) -> list[str]:
        """The parameters of ``params`` at the end of their grid that the search could not
        pass: the largest value tried (unless it stands for "never", as ``hold`` 1000 does),
        or the smallest when above 0 (no parameter goes below 0), each as
        ``"name=value (largest|smallest tried)"``. The best may lie beyond."""
        out = []
        for k, values in self.values.items():
            v = params[k]
            if len(values) > 1 and v == values[-1] and v < NEVER:
                out.append(f"{k}={v:g} (largest tried)")
            elif len(values) > 1 and v == values[0] and v > 0:
                out.append(f"{k}={v:g} (smallest tried)")
        return out


def tuning_grid(policy_spec: str) -> Grid:
    """The grid for ``policy_spec`` (a registry name, with overrides to start from); a start
    value off the grid joins it. ValueError when the policy has no ``TUNING`` grid."""
    name, overrides = parse_spec(policy_spec)
    start_policy = make_policy(policy_spec)
    values = dict(getattr(type(start_policy), "TUNING", {}))
    if not values:
        tunable = sorted(n for n, f in REGISTRY.items() if getattr(type(f()), "TUNING", None))
        raise ValueError(f"policy {name!r} declares no TUNING grid; tunable: "
                         f"{', '.join(tunable)}")
    start = {k: float(getattr(start_policy, k)) for k in values}
    for k in values:
        if start[k] not in values[k]:
            values[k] = tuple(sorted({*values[k], start[k]}))
    return Grid(name, values, parameters(make_policy(name)), start,
                {k: v for k, v in overrides.items() if k not in values})


def random_params(grid: Mapping[str, Sequence[float]], rng: random.Random) -> dict[str, float]:
    return {k: float(rng.choice(values)) for k, values in grid.items()}


def neighbours(grid: Mapping[str, Sequence[float]],
               params: Mapping[str, float]) -> list[dict[str, float]]:
    """Every variant of ``params`` with one parameter moved to an adjacent grid value."""
    out = []
    for k, values in grid.items():
        i = values.index(params[k])
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                out.append({**params, k: float(values[j])})
    return out


@dataclass
class Evaluator:
    """Replays policy specs on every trace at every (load, jitter), ``jobs`` at a time, in
    forked worker processes that inherit the loaded traces (only specs and metrics cross the
    pipes)."""

    setups: Mapping[str, Setup]  # trace label -> its trace and cluster
    loads: Sequence[float]
    jitters: Sequence[float]
    jobs: int
    seed: int
    on_replay: Callable[[], None] = lambda: None
    _procs: list[multiprocessing.process.BaseProcess] = field(default_factory=list,
                                                              init=False)
    _tasks: multiprocessing.queues.Queue | None = field(default=None, init=False)
    _results: multiprocessing.queues.Queue | None = field(default=None, init=False)

    @property
    def cells(self) -> list[Cell]:
        return [(label, ld) for label in self.setups for ld in self.loads]

    def replay(self, spec: str, label: str, scale: float) -> PolicyMetrics:
        setup = self.setups[label]
        return measure(Replayer(setup.trace.scaled(scale), make_policy(spec, self.seed),
                                setup.spec).run())

    def _serve(self, tasks: multiprocessing.queues.Queue,
               results: multiprocessing.queues.Queue) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        for key, spec, label, scale in iter(tasks.get, None):
            try:
                results.put((key, self.replay(spec, label, scale)))
            except Exception as exc:  # reported by the parent, which stops the search
                results.put((key, f"{type(exc).__name__}: {exc}"))

    def __enter__(self) -> Evaluator:
        if self.jobs > 1:
            ctx = multiprocessing.get_context("fork")
            self._tasks, self._results = ctx.Queue(), ctx.Queue()
            self._procs = [ctx.Process(target=self._serve, args=(self._tasks, self._results),
                                       daemon=True) for _ in range(self.jobs)]
            for proc in self._procs:
                proc.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:  # interrupted or failed: replays in progress are not wanted
            for proc in self._procs:
                proc.terminate()
            if self._tasks is not None:
                # Tasks no worker will read: exiting must not wait to flush them to the pipe.
                self._tasks.cancel_join_thread()
        elif self._tasks is not None:
            for _ in self._procs:
                self._tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()

    def _next_result(self, results: multiprocessing.queues.Queue
                     ) -> tuple[tuple[str, str, float, float], PolicyMetrics | str]:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                # A worker killed from outside (OOM) would leave its replay unanswered.
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"a replay worker died (exit code {dead[0].exitcode})"
                                       ) from None

    def run(self, specs: Sequence[str],
            finished: Callable[[str, dict[Cell, PolicyMetrics]], None] | None = None,
            ) -> dict[str, dict[Cell, PolicyMetrics]]:
        """spec -> cell -> metrics averaged over the jitters. ``finished(spec, those)`` is
        called for each spec as soon as its last replay is in (so in completion order)."""
        if len(set(specs)) != len(specs):
            raise ValueError(f"a spec listed twice: {', '.join(specs)}")
        work = [(s, label, ld, j) for s in specs for label, ld in self.cells
                for j in self.jitters]
        left = Counter(key[0] for key in work)
        done: dict[tuple[str, str, float, float], PolicyMetrics] = {}
        out: dict[str, dict[Cell, PolicyMetrics]] = {}

        def got(key: tuple[str, str, float, float], m: PolicyMetrics) -> None:
            done[key] = m
            self.on_replay()
            spec = key[0]
            left[spec] -= 1
            if not left[spec]:
                out[spec] = {(label, ld): Jittered(spec, tuple(
                    done[(spec, label, ld, j)] for j in self.jitters)).mean()
                    for label, ld in self.cells}
                if finished is not None:
                    finished(spec, out[spec])

        def scale(key: tuple[str, str, float, float]) -> float:
            return self.setups[key[1]].scale_for(key[2]) * key[3]

        if self._tasks is None or self._results is None:
            for key in work:
                got(key, self.replay(key[0], key[1], scale(key)))
        else:
            for key in work:
                self._tasks.put((key, key[0], key[1], scale(key)))
            for _ in work:
                key, result = self._next_result(self._results)
                if isinstance(result, str):
                    raise RuntimeError(f"replay of {key[0]} on {key[1]} at load {key[2]:g} "
                                       f"x{key[3]:g} failed: {result}")
                got(key, result)
        return {spec: out[spec] for spec in specs}


@dataclass
class Search:
    """The variants tried so far; the best by :meth:`Trial.score`."""

    grid: Grid
    peers: Mapping[Cell, Sequence[PolicyMetrics]]  # each peer's metrics per cell
    hit_weight: float
    trials: list[Trial] = field(default_factory=list)

    def spec(self, params: Mapping[str, float]) -> str:
        return self.grid.spec(params)

    def untried(self, candidates: Iterable[Mapping[str, float]],
                limit: int) -> list[dict[str, float]]:
        """Up to ``limit`` of ``candidates`` not tried yet, without repeats, in order."""
        seen = {t.spec for t in self.trials}
        out: list[dict[str, float]] = []
        for c in candidates:
            if len(out) >= limit:
                break
            s = self.spec(c)
            if s not in seen:
                seen.add(s)
                out.append(dict(c))
        return out

    def trial(self, params: Mapping[str, float],
              metrics: Mapping[Cell, PolicyMetrics]) -> Trial:
        return Trial(self.spec(params), dict(params), dict(metrics),
                     tuple(margins(metrics[c], self.peers[c], c) for c in self.peers))

    def best(self) -> Trial:
        return best_of(self.trials, self.hit_weight)

    @classmethod
    def against(cls, grid: Grid, runs: Mapping[str, Mapping[Cell, PolicyMetrics]],
                peer_specs: Sequence[str], hit_weight: float) -> Search:
        """A search scored against the peers' figures in ``runs`` (an evaluator's)."""
        cells = next(iter(runs.values())).keys()
        return cls(grid, {c: [runs[s][c] for s in peer_specs] for c in cells}, hit_weight)


def tune(evaluator: Evaluator, search: Search, trials: int, rng: random.Random,
         report: Callable[[Trial], None]) -> Trial:
    """Run the search (see the module docstring) within ``trials`` variants; the best.
    ``report`` sees each variant as its replays complete; the search adds each batch in
    the order it drew them, so the outcome does not depend on which replay ends first."""

    def evaluate(batch: list[dict[str, float]]) -> None:
        by_spec = {search.spec(p): p for p in batch}
        results = evaluator.run(list(by_spec),
                                lambda spec, m: report(search.trial(by_spec[spec], m)))
        search.trials.extend(search.trial(p, results[s]) for s, p in by_spec.items())

    first = search.untried([search.grid.start], 1)
    evaluate(first + search.untried((random_params(search.grid.values, rng)
                                     for _ in range(20 * trials)), max(0, trials // 2 - 1)))
    while len(search.trials) < trials:
        best = search.best()
        steps = neighbours(search.grid.values, best.params)
        rng.shuffle(steps)  # a budget too small for every step samples them evenly
        batch = search.untried(steps, trials - len(search.trials))
        if not batch:
            break  # a local optimum: every one-step neighbour tried
        evaluate(batch)
        if search.best() is best:
            break  # no step improved on it
    return search.best()


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _row(m: PolicyMetrics) -> str:
    return f"{m.ttft_mean_s:.4g} / {m.ttft_p99_s:.4g} / {m.hit_ratio:.2%}"


def run(args: argparse.Namespace) -> int:
    # Arguments first: a bad one should not wait for a large trace to load.
    try:
        grid = tuning_grid(args.policy)
        jitters = parse_jitters(args.jitter)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    loads = list(args.loads)
    peer_specs = default_peers(grid.name) if args.peers is None else [
        p.strip() for p in args.peers.split(",") if p.strip()]
    if not peer_specs or grid.name in [parse_spec(p)[0] for p in peer_specs]:
        raise SystemExit(f"error: --peers must name at least one policy other than {grid.name}")
    peer_names = [f().name for f in make_policies(",".join(peer_specs), args.seed)]
    for option, paths in (("--also", args.also), ("--check", args.check)):
        missing = [c for c in paths if not Path(c).is_file()]
        if missing:
            raise SystemExit(f"error: {option}: no such file: {', '.join(missing)}")
    setups = _prepare_all(args, [args.trace, *args.also])
    if setups is None:
        return 2
    cells = len(setups) * len(loads)
    print(f"tuning {args.policy} against {', '.join(peer_names)}: "
          f"{len(setups)} trace{'s' if len(setups) > 1 else ''} x loads "
          f"{', '.join(f'{ld:.0%}' for ld in loads)} x rate jitters "
          f"{', '.join(f'x{j:g}' for j in jitters)} ({cells * len(jitters)} replays a variant), "
          f"up to {args.trials} variants, {args.jobs} at once", flush=True)
    t0 = time.perf_counter()
    search, trials, interrupted = _search(args, setups, grid, peer_specs, loads, jitters)
    if search is None or not trials:
        print("interrupted before any variant was replayed", file=sys.stderr)
        return 130
    best = best_of(trials, args.hit_weight)
    first_spec = grid.spec(grid.start)
    first = next((t for t in trials if t.spec == first_spec), None)
    print(f"\n{'interrupted: ' if interrupted else ''}{len(trials)} "
          f"variant{'s' if len(trials) > 1 else ''} and "
          f"{len(peer_specs)} peer{'s' if len(peer_specs) > 1 else ''} in "
          f"{time.perf_counter() - t0:.0f} s")
    summarize(search, first, best, args.hit_weight)
    checks: list[dict[str, object]] = []
    pick = best
    for path in [] if interrupted else args.check:
        try:
            held = _check(args, path, grid, list({t.spec: t for t in (first, best)
                                                  if t is not None}.values()),
                          peer_specs, loads, jitters)
        except KeyboardInterrupt:
            interrupted = True
            break
        if held is None:
            return 2
        checks.append({"trace": path, **{t.spec: t.to_json(args.hit_weight) for t in held}})
        if first is not None and held[-1].score(args.hit_weight) < \
                held[0].score(args.hit_weight):
            pick = first  # the search fit the tuning traces' accidents
    if pick is not best:
        print(f"\nthe best variant did not hold up on every --check trace: keep {pick.spec}")
    print(f"deploy: kvroute router --policy '{pick.spec}'   or, with Helm: "
          f"--set router.policy='{pick.spec}'")
    if not args.check:
        print("tuned on this traffic: confirm on other traffic (kvroute tune TRACE --check "
              f"TRACE2, or kvroute replay TRACE2 --jitter {','.join(f'{j:g}' for j in jitters)}"
              f" --policies '{','.join(dict.fromkeys([first_spec, best.spec, *peer_specs]))}')")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "tune.json"
        path.write_text(json.dumps({
            "traces": {label: s.trace.source for label, s in setups.items()},
            "policy": args.policy, "peers": peer_specs, "loads": loads,
            "jitters": list(jitters), "hit_weight": args.hit_weight, "seed": args.seed,
            "interrupted": interrupted, "best": best.spec, "recommended": pick.spec,
            "best_at_grid_edge": search.grid.edges(best.params),
            "checks": checks,
            "peer_metrics": [{"trace": c[0], "load": c[1],
                              "metrics": [m.row() for m in search.peers[c]]}
                             for c in search.peers],
            "trials": [t.to_json(args.hit_weight) for t in trials],
        }, indent=2))
        print(f"wrote {path}")
    return 130 if interrupted else 0


def _prepare_all(args: argparse.Namespace, paths: Sequence[str]) -> dict[str, Setup] | None:
    """Each trace loaded on the cluster of ``args``, by label (its file name, or its path
    where two share a name); None if one cannot be read."""
    names = [Path(p).name for p in paths]
    out: dict[str, Setup] = {}
    for path, name in zip(paths, names, strict=True):
        label = name if names.count(name) == 1 else path
        if label in out:
            raise SystemExit(f"error: {path} given twice")
        setup = prepare(argparse.Namespace(**{**vars(args), "trace": path}))
        if setup is None:
            return None
        out[label] = setup
    return out


def _search(args: argparse.Namespace, setups: Mapping[str, Setup], grid: Grid,
            peer_specs: list[str], loads: list[float], jitters: Sequence[float]
            ) -> tuple[Search | None, list[Trial], bool]:
    """The peers' replays and the search: (the search, its trials, interrupted). On Ctrl-C,
    the trials are those completed, in the order they completed."""
    search: Search | None = None
    completed: list[Trial] = []
    t0 = time.perf_counter()
    try:
        with Evaluator(setups, loads, jitters, args.jobs, args.seed) as ev, \
                _progress(args, ev, len(ev.cells) * len(jitters)
                          * (len(peer_specs) + args.trials)):
            peer_runs = ev.run(peer_specs)
            print(f"peers replayed in {time.perf_counter() - t0:.0f} s; variants, as their "
                  "replays complete (worst: the lowest margin; see kvroute tune --help):",
                  flush=True)
            search = Search.against(grid, peer_runs, peer_specs, args.hit_weight)

            t1 = time.perf_counter()

            def report(t: Trial) -> None:
                completed.append(t)
                spent = time.perf_counter() - t1
                # Variants cost about the same; the search may stop early, so "up to".
                left = spent / len(completed) * (args.trials - len(completed))
                print(f"  {len(completed):3d}/{args.trials}  wins {t.wins}/{len(t.margins)}  "
                      f"worst {_pct(t.worst(args.hit_weight))}  {t.spec}  "
                      f"[{spent:.0f} s, up to ~{left:.0f} s left]", flush=True)

            tune(ev, search, args.trials, random.Random(args.seed), report)
    except KeyboardInterrupt:
        return search, completed, True
    assert search is not None
    return search, search.trials, False


def _check(args: argparse.Namespace, path: str, grid: Grid, trials: Sequence[Trial],
           peer_specs: list[str], loads: list[float], jitters: Sequence[float]
           ) -> list[Trial] | None:
    """``trials``' variants (the start, the best) replayed on the trace at ``path`` against
    the peers replayed there: their trials on it, in order; None if it cannot be read."""
    print(f"\ncheck on {path}:", flush=True)
    setups = _prepare_all(args, [path])
    if setups is None:
        return None
    specs = [t.spec for t in trials]
    with Evaluator(setups, loads, jitters, args.jobs, args.seed) as ev, \
            _progress(args, ev, len(ev.cells) * len(jitters) * (len(peer_specs) + len(specs))):
        runs = ev.run(peer_specs + specs)
    there = Search.against(grid, runs, peer_specs, args.hit_weight)
    out = [there.trial(t.params, runs[t.spec]) for t in trials]
    start = grid.spec(grid.start)
    for t in out:
        label = "best" if t.spec != start else "start" if len(out) > 1 else "start = best"
        print(f"  {label}: wins {t.wins}/{len(t.margins)}  worst "
              f"{_pct(t.worst(args.hit_weight))}  {t.spec}  | " + "; ".join(
                  f"{m.load:.0%} {_pct(m.mean)} / {_pct(m.p99)} / {m.hit:+.2f} pts"
                  for m in t.margins), flush=True)
    return out


@contextlib.contextmanager
def _progress(args: argparse.Namespace, ev: Evaluator, replays: int) -> Iterator[None]:
    """A progress bar over ``replays`` of ``ev``, closed on leaving (entered after the
    evaluator: its workers fork before the bar's thread exists)."""
    update, close = progress_bar("replays", replays,
                                 not args.no_progress and sys.stderr.isatty(), unit="replay")
    count = [0]

    def tick() -> None:
        count[0] += 1
        update(count[0])

    ev.on_replay = tick
    try:
        yield
    finally:
        close()


def summarize(search: Search, first: Trial | None, best: Trial, hit_weight: float) -> None:
    """The best peer on each metric in each cell, the start and the best variant there."""
    print("best peer at each load (mean TTFT s / p99 TTFT s / hit ratio), then the start and "
          "the best variant, with their margins:")
    shown = [("start", first), ("best", best)] if first is not None else [("best", best)]
    several = len({trace for trace, _ in search.peers}) > 1
    for i, cell in enumerate(search.peers):
        ps = search.peers[cell]
        bm = min(ps, key=lambda m: m.ttft_mean_s)
        bq = min(ps, key=lambda m: m.ttft_p99_s)
        bh = max(ps, key=lambda m: m.hit_ratio)
        where = f"{cell[0]} {cell[1]:.0%}" if several else f"{cell[1]:4.0%}"
        print(f"  {where}  peers {bm.ttft_mean_s:.4g} ({bm.policy}) / {bq.ttft_p99_s:.4g} "
              f"({bq.policy}) / {bh.hit_ratio:.2%} ({bh.policy})")
        for label, t in shown:
            m = t.margins[i]
            print(f"        {label:5s} {_row(t.metrics[cell])}   mean {_pct(m.mean)}, p99 "
                  f"{_pct(m.p99)}, hit {m.hit:+.2f} pts{'  WON' if m.won else ''}")
    n = len(search.peers)
    what = "cells (trace x load)" if several else "loads"
    line = (f"\nbest: {best.spec}  (wins {best.wins}/{n} {what}, worst margin "
            f"{_pct(best.worst(hit_weight))}")
    if first is not None:
        line += f"; start {first.spec}: {first.wins}/{n}, {_pct(first.worst(hit_weight))}"
    print(line + ")")
    edges = search.grid.edges(best.params)
    if edges:
        print(f"at the end of the grid: {', '.join(edges)}: the best may lie beyond; to search "
              f"there, start from it (--policy '{best.spec}' with those values moved on: a "
              f"start off the grid joins it)")
