"""Benchmark: replay speed of a 12,000-request trace on 16 workers, per policy.

The shared Mooncake trace (3,993 requests) is tiled 3x with distinct keys (11,979 requests)
and replayed at its recorded rate x2 through every policy. Prints the wall time per policy
(target: under 10 s) and its ratio to round-robin's, measured in the same run (round-robin
does no index lookup, so the ratio is the price of each policy's routing work).

    python bench/replay_speed.py [--trace PATH] [--tile 3] [--rate-scale 2] [--policies all]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvroute.simulations.cli import AT_LEAST_ONE, POSITIVE, make_policies
from kvroute.simulations.policies import REPLAY_REGISTRY as REGISTRY
from kvroute.simulations.replay import ClusterSpec, Replayer
from kvroute.simulations.trace import load

MOONCAKE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=MOONCAKE)
    ap.add_argument("--tile", type=AT_LEAST_ONE, default=3)
    ap.add_argument("--rate-scale", type=POSITIVE, default=2.0)
    ap.add_argument("--policies", default="all",
                    help="comma-separated policies (round_robin, the baseline, is always run)")
    args = ap.parse_args()
    trace = load(args.trace).tiled(args.tile).scaled(args.rate_scale)
    print(f"{len(trace.requests)} requests, 16 workers")
    walls: dict[str, float] = {}
    names = sorted(REGISTRY) if args.policies == "all" else \
        list(dict.fromkeys(["round_robin", *args.policies.split(",")]))
    for name, make in zip(names, make_policies(",".join(names), 0), strict=True):
        t0 = time.perf_counter()
        Replayer(trace, make(), ClusterSpec(workers=16)).run()
        walls[name] = time.perf_counter() - t0
    base = walls["round_robin"]
    for name, wall in sorted(walls.items(), key=lambda kv: kv[1]):
        ok = "ok" if wall < 10 else "OVER 10 s"
        print(f"{name:<13} {wall:6.2f} s  {wall / base:5.2f}x round_robin  {ok}")


if __name__ == "__main__":
    main()
