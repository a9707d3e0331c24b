"""Benchmark: the routing decision alone, from a parsed request to a ranked list of workers.

For prompts of 1k, 8k and 32k tokens and clusters of 16 and 128 workers (``--workers``),
over an index of at least 1M (block, worker) entries, time what the router runs per request
once gRPC has parsed it: the prompt's ids out of the request's wire bytes and checked
(``request_token_ids``, ``check_tokens``), then ``Decider.decide`` (key hashing, index walk,
policy). Each case runs on a quiet cluster (nothing queued) and a loaded one (0-4 requests
queued per worker, so the policy's queue and decode terms run). The baseline,
measured in the same run, is the straightforward design: the ids read from the protobuf
container, every block hashed in Python, each worker's key set walked until its first miss,
then the same policy in Python.

    python bench/routing_decision.py [--entries 1000000] [--iters 300] [--workers 16,128]
        [--hot 0.25] [--prompts 1024,8192,32768] [--pending 4000]

Each query prompt's prefix is cached on 1-4 random workers; with ``--hot F``, on a share F
of the workers instead (a hot system prompt, as bench/scale.py's probes are held by ~25% of
its workers), each to a random depth. ``--workers 1000 --entries 4000000 --hot 0.25
--prompts 8192`` is the 1,000-worker decision of issue 40 (the baseline's pure-Python walk
over 1,000 key sets is then timed on a fifth of the iterations, as always).

Prints p50/p99 in microseconds and the baseline/kvroute ratio (higher is better), then the
p50 of each stage of kvroute's decision, with the index walk also timed on the pure-Python
holder map (``PrefixIndex(native=False)``) in a pass of its own; the policy's ranking
(``kvroute``);
and what the router adds for a request whose prefix is in demand (``replica``: where the
policy would copy it).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvroute.core.blocks import BlockHasher
from kvroute.core.grpc_util import Received
from kvroute.core.index import PrefixIndex
from kvroute.core.load import EngineLoad
from kvroute.core.policies import Kvroute, Policy, RouteQuery
from kvroute.core.redis_schema import Heartbeat
from kvroute.core.settings import AT_LEAST_ONE
from kvroute.core.validate import Limits, check_tokens
from kvroute.core.wire import request_token_ids
from kvroute.router.decide import Decider, rank_request
from kvroute.router.registry import WorkerRegistry
from kvroute.v1 import common_pb2

BLOCK = 16
MODEL = "bench"
LIMITS = Limits(vocab_size=50257, max_prompt_tokens=65536, max_new_tokens=1)
COUNTS = AT_LEAST_ONE.list_parser(int)  # --workers 16,128


def build(workers: int, entries: int, prompts: Sequence[list[int]], rng: random.Random,
          hot: float = 0.0, index: PrefixIndex | None = None
          ) -> tuple[PrefixIndex, dict[str, set[int]], list[str]]:
    """An index of ``entries`` (block, worker) pairs: background chains, plus each query
    prompt's prefix cached (to a random depth) on 1-4 random workers, or with ``hot`` on
    that share of them (at least one): how many workers a decision scores as matched.
    Filled into ``index`` if given (it must be empty)."""
    index = PrefixIndex() if index is None else index
    naive: dict[str, set[int]] = {f"w{i}": set() for i in range(workers)}
    names = list(naive)
    hasher = BlockHasher(BLOCK, MODEL)
    for p in prompts:
        keys = hasher.keys(p)
        holders = max(1, round(hot * workers)) if hot else rng.randint(1, 4)
        for w in rng.sample(names, holders):
            depth = rng.randint(len(keys) // 4, len(keys))
            index.add(w, keys[:depth])
            naive[w].update(keys[:depth])
    per_worker = max(0, entries - index.entries()) // workers
    for w in names:
        background = [rng.getrandbits(64) for _ in range(per_worker)]
        index.add(w, background)
        naive[w].update(background)
    return index, naive, names


def registry(names: list[str], queued: int, rng: random.Random, pending: int = 4000
             ) -> WorkerRegistry:
    """Heartbeats of a running cluster, with 0..``2 * queued`` requests queued per worker
    and 0..``pending`` prompt tokens still to prefill."""
    reg = WorkerRegistry({}, BLOCK)
    reg.apply_heartbeats({w: Heartbeat(w, f"127.0.0.1:{i}", "e", load=EngineLoad(
                              running=rng.randint(0, 8), queued=rng.randint(0, 2 * queued),
                              pending_prefill_tokens=rng.randint(0, pending)))
                          for i, w in enumerate(names)})
    return reg


def received(tokens: list[int]) -> Received:
    """The request as the router's servicer gets it: serialized by a client, parsed by gRPC
    (``Received.parse`` is the router's deserializer)."""
    return Received.parse(common_pb2.GenerateRequest(token_ids=tokens, model=MODEL)
                          .SerializeToString())


def kvroute_decide(req: Received, decider: Decider, index: PrefixIndex,
                   reg: WorkerRegistry) -> str:
    """What RouterService runs for a token-id request: ``_prompt`` then ``_decide``."""
    tokens, top = request_token_ids(req.msg, req.wire)
    check_tokens(tokens, LIMITS, top=top)
    return decider.decide(tokens, index, reg).best


def naive_decide(req: Received, naive: dict[str, set[int]],
                 reg: WorkerRegistry, hasher: BlockHasher, policy: Policy) -> str:
    tokens = list(req.msg.token_ids)
    check_tokens(tokens, LIMITS)
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
    affinity = keys[0] if keys else 0
    return policy.rank(RouteQuery(len(tokens), BLOCK, matched, reg.loads, affinity))[0].worker


def timeit(fn: Callable[[Received], object], prompts: list[Received], iters: int
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


def stages(reqs: list[Received], decider: Decider, index: PrefixIndex,
           dict_index: PrefixIndex, reg: WorkerRegistry, iters: int) -> dict[str, float]:
    """p50 of each stage of kvroute's decision (and of the walk on the dict holder map, in
    a pass of its own), in microseconds."""
    times: dict[str, list[float]] = {"ids": [], "hash": [], "walk": [], "walk_dict": [],
                                     "policy": [], "replica": []}
    policy = decider.policy
    hasher = decider.hasher("")
    clock = time.perf_counter_ns
    for i in range(iters):
        req = reqs[i % len(reqs)]
        t0 = clock()
        tokens, top = request_token_ids(req.msg, req.wire)
        check_tokens(tokens, LIMITS, top=top)
        t1 = clock()
        keys = hasher.keys(tokens)
        t2 = clock()
        t = clock()
        index.match(keys)
        times["walk"].append((clock() - t) / 1000)
        query = rank_request(policy, index, keys, len(tokens), BLOCK, reg.loads,
                             keys[0]).query
        t = clock()
        policy.rank(query)
        times["policy"].append((clock() - t) / 1000)
        # The same request for a prefix in demand: where to copy it (a second ranking).
        hot = replace(query, prefix_rate=1.0)
        best = policy.rank(hot)[0].worker
        t = clock()
        policy.replica(hot, best)
        times["replica"].append((clock() - t) / 1000)
        times["ids"].append((t1 - t0) / 1000)
        times["hash"].append((t2 - t1) / 1000)
    # The pure-Python map's walk in a pass of its own: interleaved, it would evict the C
    # map's entries between decisions, which a router's walks do not suffer.
    for i in range(iters):
        keys = hasher.keys(request_token_ids(reqs[i % len(reqs)].msg)[0])
        t = clock()
        dict_index.match(keys)
        times["walk_dict"].append((clock() - t) / 1000)
    return {k: pct(v, 50) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=1_000_000, help="index size")
    ap.add_argument("--iters", type=int, default=300, help="decisions timed per case")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=COUNTS, default=[16, 128],
                    help="cluster sizes, comma-separated (default 16,128)")
    ap.add_argument("--hot", type=float, default=0.0,
                    help="share of the workers caching each query prompt's prefix (0: 1-4)")
    ap.add_argument("--prompts", type=COUNTS, default=[1024, 8192, 32768],
                    help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--pending", type=int, default=4000,
                    help="most prompt tokens left to prefill per worker (0: a quiet "
                         "cluster, whose workers differ only in their running sequences "
                         "and whose rankings hold long runs of equal costs)")
    args = ap.parse_args()
    print(f"{'prompt':>7} {'workers':>7} {'queued':>6} | {'kvroute p50':>11} {'p99':>8} |"
          f" {'baseline p50':>12} {'p99':>8} | {'p99 ratio':>9} | p50 of: ids  hash  walk"
          f" (dict map)  policy  replica")
    for workers in args.workers:
        rng = random.Random(args.seed)
        lengths = tuple(args.prompts)
        prompts = {n: [[rng.randrange(50257) for _ in range(n)] for _ in range(20)]
                   for n in lengths}
        t0 = time.perf_counter()
        index, naive, names = build(workers, args.entries,
                                    [p for ps in prompts.values() for p in ps], rng,
                                    args.hot)
        build_s = time.perf_counter() - t0
        dict_index = PrefixIndex(native=False)
        for w, held in naive.items():
            dict_index.add(w, held)
        decider = Decider(MODEL, BLOCK, Kvroute())
        hasher = BlockHasher(BLOCK, MODEL, native=False)  # the baseline is all Python
        policy = Kvroute()
        for n, queued in itertools.product(lengths, (0, 2)):
            reg = registry(names, queued, rng, args.pending)
            reqs = [received(p) for p in prompts[n]]
            # Same answers from both, or the comparison means nothing.
            for r in reqs[:5]:
                assert kvroute_decide(r, decider, index, reg) == naive_decide(
                    r, naive, reg, hasher, policy)
            ours = timeit(functools.partial(kvroute_decide, decider=decider, index=index,
                                            reg=reg), reqs, args.iters)
            base = timeit(functools.partial(naive_decide, naive=naive, reg=reg, hasher=hasher,
                                            policy=policy), reqs, max(30, args.iters // 5))
            st = stages(reqs, decider, index, dict_index, reg, args.iters)
            print(f"{n:>7} {workers:>7} {'0' if not queued else f'0-{2 * queued}':>6} |"
                  f" {pct(ours, 50):>9.0f}us"
                  f" {pct(ours, 99):>6.0f}us | {pct(base, 50):>10.0f}us {pct(base, 99):>6.0f}us"
                  f" | {pct(base, 99) / pct(ours, 99):>8.1f}x | {st['ids']:>11.0f} "
                  f"{st['hash']:>5.0f} {st['walk']:>5.0f} ({st['walk_dict']:>6.0f})"
                  f" {st['policy']:>7.0f} {st['replica']:>8.0f}", flush=True)
        print(f"        (index of {index.entries():,} entries built in {build_s:.1f}s)")


if __name__ == "__main__":
    main()
