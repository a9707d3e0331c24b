"""Benchmark: the routing decision alone (key hashing + index lookup + policy).

For prompts of 1k, 8k and 32k tokens and clusters of 16 and 128 workers, over an index of at
least 1M (block, worker) entries, time ``Decider.decide`` -- exactly what the router runs per
request -- and, as the baseline measured in the same run, the straightforward design: hash
every block, then walk each worker's key set until its first miss, then the same policy.

    python bench/routing_decision.py [--entries 1000000] [--iters 300]

Prints p50/p99 in microseconds and the baseline/kvroute ratio (higher is better).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence

from kvroute.core.blocks import BlockHasher
from kvroute.core.index import PrefixIndex
from kvroute.core.policies import KvrouteCost, RouteQuery
from kvroute.core.redis_schema import Heartbeat
from kvroute.router.decide import Decider
from kvroute.router.registry import WorkerRegistry

BLOCK = 16
MODEL = "bench"


def build(workers: int, entries: int, prompts: Sequence[list[int]], rng: random.Random
          ) -> tuple[PrefixIndex, dict[str, set[int]], WorkerRegistry]:
    """An index of ``entries`` (block, worker) pairs: background chains, plus each query
    prompt's prefix cached (to a random depth) on 1-4 random workers."""
    index = PrefixIndex()
    naive: dict[str, set[int]] = {f"w{i}": set() for i in range(workers)}
    names = list(naive)
    hasher = BlockHasher(BLOCK, MODEL)
    for p in prompts:
        keys = hasher.keys(p)
        for w in rng.sample(names, rng.randint(1, 4)):
            depth = rng.randint(len(keys) // 4, len(keys))
            index.add(w, keys[:depth])
            naive[w].update(keys[:depth])
    per_worker = max(0, entries - index.entries()) // workers
    for w in names:
        background = [rng.getrandbits(64) for _ in range(per_worker)]
        index.add(w, background)
        naive[w].update(background)
    reg = WorkerRegistry({}, BLOCK)
    reg.apply_heartbeats({w: Heartbeat(w, f"127.0.0.1:{i}", "e", running=rng.randint(0, 8),
                                       pending_prefill_tokens=rng.randint(0, 4000))
                          for i, w in enumerate(names)})
    return index, naive, reg


def naive_decide(tokens: list[int], naive: dict[str, set[int]], reg: WorkerRegistry,
                 hasher: BlockHasher, policy: KvrouteCost) -> str:
    keys = hasher.keys(tokens)
    matched = {}
    for w, held in naive.items():
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        if n:
            matched[w] = n
    q = RouteQuery(len(tokens), BLOCK, matched, reg.loads, keys[0] if keys else 0)
    return policy.rank(q)[0].worker


def timeit(fn: Callable[[list[int]], object], prompts: list[list[int]], iters: int
           ) -> list[float]:
    for p in prompts[:5]:
        fn(p)  # warm caches
    out = []
    for i in range(iters):
        p = prompts[i % len(prompts)]
        t0 = time.perf_counter_ns()
        fn(p)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=1_000_000, help="index size")
    ap.add_argument("--iters", type=int, default=300, help="decisions timed per case")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(f"{'prompt':>7} {'workers':>7} {'entries':>9} | {'kvroute p50':>11} {'p99':>8} |"
          f" {'baseline p50':>12} {'p99':>8} | {'p99 ratio':>9}")
    for workers in (16, 128):
        rng = random.Random(args.seed)
        lengths = (1024, 8192, 32768)
        prompts = {n: [[rng.randrange(50257) for _ in range(n)] for _ in range(20)]
                   for n in lengths}
        t0 = time.perf_counter()
        index, naive, reg = build(workers, args.entries,
                                  [p for ps in prompts.values() for p in ps], rng)
        build_s = time.perf_counter() - t0
        decider = Decider(MODEL, BLOCK, KvrouteCost())
        hasher = BlockHasher(BLOCK, MODEL, native=False)  # the baseline is all Python
        policy = KvrouteCost()
        for n in lengths:
            ps = prompts[n]
            # Same answers from both, or the comparison means nothing.
            for p in ps[:5]:
                assert decider.decide(p, index, reg).best == naive_decide(
                    p, naive, reg, hasher, policy)
            ours = timeit(functools.partial(decider.decide, index=index, registry=reg), ps,
                          args.iters)
            base = timeit(functools.partial(naive_decide, naive=naive, reg=reg, hasher=hasher,
                                            policy=policy), ps, max(30, args.iters // 5))
            print(f"{n:>7} {workers:>7} {index.entries():>9} | {pct(ours, 50):>9.0f}us"
                  f" {pct(ours, 99):>6.0f}us | {pct(base, 50):>10.0f}us {pct(base, 99):>6.0f}us"
                  f" | {pct(base, 99) / pct(ours, 99):>8.1f}x", flush=True)
        print(f"        (index of {index.entries():,} entries built in {build_s:.1f}s)")


if __name__ == "__main__":
    main()
