"""Controller programs end to end: real agents (tiny engine, real gRPC), llguidance masks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvroute.router.refusal import refused_field
from kvroute.v1 import common_pb2, program_pb2, router_pb2_grpc, worker_agent_pb2_grpc
from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from tests.support import wait_for

TINY = dict(engine="tiny", tokenizer="byte", vocab_size=258, capacity_blocks=256)
PROMPT = list(b"kvroute controller program test prompt: ")  # 41 tokens


def gen(n: int, **kw: Any) -> P.Step:
    return P.Step(gen=P.Gen(max_tokens=n, **kw))


def ff(text: str) -> P.Step:
    return P.Step(fast_forward=P.FastForward(text=text))


def back(k: int) -> P.Step:
    return P.Step(backtrack=P.Backtrack(tokens=k))


def fork(*subs: list[P.Step], n: int = 0, select: int = 0) -> P.Step:
    return P.Step(fork=P.Fork(branches=[P.ControllerProgram(steps=s) for s in subs], n=n,
                              select=select))


async def run(port: int, steps: list[P.Step], prompt: list[int] | None = None, seed: int = 0,
              router: bool = False) -> list[common_pb2.GenerateResponse]:
    req = common_pb2.GenerateRequest(token_ids=prompt or PROMPT,
                                     program=P.ControllerProgram(steps=steps),
                                     sampling=common_pb2.SamplingParams(seed=seed))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub: Any = (router_pb2_grpc.RouterStub(ch) if router
                     else worker_agent_pb2_grpc.WorkerAgentStub(ch))
        return [r async for r in stub.Generate(req)]


@contextlib.asynccontextmanager
async def cancel_when_all_decode(port: int, req: common_pb2.GenerateRequest,
                                 branches: int) -> AsyncIterator[None]:
    """Stream ``req`` from the agent at ``port`` until ``branches`` branches have produced
    tokens, run the body, then cancel the call (as a client that goes away)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(req)
        seen: set[str] = set()
        async for r in call:
            if r.token_ids:
                seen.add(r.branch_id)
            if len(seen) == branches:
                break
        yield
        call.cancel()


def forks(agent: Any) -> dict[str, float | None]:
    """The agent's kvroute_agent_program_forks_total, by how the children started."""
    return {start: agent.metrics.registry.get_sample_value(
        "kvroute_agent_program_forks_total", {"start": start})
        for start in ("led", "cached", "warmed")}


def results(resps: list[common_pb2.GenerateResponse]) -> dict[str, program_pb2.BranchResult]:
    assert resps[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    return {r.branch_id: r for r in resps[-1].results}


def replay(resps: list[common_pb2.GenerateResponse], branch: str) -> list[int]:
    """A client's view of one branch's tokens from the stream (appends and backtracks), with
    forks copying the parent's tokens."""
    seqs: dict[str, list[int]] = {"0": []}
    for r in resps[:-1]:
        seq = seqs.setdefault(r.branch_id, [])
        seq.extend(r.token_ids)
        for e in r.events:
            if e.kind == P.ProgramEvent.KIND_BACKTRACK:
                del seq[len(seq) - e.count:]
            elif e.kind == P.ProgramEvent.KIND_FORKED:
                for c in e.branch_ids:
                    seqs[c] = list(seq)
    return seqs[branch]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{2,4}"
LARK = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,2}/'
CHOICES = ["red", "green", "blue", "re\"d"]


def valid_json(text: str) -> bool:
    v = json.loads(text)
    return (set(v) == {"name", "age", "ok"} and isinstance(v["name"], str)
            and len(v["name"]) <= 6 and type(v["age"]) is int and 0 <= v["age"] <= 120
            and isinstance(v["ok"], bool))


def valid_lark(text: str) -> bool:
    while re.search(r"\(\d+[+*]\d+\)", text):  # reduce innermost (a op b) to a number
        text = re.sub(r"\(\d+[+*]\d+\)", "0", text)
    return re.fullmatch(r"\d{1,2}", text) is not None


