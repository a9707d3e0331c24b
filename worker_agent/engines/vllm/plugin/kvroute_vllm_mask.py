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

``KvrouteMask`` implements both of vLLM's logits-processor interfaces, because vLLM chooses
the model runner itself: the V1 runner's (``AdapterLogitsProcessor``: the CPU build, and GPU
builds before 0.32 or where Model Runner V2 lacks a feature asked for) and Model Runner V2's
(``vllm.v1.worker.gpu.sample.logits_processor``, where that module exists: the GPU default
from 0.32). vLLM constructs it with the runner's own arguments, and it takes that runner's
part.

Invariant: nothing here raises inside vLLM's engine loop (an exception there stops the
engine). A grammar or prefix the matcher refuses leaves only end-of-sequence allowed: the
request ends, and the agent, which checks every constrained output itself, reports it.
Malformed arguments are refused at the API server (HTTP 400) by ``validate_params``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

try:  # Model Runner V2's interface (vLLM 0.32 and later)
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as RunnerV2
except ImportError:  # an older vLLM: the V1 runner only
    RunnerV2 = object  # type: ignore[assignment,misc]

GRAMMAR = "kvroute_grammar"
PREFIX = "kvroute_prefix"
MAX_PREFIX = 1 << 20

log = logging.getLogger("kvroute.vllm_mask")


def grammar_of(params: SamplingParams) -> tuple[str, list[int]] | None:
    """The request's grammar and region prefix, or None when it carries no grammar."""
    args = params.extra_args or {}
    grammar = args.get(GRAMMAR)
    return None if grammar is None else (grammar, list(args.get(PREFIX) or ()))


class KvrouteMask(AdapterLogitsProcessor, RunnerV2):
    """The per-request masks of requests that carry ``kvroute_grammar``, under either model
    runner: V1 calls ``__init__(vllm_config, device, is_pin_memory)`` and ``apply(logits)``,
    V2 ``__init__(vllm_config, req_states)`` and ``apply(logits, ctx)``."""

    def __init__(self, vllm_config: Any, *runner_args: Any) -> None:
        from vllm.tokenizers import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
        # As vLLM's own guidance backend builds it: the logits' width, every token named.
        self._n_vocab = max(vllm_config.model_config.get_vocab_size(), len(tokenizer))
        self._ll = llguidance.hf.from_tokenizer(tokenizer, self._n_vocab)
        self._v2: SlotMasks | None = None
        if len(runner_args) == 1:  # Model Runner V2: (req_states,)
            self._v2 = SlotMasks(runner_args[0], self._ll, self._n_vocab)
        else:  # the V1 runner: (device, is_pin_memory)
            AdapterLogitsProcessor.__init__(self, vllm_config, *runner_args)

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

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if self._v2 is None:
            return AdapterLogitsProcessor.apply(self, logits)
        return self._v2.apply(logits, ctx)

    # --- the V1 runner -------------------------------------------------------------------

    def is_argmax_invariant(self) -> bool:
        return False  # a mask changes which token is the most likely

    def new_req_logits_processor(self, params: SamplingParams) -> RequestMask | None:
        found = grammar_of(params)
        return None if found is None else RequestMask(
            Matcher(self._ll, *found), self._n_vocab)

    # --- Model Runner V2 -----------------------------------------------------------------

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        assert self._v2 is not None, "add_request is Model Runner V2's call"
        return self._v2.add(req_idx, sampling_params)


