"""``kvroute replay``, run: the trace loaded and described, every policy replayed at one rate
or at each load of a sweep (with ``--jitter``, at small factors of it, and with
``--match-load``, the lighter leaders again at the focus's load), the comparison printed, and
with ``--out`` the results, the requests and the plots written. The arguments are
:mod:`kvroute.simulations.cli`'s."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.core.policies import Policy
from kvroute.core.policies.cost_model import CostModel
from kvroute.simulations.cli import make_policies, progress_bar
from kvroute.simulations.compare import (
    Jittered,
    Matched,
    at_rate,
    match_loads,
    matched_lines,
    parse_jitters,
    replay_jittered,
    verdicts,
)
from kvroute.simulations.metrics import (
    PolicyMetrics,
    capacity_rps,
    floor_summary,
    global_lru_hits,
    hit_ratio,
    infinite_cache_hits,
    measure,
    ttft_floor,
)
from kvroute.simulations.replay import ClusterSpec, Replayer, ReplayResult
from kvroute.simulations.trace import Trace, TraceError, load

Compared = tuple[list[ReplayResult], list[PolicyMetrics], list[Jittered], list[Matched]]
"""One rate's comparison: the replays kept for the plots, each policy's metrics (averaged
over the jitters), the jittered runs, the load-matched ones."""


def replay_all(trace: Trace, factories: Sequence[Callable[[], Policy]], spec: ClusterSpec,
               progress: bool) -> tuple[list[ReplayResult], list[PolicyMetrics]]:
    results, rows = [], []
    for make in factories:
        policy = make()
        update, close = progress_bar(policy.name, len(trace.requests), progress)
        t0 = time.perf_counter()
        res = Replayer(trace, policy, spec, progress=update).run()
        res.wall_s = time.perf_counter() - t0
        close()
        results.append(res)
        rows.append(measure(res))
    return results, rows


@dataclass(frozen=True)
class Setup:
    """A loaded trace and the cluster it replays on."""

    trace: Trace
    spec: ClusterSpec
    base_rps: float  # the trace's own request rate
    capacity_rps: float  # the cluster's estimated capacity for this trace's requests
    replies: int = 0  # requests whose reply a later prompt continues (cached where generated)
    reply_tokens: int = 0  # ... the tokens of those replies' full blocks

    def meta(self) -> dict[str, object]:
        """What a results.json must say to be compared with another: the trace, the cluster
        and the router's settings."""
        sp = self.spec
        return {"trace": self.trace.source, "requests": len(self.trace.requests),
                "warmup": self.trace.warmup,
                "workers": sp.workers, "capacity_blocks": sp.capacity_blocks,
                "host_blocks": sp.host_blocks, "lower_tier": sp.lower_tier,
                "max_batch": sp.max_batch, "prefill_budget": sp.prefill_budget,
                "chunked_prefill": sp.chunked_prefill,
                "long_prefill_threshold": sp.long_prefill_threshold, "programs": sp.programs,
                "closed_loop": sp.closed_loop,
                "copies": sp.copies, "overflow": sp.overflow,
                "propagation_ms": sp.propagation_s * 1000,
                "predict_ttl_ms": sp.predict_ttl_s * 1000, "coalesce_share": sp.coalesce_share,
                "replies": self.replies, "reply_tokens": self.reply_tokens}

    def scale_for(self, load: float) -> float:
        """The rate factor that offers ``load`` x the cluster's capacity."""
        return load * self.capacity_rps / self.base_rps


