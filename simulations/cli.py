"""``kvroute replay``: replay a trace through every policy and report which wins."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.core import config
from kvroute.core.config import COALESCE_SHARE, PREDICT_TTL_S
from kvroute.core.policies import Policy
from kvroute.core.policies.cost_model import CostModel
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
from kvroute.simulations.policies import REPLAY_REGISTRY, make_replay_policy
from kvroute.simulations.replay import ClusterSpec, Replayer, ReplayResult
from kvroute.simulations.trace import Trace, TraceError, load

# The loads a sweep replays at, light to saturated, as fractions of the cluster's capacity
# (``kvroute replay --sweep``, ``bench/policy_jitter.py``).
SWEEP_LOADS = (0.5, 0.65, 0.8, 0.95)


# argparse types for the numbers below (kvroute.core.config's ranges, read from text): a bad
# value is refused by name before a large trace loads (a rate of 0 or NaN was a traceback, a
# negative delay ran).
POSITIVE = config.POSITIVE.parser(float)
NON_NEGATIVE = config.NON_NEGATIVE.parser(float)
AT_LEAST_ONE = config.AT_LEAST_ONE.parser(int)
COUNT = config.NON_NEGATIVE.parser(int)
FRACTION = config.FRACTION.parser(float)


def parse_loads(text: str) -> tuple[float, ...]:
    """An argparse type: ``"0.5,0.8"`` -> the distinct loads in ascending order, each a
    fraction of the cluster's capacity in (0, 2]."""
    try:
        loads = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        loads = []
    if not loads or not all(0 < ld <= 2 for ld in loads):  # (NaN fails both comparisons)
        raise argparse.ArgumentTypeError(
            f"expected comma-separated fractions of capacity in (0, 2], got {text!r}")
    return tuple(loads)


