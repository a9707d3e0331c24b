"""A small tree search: fork 3 candidate continuations under a regex, keep the best
(logprob), backtrack its last 4 tokens and regrow them 3 ways under the still-open
constraint, keep the best again. Every fork shares the cached prefix on one worker."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import backtrack, ff, fork, gen, router_arg, run_program, show

from kvroute.v1 import common_pb2
from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders

PROMPT = "A serial number has three groups of letters and digits, like AB12-CD34-EF56.\n"


async def main(router: str) -> list[common_pb2.GenerateResponse]:
    serial = P.Constraint(regex=r"[A-Z]{2}[0-9]{2}-[A-Z]{2}[0-9]{2}-[A-Z]{2}[0-9]{2}")
    best = P.SELECT_MODE_BEST_LOGPROB
    steps = [
        ff("Serial: "),
        gen(5, constraint=serial),  # the first group, constraint stays open
        fork([gen(5, temperature=1.0, continue_constraint=True)], n=3, select=best),
        backtrack(4),
        fork([gen(20, temperature=1.0, continue_constraint=True, capture="serial")], n=3,
             select=best),
    ]
    resps = await run_program(router, PROMPT, steps, seed=3)
    print("tree search (fork, score, backtrack, fork again):")
    show(resps)
    return resps


if __name__ == "__main__":
    asyncio.run(main(router_arg()))