@pytest.mark.parametrize(("constraint", "check"), [
    (P.Constraint(json_schema=json.dumps(SCHEMA)), valid_json),
    (P.Constraint(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    (P.Constraint(lark=LARK), valid_lark),
    (P.Constraint(choices=P.Choices(options=CHOICES)), lambda t: t in CHOICES),
], ids=["json_schema", "regex", "lark", "choices"])
async def test_constrained_outputs_always_match_their_constraint(cluster, constraint,
                                                                 check) -> None:
    """Property over many seeds: 3 requests x 8 sampled branches (temperature 1.5 on a random
    model: the mask alone keeps the output in the language)."""
    a = await cluster.agent("a", **TINY)
    seen = set()
    for seed in (1, 2, 3):
        body = [gen(64, temperature=1.5, constraint=constraint, capture="v")]
        res = results(await run(a.port, [fork(body, n=8)], seed=seed))
        assert len(res) == 8
        for r in res.values():
            v = r.variables["v"]
            assert v.complete, v.text
            assert check(v.text), v.text
            assert bytes(r.token_ids).decode() == v.text  # the branch is the capture
            seen.add(v.text)
    assert len(seen) > 3  # the seeds really sampled different outputs


async def test_backtrack_then_regenerate_equals_a_fresh_run_from_the_truncated_prompt(
        cluster) -> None:
    a = await cluster.agent("a", **TINY)
    res = results(await run(a.port, [gen(20, capture="x"), back(7), gen(12, capture="y")]))
    x, y = res["0"].variables["x"].token_ids, res["0"].variables["y"].token_ids
    assert len(x) == 20 and len(y) == 12
    assert list(res["0"].token_ids) == list(x[:13]) + list(y)
    # The fresh run: a plain request whose prompt is the truncated sequence.
    fresh = common_pb2.GenerateRequest(token_ids=PROMPT + list(x[:13]),
                                       sampling=common_pb2.SamplingParams(max_tokens=12))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
        plain = [t async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(fresh)
                 for t in r.token_ids]
    assert list(y) == plain
    # The regenerate reused the cache: its request hit every full block before the cut.
    assert res["0"].engine_requests == 2


async def test_a_one_gen_program_samples_what_the_plain_request_does_with_its_seed(
        cluster) -> None:
    """A request with stop strings runs as a one-gen program: same seed, same text."""
    a = await cluster.agent("a", **TINY)

    async def plain(seed: int) -> list[int]:
        req = common_pb2.GenerateRequest(token_ids=PROMPT, sampling=common_pb2.SamplingParams(
            max_tokens=16, temperature=1.0, seed=seed))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
            return [t async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(req)
                    for t in r.token_ids]

    req = common_pb2.GenerateRequest(
        token_ids=PROMPT, sampling=common_pb2.SamplingParams(temperature=1.0, seed=11),
        program=P.ControllerProgram(steps=[gen(16, stop=["never in the text"])]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ch:
        resps = [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(req)]
    assert list(results(resps)["0"].token_ids) == await plain(11) != await plain(12)


async def test_forks_do_not_disturb_each_others_state(cluster) -> None:
    """Each child of a fork ends exactly as its sub-program does when run alone, including
    an open constraint continued in every child (llguidance deep_copy)."""
    a = await cluster.agent("a", **TINY)
    digits = P.Constraint(regex="[0-9]{30}")
    prefix = [ff("Numbers: "), gen(6, constraint=digits)]  # stops early: constraint open
    subs = [
        [gen(8, continue_constraint=True, capture="v")],
        [back(3), gen(10, continue_constraint=True, capture="v")],
        [ff("99"), gen(5, capture="v")],  # "99" fits the constraint; then an open gen
        [gen(4, temperature=1.0), back(2), ff(" and "), gen(6, capture="v")],
    ]
    forked = results(await run(a.port, [*prefix, fork(*subs)], seed=5))
    assert set(forked) == {"0.0", "0.1", "0.2", "0.3"}
    resps_alone = []
    for i, sub in enumerate(subs):
        alone = await run(a.port, [*prefix, *sub], seed=5)
        resps_alone.append(alone)
        r = results(alone)["0"]
        f = forked[f"0.{i}"]
        if i != 3:  # child 3 samples: its seed depends on the branch id
            assert list(f.token_ids) == list(r.token_ids), i
            assert f.variables["v"] == r.variables["v"]
    digits_out = bytes(forked["0.1"].token_ids).decode()
    assert re.fullmatch(r"Numbers: [0-9]{13}", digits_out)
    # The stream tells each branch's story: replaying it gives the final tokens.
    forked_stream = await run(a.port, [*prefix, fork(*subs)], seed=5)
    for bid, r in results(forked_stream).items():
        assert replay(forked_stream, bid) == list(r.token_ids)


async def test_fork_children_share_the_prefix_and_select_keeps_the_best(cluster) -> None:
    a = await cluster.agent("a", **TINY)
    prompt = list(b"x" * 100)
    resps = await run(a.port, [fork([gen(6, temperature=1.0)], n=4,
                                    select=P.SELECT_MODE_BEST_LOGPROB)], prompt=prompt,
                      seed=3)
    res = resps[-1].results
    kept = [r for r in res if r.selected]
    assert len(kept) == 1 and len(res) == 4
    assert kept[0].logprob == max(r.logprob for r in res) < 0
    # The first child leads: one engine request prefills the cold prompt with its suffix.
    # Its siblings start once that is done, so each prefills only its last partial block.
    by_id = {r.branch_id: r for r in res}
    assert (by_id["0.0"].cached_tokens, by_id["0.0"].prefill_tokens) == (0, 100)
    for bid in ("0.1", "0.2", "0.3"):
        assert (by_id[bid].cached_tokens, by_id[bid].prefill_tokens) == (96, 4)
    assert all(r.engine_requests == 1 for r in res)  # no warm-up request
    assert resps[-1].usage.cached_tokens == 0  # the prompt's hit: the leader's, cold
    # Run again: the prefix is cached, so every child (the first too) starts at once on it.
    again = await run(a.port, [fork([gen(6, temperature=1.0)], n=4)], prompt=prompt, seed=4)
    assert [r.cached_tokens for r in again[-1].results] == [96] * 4
    assert again[-1].usage.cached_tokens == 96
    assert forks(a) == {"led": 1, "cached": 1, "warmed": 0}
    first = await run(a.port, [fork([gen(30)], [gen(1)], select=P.SELECT_MODE_FIRST_FINISHED)])
    res2 = {r.branch_id: r for r in first[-1].results}
    assert res2["0.1"].selected and not res2["0.0"].selected
    assert len(res2["0.0"].token_ids) < 30  # cancelled when its sibling finished
    await wait_for(lambda: a.engine.load().running == 0, what="loser freed")


async def test_a_fork_leader_without_an_engine_request_still_warms_its_siblings(
        cluster) -> None:
    a = await cluster.agent("a", **TINY)
    prompt = list(b"y" * 100)
    # The leading child only fast-forwards: the siblings get a warm-up request instead.
    resps = await run(a.port, [fork([ff("abc")], [gen(3)], [gen(3)])], prompt=prompt)
    res = results(resps)
    assert bytes(res["0.0"].token_ids) == b"abc" and res["0.0"].engine_requests == 0
    for bid in ("0.1", "0.2"):
        assert (res[bid].cached_tokens, res[bid].prefill_tokens) == (96, 4)
    assert resps[-1].usage.cached_tokens == 0  # the warm-up's hit
    assert forks(a) == {"led": 1, "cached": 0, "warmed": 1}


async def test_a_fork_leader_that_forks_again_releases_its_siblings_at_its_first_prefill(
        cluster) -> None:
    a = await cluster.agent("a", **TINY)
    prompt = list(b"z" * 100)
    # 0.0 forks again before any engine request: its own leader's prefill (0.0.0's) is what
    # caches the prompt, so 0.1 and 0.2 start then, not when 0.0's long branches end.
    resps = await run(a.port, [fork([fork([gen(40)], [gen(40)])], [gen(2)], [gen(2)])],
                      prompt=prompt)
    res = results(resps)
    assert (res["0.0.0"].cached_tokens, res["0.0.0"].prefill_tokens) == (0, 100)
    for bid in ("0.0.1", "0.1", "0.2"):
        assert (res[bid].cached_tokens, res[bid].prefill_tokens) == (96, 4)
    last = {r.branch_id: i for i, r in enumerate(resps[:-1]) if r.token_ids}
    assert max(last["0.1"], last["0.2"]) < min(last["0.0.0"], last["0.0.1"])
    # No warm-up request either (it would have found the prompt cached: 96).
    assert resps[-1].usage.cached_tokens == 0
    assert forks(a) == {"led": 2, "cached": 0, "warmed": 0}


LIMITS = dict(max_program_fanout=4, max_program_tokens=300, max_program_steps=10,
              max_grammar_bytes=1000)


@pytest.mark.parametrize(("steps", "code", "limit"), [
    ([fork([gen(5)], n=5)], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_program_fanout"),
    ([fork([gen(100)], n=4)], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_program_tokens"),
    ([gen(1)] * 11, grpc.StatusCode.INVALID_ARGUMENT, "max_program_steps"),
    ([gen(5, constraint=P.Constraint(regex="a" * 1001))], grpc.StatusCode.INVALID_ARGUMENT,
     "max_grammar_bytes"),
    ([gen(5, constraint=P.Constraint(regex="|".join(f"w{i}[a-z]*e{i}" for i in range(60))))],
     grpc.StatusCode.RESOURCE_EXHAUSTED, "grammar_compile_timeout_s"),
    ([gen(5, constraint=P.Constraint(lark="start: nothing"))],
     grpc.StatusCode.INVALID_ARGUMENT, "constraint"),
], ids=["fanout", "tokens", "steps", "grammar_bytes", "compile_timeout", "bad_grammar"])
async def test_every_limit_is_enforced_before_any_engine_work(cluster, steps, code,
                                                              limit) -> None:
    # A zero compile budget where the compile time limit is under test: asyncio.wait_for
    # then always times out (a small positive budget races llguidance's lazy compile).
    timeout = 0.0 if limit == "grammar_compile_timeout_s" else 5.0
    a = await cluster.agent("a", **TINY, **LIMITS, grammar_compile_timeout_s=timeout)
    router = await cluster.router(vocab_size=258)
    await wait_for(lambda: len(router.registry.loads) == 1, what="agent registered")
    for via_router in (False, True):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run(router.port if via_router else a.port, steps, router=via_router)
        assert err.value.code() == code
        assert limit in err.value.details()
        if not via_router:  # the field it is about travels with it, for the router's fronts
            fanout = limit == "max_program_fanout"
            assert refused_field(err.value) == ("program.fanout" if fanout else "program")
    assert a.engine.stats.admitted == 0


async def test_the_sim_engine_runs_programs_and_honours_constraints(cluster) -> None:
    """The sim has no logits but applies masks (tests/e2e/test_programs_sim.py has more)."""
    s = await cluster.agent("s", engine="sim", vocab_size=258, capacity_blocks=256)
    res = results(await run(s.port, [gen(8, constraint=P.Constraint(regex="a{1,3}b"),
                                         capture="v")]))
    v = res["0"].variables["v"]
    assert v.complete and re.fullmatch("a{1,3}b", v.text), v.text
    res = results(await run(s.port, [gen(5), back(2), fork([gen(3)], n=2)]))
    assert {len(r.token_ids) for r in res.values()} == {6}


async def test_a_cancelled_program_frees_every_branch(cluster) -> None:
    a = await cluster.agent("a", **TINY)
    capacity = a.engine.load().capacity_blocks
    req = common_pb2.GenerateRequest(
        token_ids=PROMPT, program=P.ControllerProgram(steps=[fork([gen(600)], n=4)]))
    async with cancel_when_all_decode(a.port, req, 4):
        assert a.engine.load().running == 4
    await wait_for(lambda: a.engine.load().running == 0 and a.engine.load().queued == 0,
                   what="every branch left the engine")
    await wait_for(lambda: a.engine.load().free_blocks == capacity, what="blocks freed")
    await asyncio.sleep(0)


@pytest.mark.parametrize("engine", ["tiny", "sim"])
async def test_the_examples_run_against_a_router_and_tiny_or_sim_agents(cluster, capsys,
                                                                       engine) -> None:
    import importlib
    import sys
    from pathlib import Path

    await cluster.agent("a", **{**TINY, "engine": engine})
    router = await cluster.router(vocab_size=258)
    await wait_for(lambda: len(router.registry.loads) == 1, what="agent registered")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        for name in ("best_of_n_json", "multiple_choice", "tree_search"):
            resps = await importlib.import_module(name).main(f"127.0.0.1:{router.port}")
            kept = [r for r in resps[-1].results if r.selected]
            assert len(kept) == 1 and all(v.complete for v in kept[0].variables.values())
    finally:
        sys.path.pop(0)
    assert "parsed:" in capsys.readouterr().out
