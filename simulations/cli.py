"""``kvroute replay``: replay a trace through every policy and report which wins."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvroute.core import config
from kvroute.core.config import COALESCE_SHARE, PREDICT_TTL_S
from kvroute.core.policies import Policy
from kvroute.simulations.policies import REPLAY_REGISTRY, make_replay_policy
from kvroute.simulations.replay import LOWER_TIER_VIEWS
from kvroute.simulations.trace import Trace

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
    p.add_argument("--host-blocks", type=COUNT, default=0,
                   help="KV blocks per worker in a host (CPU) tier behind its GPU cache "
                        "(vLLM's offloading, SGLang's HiCache): evicted blocks go there and "
                        "load back at the cost model's PCIe rate (default: 0, no tier)")
    p.add_argument("--lower-tier", choices=LOWER_TIER_VIEWS, default="weighted",
                   help="with --host-blocks: what the router makes of the host tier: "
                        "'weighted' (a hit to load, at its cost: kvroute's router), 'gpu' "
                        "(counted as GPU hits), 'ignore' (no hit at all)")
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
