"""The supported vLLM range: the version read from vLLM's ``/version``, the request fields
picked from it, and every field the agent sends or reads checked against each end's own
``CompletionRequest`` / response models (read from its wheel, see vllm_release)."""

from __future__ import annotations

import logging

import pytest

from kvroute.worker_agent.engines.base import EngineRequest
from kvroute.worker_agent.engines.vllm import SUPPORTED, VllmConfig, VllmEngine
from kvroute.worker_agent.engines.vllm.versions import (
    StructuredDialect,
    guided_fields,
    is_supported,
    parse_version,
    structured_dialect,
)
from tests.support import wait_for

LOG = "kvroute.agent.vllm"


def test_versions_parse_compare_and_pick_the_constraint_fields() -> None:
    assert SUPPORTED == ("0.10.2", "0.34.0")
    assert parse_version("0.10.2") == (0, 10, 2)
    assert parse_version("v0.11.1rc2.dev41+g1234abc") == (0, 11, 1)
    assert parse_version("0.10.1.1") == (0, 10, 1)
    assert parse_version("0.12") == (0, 12, 0)
    assert parse_version("dev") is None
    assert [is_supported(parse_version(v)) for v in ("0.10.1.1", "0.10.2", "0.20.0",
                                                     "0.34.0", "0.34.1", "1.0.0")] == \
        [False, True, True, True, False, False]
    assert structured_dialect((0, 10, 2)) is StructuredDialect.GUIDED
    assert structured_dialect((0, 11, 0)) is StructuredDialect.STRUCTURED_OUTPUTS
    assert structured_dialect(None) is StructuredDialect.STRUCTURED_OUTPUTS
    assert guided_fields({"regex": "a|b"}) == {"guided_regex": "a|b"}
    with pytest.raises(ValueError, match="'structural_tag' has no guided_"):
        guided_fields({"structural_tag": "x"})


def test_the_fields_the_agent_reads_are_in_each_releases_responses(vllm_release) -> None:
    r = vllm_release
    assert {"token_ids", "finish_reason", "logprobs", "text"} <= \
        r.fields("CompletionResponseStreamChoice")
    assert {"choices", "usage"} <= r.fields("CompletionStreamResponse")
    assert {"tokens", "token_logprobs"} <= r.fields("CompletionLogProbs")
    assert {"prompt_tokens", "prompt_tokens_details"} <= r.fields("UsageInfo")
    assert "cached_tokens" in r.fields("PromptTokenUsageInfo")
    assert "include_usage" in r.fields("StreamOptions")
    if "structured_outputs" in r.constraint_fields:
        assert {"json", "regex", "choice", "grammar"} <= r.fields("StructuredOutputsParams")


async def test_requests_use_only_fields_the_release_declares(fake_vllm, vllm_release,
                                                             caplog) -> None:
    fake = fake_vllm("--vocab", "258")
    eng = VllmEngine(VllmConfig(url=fake.url, events=fake.events, replay=fake.replay,
                                served_model="fake-model", report_reused="always"))
    caplog.set_level(logging.INFO, LOG)
    await eng.start()
    try:
        await wait_for(lambda: eng.vllm_version is not None, what="/version read")
        assert eng.vllm_version == vllm_release.version
        want = StructuredDialect.GUIDED if vllm_release.version == "0.10.2" \
            else StructuredDialect.STRUCTURED_OUTPUTS
        assert eng.client.dialect is want
        prompt = list(range(65, 65 + 40))
        # Every optional field the agent can send: seed, stop ids, salt, logprobs, xargs ...
        req = EngineRequest("a", prompt, 3, temperature=0.5, seed=9,
                            stop_token_ids=frozenset({256}), cache_salt="s", logprobs=True)
        assert [c async for c in eng.generate(req)][-1].finish_reason == "length"
        # ... and each kind of constraint: the fake reads only the release's own fields.
        for kind, source, text in (("choices", ["blue", "red"], b"blue"),
                                   ("regex", "sky|cloud", b"sky"),
                                   ("json_schema", '{"examples": [1]}', b"1"),
                                   ("lark", 'start: "a"', None)):
            chunks = [c async for c in eng.generate(EngineRequest("b", prompt, 6),
                                                    constraint=(kind, source))]
            if text is not None:
                assert bytes(t for c in chunks for t in c.token_ids) == text
        bodies = fake.requests()
        assert all(b["vllm_xargs"] == {"kv_cache_report_mode": "full"} for b in bodies)
        assert fake.state()["ignored_fields"] == []
    finally:
        await eng.stop()
    records = [r for r in caplog.records if r.name == LOG]
    start = next(r for r in records if r.getMessage() == "following vLLM")
    assert start.kv["supported_vllm"] == "0.10.2..0.34.0"
    version = next(r for r in records if r.getMessage() == "vLLM version")
    assert version.kv["version"] == vllm_release.version
    assert not [r for r in records if r.levelno >= logging.WARNING
                and ("outside" in r.getMessage() or "cannot tell" in r.getMessage())]


# The fake's release does not matter here: one run, on the newest, is enough.
@pytest.mark.parametrize("vllm_version", [SUPPORTED[-1]], ids=lambda v: f"vllm-{v}",
                         scope="session")
@pytest.mark.parametrize(("reported", "dialect", "warning"), [
    ("0.9.2", StructuredDialect.GUIDED, "vLLM 0.9.2 is outside the supported range"),
    ("0.35.0rc1", StructuredDialect.STRUCTURED_OUTPUTS, "vLLM 0.35.0rc1 is outside"),
    ("dev", StructuredDialect.STRUCTURED_OUTPUTS, "vLLM dev is outside"),
    ("none", StructuredDialect.STRUCTURED_OUTPUTS, "cannot tell vLLM's version"),
])
async def test_outside_the_range_warns_and_carries_on(fake_vllm, vllm_release, caplog,
                                                      reported, dialect, warning) -> None:
    fake = fake_vllm("--report-version", reported)
    eng = VllmEngine(VllmConfig(url=fake.url, events=fake.events, served_model="fake-model"))
    caplog.set_level(logging.INFO, LOG)
    await eng.start()
    try:
        await wait_for(lambda: any(warning in r.getMessage() for r in caplog.records),
                       what="warning logged")
        assert eng.client.dialect is dialect
        assert eng.vllm_version == (None if reported == "none" else reported)
        chunks = [c async for c in eng.generate(EngineRequest("a", [1, 2, 3], 2))]
        assert chunks[-1].finish_reason == "length"  # not refused
    finally:
        await eng.stop()
