"""Controller programs on ``--engine tiny`` with GPT-2's vocabulary (50257 ids).

    .venv/bin/python bench/controller.py [--tokens 48 --branches 4 --rounds 3]

1. Token-mask time per decode step (the agent's ``mask_fn``: feed the matcher the new
   token(s), check for a grammar fast-forward, fill llguidance's bitmask, expand it to the
   engine's boolean mask), p50/p99, for a JSON schema, a regex and a Lark grammar; measured
   inside the real decode loop (runtime + engine), sampled branches at temperature 1. Two
   figures: the compute time of each mask_fn call, and what the decode loop waits for masks
   per step: the tiny engine computes a step's masks while its forward pass runs, so only
   mask time past the end of the forward delays the step (``TinyEngine.mask_waits``).
2. Runtime overhead per generated token against plain generation on the same engine, in the
   same run: plain engine requests (the baseline), the same tokens as an unconstrained
   program ``gen`` (runtime only), and a regex-constrained ``gen``; printed as ratios.
3. Fork prefill: N branches after a shared prompt, as one program (children share the cached
   prefix) against N independent requests submitted together (what routing each branch as
   its own request gives when they land on one worker at once). Then the branches' time to
   first token: the program as the agent runs it (the first child prefills the prefix with
   its suffix, the others follow) against a 1-token warm-up request followed by the fork
   (how the agent ran forks before), on fresh prompts, median of the rounds.
4. The same through a real router and two tiny agents (byte vocabulary; a local
   redis-server): a fork program against N independent requests sent together through the
   router, prefill counted on the agents' engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from kvroute.core.tokenizer import GPT2Tokenizer
from kvroute.v1 import common_pb2
from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from kvroute.worker_agent.controller import ProgramLimits, ProgramRuntime
from kvroute.worker_agent.engines.base import EngineRequest
from kvroute.worker_agent.engines.tiny import TinyConfig, TinyEngine

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 10}}}}
REGEX = r"[a-z]+( [a-z]+){0,12}\. [A-Z][a-z0-9 ,]{0,60}"
LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | NAME | "(" expr ")"
NUMBER: /[0-9]{1,4}/
NAME: /[a-z]{1,6}/
"""
CONSTRAINTS = {"json_schema": P.Constraint(json_schema=json.dumps(SCHEMA)),
               "regex": P.Constraint(regex=REGEX), "lark": P.Constraint(lark=LARK)}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


async def stream(rt: ProgramRuntime, prompt: list[int], steps: list[P.Step],
                 seed: int) -> AsyncIterator[common_pb2.GenerateResponse]:
    """Run a program on the runtime, as the agent's Generate does; its response stream."""
    prog = P.ControllerProgram(steps=steps)
    req = common_pb2.GenerateRequest(token_ids=prompt, program=prog,
                                     sampling=common_pb2.SamplingParams(seed=seed))
    prep = await rt.prepare(prog)
    async for r in rt.run(prep, req, f"bench-{seed}-{time.monotonic_ns()}"):
        yield r


async def program(rt: ProgramRuntime, prompt: list[int], steps: list[P.Step],
                  seed: int) -> list[common_pb2.GenerateResponse]:
    return [r async for r in stream(rt, prompt, steps, seed)]


async def first_tokens(rt: ProgramRuntime, prompt: list[int], steps: list[P.Step], seed: int,
                       t0: float) -> list[float]:
    """Run a program; each branch's first token, in seconds after ``t0``."""
    first: dict[str, float] = {}
    async for r in stream(rt, prompt, steps, seed):
        if r.token_ids and r.branch_id not in first:
            first[r.branch_id] = time.perf_counter() - t0
    return list(first.values())


async def plain(engine: TinyEngine, prompt: list[int], n: int, rid: str) -> int:
    got = 0
    async for chunk in engine.generate(EngineRequest(rid, prompt, n)):
        got += len(chunk.token_ids)
    return got


def fork(step: P.Step, n: int) -> P.Step:
    return P.Step(fork=P.Fork(branches=[P.ControllerProgram(steps=[step])], n=n))


