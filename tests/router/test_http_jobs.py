"""Streaming a choice's text (router/http_jobs.py): tokens decoded as they come, with the
byte model's tokenizer (characters split across tokens) and GPT-2's (words with their
leading spaces)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.tokenizer import GPT2Tokenizer
from kvroute.demo.openai_model import write_byte_model
from kvroute.router.http_jobs import Choice, FrontModel, choice_text, unsent_text


class Counting:
    """A tokenizer that counts the ids it decodes."""

    def __init__(self, tok: object) -> None:
        self.tok, self.decoded = tok, 0

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids)  # type: ignore[attr-defined]


@pytest.fixture(scope="module", params=["byte", "gpt2"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
    if request.param == "gpt2":
        return GPT2Tokenizer()
    return ChatTokenizer.load(str(write_byte_model(tmp_path_factory.mktemp("byte"))))


def stream(tok: object, ids: list[int], cuts: Sequence[int]) -> tuple[str, Counting]:
    """``ids`` arriving in pieces at ``cuts``: the text streamed, finish included."""
    counting = Counting(tok)
    m = FrontModel("m", counting)  # type: ignore[arg-type]
    c = Choice(0)
    out = []
    at = 0
    for cut in [*sorted(set(cuts)), len(ids)]:
        c.token_ids.extend(ids[at:cut])
        at = cut
        if cut == len(ids):
            c.finish_reason = "stop"
        piece = unsent_text(c, m)
        assert "\ufffd" not in piece or c.finish_reason, piece  # no half character sent
        out.append(piece)
    assert choice_text(c, FrontModel("m", tok)) == "".join(out)  # type: ignore[arg-type]
    return "".join(out), counting


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8"), max_size=60),
       cuts=st.lists(st.integers(0, 200), max_size=30))
def test_the_text_streamed_piece_by_piece_is_the_whole_texts(tok: object, text: str,
                                                              cuts: list[int]) -> None:
    ids = list(tok.encode(text))  # type: ignore[attr-defined]
    got, _ = stream(tok, ids, [c for c in cuts if c < len(ids)])
    assert got == tok.decode(ids)  # type: ignore[attr-defined]


def test_each_token_is_decoded_a_bounded_number_of_times(tok: object) -> None:
    """One token at a time, a long output costs time in proportion to its length, not its
    square: each id is decoded as new and as the next ones' context, about twice."""
    text = "The quick brown fox, über naïve, jumps: 数据 🙂 over the lazy dog. " * 40
    ids = list(tok.encode(text))  # type: ignore[attr-defined]
    got, counting = stream(tok, ids, range(1, len(ids)))
    assert got == text
    assert counting.decoded <= 4 * len(ids) + 100, (counting.decoded, len(ids))


def test_replaced_tokens_are_decoded_whole(tok: object) -> None:
    """A program's results replace what streamed (a backtrack): the text is then read from
    all the tokens, and only what extends what was sent goes."""
    m = FrontModel("m", tok)  # type: ignore[arg-type]
    c = Choice(0)
    c.token_ids = list(tok.encode("Hello there"))  # type: ignore[attr-defined]
    assert unsent_text(c, m) == "Hello there"
    c.token_ids, c.window = list(tok.encode("Hello there, world")), None  # type: ignore
    assert unsent_text(c, m) == ", world"

