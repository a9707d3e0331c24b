"""Best-of-N JSON extraction: fork 4 sampled, schema-constrained extractions that share the
prompt's cached prefix, keep the one the model likes best (total log-probability)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fork, gen, router_arg, run_program, show

from kvroute.v1 import common_pb2
from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "city": {"enum": ["Paris", "Oslo", "Lima"]}},
}
PROMPT = ("Extract the person as JSON.\nText: Ada Lovelace, 36, lives in Paris and writes "
          "programs for the Analytical Engine.\nJSON: ")


async def main(router: str) -> list[common_pb2.GenerateResponse]:
    extract = gen(80, temperature=0.8, capture="person",
                  constraint=P.Constraint(json_schema=json.dumps(SCHEMA)))
    resps = await run_program(router, PROMPT, [fork([extract], n=4,
                                                    select=P.SELECT_MODE_BEST_LOGPROB)],
                              seed=42)
    print("best-of-4 JSON extraction (schema-constrained, select best logprob):")
    show(resps)
    best = next(r for r in resps[-1].results if r.selected)
    print("  parsed:", json.loads(best.variables["person"].text))
    return resps


if __name__ == "__main__":
    asyncio.run(main(router_arg()))