async def main(args: argparse.Namespace) -> None:
    tok = GPT2Tokenizer()
    engine = TinyEngine(TinyConfig(capacity_blocks=2048, vocab_size=tok.vocab_size,
                                   eos_token_id=tok.eos_token_id, dim=args.dim,
                                   layers=args.layers, heads=max(1, args.dim // 16)))
    await engine.start()
    rt = ProgramRuntime(engine, ProgramLimits(
        max_fanout=64, max_tokens=1 << 20, max_steps=1000, max_grammar_bytes=1 << 20,
        compile_timeout_s=30.0, max_new_tokens=4096, vocab_size=tok.vocab_size), "gpt2",
        "bench")
    t0 = time.perf_counter()
    await rt.vocab()
    print(f"GPT-2 vocabulary for llguidance: {tok.vocab_size} tokens, built in "
          f"{time.perf_counter() - t0:.2f} s (once per agent)")
    prompt = tok.encode("Extract the record as JSON, then write a short sentence and a "
                        "formula about it. The record: Ada, 36, tags math and engines. ")

    print(f"\n1. mask time per decode step (mask_fn), {args.branches} sampled branches x "
          f"{args.rounds} rounds, up to {args.tokens} tokens each")
    print(f"{'constraint':<12} {'calls':>6} {'compute p50 / p99 us':>21} "
          f"{'steps':>6} {'step wait p50 / p99 us':>23}   "
          "targets: p99 < 1000 us (json, regex), < 5000 us (lark)")
    for name, c in CONSTRAINTS.items():
        rt.mask_times = []
        engine.mask_waits = []
        for r in range(args.rounds):
            g = P.Step(gen=P.Gen(max_tokens=args.tokens, temperature=1.0, constraint=c))
            await program(rt, prompt, [fork(g, args.branches)], seed=r + 1)
        ts = [t * 1e6 for t in rt.mask_times]
        ws = [t * 1e6 for t in engine.mask_waits]
        print(f"{name:<12} {len(ts):>6} {pct(ts, 50):>9.1f} / {pct(ts, 99):>9.1f} "
              f"{len(ws):>6} {pct(ws, 50):>10.1f} / {pct(ws, 99):>10.1f}")
    rt.mask_times = None
    engine.mask_waits = None

    n = args.tokens * 2
    print(f"\n2. time per generated token, {args.branches} concurrent sequences x {n} "
          f"tokens, best of {args.rounds}")

    async def timed(fn: Any) -> float:
        best = float("inf")
        for r in range(args.rounds):
            t = time.perf_counter()
            await fn(r)
            best = min(best, time.perf_counter() - t)
        return best / (n * args.branches)

    async def run_plain(r: int) -> None:
        await asyncio.gather(*(plain(engine, [*prompt, i, r], n, f"p{r}-{i}")
                               for i in range(args.branches)))

    async def run_gen(r: int, constraint: P.Constraint | None = None) -> None:
        kw: dict[str, Any] = {"constraint": constraint} if constraint is not None else {}
        g = P.Step(gen=P.Gen(max_tokens=n, **kw))
        await asyncio.gather(*(program(rt, [*prompt, i, r], [g], seed=1)
                               for i in range(args.branches)))

    base = await timed(run_plain)
    unconstrained = await timed(run_gen)
    regex = await timed(lambda r: run_gen(r, P.Constraint(regex=r"[a-z ]{1,4000}")))
    print(f"{'plain engine requests (baseline)':<36} {base * 1e3:8.3f} ms/token  1.00x")
    print(f"{'program gen, unconstrained':<36} {unconstrained * 1e3:8.3f} ms/token  "
          f"{unconstrained / base:.2f}x")
    print(f"{'program gen, regex constraint':<36} {regex * 1e3:8.3f} ms/token  "
          f"{regex / base:.2f}x")

    print(f"\n3. fork of {args.branches} after a shared prompt of {args.prefix} tokens "
          f"(block size {engine.block_size})")
    shared = [(7 * i) % 50000 for i in range(args.prefix)]
    before = engine.stats.prefill_tokens
    resps = await program(rt, shared, [fork(P.Step(gen=P.Gen(max_tokens=8,
                                                             temperature=1.0)),
                                            args.branches)], seed=9)
    prog_prefill = engine.stats.prefill_tokens - before
    children = [r for r in resps[-1].results]
    cached = sorted({r.cached_tokens for r in children})
    shared2 = [(11 * i) % 50000 for i in range(args.prefix)]
    before = engine.stats.prefill_tokens
    await asyncio.gather(*(plain(engine, [*shared2, 1000 + i], 8, f"ind-{i}")
                           for i in range(args.branches)))
    ind_prefill = engine.stats.prefill_tokens - before
    print(f"program fork:          prefilled {prog_prefill:6d} tokens in all "
          f"(children's cached_tokens {cached})")
    print(f"independent requests:  prefilled {ind_prefill:6d} tokens in all  "
          f"({ind_prefill / max(prog_prefill, 1):.2f}x the fork)")
    g8 = [fork(P.Step(gen=P.Gen(max_tokens=8, temperature=1.0)), args.branches)]
    led: list[float] = []
    warmed: list[float] = []
    for r in range(args.rounds * 3):
        fresh = [(13 * i + 101 * r + 7) % 50000 for i in range(args.prefix)]
        t0 = time.perf_counter()
        led.append(float(np.mean(await first_tokens(rt, fresh, g8, r, t0))))
        fresh = [(17 * i + 103 * r + 5) % 50000 for i in range(args.prefix)]
        t0 = time.perf_counter()
        await plain(engine, fresh, 1, f"warm-{r}")
        warmed.append(float(np.mean(await first_tokens(rt, fresh, g8, r, t0))))
    base, ours = float(np.median(warmed)), float(np.median(led))
    print(f"time to first token, mean of the {args.branches} branches (median of "
          f"{len(led)} fresh prompts):")
    print(f"  warm-up request, then the fork (baseline): {base * 1e3:7.1f} ms  1.00x")
    print(f"  first child leads (the agent):             {ours * 1e3:7.1f} ms  "
          f"{ours / base:.2f}x")
    await engine.stop()
    await through_router(args)


async def through_router(args: argparse.Namespace) -> None:
    import grpc

    from kvroute.core.config import AgentConfig, RouterConfig
    from kvroute.demo.procs import scratch_redis
    from kvroute.router.app import RouterApp
    from kvroute.v1 import router_pb2_grpc
    from kvroute.worker_agent.server import AgentApp

    print(f"\n4. through a router and 2 tiny agents: fork of {args.branches} after "
          f"{args.prefix} shared tokens, against {args.branches} independent requests")
    async with scratch_redis() as url:
        agents = [AgentApp(AgentConfig.of(redis=url, port=0, worker_id=f"a{i}", engine="tiny",
                                       tokenizer="byte", vocab_size=258, capacity_blocks=1024,
                                       heartbeat_s=0.2)) for i in range(2)]
        router = RouterApp(RouterConfig.of(redis=url, port=0, vocab_size=258))
        started: list[Any] = []
        try:
            for a in agents:
                await a.start()
                started.append(a)
            await router.start(wait_for_redis_s=5.0)
            started.append(router)
            while len(router.registry.loads) < 2:
                await asyncio.sleep(0.05)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
                await fork_vs_independent(args, router_pb2_grpc.RouterStub(ch), agents)
        finally:
            for app in reversed(started):
                await app.stop(grace_s=0.5)


async def fork_vs_independent(args: argparse.Namespace, stub: Any, agents: list[Any]) -> None:
    def prefilled() -> int:
        return sum(a.engine.stats.prefill_tokens for a in agents)

    before = prefilled()
    req = common_pb2.GenerateRequest(
        token_ids=[(7 * i) % 256 for i in range(args.prefix)],
        program=P.ControllerProgram(steps=[fork(P.Step(gen=P.Gen(
            max_tokens=8, temperature=1.0)), args.branches)]),
        sampling=common_pb2.SamplingParams(seed=9))
    resps = [r async for r in stub.Generate(req)]
    prog = prefilled() - before
    prog_workers = {r.worker_id for r in resps if r.worker_id}
    cached = sorted({r.cached_tokens for r in resps[-1].results})
    shared = [(11 * i) % 256 for i in range(args.prefix)]
    before = prefilled()

    async def one(i: int) -> str:
        r = common_pb2.GenerateRequest(token_ids=[*shared, i],
                                       sampling=common_pb2.SamplingParams(max_tokens=8))
        return [c async for c in stub.Generate(r)][-1].worker_id

    ind_workers = set(await asyncio.gather(*(one(i) for i in range(args.branches))))
    ind = prefilled() - before
    print(f"program fork via router:   prefilled {prog:6d} tokens on {sorted(prog_workers)} "
          f"(children's cached_tokens {cached})")
    print(f"independent via router:    prefilled {ind:6d} tokens on {sorted(ind_workers)} "
          f"({ind / max(prog, 1):.2f}x the fork)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    asyncio.run(main(ap.parse_args()))
