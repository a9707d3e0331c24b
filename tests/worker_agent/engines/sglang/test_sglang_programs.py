"""Controller programs on ``--engine sglang``: a real router -> a real agent -> the fake
SGLang, once per end of the supported range. A constrained gen goes as SGLang's grammar
fields in ``sampling_params``; the fake records them and answers a regex of literal
alternatives with the first, which is all this test needs. What the fake received is the
oracle for the requests the runtime made."""

from __future__ import annotations

import asyncio

from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from kvroute.worker_agent.engines.sglang.versions import SAMPLING_SEED_SINCE
from kvroute.worker_agent.engines.vllm.versions import parse_version
from tests.e2e.test_programs import fork, gen, results, run
from tests.support import wait_for
from tests.worker_agent.engines.vllm.fake_vllm import fake_logprob

W = "s0"
PROMPT = list(b"Question: which colour is the sky on a clear day? Options: blue, red, green."
              b" Answer:  ")  # 86 tokens: 5 full blocks of 16
CHOICES = ["blue", "red", "green"]


async def test_fork_choice_select_with_sglangs_hits_and_logprobs(cluster, fake_sglang) -> None:
    fake = fake_sglang("--vocab", "258")
    agent = await cluster.agent(W, engine="sglang", sglang_url=fake.url,
                                sglang_events=fake.events, sglang_replay=fake.replay,
                                sglang_topic="kv-events", tokenizer="byte", vocab_size=258)
    await asyncio.wait_for(agent.engine.events.ready.wait(), 5)
    router = await cluster.router(vocab_size=258)
    await wait_for(lambda: W in router.registry.loads, what="agent registered")
    # The leading child's stored blocks never reach the agent: its prediction for the
    # others stays 0, so the 80 they report can only come from SGLang's meta_info.
    fake.drop(next_n=1)
    choose = P.Constraint(choices=P.Choices(options=CHOICES))
    steps = [fork([gen(10, temperature=1.0, constraint=choose, capture="answer")], n=3,
                  select=P.SELECT_MODE_BEST_LOGPROB)]
    res = results(await run(router.port, steps, prompt=PROMPT, seed=7, router=True))
    assert set(res) == {"0.0", "0.1", "0.2"}
    for r in res.values():
        assert r.variables["answer"].text == "blue" and bytes(r.token_ids) == b"blue"
        assert list(r.token_logprobs) == [fake_logprob(t) for t in r.token_ids]
    assert [r.branch_id for r in res.values() if r.selected] == ["0.0"]
    assert (res["0.0"].cached_tokens, res["0.0"].prefill_tokens) == (0, 86)
    for bid in ("0.1", "0.2"):
        assert (res[bid].cached_tokens, res[bid].prefill_tokens) == (80, 6)
    children = fake.requests()
    assert len(children) == 3
    for body in children:
        sp = body["sampling_params"]
        assert body["input_ids"] == PROMPT and body["return_logprob"] is True
        assert sp["regex"] == "blue|red|green"
        assert sp["max_new_tokens"] == 10 and sp["temperature"] == 1.0
        assert 256 in sp["stop_token_ids"]  # the vocabulary's eos
    seeds = {body["sampling_params"].get("sampling_seed") for body in children}
    if parse_version(fake.release) >= SAMPLING_SEED_SINCE:
        assert len(seeds) == 3  # siblings sample differently
    else:
        assert seeds == {None}  # the release takes no seed
    await wait_for(lambda: agent.engine.load().running == 0, what="requests done")