class Matcher:
    """One request's grammar state: fed the region's prefix once, then the tokens the
    request commits; fills a bitmask row with what it allows next."""

    def __init__(self, ll: Any, grammar: str, prefix: list[int]) -> None:
        self._m = llguidance.LLMatcher(ll, grammar, log_level=0)
        if prefix:
            self._m.consume_tokens(prefix)
        self._eos = ll.eos_token
        self.fed = 0  # tokens of the request's output consumed
        self._warned = False

    def feed(self, tokens: list[int]) -> None:
        if tokens and not self._m.is_error():
            self._m.consume_tokens(tokens)
        self.fed += len(tokens)

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """Row ``row`` of ``bitmask``: the tokens allowed after the committed ones and
        ``drafts`` (speculative tokens not yet accepted, consumed and rolled back here). A
        draft the grammar refuses leaves the row as it is: the row before rejects it."""
        m = self._m
        if m.is_error():
            self._end_only(bitmask, row)
            return
        if drafts:
            if m.validate_tokens(list(drafts)) < len(drafts):
                return
            m.consume_tokens(list(drafts))
        llguidance.torch.fill_next_token_bitmask(m, bitmask, row)
        if drafts:
            m.rollback(len(drafts))

    def _end_only(self, bitmask: torch.Tensor, row: int) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kvroute grammar refused the request's tokens: ending it (%s)",
                        self._m.get_error()[:300])
        bitmask[row].zero_()
        word, bit = divmod(self._eos, 32)
        bitmask[row, word] = (1 << bit) if bit < 31 else -(1 << 31)  # int32's sign bit


class RequestMask:
    """The V1 runner's per-request callable: feeds the request's new output ids to its
    matcher and masks its logits row."""

    def __init__(self, matcher: Matcher, n_vocab: int) -> None:
        self._matcher = matcher
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, n_vocab)

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        m = self._matcher
        m.feed(list(output_ids[m.fed:]))
        m.fill(self._bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(
            logits, self._bitmask.to(logits.device, non_blocking=True))
        return logits


class SlotMasks:
    """Model Runner V2's side: matchers by request slot (slots are reused, so ``add``
    resets one), fed each step from the runner's token history.

    A row's output so far is, as vLLM's own bad-words stage reads it, the slot's committed
    tokens (``all_token_ids[prompt_len:total_len]``, the row of local position 0 fed the
    last of them) and, for the row at local position ``j`` under speculative decoding, the
    drafts fed at positions 1..j of its request."""

    def __init__(self, req_states: Any, ll: Any, n_vocab: int) -> None:
        self._states = req_states
        self._ll = ll
        self._n_vocab = n_vocab
        self._slots: dict[int, Matcher] = {}
        # One (pinned, on a GPU) bitmask for every step, grown for speculative rows.
        self._bitmask = llguidance.torch.allocate_token_bitmask(req_states.max_num_reqs,
                                                                n_vocab)

    def add(self, slot: int, params: SamplingParams) -> bool:
        found = grammar_of(params)
        if found is None:
            self._slots.pop(slot, None)
            return False
        self._slots[slot] = Matcher(self._ll, *found)
        return True

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        slots = self._slots
        ours = [int(s) for s in ctx.idx_mapping_np if int(s) in slots]
        if not ours:
            return logits
        self._feed_committed(ours)
        rows = ctx.expanded_idx_mapping.tolist()
        local = ctx.expanded_local_pos.tolist()
        inputs = ctx.input_ids.tolist() if len(rows) > len(ctx.idx_mapping_np) else None
        if len(rows) > self._bitmask.shape[0]:
            self._bitmask = llguidance.torch.allocate_token_bitmask(len(rows), self._n_vocab)
        bitmask = self._bitmask[:len(rows)]
        bitmask.fill_(-1)  # rows of other requests: everything allowed
        for row, slot in enumerate(rows):
            matcher = slots.get(slot)
            if matcher is not None:
                j = local[row]
                drafts = inputs[row - j + 1: row + 1] if j and inputs is not None else []
                matcher.fill(bitmask, row, drafts)
        llguidance.torch.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True))
        return logits

    def _feed_committed(self, ours: list[int]) -> None:
        """Each matcher consumes its slot's tokens committed since the last step."""
        states = self._states
        index = torch.tensor(ours, dtype=torch.long, device=states.total_len.gpu.device)
        totals = states.total_len.gpu[index].tolist()
        for slot, total in zip(ours, totals, strict=True):
            matcher = self._slots[slot]
            start = int(states.prompt_len.np[slot]) + matcher.fed
            if total > start:
                matcher.feed(states.all_token_ids.gpu[slot, start:total].tolist())
