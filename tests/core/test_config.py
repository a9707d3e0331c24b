from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvroute.core.config import AgentConfig, EppConfig, RedisSettings, RouterConfig
from kvroute.core.settings import (
    AT_LEAST_ONE,
    FRACTION,
    add_arguments,
    from_env,
    from_namespace,
)
from kvroute.core.settings import (
    flag as flag_of,
)


def test_flags_env_and_defaults() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, RouterConfig, {"KVROUTE_POLICY": "round_robin", "KVROUTE_LOG_JSON": "yes"})
    cfg = from_namespace(RouterConfig, p.parse_args(["--port", "7", "--block-size", "32"]))
    assert (cfg.listen.port, cfg.model.block_size, cfg.policy.name, cfg.log.json) == \
        (7, 32, "round_robin", True)
    # A flag beats the environment.
    cfg = from_namespace(RouterConfig, p.parse_args(["--policy", "kvroute"]))
    assert cfg.policy.name == "kvroute"


def test_bad_env_value_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="KVROUTE_PORT"):
        from_env(AgentConfig, {"KVROUTE_PORT": "eighty"})


def test_from_env_with_overrides() -> None:
    cfg = from_env(AgentConfig, {"KVROUTE_CAPACITY_BLOCKS": "10"}, worker_id="w")
    assert (cfg.engine.capacity_blocks, cfg.worker.worker_id, cfg.listen.port) == (10, "w", 50061)


def test_coalescing_window_and_wait_are_checked() -> None:
    # Coalescing is on by default: predictions last until stored, at most as long as a wait.
    cfg = RouterConfig.of()
    p = cfg.policy
    assert p.predict_ttl_s == p.coalesce_wait_s == 600.0 and p.coalesce_share == 0.8
    assert RouterConfig.of(predict_ttl_s=0).policy.predict_ttl_s == 0  # off
    assert RouterConfig.of(coalesce_share=0).policy.coalesce_share == 0  # always wait
    for kw, flag in (({"predict_ttl_s": -1.0}, "--predict-ttl-s"),
                     ({"predict_ttl_s": float("nan")}, "--predict-ttl-s"),
                     ({"coalesce_wait_s": 0.0}, "--coalesce-wait-s"),
                     ({"coalesce_wait_s": float("inf")}, "--coalesce-wait-s"),
                     ({"coalesce_share": 1.5}, "--coalesce-share"),
                     ({"coalesce_share": -0.1}, "--coalesce-share"),
                     ({"coalesce_share": float("nan")}, "--coalesce-share")):
        with pytest.raises(SystemExit, match=flag):
            RouterConfig.of(**kw)


def test_route_candidates_must_not_be_negative() -> None:
    assert RouterConfig.of().policy.route_candidates == 0  # every live worker
    with pytest.raises(SystemExit, match=r"--route-candidates .* must be an integer >= 0"):
        RouterConfig.of(route_candidates=-1)


