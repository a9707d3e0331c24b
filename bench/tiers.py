"""What weighing a lower tier changes: the same cluster, each worker with a host (CPU) tier
behind its GPU cache, replayed with the router seeing that tier three ways, against no tier.

    python bench/tiers.py [TRACE] [--loads 0.5,0.8,0.95] [--quick]

Each worker holds ``--capacity-blocks`` in GPU memory (default 420 blocks of the shared
trace's 512 tokens: 215k tokens, a little more than an A100-40GB holds for Llama-3.1-8B) and
``--host-blocks`` in host memory (1,600: 819k tokens, ~107 GB at 128 KiB a token). Evicted
blocks go to the host tier and a prompt loads them back at the cost model's PCIe rate
(``CostModel.lower_tier_s_per_token``; ``--tier-gbps`` another, which the workers then report
to the router) instead of computing them. The router sees the tier:

* ``weighted``: as kvroute's router does: a hit to load, at the tier's cost (the policy's
  ``load`` term);
* ``gpu``: every lower-tier block counted as a GPU hit (what a router that reads one block
  set does: kvroute before tiers);
* ``ignore``: lower-tier blocks dropped (a router that does not read the tier's events);
* ``none``: no host tier at all (the GPU cache alone).

Per load (a fraction of the GPU-only cluster's capacity, as ``kvroute replay --load``), every
view is replayed at each rate jitter (``--jitters``) and the means are printed: hit ratio (the
host tier's share of it), mean and p99 TTFT, and each view's TTFT as a ratio of ``gpu``'s,
measured in the same run. ``--quick`` replays the first 1,200 requests at one jitter.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvroute.core.policies.cost_model import CostModel
from kvroute.simulations.cli import parse_loads
from kvroute.simulations.compare import DEFAULT_JITTERS, parse_jitters
from kvroute.simulations.metrics import capacity_rps, measure
from kvroute.simulations.policies import make_replay_policy
from kvroute.simulations.replay import LOWER_TIER_VIEWS, ClusterSpec, Replayer
from kvroute.simulations.trace import Trace, load

MOONCAKE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_synthetic_trace.jsonl"
VIEWS = ("none", *LOWER_TIER_VIEWS)
BASE = "gpu"


@dataclass
class Cell:
    hit: float
    host: float  # share of prompt tokens loaded from a host tier
    ttft_mean: float
    ttft_p99: float


def replay(trace: Trace, spec: ClusterSpec, policy: str) -> Cell:
    res = Replayer(trace, make_replay_policy(policy), spec).run()
    m = measure(res)
    reqs = res.measured
    host = sum(r.loaded_tokens for r in reqs) / max(1, sum(r.prompt_tokens for r in reqs))
    return Cell(m.hit_ratio, host, m.ttft_mean_s, m.ttft_p99_s)


def mean_cell(cells: list[Cell]) -> Cell:
    return Cell(*(statistics.fmean(getattr(c, f) for c in cells)
                  for f in ("hit", "host", "ttft_mean", "ttft_p99")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(MOONCAKE))
    ap.add_argument("--loads", type=parse_loads, default="0.5,0.8,0.95")
    ap.add_argument("--jitters", type=parse_jitters,
                    default=",".join(map(str, DEFAULT_JITTERS)))
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--capacity-blocks", type=int, default=420)
    ap.add_argument("--host-blocks", type=int, default=1600)
    ap.add_argument("--tier-gbps", type=float, default=25.0,
                    help="the host tier's load rate, GB/s of 128 KiB tokens (25: PCIe 4.0 "
                         "x16; 2.5: a local NVMe disk)")
    ap.add_argument("--policy", default="kvroute")
    ap.add_argument("--quick", action="store_true",
                    help="the trace's first 1,200 requests, one jitter")
    args = ap.parse_args()
    trace = load(args.trace)
    jitters = args.jitters
    if args.quick:
        trace = Trace(trace.requests[:1200], trace.block_size, trace.source)
        jitters = [1.0]
    cost = CostModel(lower_tier_s_per_token=131072 / (args.tier_gbps * 1e9))
    capacity = capacity_rps(trace, args.workers, args.capacity_blocks, cost)
    base_rps = len(trace.requests) / max(trace.duration_s, 1e-9)
    per_token = cost.lower_tier_s_per_token
    print(f"trace {trace.source}: {len(trace.requests)} requests; {args.workers} workers x "
          f"{args.capacity_blocks} GPU blocks + {args.host_blocks} host blocks of "
          f"{trace.block_size} tokens; a host-tier token loads in {per_token * 1e6:.2f} us "
          f"({per_token / cost.linear_s_per_token:.3f} of its prefill); policy "
          f"{args.policy}; jitters {jitters}", flush=True)
    start = time.monotonic()
    for ld in args.loads:
        cells: dict[str, Cell] = {}
        for view in VIEWS:
            runs = []
            for j in jitters:
                spec = ClusterSpec(workers=args.workers, capacity_blocks=args.capacity_blocks,
                                   host_blocks=0 if view == "none" else args.host_blocks,
                                   lower_tier="weighted" if view == "none" else view,
                                   cost=cost)
                runs.append(replay(trace.scaled(ld * capacity / base_rps * j), spec,
                                   args.policy))
            cells[view] = mean_cell(runs)
        base = cells[BASE]
        print(f"\nload {ld:.2f} ({time.monotonic() - start:.0f} s)")
        print(f"{'view':10} {'hit':>6} {'host':>6} {'TTFT mean':>10} {'p99':>8} "
              f"{'mean/gpu':>9} {'p99/gpu':>8}")
        for view, c in cells.items():
            print(f"{view:10} {c.hit:6.1%} {c.host:6.1%} {c.ttft_mean:9.3f}s {c.ttft_p99:7.2f}s "
                  f"{c.ttft_mean / base.ttft_mean:9.3f} {c.ttft_p99 / base.ttft_p99:8.3f}",
                  flush=True)
    print(f"\n{time.monotonic() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
