"""Policy comparison averaged over small rate jitters: single replays are chaotic (a 1%
change in rate can move one policy's TTFT by 5-20%), so each load is replayed at 0.98x,
1.00x and 1.02x of its rate and the means are compared.

    python bench/policy_jitter.py TRACE [--policies kvroute,llmd,preble,chwbl] [--loads ...]

Prints, per load (fraction of the cluster's capacity, as `kvroute replay --load`), every
policy's mean TTFT / p99 TTFT (s) and hit ratio, best mean first.
"""

from __future__ import annotations

import argparse
import statistics

from kvroute.core.config import PREDICT_TTL_S
from simulations.cli import make_policies
from simulations.metrics import capacity_rps, measure
from simulations.replay import ClusterSpec, Replayer
from simulations.trace import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--policies", default="kvroute,llmd,preble,chwbl,dynamo,mooncake")
    ap.add_argument("--loads", default="0.5,0.65,0.8,0.95")
    ap.add_argument("--jitters", default="0.98,1.0,1.02")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--predict-ttl-ms", type=float, default=PREDICT_TTL_S * 1000,
                    help="the router predicts a routed prompt's blocks this long and coalesces "
                         "bursts on them (0: off, as peer routers; default: the router's)")
    ap.add_argument("--programs", action="store_true",
                    help="run forks as controller programs (kvroute's agent; see replay.py)")
    args = ap.parse_args()
    trace = load(args.trace)
    base = len(trace.requests) / trace.duration_s
    cap = 480_000 // trace.block_size
    spec = ClusterSpec(workers=args.workers, capacity_blocks=cap,
                       predict_ttl_s=args.predict_ttl_ms / 1000, programs=args.programs)
    capacity = capacity_rps(trace, args.workers, cap, spec.cost)
    names = args.policies.split(",")
    factories = dict(zip(names, make_policies(args.policies, 0), strict=True))
    for ld in map(float, args.loads.split(",")):
        runs: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
        for j in map(float, args.jitters.split(",")):
            scaled = trace.scaled(ld * j * capacity / base)
            for n in names:
                m = measure(Replayer(scaled, factories[n](), spec).run())
                runs[n].append((m.ttft_mean_s, m.ttft_p99_s, m.hit_ratio))
        rows = sorted((statistics.mean(r[0] for r in rs), statistics.mean(r[1] for r in rs),
                       statistics.mean(r[2] for r in rs), n) for n, rs in runs.items())
        print(f"load {ld:.0%}: " + "; ".join(f"{n} {m:.4g}/{p:.4g} ({h:.2%})"
                                          for m, p, h, n in rows), flush=True)


if __name__ == "__main__":
    main()
