"""``VllmEngine``: the agent's adapter for a vLLM server (see the package doc)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.worker_agent.engines.served.engine import EventedConfig, EventedEngine
from kvroute.worker_agent.engines.vllm.openai import CompletionsClient
from kvroute.worker_agent.engines.vllm.plugin_check import PluginCheck
from kvroute.worker_agent.engines.vllm.prom import parse_metrics
from kvroute.worker_agent.engines.vllm.render_check import RenderCheck
from kvroute.worker_agent.engines.vllm.versions import (
    SUPPORTED,
    is_supported,
    parse_version,
    structured_dialect,
)

log = logging.getLogger("kvroute.agent.vllm")

REPORT_MODES = ("auto", "always", "never")


@dataclass(frozen=True, slots=True)
class VllmConfig(EventedConfig):
    """vLLM's flags, as the load reports them: ``max_num_seqs`` its ``--max-num-seqs``,
    ``max_num_batched_tokens`` its ``--max-num-batched-tokens``, ``chunked_prefill`` False
    with ``--no-enable-chunked-prefill``, ``long_prefill_token_threshold`` its
    ``--long-prefill-token-threshold``."""

    model_source: str = ""
    """The router's SOURCE of the model (``--model NAME=SOURCE``): with it, vLLM's rendering
    of a probe chat is checked against the router's (:mod:`.render_check`)."""
    render_check_s: float = 300.0
    """Seconds between those checks."""
    mask_plugin: bool = False
    """vLLM runs kvroute's mask plugin (``plugin/kvroute_vllm_mask.py``): a continued
    constrained region goes as its grammar and tokens so far (:class:`GrammarState`)."""
    report_reused: str = "auto"
    """Ask vLLM to re-report reused prefix blocks (``kv_cache_report_mode=full``): ``auto``
    while the cache view is incomplete (started late or reset), ``always`` or ``never``."""

    def __post_init__(self) -> None:
        EventedConfig.__post_init__(self)
        if self.report_reused not in REPORT_MODES:
            raise ValueError(f"report_reused must be one of {REPORT_MODES}")


class VllmEngine(EventedEngine):
    """Implements the :class:`~kvroute.worker_agent.engines.base.Engine` protocol."""

    kind = "vllm"
    product = "vLLM"

    def __init__(self, config: VllmConfig, chat: ChatTokenizer | None = None) -> None:
        """``chat``: ``config.model_source`` already loaded (else it is loaded here)."""
        self.client: CompletionsClient = CompletionsClient(
            config.url, config.served_model or config.model)
        super().__init__(config, self.client, parse_metrics, log)
        self.config: VllmConfig = config
        self.render_check: RenderCheck | None = None
        """With ``model_source``: the chat-rendering check against vLLM's /tokenize."""
        if config.model_source:
            # Loaded now: a SOURCE that is not a tokenizer ends the start (ModelSourceError).
            chat = chat or ChatTokenizer.load(config.model_source, name=config.model)
            self.render_check = RenderCheck(config.url, self.served_model, chat,
                                            config.render_check_s)
        self.plugin_check: PluginCheck | None = None
        """With ``mask_plugin``: whether vLLM does run it (:mod:`.plugin_check`)."""
        if config.mask_plugin:
            self.plugin_check = PluginCheck(config.url, self.served_model,
                                            config.render_check_s)

    @property
    def continues_grammars(self) -> bool:
        """Whether a constraint may be a :class:`GrammarState`: the mask plugin was named
        and vLLM said it runs."""
        return self.plugin_check is not None and self.plugin_check.runs

    @property
    def vllm_version(self) -> str | None:
        """The server's release from ``GET /version``; None until it answers."""
        return self.server_version

    def _supported(self) -> tuple[str, str]:
        return SUPPORTED

    def _on_version(self, answer: Any) -> str:
        text = super()._on_version(answer)
        self.client.dialect = structured_dialect(parse_version(text))
        return text

    def _version_info(self) -> dict[str, Any]:
        return {"constraint_fields": self.client.dialect.value}

    def _version_supported(self, text: str) -> bool:
        version = parse_version(text)
        return version is not None and is_supported(version)

    def _report_reused(self) -> bool:
        mode = self.config.report_reused
        return mode == "always" or (mode == "auto" and not self.events.stats.complete)

    def _checks(self) -> list[tuple[str, RenderCheck | PluginCheck]]:
        found = [("vllm-render-check", self.render_check),
                 ("vllm-mask-plugin-check", self.plugin_check)]
        return [(name, check) for name, check in found if check is not None]

    def _background(self) -> list[tuple[str, Callable[[], Any]]]:
        return [(name, check.run) for name, check in self._checks()]

    def _on_liveness(self, alive: bool) -> None:
        if self.plugin_check is not None:
            self.plugin_check.on_liveness(alive)

    async def _close_extra(self) -> None:
        for _, check in self._checks():
            await check.aclose()

    def metric_families(self) -> Iterator[Metric]:
        yield from super().metric_families()
        for _, check in self._checks():
            yield from check.metric_families()
