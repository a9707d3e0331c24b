"""Multiple choice: the model answers under a `choices` constraint, greedily and as a
best-of-3 sampled fork with a `select`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ff, fork, gen, router_arg, run_program, show

from kvroute.v1 import common_pb2
from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders

OPTIONS = ["Paris", "Berlin", "Madrid", "Rome"]
PROMPT = "Question: what is the capital of France?\nOptions: " + ", ".join(OPTIONS) + "\n"


async def main(router: str) -> list[common_pb2.GenerateResponse]:
    choose = P.Constraint(choices=P.Choices(options=OPTIONS))
    steps = [
        ff("Answer (greedy): "), gen(10, constraint=choose, capture="greedy"),
        ff("\nAnswer (sampled): "),
        fork([gen(10, temperature=1.0, constraint=choose, capture="sampled")], n=3,
             select=P.SELECT_MODE_BEST_LOGPROB),
    ]
    resps = await run_program(router, PROMPT, steps, seed=7)
    print("multiple choice (choices constraint; best of 3 by logprob):")
    show(resps)
    return resps


if __name__ == "__main__":
    asyncio.run(main(router_arg()))
