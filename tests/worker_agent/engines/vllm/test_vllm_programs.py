"""Controller programs on ``--engine vllm``: a real router -> a real agent -> the fake vLLM
(tests/worker_agent/engines/vllm/fake_vllm.py), once per end of the supported range. Constrained
gens go in the fields the release reads (``structured_outputs``; 0.10.2: ``guided_*``),
which the agent picks from vLLM's ``/version``; the fake reads only those, and does not
enforce grammars (real vLLM does): it answers a ``choice`` with the first option, which is
all these tests need. What the fake received is the oracle for the requests the runtime
made."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import httpx
import pytest

from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from tests.e2e.test_programs import back, fork, gen, results, run
from tests.support import wait_for

W = "v0"
PROMPT = list(b"Question: which colour is the sky on a clear day? Options: blue, red, green."
              b" Answer:  ")  # 86 tokens: 5 full blocks of 16
CHOICES = ["blue", "red", "green"]


async def start(cluster, fake):
    agent = await cluster.agent(W, engine="vllm", vllm_url=fake.url, vllm_events=fake.events,
                                vllm_replay=fake.replay, vllm_model="fake-model",
                                tokenizer="byte", vocab_size=258)
    await asyncio.wait_for(agent.engine.events.ready.wait(), 5)
    router = await cluster.router(vocab_size=258)
    await wait_for(lambda: W in router.registry.loads, what="agent registered")
    return agent, router


def received(fake) -> list[dict[str, Any]]:
    return httpx.get(fake.url + "/control/requests").json()


def constraint(fake, body: dict[str, Any]) -> dict[str, Any] | None:
    """The constraint a request carried, as ``structured_outputs``; it must be in the fields
    the fake's release reads (the others it would ignore, generating unconstrained)."""
    sent = {k for k in body if k == "structured_outputs" or k.startswith("guided_")}
    assert sent <= fake.release.constraint_fields, \
        f"vLLM {fake.release.version} ignores {sorted(sent - fake.release.constraint_fields)}"
    if "structured_outputs" in body:
        return body["structured_outputs"]
    return {k.removeprefix("guided_"): v for k, v in body.items() if k.startswith("guided_")}


async def test_fork_choice_select_through_a_router_with_cached_tokens_from_usage(
        cluster, fake_vllm) -> None:
    fake = fake_vllm("--vocab", "258")
    agent, router = await start(cluster, fake)
    assert len(PROMPT) == 86
    # The leading child's stored blocks never reach the agent: its prediction for the
    # others stays 0, so the 80 they report can only come from vLLM's usage.
    fake.drop(next_n=1)
    choose = P.Constraint(choices=P.Choices(options=CHOICES))
    steps = [fork([gen(10, temperature=1.0, constraint=choose, capture="answer")], n=3,
                  select=P.SELECT_MODE_BEST_LOGPROB)]
    resps = await run(router.port, steps, prompt=PROMPT, seed=7, router=True)
    assert {r.worker_id for r in resps} == {W}
    res = results(resps)
    assert set(res) == {"0.0", "0.1", "0.2"}
    kept = [r for r in res.values() if r.selected]
    assert [r.branch_id for r in kept] == ["0.0"]  # equal outputs, equal logprobs: the first
    for r in res.values():
        v = r.variables["answer"]
        assert v.text == "blue" and v.complete and bytes(r.token_ids) == b"blue"
        assert r.engine_requests == 1
    # The first child leads on the cold cache; the others start once it has prefilled.
    assert (res["0.0"].cached_tokens, res["0.0"].prefill_tokens) == (0, 86)
    for bid in ("0.1", "0.2"):
        assert (res[bid].cached_tokens, res[bid].prefill_tokens) == (80, 6)
    assert resps[-1].usage.cached_tokens == 0  # the prompt's hit: the leader's, cold
    children = received(fake)
    assert len(children) == 3  # no warm-up request
    for body in children:
        assert body["prompt"] == PROMPT  # the branch's whole sequence: vLLM's prefix cache
        assert constraint(fake, body) == {"choice": CHOICES}
        assert body["max_tokens"] == 10 and body["temperature"] == 1.0
        assert 256 in body["stop_token_ids"]  # the vocabulary's eos
    assert len({body["seed"] for body in children}) == 3  # siblings sample differently
    await wait_for(lambda: agent.engine.load().running == 0, what="requests done")