@dataclass(frozen=True)
class Warmup:
    """What ``--warmup`` leaves out of the figures: a number of requests (``600``), or those
    of the trace's first seconds (``30s``)."""

    requests: int = 0
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Warmup:
        """An argparse type: ``"600"`` or ``"30s"``."""
        try:
            if text.strip().endswith("s"):
                w = cls(seconds=float(text.strip()[:-1]))
                ok = 0 <= w.seconds < float("inf")
            else:
                w = cls(requests=int(text))
                ok = w.requests >= 0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(
                f"expected a number of requests (600) or seconds of trace time (30s), "
                f"got {text!r}")
        return w

    def apply(self, trace: Trace) -> Trace:
        """``trace`` with this warm-up (ValueError if it would leave nothing to measure)."""
        if self.seconds:
            t0 = trace.requests[0].arrival_s if trace.requests else 0.0
            n = sum(1 for r in trace.requests if r.arrival_s < t0 + self.seconds)
            return trace.with_warmup(n)
        return trace.with_warmup(self.requests)


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The trace and the simulated cluster: ``kvroute replay``'s and the benches'."""
    p.add_argument("trace", help="trace file: Mooncake JSONL (hash_ids) or JSONL with token_ids")
    p.add_argument("--workers", type=AT_LEAST_ONE, default=16, help="simulated workers")
    p.add_argument("--capacity-blocks", type=COUNT, default=0,
                   help="KV blocks per worker (default: 480k tokens' worth, an A100-80GB "
                        "serving Llama-3.1-8B)")
    p.add_argument("--propagation-ms", type=NON_NEGATIVE, default=50.0,
                   help="delay before the router sees a cache event (agent -> Redis -> router)")
    p.add_argument("--routers", type=AT_LEAST_ONE, default=1,
                   help="router replicas the arrivals are split over (round robin), each with "
                        "its own index, predictions and in-flight counts, seeing the others' "
                        "traffic only in the workers' heartbeats (docs/scaling.md)")
    p.add_argument("--share-inflight", action="store_true",
                   help="with --routers > 1: each routing decision reaches the other routers "
                        "--propagation-ms later (their in-flight counts and predictions)")
    p.add_argument("--heartbeat-ms", type=NON_NEGATIVE, default=1000.0,
                   help="with --routers > 1: how often the workers' heartbeats (queue, "
                        "pending prefill: every router's traffic) refresh each router's view")
    p.add_argument("--predict-ttl-ms", type=NON_NEGATIVE, default=PREDICT_TTL_S * 1000,
                   help="router predicts a routed prompt's blocks on its worker until they "
                        "are stored, at most this long, and holds a request routed on a "
                        "prediction until that prefill is done, so requests sharing a new "
                        f"prefix prefill it once (0 = off; default: the router's, "
                        f"{PREDICT_TTL_S * 1000:g})")
    p.add_argument("--coalesce-share", type=FRACTION, default=COALESCE_SHARE,
                   help="a request waits for an in-flight prefill only if it would get at "
                        "least this fraction of it; else it is routed on what workers really "
                        f"hold (0: always wait; default: the router's, {COALESCE_SHARE:g})")
    p.add_argument("--no-copies", action="store_true",
                   help="no background copies of hot prefixes, as a router with --max-copies 0 "
                        "(kvroute's policy places them)")
    p.add_argument("--programs", action="store_true",
                   help="run requests sharing a `program` id as one controller program: placed "
                        "once, shared prefix prefilled once, branches beside it")
    p.add_argument("--max-batch", type=AT_LEAST_ONE, default=256,
                   help="most sequences a worker runs at once (vLLM's --max-num-seqs)")
    p.add_argument("--prefill-budget", type=AT_LEAST_ONE, default=16384,
                   help="prompt tokens a worker prefills per iteration (vLLM's "
                        "--max-num-batched-tokens)")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="split prefills longer than the budget across iterations, as vLLM V1 "
                        "does: the running batch decodes between chunks, each chunk stores "
                        "its blocks (default: a prefill runs whole in one iteration); the "
                        "workers report it to the policies as a vLLM V1 agent does")
    p.add_argument("--long-prefill-threshold", type=COUNT, default=0, metavar="N",
                   help="with --chunked-prefill: the most tokens of one prefill per iteration "
                        "(vLLM's --long-prefill-token-threshold), so requests queued behind "
                        "a long prompt join its iterations instead of waiting it out; the "
                        "workers report it to the policies (default: 0, the whole budget)")
    p.add_argument("--closed-loop", action="store_true",
                   help="send a chat turn or agent call that carries an earlier reply only "
                        "when that reply has ended, as its client would (default: every "
                        "request at its trace time; session traffic then reaches only the "
                        "load its sessions can offer)")
    p.add_argument("--no-overflow", action="store_true",
                   help="with --programs: keep every branch on its program's worker even when "
                        "it has no room (the router's --no-program-overflow)")
    p.add_argument("--token-block-size", type=AT_LEAST_ONE, default=16,
                   help="block size for traces given as token_ids")
    p.add_argument("--tile", type=AT_LEAST_ONE, default=1,
                   help="repeat the trace this many times back to back (speed tests)")
    p.add_argument("--warmup", type=Warmup.parse, default=Warmup(), metavar="N|Ss",
                   help="run the trace's first N requests (or those of its first S seconds: "
                        "30s) but leave them out of every figure (bounds and floor "
                        "included), to measure a cluster already serving this traffic rather "
                        "than one starting with empty caches (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed for randomised policies and --nudge")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p)
    p.add_argument("--policies", default="all",
                   help=f"comma-separated, or 'all': {', '.join(sorted(REPLAY_REGISTRY))}; each "
                        "may override parameters, e.g. kvroute:delay=2 (`kvroute "
                        "policies` lists them), to compare variants side by side")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate-scale", type=POSITIVE, default=1.0,
                      help="replay this many times faster than recorded")
    rate.add_argument("--load", type=POSITIVE, default=None,
                      help="replay at this fraction of the cluster's capacity (overrides "
                           "--rate-scale)")
    rate.add_argument("--sweep", nargs="?", type=parse_loads, const=SWEEP_LOADS, default=None,
                      metavar="LOADS",
                      help="replay at each of these fractions of capacity (default: "
                           f"{','.join(map(str, SWEEP_LOADS))}) and plot TTFT against load")
    p.add_argument("--out", type=Path, default=None,
                   help="write results.json, results.csv, requests.csv (a row per request "
                   "and policy) and PNG plots (with matplotlib: pip install 'kvroute[sim]') "
                   "here")
    p.add_argument("--jitter", default=None, metavar="F,F,...",
                   help="replay each policy at these factors of the rate (e.g. 0.98,1,1.02), "
                        "report the averages, and say whether each lead holds at every "
                        "factor or is within noise (single replays are chaotic)")
    add_nudge_argument(p)
    p.add_argument("--focus", default=None, metavar="POLICY",
                   help="with --jitter: compare this policy (as named in --policies) with the "
                        "best of the others, instead of the leader with the runner-up")
    p.add_argument("--match-load", action="store_true",
                   help="with --closed-loop, --jitter and --focus: replay each policy whose "
                        "clients sent less than --focus's and that leads it on anything at "
                        "higher rates until they send as much, and give the verdicts again at "
                        "that load (a slow policy's clients send slowly: its lead may be the "
                        "lighter load's)")


def add_nudge_argument(p: argparse.ArgumentParser) -> None:
    """``--nudge`` (:func:`~kvroute.simulations.compare.at_rate`), for replay and the bench."""
    p.add_argument("--nudge", type=FRACTION, default=0.0, metavar="F",
                   help="move each arrival by up to F x half the gap to its neighbour, with "
                        "a seed per rate: jitters of the rate alone leave a cold start's "
                        "first decisions the same at every jitter; nudged, they differ too "
                        "(default: 0, arrivals as recorded)")


def make_policies(specs: str, seed: int) -> list[Callable[[], Policy]]:
    """A factory per comma-separated policy spec (``all``: every registered policy); each
    spec is a name in :data:`~kvroute.simulations.policies.REPLAY_REGISTRY` with optional
    overrides, ``kvroute:delay=2`` (see :func:`kvroute.core.policies.make_policy`). Exits
    with the reason on a bad spec."""
    chosen = sorted(REPLAY_REGISTRY) if specs == "all" else [n.strip() for n in specs.split(",")
                                                      if n.strip()]
    if not chosen:
        raise SystemExit(f"--policies names no policy; choose from: "
                         f"{', '.join(sorted(REPLAY_REGISTRY))} or all")
    names = []
    for spec in chosen:
        try:
            names.append(make_replay_policy(spec, seed).name)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    if len(set(names)) != len(names):
        raise SystemExit(f"--policies lists a policy twice: {specs}")
    return [functools.partial(make_replay_policy, spec, seed) for spec in chosen]


def progress_bar(label: str, total: int, enabled: bool, unit: str = "req"
                 ) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(update(done so far), close) for a tqdm bar on stderr; no-ops when not ``enabled``."""
    if not enabled:
        return (lambda n: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:  # a plain line per policy is enough without tqdm
        print(f"  {label} ...", file=sys.stderr, flush=True)
        return (lambda n: None), (lambda: None)
    bar = tqdm(total=total, desc=f"{label:<13}", unit=unit, leave=False, file=sys.stderr)

    def update(n: int) -> None:
        bar.update(n - bar.n)

    return update, bar.close


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
    print(f"trace {trace.source}: {len(trace.requests)} requests over {trace.duration_s:.0f} s "
          f"({base_rps:.2f} req/s), block {trace.block_size} tokens; cluster: {args.workers} "
          f"workers x {cap} blocks; capacity ~{capacity:.2f} req/s", flush=True)
    if trace.warmup:
        print(f"warm-up: the first {trace.warmup} requests run but are not measured "
              f"({len(trace.measured)} are)", flush=True)
    replies = trace.reply_keys()
    n_replies = sum(1 for r in replies if r)
    reply_tokens = sum(map(len, replies)) * trace.block_size
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
    return Setup(trace, spec, base_rps, capacity, n_replies, reply_tokens)


def run(args: argparse.Namespace) -> int:
    from kvroute.simulations.report import (
        plot_replay,
        plot_sweep,
        plots_skipped,
        sent_loads,
        table,
        write_requests,
        write_results,
    )

    # Arguments first: a bad one should not wait for a large trace to load.
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
    setup = prepare(args)
    if setup is None:
        return 2
    trace, spec, cap = setup.trace, setup.spec, setup.spec.capacity_blocks
    base_rps, capacity = setup.base_rps, setup.capacity_rps
    infinite = infinite_cache_hits(trace)
    bounds = {
        "global LRU": hit_ratio(trace, global_lru_hits(trace, cap * args.workers)),
        "infinite cache": hit_ratio(trace, infinite),
    }
    floor = ttft_floor(trace, spec.cost, infinite)  # the same at every rate: no queueing
    measured_floor = floor[trace.warmup:]

    def at(scale: float) -> Trace:
        return at_rate(trace, scale, args.nudge, args.seed)

    progress = not args.no_progress and sys.stderr.isatty()

    def compare(scale: float) -> tuple[list[ReplayResult], list[PolicyMetrics],
                                       list[Jittered], list[Matched]]:
        """Every policy at ``scale``; with --jitter, at each factor of it (the results kept
        for the plots are those nearest the nominal rate); with --match-load, the lighter
        leaders replayed at --focus's load too."""
        if not jitters:
            results, rows = replay_all(at(scale), factories, spec, progress)
            return results, rows, [], []
        kept: dict[float, list[ReplayResult]] = {}

        def one(factor: float) -> list[PolicyMetrics]:
            print(f"  jitter x{factor:g}", flush=True)
            kept[factor], rows = replay_all(at(scale * factor), factories, spec, progress)
            return rows

        def faster(name: str, by: float) -> Jittered:
            print(f"  {name} at x{by:.3g} the rate, for {args.focus}'s load", flush=True)
            only = [f for f in factories if f().name == name]
            return replay_jittered(jitters, lambda f: replay_all(
                at(scale * by * f), only, spec, progress)[1])[0]

        runs = replay_jittered(jitters, one)
        nominal = min(kept, key=lambda f: abs(f - 1.0))
        matched = match_loads(runs, args.focus, lambda j: j.mean().offered_load(capacity),
                              faster) if args.match_load else []
        return kept[nominal], [j.mean() for j in runs], runs, matched

    def report(rows: list[PolicyMetrics], runs: list[Jittered],
               matched: list[Matched]) -> None:
        print(table(rows, bounds, floor_summary(measured_floor)), flush=True)
        if spec.closed_loop:
            # The sessions set the pace: a rate scale compresses only their think times.
            print(sent_loads(rows, capacity), flush=True)
        if runs:
            nudged = f", arrivals nudged by up to {args.nudge:g} x half their gaps" \
                if args.nudge else ""
            print(f"averaged over rate jitters {', '.join(f'x{j:g}' for j in jitters)}{nudged}")
            for v in verdicts(runs, focus=args.focus):
                print(f"  {v}")
        for line in matched_lines(runs, matched, args.focus):
            print(line)

    if args.sweep:
        sweep: dict[float, list[PolicyMetrics]] = {}
        sweep_runs: dict[float, list[Jittered]] = {}
        for ld in args.sweep:
            scale = setup.scale_for(ld)
            print(f"\n== load {ld:.0%} of capacity (rate x{scale:.2f})", flush=True)
            results, rows, runs, matched = compare(scale)
            report(rows, runs, matched)
            sweep[ld], sweep_runs[ld] = rows, runs
            if args.out:  # written as each load ends: the replays' requests are not kept
                at_load = args.out / f"load_{int(ld * 100)}"
                write_results(at_load, rows, bounds, measured_floor,
                              {**setup.meta(), "load": ld, "rate_scale": scale,
                               "seed": args.seed, "jitters": list(jitters),
                               "nudge": args.nudge, "focus": args.focus},
                              runs, args.focus, matched)
                write_requests(at_load, results, floor)
        if args.out:
            if skipped := plots_skipped():
                print(skipped)
            else:
                plot = plot_sweep(args.out, sweep, sweep_runs, measured_floor,
                                  capacity if spec.closed_loop else None)
                print(f"wrote {plot}")
        return 0
    scale = setup.scale_for(args.load) if args.load is not None else args.rate_scale
    load_frac = base_rps * scale / capacity
    print(f"replaying at rate x{scale:.2f} = {load_frac:.0%} of capacity", flush=True)
    results, rows, runs, matched = compare(scale)
    report(rows, runs, matched)
    print("wall time per policy: " + ", ".join(f"{r.policy} {r.wall_s:.1f}s" for r in rows))
    if args.out:
        write_results(args.out, rows, bounds, measured_floor, {
            **setup.meta(), "rate_scale": scale, "load": load_frac, "seed": args.seed,
            "jitters": list(jitters), "nudge": args.nudge, "focus": args.focus},
            runs, args.focus, matched)
        if skipped := plots_skipped():
            print(skipped)
        else:
            for path in plot_replay(args.out, results, rows, bounds, measured_floor):
                print(f"wrote {path}")
        requests = write_requests(args.out, results, floor)
        print(f"wrote {args.out / 'results.json'}, {args.out / 'results.csv'}, {requests} "
              "(a row per request and policy)")
    return 0
