"""Benchmark: two builds of the C holder map under the 1,000-worker routing decision, one
decision on each in turn.

    python bench/holders_ab.py A=path/to/_holders.so B=path/to/_holders.so
        [--reps 3] [--iters 3000] [--workers 1000] [--entries 4000000] [--hot 0.25]

On a shared VM the same build's decision swings by up to 2x from one run to the next, so
two builds timed in separate runs cannot be told apart by a few percent. Here each build
gets an index of its own (``routing_decision.build``: 8k-token prompts, each held by a
``--hot`` share of the workers), and the decisions alternate between them, so both see the
same machine (each goes first in half the pairs: the second finds the request's bytes in
cache). Prints p50/p90/p99 of each build per repetition and B's ratio to A (below 1: B is
faster). To time a former commit's build against this one:

    git worktree add /tmp/former REV && (cd /tmp/former && python setup.py -q build_ext --inplace)
    python bench/holders_ab.py former=/tmp/former/core/_holders.*.so \\
        this=core/_holders.*.so
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from types import ModuleType

from routing_decision import BLOCK, MODEL, build, kvroute_decide, received, registry

from kvroute.core.index import PrefixIndex
from kvroute.core.policies import Kvroute
from kvroute.router.decide import Decider

PROMPT = 8192


def load(path: str) -> ModuleType:
    """The extension at ``path``, loaded as a module of its own (beside any other build)."""
    spec = importlib.util.spec_from_file_location("kvroute.core._holders", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_pair(label_path: str) -> tuple[str, str]:
    label, sep, path = label_path.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"{label_path!r}: expected LABEL=PATH")
    return label, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", type=build_pair, nargs=2, metavar="LABEL=PATH")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3000, help="decisions per build and rep")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--entries", type=int, default=4_000_000)
    ap.add_argument("--hot", type=float, default=0.25)
    args = ap.parse_args()
    seed = random.Random(1)
    prompts = [[seed.randrange(50257) for _ in range(PROMPT)] for _ in range(20)]
    indexes: dict[str, PrefixIndex] = {}
    for label, path in args.builds:
        mod = load(path)
        index = PrefixIndex()
        index._holders, index._lower = mod.HolderMap(), mod.HolderMap()
        indexes[label], _, names = build(args.workers, args.entries, prompts,
                                         random.Random(2), args.hot, index)
    decider = Decider(MODEL, BLOCK, Kvroute())
    reg = registry(names, 0, random.Random(3))
    reqs = [received(p) for p in prompts]
    answers = {label: kvroute_decide(reqs[0], decider, ix, reg) for label, ix in indexes.items()}
    if len(set(answers.values())) != 1:
        raise SystemExit(f"the builds decide differently: {answers}")
    (a, _), (b, _) = args.builds
    print(f"{args.workers} workers, {indexes[a].entries():,} entries, {PROMPT}-token prompts"
          f" held by {args.hot:.0%} of the workers; {args.iters} decisions per build and rep")
    for rep in range(args.reps):
        times: dict[str, list[float]] = {label: [] for label in indexes}
        for i in range(args.iters):
            for label, index in list(indexes.items())[::1 if i % 2 else -1]:
                t0 = time.perf_counter_ns()
                kvroute_decide(reqs[i % len(reqs)], decider, index, reg)
                times[label].append((time.perf_counter_ns() - t0) / 1000)
        q = {label: statistics.quantiles(xs, n=100, method="inclusive")
             for label, xs in times.items()}
        cells = " | ".join(f"{label}: p50 {q[label][49]:.0f} p90 {q[label][89]:.0f}"
                           f" p99 {q[label][98]:.0f} us" for label in indexes)
        print(f"rep {rep + 1}: {cells} | {b}/{a}: p50 {q[b][49] / q[a][49]:.2f}x"
              f" p99 {q[b][98] / q[a][98]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