def prepare(args: argparse.Namespace) -> Setup | None:
    """Load the trace (its bad lines reported) and describe it with the cluster the arguments
    give (checked by their argparse types); None after printing why the trace cannot be read.
    Exits when a request cannot fit a worker."""
    try:
        trace = load(args.trace, strict=args.strict, token_block_size=args.token_block_size)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    for line in trace.skipped[:10]:
        print(f"warning: skipped {line}", file=sys.stderr)
    if len(trace.skipped) > 10:
        print(f"warning: ... and {len(trace.skipped) - 10} more malformed lines",
              file=sys.stderr)
    if args.tile > 1:
        trace = trace.tiled(args.tile)
    try:
        trace = args.warmup.apply(trace)
    except ValueError as exc:
        raise SystemExit(f"error: --warmup: {exc}") from None
    cost = CostModel()
    cap = args.capacity_blocks or 480_000 // trace.block_size
    try:
        spec = ClusterSpec(workers=args.workers, capacity_blocks=cap,
                           host_blocks=args.host_blocks, lower_tier=args.lower_tier,
                           propagation_s=args.propagation_ms / 1000, cost=cost,
                           predict_ttl_s=args.predict_ttl_ms / 1000,
                           coalesce_share=args.coalesce_share, programs=args.programs,
                           copies=not args.no_copies, overflow=not args.no_overflow,
                           max_batch=args.max_batch,
                           prefill_budget=args.prefill_budget,
                           chunked_prefill=args.chunked_prefill,
                           long_prefill_threshold=args.long_prefill_threshold,
                           closed_loop=args.closed_loop, routers=args.routers,
                           heartbeat_s=args.heartbeat_ms / 1000,
                           share_inflight=args.share_inflight)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    too_big = [i for i, r in enumerate(trace.requests)
               if r.prompt_tokens + r.output_tokens > cap * trace.block_size]
    if too_big:
        raise SystemExit(f"{len(too_big)} requests exceed one worker's KV capacity of "
                         f"{cap * trace.block_size} tokens (first: #{too_big[0]}); raise "
                         "--capacity-blocks")
    base_rps = len(trace.requests) / max(trace.duration_s, 1e-9)
    capacity = capacity_rps(trace, args.workers, cap, cost)
    replies = trace.reply_keys()
    n_replies = sum(1 for r in replies if r)
    reply_tokens = sum(map(len, replies)) * trace.block_size
    _describe(trace, spec, args, base_rps, capacity, n_replies, reply_tokens)
    return Setup(trace, spec, base_rps, capacity, n_replies, reply_tokens)


def _describe(trace: Trace, spec: ClusterSpec, args: argparse.Namespace, base_rps: float,
              capacity: float, n_replies: int, reply_tokens: int) -> None:
    """What is replayed, on what cluster, behind what router."""
    print(f"trace {trace.source}: {len(trace.requests)} requests over {trace.duration_s:.0f} s "
          f"({base_rps:.2f} req/s), block {trace.block_size} tokens; cluster: {args.workers} "
          f"workers x {spec.capacity_blocks} blocks"
          + (f" (+{spec.host_blocks} host-tier blocks, seen as {spec.lower_tier!r})"
             if spec.host_blocks else "") + f"; capacity ~{capacity:.2f} req/s",
          flush=True)
    if trace.warmup:
        print(f"warm-up: the first {trace.warmup} requests run but are not measured "
              f"({len(trace.measured)} are)", flush=True)
    n_next = sum(1 for j in trace.continuations() if j >= 0)
    print(f"replies: {n_replies} requests' replies are continued by a later prompt "
          f"({reply_tokens} tokens; cached where generated, as engines cache them)"
          if n_replies else "replies: no later prompt continues a reply", flush=True)
    if n_next:
        print(f"continuations: {n_next} requests carry an earlier reply; "
              + ("each is sent at its trace time or when that reply ends, whichever is later"
                 if spec.closed_loop else "each is sent at its trace time, even before that "
                 "reply has ended (--closed-loop: when it has)"),
              flush=True)
    print("router: " + (f"coalescing on (predictions until stored, at most "
                        f"{spec.predict_ttl_s:g} s; a request waits for a prefill it gets "
                        f">= {spec.coalesce_share:g} of)" if spec.predict_ttl_s > 0 else
                        "coalescing off (--predict-ttl-ms 0), as the peers' own routers")
          + f"; cache events reach it after {args.propagation_ms:g} ms", flush=True)
    if spec.routers > 1:
        print(f"routers: {spec.routers}, arrivals split in turn; each sees the others' "
              f"traffic in heartbeats every {spec.heartbeat_s * 1000:g} ms"
              + (f" and their decisions after {args.propagation_ms:g} ms (--share-inflight)"
                 if spec.share_inflight else " only (no --share-inflight)"), flush=True)


