"""Benchmark: the pause of a full garbage collection with a 1M-entry prefix index in memory.

A full (generation 2) collection traverses every container the cyclic collector tracks. The
router holds its prefix index for life, so any part of it the collector tracks is walked on
every full collection, stalling every in-flight routing decision. Over an index of ``--entries``
(block, worker) pairs (built by ``routing_decision.build``), this times ``gc.collect()`` with:

* kvroute: the index as ``PrefixIndex`` stores it (one C table, no Python object per key:
  nothing for the collector to walk);
* baseline, measured in the same run: the same process additionally holding the same entries
  as one Python set per worker, which is how ``PrefixIndex`` held them once (the former
  layout's cost to the collector).

The two cases alternate, so load on a shared machine hits both alike. In each case, routing
decisions (``Decider.decide`` on 8k-token prompts) then run while each also leaves cyclic
garbage that stays referenced for the next few hundred decisions, as in-flight requests' state
does, so it reaches the oldest generation and CPython runs full collections on its own (about
one per 2,000 decisions here). Those are rare enough to leave p50/p99 alone: they show in the
max, and in the longest automatic full collection, which also frees the bench's own garbage.

    python bench/gc_pause.py [--entries 1000000] [--workers 128] [--repeats 5] [--iters 4000]

Prints the full-collection pause (median and worst), the decision p50/p99/max and the count and
longest of the automatic full collections per case, and baseline/kvroute ratios (higher is
better).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from routing_decision import BLOCK, MODEL, build, pct, registry

from kvroute.core.index import PrefixIndex
from kvroute.core.policies import Kvroute
from kvroute.router.decide import Decider
from kvroute.router.registry import WorkerRegistry

PROMPT_TOKENS = 8192
GARBAGE_PER_DECISION = 50  # small cyclic objects per decision, like a request's state
IN_FLIGHT = 200  # decisions whose garbage is still referenced: long enough to reach gen 2


@dataclass
class Case:
    name: str
    pauses_ms: list[float] = field(default_factory=list)
    decisions_us: list[float] = field(default_factory=list)
    auto_full_ms: list[float] = field(default_factory=list)


class FullCollections:
    """Durations of the full collections CPython runs on its own, via ``gc.callbacks``."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms.append((time.perf_counter() - self._t0) * 1000)


def former_layout(index: PrefixIndex) -> dict[str, set[int]]:
    """The index's entries as one set per worker: what the collector walked before."""
    return {w: index.keys_of(w) for w in index.workers()}


def full_pauses(n: int) -> list[float]:
    gc.collect()  # settle: promote whatever was just built, so every timed run is alike
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def decisions_with_garbage(decide: Callable[[list[int]], object], prompts: list[list[int]],
                           iters: int, full: FullCollections) -> list[float]:
    """Time decide(prompt) + making one request's cyclic garbage, as the router's loop
    would; returns microseconds per iteration and fills ``full`` with automatic full
    collections."""
    in_flight: deque[list[dict[str, object]]] = deque(maxlen=IN_FLIGHT)
    gc.collect()
    full.ms.clear()
    gc.callbacks.append(full)
    try:
        out = []
        for i in range(iters):
            p = prompts[i % len(prompts)]
            t0 = time.perf_counter_ns()
            state = [{"i": j} for j in range(GARBAGE_PER_DECISION)]
            for d in state:
                d["self"] = d  # a cycle: only the collector can free it
            in_flight.append(state)
            decide(p)
            out.append((time.perf_counter_ns() - t0) / 1000)
        return out
    finally:
        gc.callbacks.remove(full)


def run_case(case: Case, decide: Callable[[list[int]], object], prompts: list[list[int]],
             iters: int) -> None:
    case.pauses_ms += full_pauses(3)
    full = FullCollections()
    case.decisions_us += decisions_with_garbage(decide, prompts, iters, full)
    case.auto_full_ms += full.ms


def report(ours: Case, base: Case, entries: int) -> None:
    print(f"{'index':>9} {'entries':>9} | {'full gc p50':>11} {'max':>8} |"
          f" {'decision p50':>12} {'p99':>8} {'max':>8} | {'auto full gcs':>13} {'max':>8}")
    for c in (ours, base):
        auto_max = max(c.auto_full_ms, default=0.0)
        print(f"{c.name:>9} {entries:>9} | {statistics.median(c.pauses_ms):>9.1f}ms"
              f" {max(c.pauses_ms):>6.1f}ms | {pct(c.decisions_us, 50):>10.0f}us"
              f" {pct(c.decisions_us, 99):>6.0f}us {max(c.decisions_us) / 1000:>6.1f}ms |"
              f" {len(c.auto_full_ms):>13} {auto_max:>6.1f}ms")
    print(f"full-collection pause, baseline/kvroute: median"
          f" {statistics.median(base.pauses_ms) / statistics.median(ours.pauses_ms):.1f}x,"
          f" worst {max(base.pauses_ms) / max(ours.pauses_ms):.1f}x;"
          f" decision p99 {pct(base.decisions_us, 99) / pct(ours.decisions_us, 99):.1f}x,"
          f" max {max(base.decisions_us) / max(ours.decisions_us):.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=1_000_000, help="index size")
    ap.add_argument("--workers", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="alternations of the two cases")
    ap.add_argument("--iters", type=int, default=4000, help="decisions per case and repeat")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(50257) for _ in range(PROMPT_TOKENS)] for _ in range(10)]
    floor = statistics.median(full_pauses(3))  # this process with no index at all
    t0 = time.perf_counter()
    index, _, names = build(args.workers, args.entries, prompts, rng)  # drops build's own sets
    reg = registry(names, 0, rng)
    print(f"(index of {index.entries():,} entries over {args.workers} workers built in"
          f" {time.perf_counter() - t0:.1f}s; full gc before building it: {floor:.1f}ms)")
    decider = Decider(MODEL, BLOCK, Kvroute())

    def decide(p: list[int], reg: WorkerRegistry = reg) -> object:
        return decider.decide(p, index, reg)

    ours, base = Case("kvroute"), Case("baseline")
    for _ in range(args.repeats):
        run_case(ours, decide, prompts, args.iters)
        held = former_layout(index)  # alive only so that the collector walks it
        run_case(base, decide, prompts, args.iters)
        del held
    report(ours, base, index.entries())


if __name__ == "__main__":
    main()
