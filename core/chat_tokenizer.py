"""A served model's own tokenizer and chat template, loaded at the router.

The router renders a chat request with the model's template and tokenizes the text itself, so
the engine receives token ids and never re-tokenizes: the router's block keys and the engine's
cache hash the same ids by construction. The contract is that
``ChatTokenizer.apply(messages, tools=..., add_generation_prompt=..., **kwargs)`` equals
transformers' ``apply_chat_template(messages, tokenize=True, ...)`` for the same files: the
rendered text (see :mod:`kvroute.core.chat_template`) is tokenized with
``add_special_tokens=False``, since the template writes BOS and the other control tokens itself
(vLLM's chat endpoint does the same).

Tokenization is ``tokenizer.json`` run by the ``tokenizers`` library, with two adjustments that
transformers (5.x) makes when it loads a model directory:

- tokens in ``tokenizer_config.json``'s ``added_tokens_decoder`` that ``tokenizer.json`` lacks
  are added (at the ids declared there; a mismatch is an error);
- for ``tokenizer_class`` ``LlamaTokenizer``/``LlamaTokenizerFast`` (Llama-2, Mistral v0.x:
  SentencePiece-style BPE) the normalizer, pre-tokenizer and decoder are the ones transformers'
  LlamaTokenizer builds (Metaspace, prepending "▁" to the first piece only unless
  ``legacy: true``) rather than the file's.

Other classes are taken from ``tokenizer.json`` as is (PreTrainedTokenizerFast, and the classes
whose files hold the pipeline their transformers class builds, such as Qwen2Tokenizer).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvroute.core.chat_template import ChatTemplate, ChatTemplateError
from kvroute.core.model_source import ModelFiles, ModelSourceError, resolve_model_files

TOKENIZERS_INSTALL_HINT = "pip install tokenizers  (or kvroute[models])"

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
"""The named special tokens a template sees as variables (transformers' list)."""

LLAMA_CLASSES = frozenset({"LlamaTokenizer", "LlamaTokenizerFast"})


def _read_json(path: Path, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"model source {origin!r}: cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelSourceError(f"model source {origin!r}: {path} is not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _llama_pipeline(spec: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` (tokenizer.json) with the pipeline transformers' LlamaTokenizer builds."""
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    legacy = bool(config.get("legacy", False))
    scheme = ("first" if not legacy else "always") if add_prefix_space else "never"
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_prefix_space:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    model = {**spec["model"], "fuse_unk": True, "byte_fallback": True, "dropout": None,
             "unk_token": None, "ignore_merges": False}
    return {**spec, "model": model, "normalizer": None,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                              "prepend_scheme": scheme, "split": False},
            "decoder": {"type": "Sequence", "decoders": decoders}}


TOKEN_CONFIG_KEYS = ("added_tokens_decoder", "additional_special_tokens",
                     "extra_special_tokens", "tokenizer_class", *SPECIAL_TOKEN_NAMES)
"""What of ``tokenizer_config.json`` changes token ids (the chat template does not)."""


def fingerprint(files: ModelFiles, config: Mapping[str, Any]) -> str:
    """The identity of a source's token ids: a hash of ``tokenizer.json``'s bytes and of the
    config entries that add or name tokens. Files, not the parsed tokenizer, so that two
    releases of the ``tokenizers`` library give the same answer."""
    h = hashlib.sha256(files.tokenizer_json.read_bytes())
    h.update(json.dumps({k: config.get(k) for k in TOKEN_CONFIG_KEYS}, sort_keys=True,
                        default=str).encode())
    return "tok:" + h.hexdigest()[:16]


class ChatTokenizer:
    """One served model's tokenizer (``hf``: a ``tokenizers.Tokenizer``) and chat templates.

    Fits :class:`kvroute.core.tokenizer.Tokenizer` (``name``, ``vocab_size``, ``eos_token_id``,
    ``encode``, ``decode``). Build it with :meth:`load`.
    """

    def __init__(self, name: str, hf: Any, config: Mapping[str, Any],
                 templates: Mapping[str, str], stop_token_ids: Sequence[int] = (),
                 fingerprint: str = "") -> None:
        self.name = name
        self.hf = hf
        self.fingerprint = fingerprint
        """``tok:`` and 16 hex digits of a hash of the files that decide token ids (see
        :func:`fingerprint`): a router and its agents loading one source agree on it."""
        self.config = dict(config)
        self.special_tokens: dict[str, str] = {}
        """The named special tokens (``bos_token`` -> its text), as templates see them."""
        for attr in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(attr))
            if text is not None:
                self.special_tokens[attr] = text
        vocab = hf.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        """Token ids are below this (including the added tokens)."""
        self.bos_token_id = self.token_id(self.special_tokens.get("bos_token"))
        eos = self.token_id(self.special_tokens.get("eos_token"))
        self.eos_token_id: int = -1 if eos is None else eos
        """-1 when the model names no EOS token."""
        stops = [*([eos] if eos is not None else []), *stop_token_ids]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        """EOS and ``generation_config.json``'s ``eos_token_id`` (Llama-3 stops on several)."""
        self._template_texts = dict(templates)
        self._compiled: dict[str, ChatTemplate] = {}

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(cls, source: str, name: str | None = None, token: str | None = None,
             cache_dir: str | None = None) -> ChatTokenizer:
        """The tokenizer of a model SOURCE (see :mod:`kvroute.core.model_source`); ``name``
        defaults to SOURCE. ModelSourceError names the file and what is wrong with it."""
        return cls.from_files(resolve_model_files(source, token=token, cache_dir=cache_dir),
                              name=name)

    @classmethod
    def from_files(cls, files: ModelFiles, name: str | None = None) -> ChatTokenizer:
        """The tokenizer in ``files``: its configuration, vocabulary with the added tokens
        the configuration declares, chat templates and stop ids."""
        config = _read_config(files)
        hf = _read_tokenizer(files, config)
        _add_declared_tokens(hf, files, config)
        return cls(name or files.origin, hf, config, _read_templates(files, config),
                   _stop_ids(files), fingerprint(files, config))

    # -- tokens ------------------------------------------------------------------------------

    def token_id(self, token: str | None) -> int | None:
        """The id of one token's text (None if ``token`` is None or not in the vocabulary)."""
        return None if token is None else self.hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids; special tokens written in it are those tokens (as transformers and
        vLLM do). ``add_special_tokens`` runs the post-processor (e.g. prepends BOS), as for a
        completion prompt; chat uses :meth:`apply`, which does not.

        ``encode_batch_fast`` of one text where tokenizers has it (0.21+): the same ids as
        ``encode`` without character offsets (the router needs none), ~40% less time at 8k
        tokens, and it releases the GIL while it runs (``encode`` holds it), so a tokenizing
        thread does not stall the event loop (docs/tokenizers.md)."""
        fast = getattr(self.hf, "encode_batch_fast", None)
        if fast is not None:
            return list(fast([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``; ids outside the vocabulary are skipped."""
        ids = [t for t in token_ids if 0 <= t < self.vocab_size]
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    # -- chat --------------------------------------------------------------------------------

    @property
    def template_names(self) -> list[str]:
        return sorted(self._template_texts)

    @property
    def templates(self) -> Mapping[str, str]:
        """The model's chat templates' texts, by name."""
        return dict(self._template_texts)

    def template(self, chat_template: str | None = None,
                 tools: Sequence[Any] | None = None) -> ChatTemplate:
        """The template to render with, chosen as transformers chooses: ``chat_template`` names
        one of the model's templates (or is a template's text); else ``tool_use`` when tools are
        given and the model has one; else ``default``."""
        texts = self._template_texts
        if chat_template is not None and chat_template in texts:
            key, text = chat_template, texts[chat_template]
        elif chat_template is not None:
            key, text = "\0" + chat_template, chat_template
        elif tools is not None and "tool_use" in texts:
            key, text = "tool_use", texts["tool_use"]
        elif "default" in texts:
            key, text = "default", texts["default"]
        elif not texts:
            raise ChatTemplateError(
                f"{self.name}: the model has no chat template (no chat_template.jinja and no "
                "chat_template in tokenizer_config.json); send a prompt of token ids or text")
        else:
            raise ChatTemplateError(f"{self.name}: the model has several chat templates and no "
                                    f"default; choose one of {self.template_names}")
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = ChatTemplate(text, self.special_tokens, name=self.name)
            self._compiled[key] = compiled
        return compiled

    def render(self, messages: Sequence[Any], tools: Sequence[Any] | None = None,
               documents: Sequence[Any] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> str:
        """The prompt text of a conversation (transformers' ``tokenize=False``). Template
        variables: ``chat_template_kwargs`` (e.g. a request's ``{"enable_thinking": false}``)
        and ``kwargs``."""
        return self.template(chat_template, tools).render(
            messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, **kwargs)

    def apply(self, messages: Sequence[Any], tools: Sequence[Any] | None = None,
              documents: Sequence[Any] | None = None, add_generation_prompt: bool = True,
              continue_final_message: bool = False, chat_template: str | None = None,
              chat_template_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> list[int]:
        """The prompt's ids: :meth:`render` tokenized without added special tokens."""
        text = self.render(messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           chat_template=chat_template,
                           chat_template_kwargs=chat_template_kwargs, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _tokenizers(origin: str) -> Any:
    """The ``tokenizers`` package (ModelSourceError with the install hint without it)."""
    try:
        import tokenizers
    except ImportError as exc:
        raise ModelSourceError(
            f"model source {origin!r} needs tokenizers: {TOKENIZERS_INSTALL_HINT}") from exc
    return tokenizers


def _read_config(files: ModelFiles) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json's tokens where it names none."""
    origin = files.origin
    config = (_read_json(files.tokenizer_config, origin) if files.tokenizer_config else {})
    if files.special_tokens_map is not None:
        # The older file: its tokens count where tokenizer_config.json names none.
        for attr, value in _read_json(files.special_tokens_map, origin).items():
            if attr in SPECIAL_TOKEN_NAMES and config.get(attr) is None:
                config[attr] = value
    return config


def _read_tokenizer(files: ModelFiles, config: Mapping[str, Any]) -> Any:
    """tokenizer.json as a ``tokenizers.Tokenizer`` (a Llama BPE given its pipeline)."""
    origin = files.origin
    spec = _read_json(files.tokenizer_json, origin)
    model_type = spec.get("model", {}).get("type") if isinstance(spec.get("model"), dict) \
        else None
    if config.get("tokenizer_class") in LLAMA_CLASSES and model_type == "BPE":
        spec = _llama_pipeline(spec, config)
    try:
        return _tokenizers(origin).Tokenizer.from_str(json.dumps(spec))
    except ModelSourceError:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelSourceError(
            f"model source {origin!r}: {files.tokenizer_json} is not a tokenizers file: {exc}"
        ) from exc


def _add_declared_tokens(hf: Any, files: ModelFiles, config: Mapping[str, Any]) -> None:
    """Add the tokens the configuration declares that ``hf`` lacks; each declared id must
    then be its token's (ModelSourceError names the two files that disagree)."""
    origin = files.origin
    added_token = _tokenizers(origin).AddedToken
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, Mapping):
        raise ModelSourceError(f"model source {origin!r}: added_tokens_decoder in "
                               f"{files.tokenizer_config} must map ids to tokens")
    for id_text, tok in sorted(declared.items(), key=lambda kv: int(kv[0])):
        content = _token_text(tok)
        if content is None:
            raise ModelSourceError(f"model source {origin!r}: added_tokens_decoder[{id_text}]"
                                   " has no content")
        want = int(id_text)
        have = hf.token_to_id(content)
        if have is None:
            flags = tok if isinstance(tok, Mapping) else {}
            special = bool(flags.get("special", True))
            added = added_token(content, single_word=bool(flags.get("single_word", False)),
                                lstrip=bool(flags.get("lstrip", False)),
                                rstrip=bool(flags.get("rstrip", False)),
                                normalized=bool(flags.get("normalized", not special)),
                                special=special)
            (hf.add_special_tokens if special else hf.add_tokens)([added])
            have = hf.token_to_id(content)
        if have != want:
            raise ModelSourceError(
                f"model source {origin!r}: {content!r} is id {want} in "
                f"{files.tokenizer_config} but id {have} in {files.tokenizer_json}")
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    if isinstance(extra, list):
        missing = [t for t in map(_token_text, extra) if t and hf.token_to_id(t) is None]
        if missing:
            hf.add_special_tokens([added_token(t, special=True, normalized=False)
                                   for t in missing])


def _read_templates(files: ModelFiles, config: Mapping[str, Any]) -> dict[str, str]:
    """The chat templates by name: the files' (chat_template.jinja and the additional
    ones), else tokenizer_config.json's ``chat_template`` (a string or a named list)."""
    origin = files.origin
    templates: dict[str, str] = {}
    if files.chat_template is not None:
        templates["default"] = files.chat_template.read_text(encoding="utf-8")
    for tname, path in files.additional_chat_templates.items():
        templates[tname] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    in_config = config.get("chat_template")
    if isinstance(in_config, str):
        templates["default"] = in_config
    elif isinstance(in_config, list):
        for item in in_config:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ModelSourceError(
                    f"model source {origin!r}: chat_template entries in "
                    f"{files.tokenizer_config} need a name and a template")
            templates[item["name"]] = item["template"]
    elif in_config is not None:
        raise ModelSourceError(f"model source {origin!r}: chat_template in "
                               f"{files.tokenizer_config} must be a string or a list")
    return templates


def _stop_ids(files: ModelFiles) -> list[int]:
    """generation_config.json's ``eos_token_id`` (one id or a list; none without it)."""
    if files.generation_config is None:
        return []
    eos = _read_json(files.generation_config, files.origin).get("eos_token_id")
    return [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
