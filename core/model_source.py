"""Where a served model's tokenizer files come from: ``--model NAME=SOURCE``.

SOURCE is one of
- a model directory holding ``tokenizer.json`` and, beside it, ``tokenizer_config.json``
  and/or ``chat_template.jinja`` (``additional_chat_templates/*.jinja``,
  ``special_tokens_map.json`` and ``generation_config.json`` are read when present);
- a ``tokenizer.json`` file (its directory's other files are read the same way);
- ``hf:ORG/REPO`` or ``hf:ORG/REPO@REVISION``: those files downloaded from the Hugging Face hub
  with ``huggingface_hub`` at start (only the tokenizer files, never weights), with the token
  given or else ``$HF_TOKEN`` / ``$HUGGING_FACE_HUB_TOKEN``. ``HF_HUB_OFFLINE=1`` and
  ``HF_HUB_CACHE`` work as huggingface_hub defines them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

HUB_INSTALL_HINT = "pip install huggingface_hub  (or kvroute[models])"

TOKENIZER_FILE_PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
    "generation_config.json", "additional_chat_templates/*.jinja",
)
"""What an ``hf:`` source downloads: the tokenizer and its templates, never weights."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
_HF = re.compile(r"hf:(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?")


class ModelSourceError(ValueError):
    """A ``--model`` value or its files are unusable; the message names what and where."""


@dataclass(frozen=True)
class ModelFiles:
    """The local files of one model source (``None`` where the source has no such file)."""

    origin: str
    """The SOURCE as given, for messages."""
    tokenizer_json: Path
    tokenizer_config: Path | None = None
    chat_template: Path | None = None
    """``chat_template.jinja`` (it wins over ``tokenizer_config.json``'s ``chat_template``)."""
    additional_chat_templates: Mapping[str, Path] = field(default_factory=dict)
    special_tokens_map: Path | None = None
    generation_config: Path | None = None


def parse_model_option(value: str) -> tuple[str, str]:
    """``NAME=SOURCE`` -> (NAME, SOURCE); ModelSourceError says what is missing."""
    name, sep, source = value.partition("=")
    name, source = name.strip(), source.strip()
    if not sep or not name or not source:
        raise ModelSourceError(
            f"--model {value!r}: expected NAME=SOURCE (SOURCE: a model directory, a "
            "tokenizer.json or hf:ORG/REPO[@REVISION])")
    if not _NAME.fullmatch(name):
        raise ModelSourceError(f"--model {value!r}: the name {name!r} may hold letters, digits "
                               "and . _ - : / only, starting with a letter or digit")
    return name, source


def parse_hf_source(source: str) -> tuple[str, str | None]:
    """``hf:ORG/REPO[@REVISION]`` -> (``ORG/REPO``, REVISION or None)."""
    m = _HF.fullmatch(source)
    if m is None:
        raise ModelSourceError(
            f"model source {source!r}: expected hf:ORG/REPO or hf:ORG/REPO@REVISION")
    return m["repo"], m["rev"]


def hub_token(token: str | None = None) -> str | None:
    """The token given, else ``$HF_TOKEN``, else ``$HUGGING_FACE_HUB_TOKEN``, else None."""
    return token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def download_from_hub(source: str, token: str | None = None,
                      cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local snapshot directory of ``hf:ORG/REPO[@REVISION]``'s tokenizer files."""
    repo_id, revision = parse_hf_source(source)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelSourceError(
            f"model source {source!r} needs huggingface_hub: {HUB_INSTALL_HINT}") from exc
    try:
        path = snapshot_download(
            repo_id=repo_id, revision=revision, allow_patterns=list(TOKENIZER_FILE_PATTERNS),
            token=hub_token(token), cache_dir=cache_dir)
    except Exception as exc:
        # Offline, unknown repo, gated without a token, no such revision: all end here.
        raise ModelSourceError(
            f"model source {source!r}: could not fetch {repo_id}"
            f"{'@' + revision if revision else ''} from the Hugging Face hub "
            f"({type(exc).__name__}: {exc})") from exc
    return Path(path)


def resolve_model_files(source: str, token: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None) -> ModelFiles:
    """The files of SOURCE (downloading an ``hf:`` source first). ModelSourceError when the
    source does not exist or has no ``tokenizer.json``."""
    if source.startswith("hf:"):
        directory = download_from_hub(source, token=token, cache_dir=cache_dir)
        tokenizer_json = directory / "tokenizer.json"
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            directory, tokenizer_json = path, path / "tokenizer.json"
        elif path.is_file():
            directory, tokenizer_json = path.parent, path
        else:
            raise ModelSourceError(f"model source {source!r}: no such file or directory")
    if not tokenizer_json.is_file():
        raise ModelSourceError(
            f"model source {source!r}: no tokenizer.json in {directory} (kvroute tokenizes with "
            "the `tokenizers` library; a slow-only tokenizer must be converted and saved first)")

    def beside(name: str) -> Path | None:
        p = directory / name
        return p if p.is_file() else None

    extra_dir = directory / "additional_chat_templates"
    extra = ({p.stem: p for p in sorted(extra_dir.glob("*.jinja"))} if extra_dir.is_dir() else {})
    return ModelFiles(
        origin=source, tokenizer_json=tokenizer_json,
        tokenizer_config=beside("tokenizer_config.json"),
        chat_template=beside("chat_template.jinja"), additional_chat_templates=extra,
        special_tokens_map=beside("special_tokens_map.json"),
        generation_config=beside("generation_config.json"))