@pytest.mark.parametrize(("cls", "kw", "message"), [
    # A 0 s heartbeat or poll would spin; a NaN TTL made the agent fail with a traceback.
    (AgentConfig, {"heartbeat_s": 0.0}, "--heartbeat-s (KVROUTE_HEARTBEAT_S) must be a finite "
                                        "number > 0, got 0.0"),
    (AgentConfig, {"heartbeat_ttl_s": float("nan")}, "--heartbeat-ttl-s"),
    (AgentConfig, {"heartbeat_s": 5.0}, "--heartbeat-ttl-s (3 s) must be longer than "
                                        "--heartbeat-s (5 s)"),
    (AgentConfig, {"time_scale": -1.0}, "--time-scale"),
    (AgentConfig, {"capacity_blocks": 0}, "--capacity-blocks (KVROUTE_CAPACITY_BLOCKS) must be "
                                          "an integer >= 1, got 0"),
    (AgentConfig, {"max_batched_tokens": -1}, "--max-batched-tokens"),
    (AgentConfig, {"vllm_long_prefill_threshold": -1}, "--vllm-long-prefill-threshold"),
    (AgentConfig, {"sim_long_prefill_threshold": -1}, "--sim-long-prefill-threshold"),
    (AgentConfig, {"sim_chunked_prefill": True}, "--sim-chunked-prefill needs "
                                                 "--max-batched-tokens > 0"),
    (AgentConfig, {"sim_long_prefill_threshold": 256, "max_batched_tokens": 2048},
     "it needs --sim-chunked-prefill"),
    (AgentConfig, {"grammar_compile_timeout_s": float("inf")}, "--grammar-compile-timeout-s"),
    (RouterConfig, {"port": 99999}, "--port (KVROUTE_PORT) must be an integer in [0, 65535]"),
    (RouterConfig, {"block_size": 0}, "--block-size"),
    (RouterConfig, {"poll_interval_s": 0.0}, "--poll-interval-s"),
    (RouterConfig, {"redis_retry_s": float("inf")}, "--redis-retry-s"),
])
def test_numbers_out_of_range_stop_the_service_by_name(cls: type, kw: dict[str, float],
                                                       message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cls.of(**kw)
    assert message in str(exc.value)


def test_an_environment_value_out_of_range_is_named() -> None:
    with pytest.raises(SystemExit, match="KVROUTE_HEARTBEAT_S"):
        from_env(AgentConfig, {"KVROUTE_HEARTBEAT_S": "0"})
    # In range, it is taken (a TTL is still longer than the interval).
    assert from_env(AgentConfig, {"KVROUTE_HEARTBEAT_S": "0.5"}).worker.heartbeat_s == 0.5


def test_a_list_flag_checks_each_value() -> None:
    counts = AT_LEAST_ONE.list_parser(int)
    assert counts("16,128, 1000") == [16, 128, 1000]
    for bad, says in ((",", "comma-separated values"), ("16,0", "an integer >= 1"),
                      ("16,x", "an integer >= 1"), ("", "comma-separated")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            counts(bad)
    assert FRACTION.list_parser(float)("0.5,1") == [0.5, 1.0]
    with pytest.raises(argparse.ArgumentTypeError, match=r"in \[0, 1\]"):
        FRACTION.list_parser(float)("0.5,nan")


def test_settings_have_one_flat_name_each_and_sections_read_back() -> None:
    for cls in (RouterConfig, EppConfig, AgentConfig):
        names = [s.name for s in cls.settings()]
        assert len(names) == len(set(names)), cls
        cfg = cls.of(model="m", block_size=32)
        assert cls.of(**cfg.flat()) == cfg
        assert cfg.replace(block_size=64).model.block_size == 64
    with pytest.raises(TypeError, match="no setting epp_port"):
        RouterConfig.of(epp_port=1)


def test_shared_sections_mean_the_same_and_clashing_names_are_apart() -> None:
    r, a = RouterConfig.of(), AgentConfig.of()
    assert type(r.tls) is type(a.tls) and type(r.log) is type(a.log)
    assert isinstance(r.redis, RedisSettings) and isinstance(a.redis, RedisSettings)
    # The router's program limits bound a whole program; an agent's, its own share.
    assert "router_max_program_fanout" in {s.name for s in RouterConfig.settings()}
    assert "max_program_fanout" not in {s.name for s in RouterConfig.settings()}
    assert (r.limits.program_fanout, a.programs.fanout) == (1024, 16)
    p = argparse.ArgumentParser()
    add_arguments(p, RouterConfig, {})
    old = from_namespace(RouterConfig, p.parse_args(["--max-program-fanout", "64"]))
    assert old.limits.program_fanout == 64  # the router's former flag still works
    # An agent takes the router's --model NAME=SOURCE as NAME and --model-source SOURCE.
    m = AgentConfig.of(model="qwen=/models/qwen").model
    assert (m.name, m.source) == ("qwen", "/models/qwen")
    assert AgentConfig.of(model="qwen=/m", model_source="/m").model.source == "/m"
    with pytest.raises(SystemExit, match="not both"):
        AgentConfig.of(model="qwen=/m", model_source="/other")


def test_help_lists_settings_by_section() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, AgentConfig, {})
    text = p.format_help()
    for title in ("Redis:", "TLS:", "Engine:", "vLLM engine:", "Programs:"):
        assert title in text
    groups = text[text.index("\nRedis:"):]  # past the usage line
    assert groups.index("--vllm-url") > groups.index("vLLM engine:") > \
        groups.index("--redis-ca-file")


def test_the_configuration_guide_lists_every_setting_in_its_section() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines()
            if line.startswith("| ") and line.count("|") > 5}
    for cls in (RouterConfig, EppConfig, AgentConfig):
        for s in cls.settings():
            row = rows.get(s.section_cls.title, "")
            name = flag_of(s.name)
            assert f"`{name}`" in row, f"{name} not in the {s.section_cls.title} row"
