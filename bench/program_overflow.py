"""Program placement when a fork does not fit its worker: split (the router's default) against
keeping every branch on the program's worker, in the replay simulator.

    python bench/program_overflow.py [TRACE] [--fanout 16] [--loads 0.8,1.5,2.5]
                                     [--max-batch 256,32]

TRACE defaults to `kvroute gen fork --requests 3000 --rate 20 --seed 1 --param fanout=16`
(forks of 16 branches). Prints, per batch
size and load (fraction of the cluster's capacity for independent requests, as
`kvroute replay --load`), the branches moved and mean / p99 TTFT both ways, as a ratio.
"""

from __future__ import annotations

import argparse
import json

from kvroute.simulations.cli import make_policies
from kvroute.simulations.generators import generate
from kvroute.simulations.metrics import capacity_rps, measure
from kvroute.simulations.replay import ClusterSpec, Replayer
from kvroute.simulations.trace import Trace, load, parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--fanout", type=int, default=16, help="branches per fork (no TRACE)")
    ap.add_argument("--loads", default="0.8,1.5,2.5")
    ap.add_argument("--max-batch", default="256,32")
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    trace: Trace = load(args.trace) if args.trace else parse(
        [json.dumps(r) for r in generate("fork", 3000, rate_per_s=20.0, seed=1,
                                         fanout=args.fanout)])
    base = len(trace.requests) / trace.duration_s
    cap = 480_000 // trace.block_size
    print("max_batch  load  moved  TTFT mean split / kept (ratio)   p99 split / kept (ratio)")
    for mb in map(int, args.max_batch.split(",")):
        for ld in map(float, args.loads.split(",")):
            out = {}
            for overflow in (True, False):
                spec = ClusterSpec(workers=args.workers, capacity_blocks=cap, programs=True,
                                   overflow=overflow, max_batch=mb)
                rate = ld * capacity_rps(trace, args.workers, cap, spec.cost)
                rep = Replayer(trace.scaled(rate / base), make_policies("kvroute", 0)[0](), spec)
                out[overflow] = (rep, measure(rep.run()))
            (rs, s), (_, k) = out[True], out[False]
            print(f"{mb:9d} {ld:5.2f} {rs.overflowed:6d}  {s.ttft_mean_s:7.3f} / "
                  f"{k.ttft_mean_s:7.3f} ({s.ttft_mean_s / k.ttft_mean_s:.2f}x)   "
                  f"{s.ttft_p99_s:6.3f} / {k.ttft_p99_s:6.3f} ({s.ttft_p99_s / k.ttft_p99_s:.2f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