def run(args: argparse.Namespace) -> int:
    """``kvroute replay``: 0, or 2 when the trace cannot be read."""
    factories, jitters = _checked(args)  # before a large trace loads
    setup = prepare(args)
    if setup is None:
        return 2
    command = ReplayCommand(args, setup, factories, jitters)
    if args.sweep:
        command.sweep(args.sweep)
    else:
        command.one_rate(setup.scale_for(args.load) if args.load is not None
                         else args.rate_scale)
    return 0


def _checked(args: argparse.Namespace) -> tuple[list[Callable[[], Policy]], tuple[float, ...]]:
    """The policies and jitters the arguments name; exits on arguments that do not fit
    together."""
    factories = make_policies(args.policies, args.seed)
    try:
        jitters = parse_jitters(args.jitter) if args.jitter is not None else ()
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.focus is not None:
        named = [f().name for f in factories]
        if not jitters or args.focus not in named:
            raise SystemExit(f"error: --focus needs --jitter and one of --policies "
                             f"({', '.join(named)}); got {args.focus!r}")
    if args.match_load and not (args.closed_loop and args.focus):
        raise SystemExit("error: --match-load compares closed-loop replays at --focus's load: "
                         "it needs --closed-loop, --jitter and --focus")
    return factories, jitters


class ReplayCommand:
    """The comparisons of one ``kvroute replay`` on a loaded trace: the cache bounds and the
    TTFT floor (the same at every rate), then each rate's replays, report and files."""

    def __init__(self, args: argparse.Namespace, setup: Setup,
                 factories: Sequence[Callable[[], Policy]], jitters: tuple[float, ...]) -> None:
        self.args, self.setup = args, setup
        self.factories, self.jitters = list(factories), jitters
        trace, spec = setup.trace, setup.spec
        infinite = infinite_cache_hits(trace)
        self.bounds = {
            "global LRU": hit_ratio(trace, global_lru_hits(trace,
                                                           spec.capacity_blocks * args.workers)),
            "infinite cache": hit_ratio(trace, infinite),
        }
        self.floor = ttft_floor(trace, spec.cost, infinite)  # no queueing: rate-independent
        self.measured_floor = self.floor[trace.warmup:]
        self.progress = not args.no_progress and sys.stderr.isatty()

    def one_rate(self, scale: float) -> None:
        """Every policy at rate ``scale``: reported, and written with ``--out``."""
        args, setup = self.args, self.setup
        load_frac = setup.base_rps * scale / setup.capacity_rps
        print(f"replaying at rate x{scale:.2f} = {load_frac:.0%} of capacity", flush=True)
        results, rows, runs, matched = self.compare(scale)
        self.report(rows, runs, matched)
        print("wall time per policy: " + ", ".join(f"{r.policy} {r.wall_s:.1f}s" for r in rows))
        if not args.out:
            return
        self._write(args.out, results, rows, runs, matched,
                    {"rate_scale": scale, "load": load_frac})
        from kvroute.simulations.report import plot_replay, plots_skipped
        if skipped := plots_skipped():
            print(skipped)
        else:
            for path in plot_replay(args.out, results, rows, self.bounds, self.measured_floor):
                print(f"wrote {path}")
        print(f"wrote {args.out / 'results.json'}, {args.out / 'results.csv'}, "
              f"{args.out / 'requests.csv'} (a row per request and policy)")

    def sweep(self, loads: Sequence[float]) -> None:
        """Every policy at each load (a fraction of capacity): each reported and written as
        it ends (the replays' requests are not kept), then the sweep's plot."""
        sweep: dict[float, list[PolicyMetrics]] = {}
        sweep_runs: dict[float, list[Jittered]] = {}
        out = self.args.out
        for ld in loads:
            scale = self.setup.scale_for(ld)
            print(f"\n== load {ld:.0%} of capacity (rate x{scale:.2f})", flush=True)
            results, rows, runs, matched = self.compare(scale)
            self.report(rows, runs, matched)
            sweep[ld], sweep_runs[ld] = rows, runs
            if out:
                self._write(out / f"load_{int(ld * 100)}", results, rows, runs, matched,
                            {"load": ld, "rate_scale": scale})
        if not out:
            return
        from kvroute.simulations.report import plot_sweep, plots_skipped
        if skipped := plots_skipped():
            print(skipped)
        else:
            spec = self.setup.spec
            plot = plot_sweep(out, sweep, sweep_runs, self.measured_floor,
                              self.setup.capacity_rps if spec.closed_loop else None)
            print(f"wrote {plot}")

    def compare(self, scale: float) -> Compared:
        """Every policy at ``scale``; with --jitter, at each factor of it (the results kept
        for the plots are those nearest the nominal rate); with --match-load, the lighter
        leaders replayed at --focus's load too."""
        if not self.jitters:
            results, rows = self._replay(scale, self.factories)
            return results, rows, [], []
        kept: dict[float, list[ReplayResult]] = {}

        def one(factor: float) -> list[PolicyMetrics]:
            print(f"  jitter x{factor:g}", flush=True)
            kept[factor], rows = self._replay(scale * factor, self.factories)
            return rows

        def faster(name: str, by: float) -> Jittered:
            print(f"  {name} at x{by:.3g} the rate, for {self.args.focus}'s load", flush=True)
            only = [f for f in self.factories if f().name == name]
            return replay_jittered(self.jitters, lambda f: self._replay(
                scale * by * f, only)[1])[0]

        runs = replay_jittered(self.jitters, one)
        nominal = min(kept, key=lambda f: abs(f - 1.0))
        capacity = self.setup.capacity_rps
        matched = match_loads(runs, self.args.focus,
                              lambda j: j.mean().offered_load(capacity),
                              faster) if self.args.match_load else []
        return kept[nominal], [j.mean() for j in runs], runs, matched

    def report(self, rows: list[PolicyMetrics], runs: list[Jittered],
               matched: list[Matched]) -> None:
        from kvroute.simulations.report import sent_loads, table
        args = self.args
        print(table(rows, self.bounds, floor_summary(self.measured_floor)), flush=True)
        if self.setup.spec.closed_loop:
            # The sessions set the pace: a rate scale compresses only their think times.
            print(sent_loads(rows, self.setup.capacity_rps), flush=True)
        if runs:
            nudged = f", arrivals nudged by up to {args.nudge:g} x half their gaps" \
                if args.nudge else ""
            print(f"averaged over rate jitters {', '.join(f'x{j:g}' for j in self.jitters)}"
                  f"{nudged}")
            for v in verdicts(runs, focus=args.focus):
                print(f"  {v}")
        for line in matched_lines(runs, matched, args.focus):
            print(line)

    def _replay(self, scale: float, factories: Sequence[Callable[[], Policy]]
                ) -> tuple[list[ReplayResult], list[PolicyMetrics]]:
        args = self.args
        return replay_all(at_rate(self.setup.trace, scale, args.nudge, args.seed), factories,
                          self.setup.spec, self.progress)

    def _write(self, out: Path, results: list[ReplayResult], rows: list[PolicyMetrics],
               runs: list[Jittered], matched: list[Matched], at: dict[str, float]) -> None:
        """results.json/csv and requests.csv of one rate under ``out``."""
        from kvroute.simulations.report import write_requests, write_results
        args = self.args
        write_results(out, rows, self.bounds, self.measured_floor,
                      {**self.setup.meta(), **at, "seed": args.seed,
                       "jitters": list(self.jitters), "nudge": args.nudge, "focus": args.focus},
                      runs, args.focus, matched)
        write_requests(out, results, self.floor)
