"""The SGLang adapter's parts: endpoints per data-parallel rank (SGLang's own rule, checked
against its publisher's code), its /metrics read per rank, what each release takes, and the
grammar fields."""

from __future__ import annotations

import re
from types import ModuleType

import pytest

from kvroute.worker_agent.engines.sglang.client import grammar_field
from kvroute.worker_agent.engines.sglang.metrics import parse_metrics
from kvroute.worker_agent.engines.sglang.versions import Features, rank_endpoint
from kvroute.worker_agent.engines.vllm.versions import parse_version

ENDPOINTS = ["tcp://*:5557", "tcp://127.0.0.1:5557", "tcp://[::1]:6000", "inproc://cache",
             "ipc:///tmp/kv", ""]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_rank_endpoints_are_sglangs_own(sglang_kv: ModuleType, endpoint: str,
                                        rank: int) -> None:
    try:
        theirs = sglang_kv.ZmqEventPublisher.offset_endpoint_port(endpoint or None, rank)
    except ValueError:
        with pytest.raises(ValueError):  # SGLang refuses it: so does the agent, at start
            rank_endpoint(endpoint, rank)
        return
    assert rank_endpoint(endpoint, rank) == (theirs or "")


def sample(name: str, value: float, dp: int | None = None, tp: int = 0) -> str:
    labels = f'model_name="m",tp_rank="{tp}"' + (f',dp_rank="{dp}"' if dp is not None else "")
    return f"sglang:{name}{{{labels}}} {value}"


def test_metrics_add_up_ranks_or_read_one() -> None:
    text = "\n".join([
        "# TYPE sglang:num_running_reqs gauge",
        sample("num_running_reqs", 3, 0), sample("num_running_reqs", 3, 0, tp=1),
        sample("num_running_reqs", 5, 1),
        "# TYPE sglang:num_queue_reqs gauge",
        sample("num_queue_reqs", 1, 0), sample("num_queue_reqs", 2, 1),
        "# TYPE sglang:token_usage gauge",
        sample("token_usage", 0.25, 0), sample("token_usage", 0.75, 1),
        "# TYPE sglang:max_total_num_tokens gauge",
        sample("max_total_num_tokens", 1600, 0), sample("max_total_num_tokens", 1600, 1),
    ]) + "\n"
    whole = parse_metrics(text, 16)
    # tensor-parallel ranks of one group report one batch: counted once
    assert (whole.running, whole.waiting, whole.kv_usage, whole.num_gpu_blocks) == \
        (8, 3, 0.5, 200)
    one = parse_metrics(text, 16, dp_rank=1)
    assert (one.running, one.waiting, one.kv_usage, one.num_gpu_blocks) == (5, 2, 0.75, 100)
    with pytest.raises(ValueError):
        parse_metrics("sglang:num_running_reqs{ 3\n", 16)


@pytest.mark.parametrize(("version", "salt", "seed", "field"), [
    ("0.5.1", False, False, "data_parallel_rank"),
    ("0.5.3", False, True, "data_parallel_rank"),
    ("0.5.10", False, True, "routed_dp_rank"),
    ("0.5.18", True, True, "routed_dp_rank"),
    ("0.5.23", True, True, "routed_dp_rank"),
])
def test_what_each_release_takes(version: str, salt: bool, seed: bool, field: str) -> None:
    f = Features.of(parse_version(version))
    assert (f.cache_salt, f.sampling_seed, f.dp_rank_field) == (salt, seed, field)
    assert Features.of(None) == Features()  # unknown: the newest's


def test_grammar_fields() -> None:
    choice = grammar_field("choices", ["a.b", "c|d", "e"])["regex"]
    assert all(re.fullmatch(choice, c) for c in ("a.b", "c|d", "e"))
    assert not re.fullmatch(choice, "axb")
    assert grammar_field("lark", "start: /x/") == {"ebnf": "start: /x/"}
    assert grammar_field("json_schema", "{}") == {"json_schema": "{}"}
    with pytest.raises(ValueError):
        grammar_field("masks", "")
