"""``--engine sglang``: the agent beside an SGLang server.

SGLang is started with its radix cache's page size equal to the agent's block size, KV
events, and metrics, e.g.::

    python -m sglang.launch_server --model-path MODEL --page-size 16 --enable-metrics \\
        --grammar-backend llguidance \\
        --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557",
                             "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'

and the agent beside it with ``--engine sglang --sglang-url http://127.0.0.1:30000
--sglang-events tcp://127.0.0.1:5557 --sglang-replay tcp://127.0.0.1:5558
--sglang-topic kv-events --block-size 16``.

SGLang's KV events are vLLM's design (the same frames, replay socket and event types, plus
a ``medium`` for HiCache's host tier and the ``cache_salt``), so the agent follows them with
:mod:`..served`'s machinery and recovery contract. SGLang-specific, one job each:

* :mod:`.client` -- streaming native ``/generate`` with token ids
* :mod:`.metrics` -- load from SGLang's ``/metrics``
* :mod:`.versions` -- :data:`SUPPORTED` (oldest, newest; both tested) and what differs
* :mod:`.engine` -- :class:`SglangEngine`, which also reads ``/server_info``

What is exact and what is not:

* The cache hit of a request is SGLang's own (``meta_info.cached_tokens``), on its last chunk.
* Blocks are published as SGLang reports them; a block SGLang keeps only in HiCache's host
  memory (``CPU_PINNED``) counts as cached until its last tier drops it.
* A LoRA adapter's request (a router's ``--lora``) is sent with ``lora_path``; its blocks are
  keyed from the events' ``lora_name`` as vLLM's are (SGLang 0.5.22 and later; older events
  do not name the adapter, see :mod:`.versions`).
* Data parallelism (``--dp-size N``): each rank has its own cache and publishes its own
  events (on the endpoint's port plus the rank). Run one agent per rank, each with
  ``--sglang-dp-rank R`` and its own ``--worker-id``, all given the same endpoints: each
  follows its rank's events, reads its rank's load and pins its requests to its rank, so the
  router routes among ranks by their caches (SGLang's own DP controller does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.worker_agent.engines.served.engine import EventedConfig
from kvroute.worker_agent.engines.sglang.engine import SglangEngine
from kvroute.worker_agent.engines.sglang.versions import SUPPORTED, rank_endpoint

if TYPE_CHECKING:
    from kvroute.core.config import AgentConfig

__all__ = ["SUPPORTED", "SglangEngine", "from_agent_config"]


def from_agent_config(cfg: AgentConfig) -> SglangEngine:
    rank = cfg.sglang.dp_rank
    try:
        events, replay = (rank_endpoint(e, rank) for e in (cfg.sglang.events, cfg.sglang.replay))
    except ValueError as exc:
        raise SystemExit(f"--sglang-dp-rank {rank}: {exc}") from None
    return SglangEngine(EventedConfig(
        url=cfg.sglang.url,
        model=cfg.model.name,
        block_size=cfg.model.block_size,
        events=events,
        replay=replay,
        topic=cfg.sglang.topic,
        capacity_blocks=cfg.engine.capacity_blocks,
        max_num_seqs=0,  # from /server_info's max_running_requests
        max_num_batched_tokens=cfg.engine.max_batched_tokens,
        lower_tier_s_per_token=cfg.tier.s_per_token,
        # Load is published once per heartbeat: two polls per beat keep it fresh.
        metrics_interval_s=min(1.0, max(0.05, cfg.worker.heartbeat_s / 2)),
    ), dp_rank=rank)
