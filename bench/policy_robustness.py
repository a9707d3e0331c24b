"""What each term of kvroute's policy is worth, and how the policies fare when the router's picture
of the cluster is wrong: the ablation and robustness tables of docs/policy.md.

    python bench/policy_robustness.py ablation TRACE [TRACE ...] [--loads 0.5,0.8,0.95]
    python bench/policy_robustness.py robustness TRACE [TRACE ...] [--loads 0.8]

``ablation`` replays kvroute whole and with each term of its formula removed (the term
set to 0 in every worker's score; ``lookahead``: the router's block predictions off, so
queued requests' prefixes are not counted; ``copies``: no background copies of hot
prefixes), beside Mooncake-local.
``robustness`` replays kvroute and the peers named by ``--peers`` with the
simulated GPU other than the router's cost model says (attention or decode 0.5x and 2x:
the policies keep their defaults), with cache events reaching the router after 5 and 500
ms instead of 50, and prints each policy's change against its own nominal replay; under a
wrong GPU model, kvroute's change is against itself told the true constants
(``told``): what the error costs, apart from what the other GPU does to every policy. (Output
lengths: no policy reads them, the load view carries none, so there is nothing to remove.)

Every figure is the mean over ``--jitters`` of the rate, as ``bench/policy_jitter.py``
averages; loads are fractions of the capacity under the simulated GPU (the same traffic
share, not the same rate, so a slower GPU is not simply an overload). kvroute's policy
runs with the router's coalescing on, the peers without it, as in ``bench/campaign.py``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from kvroute.core.policies import Kvroute, Policy, RanksOnly, RouteQuery, Scored
from kvroute.core.policies.base import rank_by_cost
from kvroute.core.policies.cost_model import CostModel
from kvroute.core.policies.kvroute import longest_cached
from kvroute.simulations.cli import parse_loads
from kvroute.simulations.compare import DEFAULT_JITTERS, at_rate, parse_jitters
from kvroute.simulations.metrics import PolicyMetrics, capacity_rps, measure
from kvroute.simulations.policies import make_replay_policy as make_policy
from kvroute.simulations.replay import ClusterSpec, Replayer
from kvroute.simulations.trace import Trace, TraceError, load

TERMS = ("wait", "elapsed", "decode", "arrivals", "extension", "pressure")
# Removed with a term: ``elapsed`` is the part of ``wait`` already done, negative; alone it
# would make the busiest worker the cheapest.
WITH = {"wait": ("elapsed",)}


@dataclass
class WithoutTerm:
    """kvroute with one term of its formula left out (``Kvroute.terms``), ranked from the
    term-by-term formula (slower than its inlined ranking, the same order otherwise)."""

    term: str
    base: Kvroute
    name: str = ""
    places_replicas: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.name = f"kvroute -{self.term}"

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        later, top = self.base.later(query), longest_cached(query)
        costs = {}
        for w in query.loads:
            t = self.base.terms(query, w, later, top)
            for term in (self.term, *WITH.get(self.term, ())):
                t[term] = 0.0
            costs[w] = sum(t.values())
        return rank_by_cost(query, costs)

    def replica(self, query: RouteQuery, worker: str) -> tuple[str, int] | None:
        return self.base.replica(query, worker)  # the copies stay: only the term goes


@dataclass
class WithoutCopies(RanksOnly):
    """kvroute ranking as it does, but making no background copies of hot prefixes."""

    base: Kvroute
    name: str = "kvroute -copies"

    def rank(self, query: RouteQuery) -> Sequence[Scored]:
        return self.base.rank(query)


@dataclass(frozen=True)
class Entry:
    """One row: a policy (made fresh per replay) and the cluster it is replayed on."""

    label: str
    make: Callable[[], Policy]
    coalesce: bool  # the router's predictions and coalescing (kvroute's), or not (peers')


def replay(trace: Trace, entry: Entry, spec: ClusterSpec, load: float,
           jitters: Sequence[float]) -> PolicyMetrics:
    """``entry`` at ``load`` of the capacity under ``spec``'s GPU, averaged over jitters."""
    base = len(trace.requests) / trace.duration_s
    capacity = capacity_rps(trace, spec.workers, spec.capacity_blocks, spec.cost)
    if not entry.coalesce:
        spec = replace(spec, predict_ttl_s=0.0)
    runs = [measure(Replayer(at_rate(trace, load * j * capacity / base), entry.make(),
                             spec).run()) for j in jitters]
    avg = {k: statistics.mean(getattr(r, k) for r in runs)
           for k in ("ttft_mean_s", "ttft_p99_s", "hit_ratio")}
    return replace(runs[0], policy=entry.label, **avg)


