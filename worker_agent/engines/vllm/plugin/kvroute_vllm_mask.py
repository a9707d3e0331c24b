"""kvroute's token masks inside vLLM: a logits processor that holds a request to an
llguidance grammar from a given state.

vLLM's structured outputs start every grammar from its beginning. A kvroute controller
program that continues a constrained region (after a fast-forward or a backtrack inside it)
needs the grammar from where the region's text so far left it. This processor does that: a
request whose ``vllm_xargs`` carry

* ``kvroute_grammar``: llguidance's grammar (its JSON or Lark text), and
* ``kvroute_prefix``: the region's token ids so far (in the prompt already),

is masked at every step to the tokens the grammar allows after the prefix and what the
request has generated since; once the grammar is complete, only the end-of-sequence token.
Requests without ``kvroute_grammar`` are not touched.

This file stands alone (vLLM, torch and llguidance, which vLLM ships): vLLM loads it from its
own environment. Start vLLM with this file's directory on ``PYTHONPATH`` and
``--logits-processors kvroute_vllm_mask:KvrouteMask``, and the kvroute agent with
``--vllm-mask-plugin`` (docs/engines.md).

It implements the logits-processor interface of vLLM's V1 model runner, which vLLM's CPU
build runs (and a GPU build of 0.32 or later with ``VLLM_USE_V2_MODEL_RUNNER=0``); Model
Runner V2's own interface is not implemented yet.

Invariant: nothing here raises inside vLLM's engine loop (an exception there stops the
engine). A grammar or prefix the matcher refuses leaves only end-of-sequence allowed: the
request ends, and the agent, which checks every constrained output itself, reports it.
Malformed arguments are refused at the API server (HTTP 400) by ``validate_params``.
"""

from __future__ import annotations

import logging
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

GRAMMAR = "kvroute_grammar"
PREFIX = "kvroute_prefix"
MAX_PREFIX = 1 << 20

log = logging.getLogger("kvroute.vllm_mask")


class KvrouteMask(AdapterLogitsProcessor):
    """The per-request masks of requests that carry ``kvroute_grammar``."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        from vllm.tokenizers import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
        # As vLLM's own guidance backend builds it: the logits' width, every token named.
        self._n_vocab = max(vllm_config.model_config.get_vocab_size(), len(tokenizer))
        self._ll = llguidance.hf.from_tokenizer(tokenizer, self._n_vocab)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = sampling_params.extra_args or {}
        if GRAMMAR not in args:
            if PREFIX in args:
                raise ValueError(f"vllm_xargs.{PREFIX} without {GRAMMAR}")
            return
        grammar, prefix = args[GRAMMAR], args.get(PREFIX, [])
        if not isinstance(grammar, str) or not grammar:
            raise ValueError(f"vllm_xargs.{GRAMMAR}: a grammar (llguidance JSON or Lark text)")
        if not isinstance(prefix, list) or len(prefix) > MAX_PREFIX or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prefix):
            raise ValueError(f"vllm_xargs.{PREFIX}: a list of token ids")
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"vllm_xargs.{GRAMMAR}: {error}")

    def is_argmax_invariant(self) -> bool:
        return False  # a mask changes which token is the most likely

    def new_req_logits_processor(self, params: SamplingParams) -> RequestMask | None:
        args = params.extra_args or {}
        grammar = args.get(GRAMMAR)
        if grammar is None:
            return None
        return RequestMask(self._ll, grammar, list(args.get(PREFIX) or ()), self._n_vocab)


class RequestMask:
    """One request's matcher: fed the prefix once, then each step the tokens generated
    since the last; masks the logits row to what it allows next."""

    def __init__(self, ll: Any, grammar: str, prefix: list[int], n_vocab: int) -> None:
        self._m = llguidance.LLMatcher(ll, grammar, log_level=0)
        if prefix:
            self._m.consume_tokens(prefix)
        self._eos = ll.eos_token
        self._fed = 0
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, n_vocab)
        self._warned = False

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        m = self._m
        if len(output_ids) > self._fed:
            m.consume_tokens(list(output_ids[self._fed:]))
            self._fed = len(output_ids)
        if m.is_error():
            if not self._warned:
                self._warned = True
                log.warning("kvroute grammar refused the request's tokens: ending it (%s)",
                            m.get_error()[:300])
            end = logits.new_full(logits.shape, float("-inf"))
            end[self._eos] = 0.0
            return end
        llguidance.torch.fill_next_token_bitmask(m, self._bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(
            logits, self._bitmask.to(logits.device, non_blocking=True))
        return logits
