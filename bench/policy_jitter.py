"""Policy comparison averaged over small rate jitters: single replays are chaotic (a 1%
change in rate can move one policy's TTFT by 5-20%), so each load is replayed at 0.98x,
1.00x and 1.02x of its rate and the means are compared.

    python bench/policy_jitter.py TRACE [--policies kvroute,llmd,preble,chwbl] [--loads ...]

Prints the trace's TTFT floor (``kvroute.simulations.metrics.ttft_floor``: no policy's TTFT is
lower), then, per load (fraction of the cluster's capacity, as `kvroute replay --load`), every
policy's mean TTFT / p99 TTFT (s) and hit ratio, best mean first, then who leads on each and
at how many jitters (a lead that does not hold at every jitter is within noise), and how
often a tie would split the jitters so (three jitters: 1 time in 4; ``--jitters`` with ten
factors tells a 1% lead from noise). The same comparison as `kvroute replay --jitter`
(``simulations/compare.py``).

With ``--closed-loop`` each policy's clients send a turn when its reply has ended, so a policy
that serves replies slowly is measured at a lighter load than the others, and the load each
offered is printed. ``--match-load`` then replays every policy that offered less than
``--focus`` and leads it on anything at higher rates (1.5x steps up to 3x, then bisected)
until its clients send as much, and gives the verdicts again at that load; a policy whose
clients cannot send that much is left out of them (it does not carry that load).

A rate factor scales every gap between arrivals alike, so a cold start's first decisions are
the same at every jitter; ``--nudge F`` also moves each jitter's arrivals by up to F x half
their gaps (``kvroute.simulations.compare.at_rate``), so a lead that holds then is not the cold
start's luck.

``--json OUT`` also writes every replay's metrics (per load, policy and jitter, and the
``--match-load`` replays); ``bench/score_cells.py`` reads such files, one per trace, and
counts the cells the focus won.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from kvroute.core.config import COALESCE_SHARE, PREDICT_TTL_S
from kvroute.simulations.cli import (
    AT_LEAST_ONE,
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    SWEEP_LOADS,
    Warmup,
    add_nudge_argument,
    make_policies,
    parse_loads,
)
from kvroute.simulations.compare import (
    DEFAULT_JITTERS,
    Jittered,
    at_rate,
    jittered_to_json,
    match_loads,
    matched_lines,
    matched_to_json,
    parse_jitters,
    replay_jittered,
    verdicts,
)
from kvroute.simulations.metrics import (
    PolicyMetrics,
    capacity_rps,
    floor_summary,
    measure,
    ttft_floor,
)
from kvroute.simulations.replay import ClusterSpec, Replayer
from kvroute.simulations.report import sent_loads
from kvroute.simulations.trace import TraceError, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--policies", default="kvroute,llmd,preble,chwbl,dynamo,mooncake_local")
    ap.add_argument("--loads", type=parse_loads, default=",".join(map(str, SWEEP_LOADS)))
    ap.add_argument("--jitters", default=",".join(map(str, DEFAULT_JITTERS)))
    ap.add_argument("--focus", default=None,
                    help="compare this policy with the best of the others (default: the "
                         "first of --policies)")
    ap.add_argument("--workers", type=AT_LEAST_ONE, default=16)
    ap.add_argument("--predict-ttl-ms", type=NON_NEGATIVE, default=PREDICT_TTL_S * 1000,
                    help="the router predicts a routed prompt's blocks until stored, at most "
                         "this long, and coalesces on them (0: off, as peer routers; default: "
                         "the router's)")
    ap.add_argument("--others-predict-ttl-ms", type=NON_NEGATIVE, default=None,
                    help="the same for every policy but --focus: 0 replays the peers as their "
                         "own routers run them, without coalescing, beside kvroute with it, "
                         "so each lead gets its jitter verdict (default: --predict-ttl-ms)")
    ap.add_argument("--coalesce-share", type=FRACTION, default=COALESCE_SHARE,
                    help="least share of an in-flight prefill a request waits for (default: "
                         "the router's)")
    ap.add_argument("--prefill-budget", type=AT_LEAST_ONE, default=16384,
                    help="prompt tokens per iteration (vLLM's --max-num-batched-tokens)")
    ap.add_argument("--chunked-prefill", action="store_true",
                    help="chunk prefills longer than the budget, as vLLM V1")
    ap.add_argument("--long-prefill-threshold", type=COUNT, default=0, metavar="N",
                    help="with --chunked-prefill: most tokens of one prefill per iteration "
                         "(vLLM's --long-prefill-token-threshold; 0: the whole budget)")
    ap.add_argument("--closed-loop", action="store_true",
                    help="send a request that carries an earlier reply only when that reply "
                         "has ended (default: every request at its trace time)")
    ap.add_argument("--programs", action="store_true",
                    help="run forks as controller programs (kvroute's agent; see replay.py)")
    ap.add_argument("--match-load", action="store_true",
                    help="closed loop: replay each policy whose clients sent less than "
                         "--focus's and that leads it on anything at higher rates until they "
                         "send as much, and compare again there")
    add_nudge_argument(ap)
    ap.add_argument("--json", type=Path, default=None, metavar="OUT",
                    help="also write every replay's metrics, per load, policy and jitter, to "
                         "OUT (rewritten after each load), for bench/score_cells.py")
    ap.add_argument("--warmup", type=Warmup.parse, default=Warmup(), metavar="N|Ss",
                    help="run the trace's first N requests (or those of its first S seconds) "
                         "but leave them out of the figures")
    args = ap.parse_args()
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json: no directory {args.json.parent}")
    if args.match_load and not args.closed_loop:
        ap.error("--match-load compares closed-loop replays (--closed-loop): in an open loop "
                 "every policy is offered the trace's load")
    try:
        trace = load(args.trace)
    except TraceError as exc:
        ap.error(str(exc))
    try:
        trace = args.warmup.apply(trace)
    except ValueError as exc:
        ap.error(f"--warmup: {exc}")
    base = len(trace.requests) / trace.duration_s
    cap = 480_000 // trace.block_size
    try:
        spec = ClusterSpec(workers=args.workers, capacity_blocks=cap,
                           predict_ttl_s=args.predict_ttl_ms / 1000, programs=args.programs,
                           coalesce_share=args.coalesce_share,
                           prefill_budget=args.prefill_budget,
                           chunked_prefill=args.chunked_prefill, closed_loop=args.closed_loop,
                           long_prefill_threshold=args.long_prefill_threshold)
    except ValueError as exc:
        ap.error(str(exc))
    capacity = capacity_rps(trace, args.workers, cap, spec.cost)
    factories = make_policies(args.policies, 0)
    names = [make().name for make in factories]
    focus = args.focus or names[0]
    if focus not in names:
        ap.error(f"--focus {focus!r} is not among --policies ({', '.join(names)})")
    others = spec if args.others_predict_ttl_ms is None else replace(
        spec, predict_ttl_s=args.others_predict_ttl_ms / 1000)
    jitters = parse_jitters(args.jitters)
    cells: list[dict[str, object]] = []  # what --json writes, a load at a time
    record = {"trace": args.trace, "focus": focus, "closed_loop": args.closed_loop,
              "warmup": trace.warmup, "jitters": list(jitters), "workers": args.workers,
              "prefill_budget": args.prefill_budget, "chunked_prefill": args.chunked_prefill,
              "long_prefill_threshold": args.long_prefill_threshold,
              "programs": args.programs, "nudge": args.nudge, "loads": cells}
    floor = floor_summary(ttft_floor(trace, spec.cost)[trace.warmup:])
    print(f"TTFT floor (no queueing, every earlier prefix cached): mean {floor['mean_s']:.4g} / "
          f"p99 {floor['p99_s']:.4g} s at every load", flush=True)
    for ld in args.loads:
        def at(factor: float, ld: float = ld, only: str | None = None) -> list[PolicyMetrics]:
            scaled = at_rate(trace, ld * factor * capacity / base, args.nudge)
            out = []
            for make in factories:
                policy = make()
                if only is not None and policy.name != only:
                    continue
                run = Replayer(scaled, policy, spec if policy.name == focus else others).run()
                out.append(measure(run))
            return out

        runs = replay_jittered(jitters, at)
        rows = sorted((j.mean() for j in runs), key=lambda m: m.ttft_mean_s)
        print(f"load {ld:.0%}: " + "; ".join(
            f"{m.policy} {m.ttft_mean_s:.4g}/{m.ttft_p99_s:.4g} ({m.hit_ratio:.2%})"
            for m in rows), flush=True)
        if args.closed_loop:
            # Each policy's clients set their own pace: its figures are at this load.
            print(f"  {sent_loads(rows, capacity)}", flush=True)
        for v in verdicts(runs, focus=focus):
            print(f"  {v}", flush=True)
        if args.match_load:
            def one(name: str, scale: float, at=at) -> Jittered:
                return replay_jittered([j * scale for j in jitters],
                                       lambda f: at(f, only=name))[0]

            matched = match_loads(runs, focus, lambda j: j.mean().offered_load(capacity), one)
            for line in matched_lines(runs, matched, focus):
                print(f"  {line}", flush=True)
        else:
            matched = []
        if args.json is not None:
            cells.append({"load": ld, "runs": jittered_to_json(runs),
                          "matched": matched_to_json(matched)})
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            tmp.replace(args.json)  # a reader never sees half a file


if __name__ == "__main__":
    main()
