"""The vLLM agent's mask-plugin check (``--vllm-mask-plugin``): a vLLM without kvroute's
plugin (the fake vLLM, which accepts ``vllm_xargs`` it does not know, as vLLM does) is seen
as such, and the agent then continues no region as a grammar state. The plugin's side, a
real vLLM refusing the probe, is checked in tests/e2e/real_vllm."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from kvroute.worker_agent.engines.vllm import VllmConfig, VllmEngine
from kvroute.worker_agent.engines.vllm.plugin_check import PROBE_ARG
from tests.support import wait_for


def gauge(eng: VllmEngine) -> float:
    for fam in eng.metric_families():
        for s in fam.samples:
            if s.name == "kvroute_agent_vllm_mask_plugin":
                return s.value
    raise AssertionError("no kvroute_agent_vllm_mask_plugin")


async def test_a_vllm_without_the_plugin_is_an_error_and_no_grammar_state_is_sent(
        fake_vllm: Any, caplog: Any) -> None:
    fake = fake_vllm()
    eng = VllmEngine(VllmConfig(url=fake.url, events=fake.events, served_model="fake-model",
                                mask_plugin=True, render_check_s=300))
    caplog.set_level(logging.INFO, logger="kvroute.agent.vllm.plugin")
    assert gauge(eng) == -1 and not eng.continues_grammars  # not known yet: no state sent
    await eng.start()
    try:
        await wait_for(lambda: gauge(eng) == 0, what="the plugin seen absent")
        assert not eng.continues_grammars
    finally:
        await eng.stop()
    [rec] = [r for r in caplog.records if "does not run kvroute's mask plugin" in
             r.getMessage()]
    assert rec.levelno == logging.ERROR and rec.kv["status"] == 200  # type: ignore[attr-defined]
    probes = [b for b in httpx.get(fake.url + "/control/requests").json()
              if PROBE_ARG in (b.get("vllm_xargs") or {})]
    assert probes  # at start, and again once vLLM first answered
    assert all(p["max_tokens"] == 1 and "kvroute_grammar" not in p["vllm_xargs"]
               for p in probes)


async def test_without_the_flag_nothing_is_asked(fake_vllm: Any) -> None:
    fake = fake_vllm()
    eng = VllmEngine(VllmConfig(url=fake.url, events=fake.events, served_model="fake-model"))
    assert eng.plugin_check is None and not eng.continues_grammars
    assert not any(f.name == "kvroute_agent_vllm_mask_plugin" for f in eng.metric_families())


async def test_a_restarted_vllm_is_asked_again_at_once(fake_vllm: Any) -> None:
    """vLLM may come back with other flags: while it does not answer the plugin is not
    known, and once it answers it is asked again, long before the next periodic check."""
    fake = fake_vllm()
    eng = VllmEngine(VllmConfig(url=fake.url, events=fake.events, served_model="fake-model",
                                mask_plugin=True, render_check_s=300, down_after_s=0.3))
    await eng.start()
    try:
        await wait_for(lambda: gauge(eng) == 0, what="the first answer")
        fake.stop()
        await wait_for(lambda: gauge(eng) == -1, what="the answer forgotten")
        fake.start()  # the same ports
        await wait_for(lambda: gauge(eng) == 0, 10, "asked again")
        asked = httpx.get(fake.url + "/control/requests").json()
        assert sum(PROBE_ARG in (b.get("vllm_xargs") or {}) for b in asked) >= 1
    finally:
        await eng.stop()
