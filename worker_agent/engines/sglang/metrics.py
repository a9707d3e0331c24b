"""Load from SGLang's Prometheus ``/metrics`` (``--enable-metrics``; polled by
:mod:`..served.poller`).

SGLang's scheduler gauges carry ``tp_rank``, ``pp_rank`` and, with data parallelism,
``dp_rank`` labels; the ranks of one data-parallel group report the same batch, so each
group's value is its largest, and groups are added up:

* ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``: summed over groups
* KV-cache usage in [0, 1]: ``sglang:token_usage``, averaged over groups
* capacity: ``sglang:max_total_num_tokens`` (0.5.12 and later) summed over groups, in blocks
  of ``block_size`` tokens; older releases tell it only in ``/server_info``

An agent of one rank (``--sglang-dp-rank``) reads that rank's group only (and samples
without a ``dp_rank`` label: a server without data parallelism).
"""

from __future__ import annotations

from collections import defaultdict

from kvroute.worker_agent.engines.served.poller import ServerMetrics, families

_NAMES = {"sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "waiting",
          "sglang:token_usage": "usage", "sglang:max_total_num_tokens": "tokens"}


def parse_metrics(text: str, block_size: int, dp_rank: int = -1) -> ServerMetrics:
    """``dp_rank``: read only that data-parallel rank's samples (-1: every rank's). ValueError
    if the text is not Prometheus exposition format."""
    only = str(dp_rank) if dp_rank >= 0 else None
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for fam in families(text, _NAMES):
        what = _NAMES.get(fam.name)
        if what is None:
            continue
        for s in fam.samples:
            per = groups[what]
            dp = s.labels.get("dp_rank", "")
            if only is not None and dp not in (only, ""):
                continue
            per[dp] = max(per.get(dp, s.value), s.value)
    usage = list(groups["usage"].values())
    kv = min(1.0, max(0.0, sum(usage) / len(usage))) if usage else None
    tokens = sum(groups["tokens"].values())
    return ServerMetrics(running=int(sum(groups["running"].values())),
                         waiting=int(sum(groups["waiting"].values())), kv_usage=kv,
                         num_gpu_blocks=int(tokens) // block_size if tokens else None)
