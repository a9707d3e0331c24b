"""``--engine vllm``: the agent beside a vLLM server.

vLLM is started with prefix caching and KV events, e.g.::

    vllm serve MODEL --block-size 16 --enable-prompt-tokens-details \\
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                             "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

and the agent beside it with ``--engine vllm --vllm-url http://127.0.0.1:8000
--vllm-events tcp://127.0.0.1:5557 --vllm-replay tcp://127.0.0.1:5558 --block-size 16``.

Modules, one job each (the KV events, the cache view, the load poller and the recovery
contract are :mod:`..served`'s, shared with SGLang):

* :mod:`.openai` -- streaming ``/v1/completions`` with token ids
* :mod:`.prom` -- load from vLLM's ``/metrics``
* :mod:`.render_check` -- vLLM's chat rendering (``/tokenize``) against the router's
* :mod:`.engine` -- :class:`VllmEngine`, :class:`~..served.engine.EventedEngine` for vLLM
* :mod:`.versions` -- :data:`SUPPORTED`, the vLLM releases supported (oldest, newest; both
  tested), and what differs between them in the requests

What vLLM adds to that contract: after a reset, the agent cannot list vLLM's cache, so
until vLLM stores (or, with ``kv_cache_report_mode=full``, which the agent requests while its
view is incomplete, reuses) a block again, the router **under-reports** that block.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvroute.worker_agent.engines.vllm.engine import VllmConfig, VllmEngine
from kvroute.worker_agent.engines.vllm.versions import SUPPORTED
from kvroute.worker_agent.vocabulary import AgentVocabulary, load_vocabulary

if TYPE_CHECKING:
    from kvroute.core.config import AgentConfig

__all__ = ["MASK_PLUGIN", "SUPPORTED", "VllmConfig", "VllmEngine", "from_agent_config"]

MASK_PLUGIN = Path(__file__).resolve().parent / "plugin" / "kvroute_vllm_mask.py"
"""kvroute's logits processor for vLLM (standalone: vLLM loads it from its own environment,
with this file's folder on ``PYTHONPATH`` and ``--logits-processors
kvroute_vllm_mask:KvrouteMask``); the agent then runs with ``--vllm-mask-plugin``."""


def from_agent_config(cfg: AgentConfig, vocab: AgentVocabulary | None = None) -> VllmEngine:
    """``vocab``: the agent's (default: its flags', by ``load_vocabulary``); with
    ``--model-source``, ``vocab.chat`` is the tokenizer the render check compares vLLM's chat
    rendering with."""
    vocab = vocab or load_vocabulary(cfg)
    return VllmEngine(VllmConfig(
        url=cfg.vllm.url,
        model=cfg.model.name,
        served_model=cfg.vllm.model or cfg.model.name,
        block_size=cfg.model.block_size,
        events=cfg.vllm.events,
        replay=cfg.vllm.replay,
        topic=cfg.vllm.topic,
        capacity_blocks=cfg.engine.capacity_blocks,
        max_num_seqs=cfg.engine.max_batch,
        max_num_batched_tokens=cfg.engine.max_batched_tokens,
        lower_tier_s_per_token=cfg.tier.s_per_token,
        chunked_prefill=cfg.vllm.chunked_prefill,
        long_prefill_token_threshold=cfg.vllm.long_prefill_threshold,
        # Load is published once per heartbeat: two polls per beat keep it fresh.
        metrics_interval_s=min(1.0, max(0.05, cfg.worker.heartbeat_s / 2)),
        model_source=cfg.model.source,
        render_check_s=cfg.vllm.render_check_s,
        mask_plugin=cfg.vllm.mask_plugin,
    ), chat=vocab.chat)