async def test_best_logprob_uses_vllms_log_probabilities(cluster, fake_vllm) -> None:
    from tests.worker_agent.engines.vllm.fake_vllm import fake_logprob

    fake = fake_vllm("--vocab", "258")
    _, router = await start(cluster, fake)
    steps = [fork([gen(5, temperature=1.0)], n=4, select=P.SELECT_MODE_BEST_LOGPROB)]
    res = results(await run(router.port, steps, prompt=PROMPT, seed=3, router=True))
    sums = {k: sum(fake_logprob(t) for t in r.token_ids) for k, r in res.items()}
    assert len(set(sums.values())) > 1  # the branches sampled differently
    for k, r in res.items():
        assert list(r.token_logprobs) == pytest.approx([fake_logprob(t) for t in r.token_ids])
        assert r.logprob == pytest.approx(sums[k])
    assert [k for k, r in res.items() if r.selected] == [max(sums, key=sums.__getitem__)]
    assert all(body["logprobs"] == 0 for body in received(fake)[1:])


async def test_backtrack_and_fast_forward_resubmit_the_edited_prompt(cluster, fake_vllm
                                                                     ) -> None:
    fake = fake_vllm("--vocab", "258")
    _, router = await start(cluster, fake)
    ff = P.Step(fast_forward=P.FastForward(tokens=P.TokenIds(ids=[65, 66, 67])))
    res = results(await run(router.port, [gen(6, capture="x"), back(2), ff,
                                          gen(4, capture="y")], prompt=PROMPT, router=True))
    x, y = list(res["0"].variables["x"].token_ids), list(res["0"].variables["y"].token_ids)
    assert len(x) == 6 and len(y) == 4
    assert list(res["0"].token_ids) == [*x[:4], 65, 66, 67, *y]
    assert res["0"].engine_requests == 2
    first, second = received(fake)
    assert first["prompt"] == PROMPT and first["max_tokens"] == 6
    # One resubmission, its prompt edited next to the engine: 2 tokens dropped, 3 appended.
    assert second["prompt"] == [*PROMPT, *x[:4], 65, 66, 67] and second["max_tokens"] == 4
    # A regex answered as a literal, and the second request hit the first one's blocks.
    lit = P.Constraint(regex="sky|cloud")
    res = results(await run(router.port, [ff, gen(8, constraint=lit, capture="w")],
                            prompt=PROMPT, router=True))
    assert res["0"].variables["w"].text == "sky" and res["0"].variables["w"].complete
    assert constraint(fake, received(fake)[-1]) == {"regex": "sky|cloud"}
    assert res["0"].cached_tokens == 80


