"""``SglangEngine``: the agent's adapter for an SGLang server (see the package doc)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from kvroute.worker_agent.engines.served.engine import EventedConfig, EventedEngine
from kvroute.worker_agent.engines.sglang.client import GenerateClient
from kvroute.worker_agent.engines.sglang.metrics import parse_metrics
from kvroute.worker_agent.engines.sglang.versions import SUPPORTED, Features, is_supported
from kvroute.worker_agent.engines.vllm.versions import parse_version

log = logging.getLogger("kvroute.agent.sglang")


class SglangEngine(EventedEngine):
    """Implements the :class:`~kvroute.worker_agent.engines.base.Engine` protocol.

    What the server says of itself (``/server_info``) fills what the agent was not told:
    ``max_running_requests`` -> the load's ``max_running``, ``max_prefill_tokens`` -> its
    ``max_batched_tokens``, ``chunked_prefill_size`` -> its prefill mode and chunk,
    ``max_total_num_tokens`` -> its capacity (when ``/metrics`` does not say). Settings
    that make the agent's view wrong are logged at ERROR: a ``page_size`` other than the
    agent's block size (every block would be skipped), no ``kv_events_config`` (no cache
    view), ``enable_metrics`` off (no load, and the agent takes the server for down)."""

    kind = "sglang"
    product = "SGLang"

    def __init__(self, config: EventedConfig, dp_rank: int = -1) -> None:
        """``dp_rank``: serve that data-parallel rank only (``config``'s event endpoints are
        already that rank's; see :func:`.versions.rank_endpoint`); -1: the whole server."""
        self.dp_rank = dp_rank
        self.client: GenerateClient = GenerateClient(config.url, dp_rank=dp_rank)
        super().__init__(config, self.client,
                         functools.partial(parse_metrics, block_size=config.block_size,
                                           dp_rank=dp_rank), log)
        self.server_info: dict[str, Any] = {}
        """``/server_info`` as the server answered it (empty until then)."""
        self._info_capacity: int | None = None

    def _supported(self) -> tuple[str, str]:
        return SUPPORTED

    def _version_supported(self, text: str) -> bool:
        return is_supported(text)

    def _on_version(self, answer: Any) -> str:
        info: dict[str, Any] = answer
        text = str(info["version"])
        self.server_info = info
        self.client.features = Features.of(parse_version(text))
        self._check_settings(info)
        self.config = dataclasses.replace(self.config, **self._learned(info))
        return text

    def _learned(self, info: dict[str, Any]) -> dict[str, Any]:
        """Config fields the server's arguments fill (only those the agent was not given)."""
        cfg = self.config
        out: dict[str, Any] = {}
        running = info.get("max_running_requests")
        if not cfg.max_num_seqs and isinstance(running, int) and running > 0:
            out["max_num_seqs"] = running
        budget = info.get("max_prefill_tokens")  # the prompt tokens of one prefill batch
        if not cfg.max_num_batched_tokens and isinstance(budget, int) and budget > 0:
            out["max_num_batched_tokens"] = budget
        chunk = info.get("chunked_prefill_size")  # the most of one prompt per iteration
        if isinstance(chunk, int) and not cfg.long_prefill_token_threshold:
            out["chunked_prefill"] = chunk > 0
            out["long_prefill_token_threshold"] = max(0, chunk)
        tokens = info.get("max_total_num_tokens")  # one rank's
        if isinstance(tokens, int) and tokens > 0:
            ranks = 1 if self.dp_rank >= 0 else _dp_size(info)
            self._info_capacity = tokens * ranks // cfg.block_size
        return out

    def _check_settings(self, info: dict[str, Any]) -> None:
        page = info.get("page_size")
        if isinstance(page, int) and page != self.block_size:
            log.error(f"SGLang runs with --page-size {page} but the agent's block size is "
                      f"{self.block_size}: every block it reports is skipped; start SGLang with "
                      f"--page-size {self.block_size} (or the agent with --block-size {page}, "
                      "and the routers alike)", extra={"kv": {"page_size": page}})
        if "kv_events_config" in info and not info.get("kv_events_config"):
            log.error("SGLang runs without --kv-events-config: it publishes no KV events, so "
                      "the routers see none of its cache")
        dp = _dp_size(info)
        if dp > 1 and self.dp_rank < 0:
            log.error(f"SGLang runs {dp} data-parallel ranks, each publishing its own KV events "
                      "(the endpoint's port plus the rank): this agent follows one endpoint, "
                      "so it sees one rank's cache but is sent the whole server's requests. "
                      "Run one agent per rank with --sglang-dp-rank", extra={"kv": {"dp_size": dp}})
        if self.dp_rank >= dp:
            log.error(f"--sglang-dp-rank {self.dp_rank} but SGLang runs {dp} data-parallel "
                      "rank(s): its requests are refused", extra={"kv": {"dp_size": dp}})
        if info.get("enable_metrics") is False:
            log.error("SGLang runs without --enable-metrics: the agent reads its load and "
                      "liveness from /metrics and takes it for down until it has them")

    def _version_info(self) -> dict[str, Any]:
        f = self.client.features
        return {"cache_salt": f.cache_salt, "sampling_seed": f.sampling_seed,
                "info_path": self.client.version_tried, "dp_rank": self.dp_rank}

    def _capacity_blocks(self) -> int:
        return (self.metrics.latest.num_gpu_blocks or self._info_capacity
                or self.config.capacity_blocks)


def _dp_size(info: dict[str, Any]) -> int:
    dp = info.get("dp_size")
    return dp if isinstance(dp, int) and dp > 0 else 1
