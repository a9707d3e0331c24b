"""Tokenizers for text prompts. The router tokenizes; agents only ever see token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; decoding skips ids >= 256 (engine-only tokens)."""

    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")


def make_tokenizer(name: str) -> Tokenizer | None:
    """'' means token ids only. ValueError names the choices."""
    if not name:
        return None
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; choose '' (token ids only) or 'byte'")
