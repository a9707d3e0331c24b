"""Drives kvroute's mask plugin the way vLLM's Model Runner V2 sampler does, in vLLM's own
environment: ``python runner_v2_drive.py MODEL_DIR`` prints one JSON object of observations.

Model Runner V2 needs a GPU, so its per-slot buffers are CPU tensors here, with the attributes
the runner's buffers have (``.gpu``, ``.np``); everything else is vLLM's own: its loaders
(``build_custom_logits_processors``, the API server's params validator), ``LogitsContext``,
``SamplingParams``, the model's config and tokenizer, and llguidance. The calls follow
``vllm.v1.worker.gpu.sample.sampler``: ``add_request`` per slot, ``apply_staged_writes``,
then ``apply(logits, ctx)`` per step over the batch's rows."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import llguidance
import llguidance.hf
import numpy as np
import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    build_custom_logits_processors,
    build_custom_logits_processors_params_validator,
)

FQCN = "kvroute_vllm_mask:KvrouteMask"
GRAMMAR = r'start: "[" NUM ("," NUM)* "]"' + "\nNUM: /[0-9]{1,3}/"
SLOTS, MAX_LEN = 4, 512


def main(model_dir: str) -> None:
    config = EngineArgs(model=model_dir, max_model_len=MAX_LEN, max_num_seqs=SLOTS,
                        logits_processors=[FQCN]).create_engine_config()
    tok = cached_tokenizer_from_config(config.model_config)
    n_vocab = max(config.model_config.get_vocab_size(), len(tok))
    out: dict[str, object] = {}

    # The API server's admission check (V2's validator) on good and bad arguments.
    validate = build_custom_logits_processors_params_validator([FQCN])
    prefix = tok.encode("[12,", add_special_tokens=False)
    good = SamplingParams(extra_args={"kvroute_grammar": GRAMMAR, "kvroute_prefix": prefix})
    validate(good)
    refused = []
    for bad in ({"kvroute_grammar": ""}, {"kvroute_prefix": [1]},
                {"kvroute_grammar": GRAMMAR, "kvroute_prefix": ["x"]}):
        try:
            validate(SamplingParams(extra_args=bad))
        except Exception as e:  # VLLMValidationError: the API server's 400
            refused.append(type(e).__name__)
    out["refused"] = refused

    # The same name loads under the V1 runner too.
    v1 = build_logitsprocs(config, torch.device("cpu"), False, False, [FQCN])
    out["v1_loaded"] = [type(p).__name__ for p in v1.all]

    states = SimpleNamespace(
        device=torch.device("cpu"), max_num_reqs=SLOTS, vocab_size=n_vocab,
        all_token_ids=SimpleNamespace(gpu=torch.zeros(SLOTS, MAX_LEN, dtype=torch.int32)),
        prompt_len=SimpleNamespace(np=np.zeros(SLOTS, dtype=np.int32)),
        prefill_len=SimpleNamespace(np=np.zeros(SLOTS, dtype=np.int32)),
        total_len=SimpleNamespace(gpu=torch.zeros(SLOTS, dtype=torch.int32)))
    procs = build_custom_logits_processors(config, states, False, [FQCN])
    out["v2_loaded"] = [type(p).__name__ for p in procs]
    (mask,) = procs

    def admit(slot: int, prompt: list[int], params: SamplingParams) -> bool:
        states.all_token_ids.gpu[slot, :len(prompt)] = torch.tensor(prompt)
        states.prompt_len.np[slot] = len(prompt)
        states.total_len.gpu[slot] = len(prompt)
        return mask.add_request(slot, params)

    def commit(slot: int, token: int) -> None:
        n = int(states.total_len.gpu[slot])
        states.all_token_ids.gpu[slot, n] = token
        states.total_len.gpu[slot] = n + 1

    def step(batch: list[tuple[int, list[int]]], logits: torch.Tensor) -> torch.Tensor:
        """One step over ``batch`` (slot, drafts): a row per slot plus one per draft."""
        rows, local, inputs = [], [], []
        for slot, drafts in batch:
            last = int(states.all_token_ids.gpu[slot, int(states.total_len.gpu[slot]) - 1])
            for j, fed in enumerate([last, *drafts]):
                rows.append(slot)
                local.append(j)
                inputs.append(fed)
        slots = [s for s, _ in batch]
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(rows, dtype=torch.int32),
            idx_mapping=torch.tensor(slots, dtype=torch.int32),
            idx_mapping_np=np.array(slots, dtype=np.int32),
            expanded_local_pos=torch.tensor(local, dtype=torch.int32),
            input_ids=torch.tensor(inputs, dtype=torch.int32),
            pos=torch.zeros(len(rows), dtype=torch.int32),
            seq_lens_upper_bound_np=np.zeros(len(slots), dtype=np.int32))
        mask.apply_staged_writes()
        return mask.apply(logits, ctx)

    ll = llguidance.hf.from_tokenizer(tok, n_vocab)

    def allowed_after(tokens: list[int]) -> set[int]:
        m = llguidance.LLMatcher(ll, GRAMMAR, log_level=0)
        m.consume_tokens(tokens)
        bits = llguidance.torch.allocate_token_bitmask(1, n_vocab)
        llguidance.torch.fill_next_token_bitmask(m, bits, 0)
        logits = torch.zeros(1, n_vocab)
        llguidance.torch.apply_token_bitmask_inplace(logits, bits)
        return set(torch.nonzero(logits[0] == 0).flatten().tolist())

    def finite(row: torch.Tensor) -> set[int]:
        return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())

    # Slot 2 has a grammar continued from "[12,", slot 1 none; greedy decoding over random
    # logits, as a model that knows nothing of the grammar.
    chat = tok.encode("Numbers:", add_special_tokens=False)
    out["needs_processing"] = [admit(2, chat + prefix, good),
                               admit(1, chat, SamplingParams(max_tokens=8))]
    gen = torch.Generator().manual_seed(7)
    region, untouched, exact = list(prefix), True, True
    for _ in range(24):
        logits = torch.randn(2, n_vocab, generator=gen)
        plain = logits[1].clone()
        masked = step([(2, []), (1, [])], logits)
        untouched &= bool(torch.equal(masked[1], plain))
        exact &= finite(masked[0]) == allowed_after(region)
        token = int(torch.argmax(masked[0]))
        commit(2, token)
        commit(1, int(torch.argmax(masked[1])))
        if token == tok.eos_token_id:
            break
        region.append(token)
    out["text"] = tok.decode(region)
    out["ended"] = token == tok.eos_token_id
    out["masks_exact"] = exact
    out["other_row_untouched"] = untouched

    # Speculative decoding: rows at local positions 1 and 2 see the drafts fed before them.
    slot3_prefix = tok.encode("[7", add_special_tokens=False)
    admit(3, chat + slot3_prefix,
          SamplingParams(extra_args={"kvroute_grammar": GRAMMAR,
                                     "kvroute_prefix": slot3_prefix}))
    drafts = tok.encode(",8", add_special_tokens=False)
    logits = step([(3, drafts)], torch.zeros(1 + len(drafts), n_vocab))
    out["draft_rows_exact"] = all(
        finite(logits[j]) == allowed_after(slot3_prefix + drafts[:j])
        for j in range(len(drafts) + 1))
    bad_drafts = tok.encode("x,", add_special_tokens=False)
    logits = step([(3, bad_drafts)], torch.zeros(1 + len(bad_drafts), n_vocab))
    out["refused_draft_rows_unmasked"] = all(
        len(finite(logits[j])) == n_vocab for j in range(1, len(bad_drafts) + 1))

    # A committed token the grammar refuses: end-of-sequence only from then on.
    commit(3, tok.encode("x", add_special_tokens=False)[0])
    logits = step([(3, [])], torch.zeros(1, n_vocab))
    out["refused_token_ends"] = finite(logits[0]) == {ll.eos_token}

    # A slot reused by a request without a grammar is not masked.
    out["reused_slot_needs_processing"] = admit(2, chat, SamplingParams())
    logits = step([(2, [])], torch.zeros(1, n_vocab))
    out["reused_slot_unmasked"] = len(finite(logits[0])) == n_vocab
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
