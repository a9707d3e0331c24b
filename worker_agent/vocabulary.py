"""The token ids an agent speaks, from one source.

With ``--model-source`` (the SOURCE of the router's ``--model NAME=SOURCE``: a HF model
directory, a tokenizer.json or ``hf:ORG/REPO[@REV]``) the agent loads the model's own
tokenizer exactly as the router does; it reports that tokenizer's fingerprint and size in its
heartbeats, checks ids against that size, and runs programs' text with it. A router and its
agents given the same source therefore agree by construction. Without one, ``--tokenizer``
(byte or gpt2) and ``--vocab-size`` describe bare token-id deployments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.config import AgentConfig, AgentModel
from kvroute.core.model_source import ModelSourceError
from kvroute.core.tokenizer import vocab_size

log = logging.getLogger("kvroute.agent")

DEFAULT_VOCAB_SIZE: int = AgentModel().vocab_size
DEFAULT_TOKENIZER: str = AgentModel().tokenizer


@dataclass(frozen=True, slots=True)
class AgentVocabulary:
    """What an agent reports and checks ids against.

    ``name``: the tokenizer in heartbeats (a model source's fingerprint, ``byte``, ``gpt2``,
    or "" when the agent cannot vouch for one); ``size``: ids are below it (before the
    engine's own limit); ``chat``: the model's tokenizer when ``--model-source`` gave one."""

    name: str
    size: int
    chat: ChatTokenizer | None = None

    @property
    def program_tokenizer(self) -> str | ChatTokenizer:
        """What programs' text is encoded with (a name is loaded when first needed)."""
        return self.chat if self.chat is not None else self.name


def load_vocabulary(cfg: AgentConfig) -> AgentVocabulary:
    """The agent's vocabulary from its flags; SystemExit in one line when they disagree."""
    if cfg.model.source:
        if cfg.model.tokenizer not in ("", DEFAULT_TOKENIZER):
            raise SystemExit(f"--model-source {cfg.model.source} names the tokenizer: drop "
                             f"--tokenizer {cfg.model.tokenizer}")
        try:
            chat = ChatTokenizer.load(cfg.model.source, name=cfg.model.name)
        except ModelSourceError as exc:
            raise SystemExit(f"--model-source: {exc}") from None
        if cfg.model.vocab_size not in (DEFAULT_VOCAB_SIZE, chat.vocab_size):
            raise SystemExit(f"--vocab-size {cfg.model.vocab_size} contradicts --model-source "
                             f"{cfg.model.source} ({chat.vocab_size} ids): drop --vocab-size")
        log.info("vocabulary from the model source source=%s tokenizer=%s vocab_size=%d",
                 cfg.model.source, chat.fingerprint, chat.vocab_size)
        return AgentVocabulary(chat.fingerprint, chat.vocab_size, chat)
    try:
        size = vocab_size(cfg.model.tokenizer)
    except ValueError:
        raise SystemExit(f"--tokenizer {cfg.model.tokenizer!r}: choose byte or gpt2, or give the "
                         "model's own tokenizer as --model-source") from None
    if cfg.engine.kind == "tiny":
        # The tiny engine's vocabulary is its tokenizer's.
        if cfg.model.vocab_size not in (DEFAULT_VOCAB_SIZE, size):
            raise SystemExit(f"--vocab-size {cfg.model.vocab_size} contradicts --tokenizer "
                             f"{cfg.model.tokenizer} ({size} ids): drop --vocab-size")
        return AgentVocabulary(cfg.model.tokenizer, size)
    # Another engine's ids are --vocab-size wide: its --tokenizer is reported (and used by
    # programs) only when it has that many ids, else the agent vouches for none.
    vocab = cfg.model.vocab_size
    return AgentVocabulary(cfg.model.tokenizer if size == vocab else "", vocab)
