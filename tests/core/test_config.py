from __future__ import annotations

import argparse

import pytest

from kvroute.core.config import AgentConfig, RouterConfig, add_arguments, from_env, from_namespace


def test_flags_env_and_defaults() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, RouterConfig, {"KVROUTE_POLICY": "round_robin", "KVROUTE_LOG_JSON": "yes"})
    cfg = from_namespace(RouterConfig, p.parse_args(["--port", "7", "--block-size", "32"]))
    assert (cfg.port, cfg.block_size, cfg.policy, cfg.log_json) == (7, 32, "round_robin", True)
    # A flag beats the environment.
    cfg = from_namespace(RouterConfig, p.parse_args(["--policy", "kvroute"]))
    assert cfg.policy == "kvroute"


def test_bad_env_value_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="KVROUTE_PORT"):
        from_env(AgentConfig, {"KVROUTE_PORT": "eighty"})


def test_from_env_with_overrides() -> None:
    cfg = from_env(AgentConfig, {"KVROUTE_CAPACITY_BLOCKS": "10"}, worker_id="w")
    assert (cfg.capacity_blocks, cfg.worker_id, cfg.port) == (10, "w", 50061)


def test_coalescing_window_and_wait_are_checked() -> None:
    # Coalescing is on by default: predictions last until stored, at most as long as a wait.
    cfg = RouterConfig()
    assert cfg.predict_ttl_s == cfg.coalesce_wait_s == 30.0 and cfg.coalesce_share == 0.8
    assert RouterConfig(predict_ttl_s=0).predict_ttl_s == 0  # off
    assert RouterConfig(coalesce_share=0).coalesce_share == 0  # always wait
    for kw, flag in (({"predict_ttl_s": -1.0}, "--predict-ttl-s"),
                     ({"predict_ttl_s": float("nan")}, "--predict-ttl-s"),
                     ({"coalesce_wait_s": 0.0}, "--coalesce-wait-s"),
                     ({"coalesce_wait_s": float("inf")}, "--coalesce-wait-s"),
                     ({"coalesce_share": 1.5}, "--coalesce-share"),
                     ({"coalesce_share": -0.1}, "--coalesce-share"),
                     ({"coalesce_share": float("nan")}, "--coalesce-share")):
        with pytest.raises(SystemExit, match=flag):
            RouterConfig(**kw)


def test_route_candidates_must_not_be_negative() -> None:
    assert RouterConfig().route_candidates == 0  # every live worker
    with pytest.raises(SystemExit, match="--route-candidates must be >= 0"):
        RouterConfig(route_candidates=-1)
