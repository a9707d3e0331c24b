"""``--engine vllm``: the agent beside a vLLM server.

vLLM is started with prefix caching and KV events, e.g.::

    vllm serve MODEL --block-size 16 --enable-prompt-tokens-details \\
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                             "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

and the agent beside it with ``--engine vllm --vllm-url http://127.0.0.1:8000
--vllm-events tcp://127.0.0.1:5557 --vllm-replay tcp://127.0.0.1:5558 --block-size 16``.

Modules, one job each:

* :mod:`.wire` -- frames and msgpack payloads, every released layout
* :mod:`.blockmap` -- vLLM block hashes -> kvroute keys; what the engine holds
* :mod:`.subscriber` -- ZMQ SUB + replay, seq tracking, gap healing, resets
* :mod:`.openai` -- streaming ``/v1/completions`` with token ids
* :mod:`.prom` -- load from vLLM's ``/metrics``, polled in the background
* :mod:`.render_check` -- vLLM's chat rendering (``/tokenize``) against the router's
* :mod:`.engine` -- :class:`VllmEngine`, the Engine protocol on top of these
* :mod:`.versions` -- :data:`SUPPORTED`, the vLLM releases supported (oldest, newest; both
  tested), and what differs between them in the requests

What the router can believe, and for how long (the recovery contract):

* Events reach the agent in ~1 ms; the publisher writes them to Redis in the next batch.
* A lost batch that vLLM's replay buffer (``buffer_steps``, default 10000 batches) still holds
  is re-applied in order: no divergence beyond the time to notice (the next frame, or
  ``probe_s`` of silence).
* A lost batch past the buffer, or a vLLM restart: the view is **reset** -- ``Op.CLEAR``
  published, then re-learned from new events. The agent cannot list vLLM's cache, so from the
  reset until vLLM stores (or, with ``kv_cache_report_mode=full``, which the agent requests
  while its view is incomplete, reuses) a block again, the router **under-reports** that
  block. It never reports a block the engine does not hold beyond the propagation delay.
* vLLM unreachable (``/metrics`` silent for ``down_after_s``): every block is withdrawn at
  once and :meth:`VllmEngine.healthy` is False, so the agent stops heartbeating until vLLM
  answers again.
* Redis restarts and outages are the publisher's (buffer, reconnect, snapshot rewrite under a
  new epoch from :meth:`VllmEngine.cached_keys`); the mirror falls back to load-only routing
  while Redis is away.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.worker_agent.engines.vllm.engine import VllmConfig, VllmEngine
from kvroute.worker_agent.engines.vllm.versions import SUPPORTED
from kvroute.worker_agent.vocabulary import AgentVocabulary, load_vocabulary

if TYPE_CHECKING:
    from kvroute.core.config import AgentConfig

__all__ = ["SUPPORTED", "VllmConfig", "VllmEngine", "from_agent_config"]


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
        chunked_prefill=cfg.vllm.chunked_prefill,
        long_prefill_token_threshold=cfg.vllm.long_prefill_threshold,
        # Load is published once per heartbeat: two polls per beat keep it fresh.
        metrics_interval_s=min(1.0, max(0.05, cfg.worker.heartbeat_s / 2)),
        model_source=cfg.model.source,
        render_check_s=cfg.vllm.render_check_s,
    ), chat=vocab.chat)
