"""Speed of ``--engine tiny`` on this CPU: prefill and decode tokens/s through the engine.

    .venv/bin/python bench/tiny_engine.py [--dim 64 --layers 2 --prompt 1024 --batch 16]

Prefill: one uncached prompt of ``--prompt`` tokens, max_tokens=1 (time to first token), then
the same prompt again (cached but for its last block). Decode: ``--batch`` concurrent
requests with short prompts, ``--decode`` tokens each; tokens/s = all output tokens / wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from kvroute.worker_agent.engines.base import EngineRequest
from kvroute.worker_agent.engines.tiny import TinyConfig, TinyEngine


async def run(engine: TinyEngine, tokens: list[int], max_tokens: int, rid: str) -> int:
    n = 0
    async for chunk in engine.generate(EngineRequest(rid, tokens, max_tokens)):
        n += len(chunk.token_ids)
    return n


async def main(args: argparse.Namespace) -> None:
    engine = TinyEngine(TinyConfig(dim=args.dim, layers=args.layers, heads=max(1, args.dim // 16),
                                   capacity_blocks=args.capacity, max_batch=args.batch))
    rng = np.random.default_rng(0)
    await engine.start()
    try:
        await run(engine, rng.integers(0, 256, 64).tolist(), 2, "warmup")
        prompt = rng.integers(0, 256, args.prompt).tolist()
        t0 = time.perf_counter()
        await run(engine, prompt, 1, "cold")
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        await run(engine, prompt, 1, "warm")
        warm = time.perf_counter() - t0
        print(f"prefill  {args.prompt} tokens uncached: {cold * 1e3:7.1f} ms  "
              f"({args.prompt / cold:,.0f} tokens/s)")
        print(f"         same prompt, cached:        {warm * 1e3:7.1f} ms")
        for batch in sorted({1, args.batch}):
            prompts = [rng.integers(0, 256, 32).tolist() for _ in range(batch)]
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(run(engine, p, args.decode, f"d{i}")
                                            for i, p in enumerate(prompts)))
            dt = time.perf_counter() - t0
            print(f"decode   batch {batch:3d} x {args.decode} tokens: {dt * 1e3:7.1f} ms  "
                  f"({sum(counts) / dt:,.0f} tokens/s, {dt / args.decode * 1e3:.1f} ms/step)")
    finally:
        await engine.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=1024)
    asyncio.run(main(ap.parse_args()))
