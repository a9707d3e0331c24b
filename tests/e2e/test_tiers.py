"""A lower tier end to end: sim agents with a host tier behind their cache, real Redis and a
real router. Blocks evicted to the host tier reach the router's index as lower-tier blocks,
a prompt whose prefix is held there is routed to it as a hit to load, and loading it brings
the blocks back into GPU memory."""

from __future__ import annotations

import random

import grpc

from kvroute.core.blocks import BlockHasher
from kvroute.core.redis_schema import RedisKeys, unpack_keys
from kvroute.v1 import common_pb2, worker_agent_pb2_grpc
from tests.support import generate, wait_for


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(n)]


async def run_on(port: int, tokens: list[int]) -> None:
    """One request straight to an agent (no router: placed by hand)."""
    req = common_pb2.GenerateRequest(token_ids=tokens,
                                     sampling=common_pb2.SamplingParams(max_tokens=2))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(req)]


async def test_a_prefix_evicted_to_the_host_tier_is_routed_as_a_hit_to_load(cluster) -> None:
    a = await cluster.agent("a", capacity_blocks=64, sim_host_blocks=1024)
    await cluster.agent("b", capacity_blocks=64)  # no tier: a miss there is a full prefill
    router = await cluster.router()
    await wait_for(lambda: len(router.registry.loads) == 2, what="2 workers registered")
    doc = prompt(640, 1)  # 40 blocks
    doc_keys = BlockHasher(16, "default").keys(doc)
    await run_on(a.port, doc)
    for seed in (2, 3):  # two other 40-block prompts through a 64-block cache: doc leaves it
        await run_on(a.port, prompt(640, seed))
    engine = a.engine
    assert set(doc_keys) <= set(engine.lower_keys()), "doc's blocks went to the host tier"
    # Redis holds the lower tier beside the snapshot, and the router's index follows it.
    client = cluster.redis.client()
    k = RedisKeys("default")
    await wait_for(lambda: {unpack_keys(m)[0] for m in client.smembers(k.lower("a"))}
                   == set(engine.lower_keys()), what="lower-tier set in Redis")
    index = router.mirror.index
    await wait_for(lambda: index.lower_keys_of("a") == set(engine.lower_keys())
                   and index.keys_of("a") == set(engine.cached_keys()), what="router's index")
    assert index.gpu_count("a") == len(engine.cached_keys()) - len(engine.lower_keys())
    load = router.registry.loads["a"]
    assert load.lower_tier_s_per_token == 131072 / 25e9  # its agent's --tier-* report
    matched = index.match(doc_keys)
    assert index.lower_blocks(doc_keys, matched) == {"a": matched["a"]}
    # Loading 40 blocks (~6% of their prefill each) beats prefilling them on the idle b.
    out = await generate(router.port, doc + prompt(40, 9))
    assert out[0].worker_id == "a"
    assert out[0].cached_tokens == 640  # loaded, not computed
    # Loaded back: the blocks are in GPU memory again, and the router sees it.
    await wait_for(lambda: not set(doc_keys) & index.lower_keys_of("a"),
                   what="blocks back in GPU memory")
    assert not set(doc_keys) & set(engine.lower_keys())