async def test_vllm_refuses_what_it_cannot_do_and_checks_what_it_returns(cluster, fake_vllm
                                                                          ) -> None:
    fake = fake_vllm("--vocab", "258")
    agent, router = await start(cluster, fake)
    # continue_constraint of a Lark grammar, or of a JSON schema with no regex, would need
    # the grammar's state mid-region, which vLLM cannot take: refused before any request.
    for c, why in ((P.Constraint(json_schema='{"type": "object"}'), "without properties"),
                   (P.Constraint(lark='start: "a"+'), "context-free")):
        steps = [gen(3, constraint=c), gen(3, continue_constraint=True)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run(router.port, steps, prompt=PROMPT, router=True)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "continue_constraint" in err.value.details()
        assert why in err.value.details()
    assert received(fake) == []
    # The fake ignores JSON schemas without examples (as a vLLM ignoring the fields would): the
    # runtime's own check of the output fails the program instead of returning it (asked of
    # the agent directly: a router reports any mid-stream failure as UNAVAILABLE).
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_gen = gen(12, constraint=P.Constraint(json_schema=json.dumps(schema)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run(agent.port, [json_gen], prompt=PROMPT)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "outside the json_schema constraint" in err.value.details()
    assert constraint(fake, received(fake)[0]) == {"json": schema}


async def test_a_regular_constraint_continues_as_the_regex_of_its_rest(cluster, fake_vllm
                                                                       ) -> None:
    """vLLM starts each request's grammar from its beginning, so a continued region is sent
    as what is left of its constraint: the regex of the strings that complete the text
    generated in it so far (here for each branch of a fork, after the parent stopped
    mid-region). The fake answers a literal regex with its first alternative."""
    fake = fake_vllm("--vocab", "258")
    _agent, router = await start(cluster, fake)
    sky = P.Constraint(regex="skyline|sky blue|cloudy")
    steps = [gen(3, constraint=sky, capture="a"),
             fork([gen(8, continue_constraint=True, capture="b")], n=2)]
    res = results(await run(router.port, steps, prompt=PROMPT, router=True))
    first, *rest = received(fake)
    assert constraint(fake, first) == {"regex": "skyline|sky blue|cloudy"}
    assert first["max_tokens"] == 3  # "sky": the region is still open
    assert [constraint(fake, r) for r in rest] == [{"regex": "line| blue"}] * 2
    for b in ("0.0", "0.1"):
        assert bytes(res[b].token_ids) == b"skyline"
        v = res[b].variables["b"]  # a capture in a constrained region holds all of it
        assert v.text == "skyline" and v.complete
    assert res["0.0"].variables["a"].text == "sky" and not res["0.0"].variables["a"].complete
    # A choice continues the same way; its rest is written as a regex with the options'
    # special characters escaped.
    opts = P.Constraint(choices=P.Choices(options=["a+b (sum)", "a*b (product)"]))
    steps = [gen(2, constraint=opts), gen(20, continue_constraint=True, capture="c")]
    res = results(await run(router.port, steps, prompt=PROMPT, router=True))
    assert constraint(fake, received(fake)[-1]) == {"regex": "b \\(sum\\)"}
    assert res["0"].variables["c"].text == "a+b (sum)" and res["0"].variables["c"].complete
    # A region complete with nothing more allowed is not asked for again.
    n = len(received(fake))
    steps = [gen(7, constraint=sky), gen(5, continue_constraint=True, capture="d")]
    res = results(await run(router.port, steps, prompt=PROMPT, router=True))
    assert len(received(fake)) == n + 1
    assert res["0"].variables["d"].text == "skyline" and res["0"].variables["d"].complete


async def test_a_json_schema_continues_as_the_regex_of_its_rest(cluster, fake_vllm) -> None:
    """A flat JSON schema is regular: a region it constrains continues as the regex of the
    JSON texts that complete it (``json_regex``, then the derivative). The fake
    answers the schema with its example, cut here by ``max_tokens``, and the rest (a
    literal once the enum is decided) with itself."""
    fake = fake_vllm("--vocab", "258")
    agent, router = await start(cluster, fake)
    schema = {"type": "object", "required": ["colour"], "examples": [{"colour": "blue"}],
              "properties": {"colour": {"enum": ["blue", "red"]}}, "additionalProperties": False}
    steps = [gen(12, constraint=P.Constraint(json_schema=json.dumps(schema)), capture="a"),
             gen(20, continue_constraint=True, capture="b")]
    res = results(await run(router.port, steps, prompt=PROMPT, router=True))
    first, second = received(fake)[-2:]
    assert constraint(fake, first) == {"json": schema} and first["max_tokens"] == 12
    # Whitespace may follow, as vLLM's guidance backend and the agent's check allow it.
    assert constraint(fake, second) == {"regex": 'lue"[ \\t\\n\\r]*\\}'}
    v = res["0"].variables
    assert v["a"].text == '{"colour":"b' and not v["a"].complete
    assert v["b"].text == '{"colour":"blue"}' and v["b"].complete
    # Text valid for the schema but outside the regex's subset (a property the schema does
    # not name, which the agent's check lets through): refused when continued, with why
    # (asked of the agent directly: a router reports a mid-stream failure as UNAVAILABLE).
    n = len(received(fake))
    schema["examples"] = [{"colour": "red", "extra": 1}]
    del schema["additionalProperties"]
    steps = [gen(20, constraint=P.Constraint(json_schema=json.dumps(schema))),
             gen(20, continue_constraint=True)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run(agent.port, steps, prompt=PROMPT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "schema's properties only" in err.value.details()
    assert len(received(fake)) == n + 1  # the continuation was never sent
