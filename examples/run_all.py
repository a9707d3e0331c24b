"""Start a local cluster in this process (a redis-server, two `tiny` agents, a router) and
run every example against it: ``python examples/run_all.py`` (``--engine sim``: two `sim`
agents instead; same outputs' shape, sim content, logprob 0). ``--router HOST:PORT`` runs them
against a cluster already up instead (``kvroute demo --serve`` starts one)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import best_of_n_json
import multiple_choice
import tree_search

from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.demo.procs import scratch_redis
from kvroute.router.app import RouterApp
from kvroute.worker_agent.server import AgentApp

EXAMPLES = (best_of_n_json, multiple_choice, tree_search)


async def run_all(router: str) -> None:
    for ex in EXAMPLES:
        await ex.main(router)
        print()


async def main(engine: str = "tiny") -> None:
    async with scratch_redis() as url:
        apps: list[AgentApp | RouterApp] = []
        try:
            for wid in ("t0", "t1"):
                agent = AgentApp(AgentConfig.of(redis=url, port=0, worker_id=wid, engine=engine,
                                             tokenizer="byte", vocab_size=258,
                                             capacity_blocks=512))
                await agent.start()
                apps.append(agent)
            router = RouterApp(RouterConfig.of(redis=url, port=0, vocab_size=258,
                                            tokenizer="byte"))
            await router.start(wait_for_redis_s=5.0)
            apps.append(router)
            while len(router.registry.loads) < 2:
                await asyncio.sleep(0.1)
            await run_all(f"127.0.0.1:{router.port}")
        finally:
            for app in reversed(apps):
                await app.stop(grace_s=0.5)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("tiny", "sim"), default="tiny",
                    help="the agents' engine (sim: no model, constraints through its masks)")
    ap.add_argument("--router", default="",
                    help="HOST:PORT of a running router (its agents: --tokenizer byte "
                         "--vocab-size 258) instead of starting a cluster here")
    args = ap.parse_args()
    asyncio.run(run_all(args.router) if args.router else main(args.engine))