def row(m: PolicyMetrics, ref: PolicyMetrics | None) -> str:
    out = f"{m.ttft_mean_s:8.3f} {m.ttft_p99_s:8.2f} {m.hit_ratio:7.2%}"
    if ref is not None:
        out += (f"  {m.ttft_mean_s / ref.ttft_mean_s - 1:+7.1%} "
                f"{m.ttft_p99_s / ref.ttft_p99_s - 1:+7.1%} "
                f"{(m.hit_ratio - ref.hit_ratio) * 100:+6.2f}")
    return out


def ablation(traces: list[tuple[str, Trace]], spec: ClusterSpec, loads: Sequence[float],
             jitters: Sequence[float]) -> None:
    whole = Kvroute()
    entries = [Entry("kvroute", Kvroute, True),
               *(Entry(f"-{t}", lambda t=t: WithoutTerm(t, whole), True) for t in TERMS),
               Entry("-copies", lambda: WithoutCopies(Kvroute()), True),
               Entry("-attention", lambda: make_policy("kvroute:attn=0"), True),
               Entry("-lookahead", Kvroute, False),
               Entry("mooncake_local", lambda: make_policy("mooncake_local"), False)]
    print("ablation: each term of kvroute removed; mean / p99 TTFT (s), hit ratio, then "
          "the change against kvroute whole (TTFT in %, hit ratio in points)")
    for name, trace in traces:
        for ld in loads:
            print(f"{name} at {ld:.0%}:", flush=True)
            ref = None
            for e in entries:
                m = replay(trace, e, spec, ld, jitters)
                print(f"  {e.label:16s} {row(m, ref)}", flush=True)
                ref = ref or m


def robustness(traces: list[tuple[str, Trace]], spec: ClusterSpec, loads: Sequence[float],
               jitters: Sequence[float], peers: list[str]) -> None:
    m0, nominal_policy = spec.cost, Kvroute()
    # Each condition: the simulated cluster, and kvroute told the truth about it (the
    # constants its defaults would have been derived from), to tell what the error costs.
    conditions: dict[str, tuple[ClusterSpec, str | None]] = {"nominal": (spec, None)}
    for f in (0.5, 2.0):
        conditions[f"attention {f:g}x"] = (
            replace(spec, cost=replace(m0, attn_s_per_token_pair=m0.attn_s_per_token_pair * f)),
            f"kvroute:attn={nominal_policy.attn * f!r}")
        conditions[f"decode {f:g}x"] = (
            replace(spec, cost=replace(m0, decode_base_s=m0.decode_base_s * f,
                                       decode_per_seq_s=m0.decode_per_seq_s * f)),
            f"kvroute:decode={nominal_policy.decode * f!r}")
    for ms in (5, 500):
        conditions[f"propagation {ms} ms"] = (replace(spec, propagation_s=ms / 1000), None)
    entries = [Entry("kvroute", Kvroute, True),
               *(Entry(p, lambda p=p: make_policy(p), False) for p in peers)]
    print("robustness: the simulated GPU or the event path other than the router's model; "
          "mean / p99 TTFT (s), hit ratio, then the change against the policy's own nominal "
          "replay (TTFT in %, hit ratio in points), kvroute's against 'told': itself "
          "with the true constants")
    for name, trace in traces:
        for ld in loads:
            print(f"{name} at {ld:.0%}:", flush=True)
            nominal: dict[str, PolicyMetrics] = {}
            for cond, (cspec, told) in conditions.items():
                print(f"  {cond}:", flush=True)
                told_m = None
                if told is not None:
                    told_m = replay(trace, Entry("told", lambda t=told: make_policy(t), True),
                                    cspec, ld, jitters)
                    print(f"    {'told':16s} {row(told_m, None)}", flush=True)
                for e in entries:
                    m = replay(trace, e, cspec, ld, jitters)
                    ref = told_m if told_m is not None and e.label == "kvroute" \
                        else nominal.get(e.label)
                    if cond == "nominal":
                        nominal[e.label] = m
                    print(f"    {e.label:16s} {row(m, ref)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("ablation", "robustness"))
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--loads", type=parse_loads, default="0.8")
    ap.add_argument("--jitters", default=",".join(map(str, DEFAULT_JITTERS)))
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--peers", default="mooncake_local,llmd",
                    help="peers in the robustness table (default: %(default)s)")
    args = ap.parse_args()
    jitters = parse_jitters(args.jitters)
    traces = []
    for path in args.traces:
        try:
            trace = load(path)
        except TraceError as exc:
            ap.error(str(exc))
        traces.append((path.rsplit("/", 1)[-1].removesuffix(".jsonl"), trace))
    block = traces[0][1].block_size
    if any(t.block_size != block for _, t in traces):
        ap.error("the traces have different block sizes: replay them one at a time")
    spec = ClusterSpec(workers=args.workers, capacity_blocks=480_000 // block,
                       cost=CostModel())
    if args.mode == "ablation":
        ablation(traces, spec, args.loads, jitters)
    else:
        robustness(traces, spec, args.loads, jitters,
                   [p for p in args.peers.split(",") if p])


if __name__ == "__main__":
    main()
