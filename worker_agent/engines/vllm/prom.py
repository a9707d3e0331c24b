"""Load from vLLM's Prometheus ``/metrics`` (polled by :mod:`..served.poller`).

Read (summed over the ``engine`` label, i.e. data-parallel engines behind one server):

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting``
* KV-cache usage in [0, 1]: ``vllm:kv_cache_usage_perc`` (v1 engine, current) or
  ``vllm:gpu_cache_usage_perc`` (older releases); averaged over engines
* capacity: the ``num_gpu_blocks`` label of ``vllm:cache_config_info`` (summed over engines)
"""

from __future__ import annotations

from kvroute.worker_agent.engines.served.poller import ServerMetrics, families

_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_READ = ("vllm:num_requests_running", "vllm:num_requests_waiting", *_USAGE,
         "vllm:cache_config_info")


def parse_metrics(text: str) -> ServerMetrics:
    """ValueError if the text is not Prometheus exposition format."""
    running = waiting = 0
    usage: dict[str, list[float]] = {}
    blocks: dict[str, int] = {}
    for fam in families(text, _READ):
        name = fam.name
        if name == "vllm:num_requests_running":
            running += int(sum(s.value for s in fam.samples))
        elif name == "vllm:num_requests_waiting":
            waiting += int(sum(s.value for s in fam.samples))
        elif name in _USAGE:
            usage.setdefault(name, []).extend(s.value for s in fam.samples)
        elif name == "vllm:cache_config_info":
            for s in fam.samples:
                raw = s.labels.get("num_gpu_blocks")
                if raw and raw.isdigit():
                    blocks[s.labels.get("engine", "")] = int(raw)
    values = next((usage[n] for n in _USAGE if usage.get(n)), None)
    kv = min(1.0, max(0.0, sum(values) / len(values))) if values else None
    return ServerMetrics(running, waiting, kv, sum(blocks.values()) if blocks else None)
