"""Why a request finds no worker, told to the client: a worker speaking another vocabulary
than the router's is left out loudly, and a worker marked down after a failure is named
with that failure. Real agents, router and redis-server on loopback ports."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import grpc
import pytest

from tests.support import generate, route, wait_for

pytest.importorskip("tokenizers")  # the gpt2 tokenizer of the tiny engine

TINY = dict(engine="tiny", capacity_blocks=64)


def excluded(router: Any, worker: str) -> float | None:
    return router.metrics.registry.get_sample_value(
        "kvroute_router_worker_excluded", {"worker": worker, "reason": "tokenizer"})


async def heartbeat_seen(router: Any, worker: str) -> None:
    await wait_for(lambda: (i := router.registry.get(worker)) is not None
                   and i.heartbeat is not None, what=f"{worker}'s heartbeat")


async def test_a_byte_router_excludes_a_gpt2_worker_and_says_why(cluster, caplog) -> None:
    """Without the check its replies came back with empty text (GPT-2 ids decoded as
    bytes): now the worker gets no request, the router says so once, counts it, and the
    client's UNAVAILABLE names the worker and both vocabularies."""
    await cluster.agent("g", tokenizer="gpt2", **TINY)
    with caplog.at_level(logging.INFO, "kvroute.router.registry"):
        router = await cluster.router(tokenizer="byte", vocab_size=258)
        await heartbeat_seen(router, "g")
        hb = router.registry.get("g").heartbeat
        assert (hb.tokenizer, hb.vocab_size) == ("gpt2", 50257)  # what the agent reports
        for rpc in (lambda: generate(router.port, text="hello", max_tokens=2),
                    lambda: route(router.port, [104, 105])):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == (
                "no routable workers: g excluded (tokenizer gpt2/50257, router byte/258)")
        await asyncio.sleep(0.5)  # five more heartbeat scans (poll_interval_s 0.1 s)
    warned = [r for r in caplog.records if r.levelname == "WARNING"
              and getattr(r, "kv", {}).get("worker") == "g"]
    assert len(warned) == 1, warned  # once, not per scan or per request
    assert warned[0].kv["its_vocabulary"] == "gpt2/50257"
    assert warned[0].kv["our_vocabulary"] == "byte/258"
    assert excluded(router, "g") == 1
    assert router.metrics.registry.get_sample_value(
        "kvroute_router_worker_routable", {"worker": "g"}) == 0
    assert router.metrics.registry.get_sample_value(
        "kvroute_router_requests_total",
        {"api": "grpc", "rpc": "Generate", "outcome": "unavailable"}) == 1


async def test_a_mixed_cluster_routes_only_to_the_matching_worker(cluster) -> None:
    """README's two tiny agents (byte and gpt2) behind a byte router: round robin would send
    every other request to the gpt2 one; all go to the byte one, and come back as text."""
    await cluster.agent("b", tokenizer="byte", **TINY)
    await cluster.agent("g", tokenizer="gpt2", **TINY)
    router = await cluster.router(tokenizer="byte", vocab_size=258, policy="round_robin")
    await heartbeat_seen(router, "g")
    await wait_for(lambda: "b" in router.registry.loads, what="b registered")
    outs = [await generate(router.port, text=f"question {i}: what is cached?", max_tokens=4)
            for i in range(4)]
    assert [o[0].worker_id for o in outs] == ["b"] * 4
    assert all("".join(r.text for r in o) for o in outs)  # byte ids decoded: text
    assert set(router.registry.loads) == {"b"}
    assert (excluded(router, "b"), excluded(router, "g")) == (0, 1)


async def test_a_token_id_router_needs_the_same_vocabulary_size(cluster) -> None:
    """No tokenizer on the router: only the size is compared. A sim agent reports its
    --vocab-size alone (its --tokenizer byte does not describe its 50257 ids); the tiny
    byte agent takes 258 ids, not the 50257 the router accepts from its clients."""
    await cluster.agent("s")
    await cluster.agent("b", tokenizer="byte", **TINY)
    router = await cluster.router()
    await heartbeat_seen(router, "b")
    await wait_for(lambda: "s" in router.registry.loads, what="s registered")
    s_hb = router.registry.get("s").heartbeat
    assert (s_hb.tokenizer, s_hb.vocab_size) == ("", 50257)
    assert set(router.registry.loads) == {"s"}
    assert router.registry.get("b").excluded_why == (
        "tokenizer byte/258, router token-ids/50257")
    out = await generate(router.port, [1, 2, 3, 40000])
    assert out[0].worker_id == "s"


async def test_a_single_workers_engine_failure_reaches_the_client(cluster) -> None:
    """The only worker's engine fails a request: the client gets the engine's error, and
    while the router skips that worker (2 s) every request is told which worker is down,
    since when and after what, instead of 'none registered, or all down'. Then it is
    routed to again. (A request the engine refuses for its own content, a prompt larger
    than its KV cache, marks nothing down: tests/e2e/test_faults.py.)"""
    a = await cluster.agent("w0", capacity_blocks=4)
    router = await cluster.router()
    await wait_for(lambda: "w0" in router.registry.loads, what="w0 registered")
    await a.engine.stop()  # its loop gone: every request fails with "engine stopped"
    engine_error = re.escape("engine stopped")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(router.port, list(range(20)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert re.fullmatch(r"no worker could serve the request: w0: UNAVAILABLE engine: "
                        + engine_error, err.value.details()), err.value.details()
    for rpc in (lambda: generate(router.port, [1, 2, 3]), lambda: route(router.port, [1, 2])):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rpc()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert re.fullmatch(r"no routable workers: w0 down since \d+\.\d s ago after: "
                            r"UNAVAILABLE: engine: " + engine_error,
                            err.value.details()), err.value.details()
    await a.engine.start()
    info = router.registry.get("w0")
    await asyncio.sleep(max(0.0, info.down_until - time.monotonic()) + 0.05)
    out = await generate(router.port, [1, 2, 3])
    assert out[0].worker_id == "w0"
