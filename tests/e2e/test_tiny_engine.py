"""End to end with real forward passes: two ``--engine tiny`` agents behind a router."""

from __future__ import annotations

from tests.support import generate, wait_for


def tokens_of(responses: list) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_tiny_agents_reuse_a_cached_prefix_with_identical_output(cluster) -> None:
    for wid in ("a", "b"):
        await cluster.agent(wid, engine="tiny", tokenizer="byte", vocab_size=258,
                            capacity_blocks=128)
    router = await cluster.router(tokenizer="byte", vocab_size=258)
    await wait_for(lambda: len(router.registry.loads) == 2, what="2 tiny workers registered")
    system = "You are kvroute's test assistant. Answer in one short line. " * 4  # 244 bytes
    first = await generate(router.port, text=system + "Q: what is cached?", max_tokens=8)
    w = first[0].worker_id
    assert first[0].cached_tokens == 0
    await wait_for(lambda: router.mirror.index.count(w) >= len(system) // 16, what="feed applied")
    again = await generate(router.port, text=system + "Q: what is cached?", max_tokens=8)
    assert again[0].worker_id == w
    assert again[0].cached_tokens == (len(system) + 18 - 1) // 16 * 16 > 0
    assert again[-1].usage.cached_tokens == again[0].cached_tokens
    assert tokens_of(again) == tokens_of(first)  # same logits from the cache: same tokens
    assert len(tokens_of(first)) == 8 and all(t < 258 for t in tokens_of(first))
    other = await generate(router.port, text=system + "Q: and what is not?", max_tokens=4)
    assert other[0].worker_id == w and other[0].cached_tokens >= 240
