"""Load from vLLM's /metrics text: both KV-usage names, data-parallel engines summed."""

from __future__ import annotations

import pytest

from kvroute.worker_agent.engines.served.poller import ServerMetrics
from kvroute.worker_agent.engines.vllm.prom import parse_metrics

CURRENT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 12345.0
"""

OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.9
"""


def test_current_and_old_metric_names() -> None:
    assert parse_metrics(CURRENT) == ServerMetrics(5, 4, 0.375, 2000)
    assert parse_metrics(OLD) == ServerMetrics(1, 2, 0.9, None)
    assert parse_metrics("") == ServerMetrics()


def test_not_prometheus_text_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_metrics("vllm:num_requests_running{ 3\n")
    with pytest.raises(ValueError, match="not Prometheus"):  # a wrong URL's page
        parse_metrics("<!DOCTYPE html>\n<html><body>Not Found</body></html>\n")


def test_only_the_metrics_read_are_parsed() -> None:
    # The other families' lines are not parsed at all (a whole vLLM /metrics costs ~10 ms
    # of the agent's event loop to parse), so even a malformed one does not matter; a
    # longer name that begins with a read one is not taken for it.
    other = ("vllm:prompt_tokens_total{engine=\"0\" 12\n"
             "vllm:num_requests_running_total{engine=\"0\"} 99.0\n"
             "vllm:num_requests_waiting_by_reason{engine=\"0\"} 7.0\n")
    assert parse_metrics(CURRENT + other) == ServerMetrics(5, 4, 0.375, 2000)
