"""The vLLM agent's chat-rendering check (``--model-source``): the router's rendering of a
probe conversation against vLLM's own ``POST /tokenize``, answered by the fake vLLM with
transformers' ``apply_chat_template`` on its ``--chat-model`` directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.config import AgentConfig
from kvroute.demo.openai_model import write_byte_model
from kvroute.worker_agent.engines.vllm import VllmConfig, VllmEngine, from_agent_config
from kvroute.worker_agent.engines.vllm.render_check import PROBES, first_difference
from tests.support import wait_for

pytest.importorskip("transformers")

# The same turns as the byte model's template, but the roles written in capitals: the kind of
# drift a template vLLM was given (--chat-template) or another revision brings.
OTHER_TEMPLATE = (
    "{% for m in messages %}<|startoftext|>{{ m['role'] | upper }}\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|startoftext|>ASSISTANT\n{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    return {"same": write_byte_model(root / "same"),
            "other": write_byte_model(root / "other", chat_template=OTHER_TEMPLATE)}


def samples(eng: VllmEngine) -> dict[str, Any]:
    out = {}
    for fam in eng.metric_families():
        for s in fam.samples:
            key = s.name + "".join(f"{{{v}}}" for v in s.labels.values())
            out[key] = s.value
    return out


def engine(fake: Any, source: Path) -> VllmEngine:
    return VllmEngine(VllmConfig(url=fake.url, events=fake.events, served_model="fake-model",
                                 model_source=str(source), render_check_s=300))


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) == -1
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [4]) == 0


async def test_the_same_rendering_matches(fake_vllm, models) -> None:
    fake = fake_vllm("--chat-model", str(models["same"]))
    eng = engine(fake, models["same"])
    assert samples(eng)["kvroute_agent_chat_template_mismatch"] == -1  # not checked yet
    await eng.start()
    try:
        await wait_for(lambda: samples(eng).get("kvroute_agent_chat_template_checks_total"
                                                "{match}") == 1, what="the check at start")
        m = samples(eng)
        assert m["kvroute_agent_chat_template_mismatch"] == 0
        assert m["kvroute_agent_chat_template_checks_total{mismatch}"] == 0
        assert m["kvroute_agent_chat_template_checks_total{error}"] == 0
        asked = httpx.get(fake.url + "/control/tokenize").json()
        assert [b["messages"] for b in asked] == [p.messages for p in PROBES]
        assert all(b["model"] == "fake-model" and b["add_generation_prompt"] for b in asked)
        assert asked[1]["tools"] == PROBES[1].tools  # tools are rendered, on both sides
    finally:
        await eng.stop()


async def test_a_different_rendering_is_an_error_naming_the_first_differing_position(
        fake_vllm, models, caplog) -> None:
    fake = fake_vllm("--chat-model", str(models["other"]))
    eng = engine(fake, models["same"])
    caplog.set_level(logging.ERROR, logger="kvroute.agent.vllm.render")
    await eng.start()
    try:
        await wait_for(lambda: samples(eng)["kvroute_agent_chat_template_mismatch"] == 1,
                       what="the mismatch seen")
        assert samples(eng)["kvroute_agent_chat_template_checks_total{mismatch}"] == 1
    finally:
        await eng.stop()
    probe = PROBES[0]
    ours = ChatTokenizer.load(str(models["same"])).apply(probe.messages)
    theirs = ChatTokenizer.load(str(models["other"])).apply(probe.messages)
    want = first_difference(ours, theirs)
    assert want == 1  # right after the first start token: "system" vs "SYSTEM"
    [rec] = [r for r in caplog.records if "chat template mismatch" in r.getMessage()]
    assert rec.levelno == logging.ERROR
    assert rec.kv["first_difference"] == want and rec.kv["probe"] == probe.name  # type: ignore[attr-defined]
    assert rec.kv["router_ids_there"] == ours[want:want + 8]  # type: ignore[attr-defined]
    assert rec.kv["vllm_ids_there"] == theirs[want:want + 8]  # type: ignore[attr-defined]


async def test_no_answer_is_counted_as_an_error_and_the_state_stays_unknown(
        fake_vllm, models) -> None:
    fake = fake_vllm()  # no chat template: /tokenize answers 400
    eng = engine(fake, models["same"])
    await eng.start()
    try:
        await wait_for(lambda: samples(eng)["kvroute_agent_chat_template_checks_total"
                                            "{error}"] >= 1, what="the failed check")
        assert samples(eng)["kvroute_agent_chat_template_mismatch"] == -1
    finally:
        await eng.stop()


def test_a_model_source_that_is_not_a_tokenizer_ends_the_start(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no such file or directory"):
        from_agent_config(AgentConfig.of(engine="vllm", model_source=str(tmp_path / "nope")))
