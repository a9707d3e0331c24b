"""``worker_agent/vocabulary.py``: an agent's token ids from ``--model-source`` (the router's
``--model NAME=SOURCE``), else from ``--tokenizer`` and ``--vocab-size``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.demo.openai_model import write_byte_model
from kvroute.router.pools import load_models
from kvroute.worker_agent.engines.tiny import from_agent_config as tiny_engine
from kvroute.worker_agent.server import make_engine
from kvroute.worker_agent.vocabulary import load_vocabulary


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_model(tmp_path_factory.mktemp("byte-model"))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory, byte_model: Path) -> Path:
    """The byte model with its two special tokens swapped: as many ids, other ids."""
    d = tmp_path_factory.mktemp("other-model")
    spec = json.loads((byte_model / "tokenizer.json").read_text())
    for tok in spec["added_tokens"]:
        tok["id"] = 257 if tok["id"] == 256 else 256
    (d / "tokenizer.json").write_text(json.dumps(spec))
    (d / "tokenizer_config.json").write_text((byte_model / "tokenizer_config.json").read_text())
    return d


def test_an_agent_and_a_router_given_one_source_agree(byte_model: Path) -> None:
    agent = load_vocabulary(AgentConfig.of(engine="sim", model="m", model_source=str(byte_model)))
    (pool,) = load_models(RouterConfig.of(model=f"m={byte_model}"))
    assert pool.chat is not None
    assert (agent.name, agent.size) == (pool.chat.fingerprint, pool.cfg.model.vocab_size) \
        == (ChatTokenizer.load(str(byte_model)).fingerprint, 258)
    assert agent.name.startswith("tok:") and agent.chat is not None
    # The source's tokenizer serves programs' text (no BOS in a fast-forward).
    assert agent.program_tokenizer is agent.chat
    assert agent.chat.encode("hi", add_special_tokens=False) == list(b"hi")


def test_the_fingerprint_tells_tokenizers_of_one_size_apart(byte_model: Path,
                                                            other_model: Path) -> None:
    a = ChatTokenizer.load(str(byte_model))
    b = ChatTokenizer.load(str(other_model))
    assert a.vocab_size == b.vocab_size and a.fingerprint != b.fingerprint
    # The chat template does not change token ids, so it does not change the fingerprint.
    cfg = json.loads((byte_model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }}"
    c = byte_model.parent / "byte-model-template"
    c.mkdir(exist_ok=True)
    (c / "tokenizer.json").write_text((byte_model / "tokenizer.json").read_text())
    (c / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTokenizer.load(str(c)).fingerprint == a.fingerprint


def test_every_engine_speaks_the_sources_ids(byte_model: Path) -> None:
    src = str(byte_model)
    sim = make_engine(AgentConfig.of(engine="sim", model_source=src))
    assert sim.config.vocab_size == 258  # type: ignore[attr-defined]
    tiny = tiny_engine(AgentConfig.of(engine="tiny", capacity_blocks=4, tiny_dim=32,
                                   tiny_layers=1, model_source=src))
    assert (tiny.vocab_size, tiny.eos_token_id) == (258, 256)


def test_flags_that_contradict_the_source_end_the_start(byte_model: Path) -> None:
    src = str(byte_model)
    with pytest.raises(SystemExit, match=r"--vocab-size 151665 contradicts --model-source .* "
                                         r"\(258 ids\): drop --vocab-size"):
        load_vocabulary(AgentConfig.of(model_source=src, vocab_size=151665))
    # The same size said twice is no contradiction.
    assert load_vocabulary(AgentConfig.of(model_source=src, vocab_size=258)).size == 258
    with pytest.raises(SystemExit, match="names the tokenizer: drop --tokenizer gpt2"):
        load_vocabulary(AgentConfig.of(model_source=src, tokenizer="gpt2"))
    with pytest.raises(SystemExit, match=r"--model-source: .*no such file"):
        load_vocabulary(AgentConfig.of(model_source=str(byte_model / "missing")))
    # A tokenizer path where a name belongs is refused, on every engine.
    with pytest.raises(SystemExit, match="--tokenizer '/models/qwen': choose byte or gpt2, or "
                                         "give the model's own tokenizer as --model-source"):
        load_vocabulary(AgentConfig.of(engine="vllm", tokenizer="/models/qwen"))
    with pytest.raises(SystemExit, match="--vocab-size 1000 contradicts --tokenizer byte"):
        load_vocabulary(AgentConfig.of(engine="tiny", vocab_size=1000))


def test_bare_token_id_deployments_keep_their_flags() -> None:
    sim = load_vocabulary(AgentConfig.of(engine="sim", vocab_size=32000))
    assert (sim.name, sim.size, sim.chat) == ("", 32000, None)  # vouches for no tokenizer
    assert load_vocabulary(AgentConfig.of(engine="sim", vocab_size=258)).name == "byte"
    tiny = load_vocabulary(AgentConfig.of(engine="tiny", tokenizer="gpt2"))
    assert (tiny.name, tiny.size, tiny.program_tokenizer) == ("gpt2", 50257, "gpt2")
