"""The vLLM releases this adapter supports, and what differs between them on the wire.

``SUPPORTED`` is the one statement of the range: its oldest end is the Helm chart's default
image (``vllm/vllm-openai:v0.10.2``), its newest the newest release on PyPI when it was last
checked. Both ends are tested (tests/worker_agent/engines/vllm/: vLLM's own ``kv_events.py`` of each
release executed from its wheel, and the OpenAI request fields each release's
``CompletionRequest`` declares). The agent logs the range at start, reads the server's version
from vLLM's ``GET /version`` (``{"version": "0.10.2"}``) and warns, without refusing, when it
is outside.

What differs across the range (from each release's own code):

* KV events (``vllm/distributed/kv_events.py``): decoded by :mod:`.wire` for every layout,
  whatever the version; nothing here.
* The constrained-decoding request fields (``vllm/entrypoints/openai/protocol.py``, later
  ``.../openai/completion/protocol.py``): before 0.11 only ``guided_json`` /
  ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; 0.11 took both; from 0.12 only
  ``structured_outputs: {json|regex|choice|grammar}``. vLLM ignores unknown fields (with a
  log line), so the wrong dialect would silently generate unconstrained: hence
  :func:`structured_dialect`, picked from ``/version``.
* Everything else the agent sends (``prompt`` as token ids, ``stream_options``,
  ``return_token_ids``, ``logprobs``, ``return_tokens_as_token_ids``, ``seed``,
  ``stop_token_ids``, ``cache_salt``, ``vllm_xargs``) and reads (``choices[0].token_ids`` /
  ``finish_reason`` / ``logprobs``, ``usage.prompt_tokens_details.cached_tokens``) has the same
  name and shape at both ends.
"""

from __future__ import annotations

import re
from enum import Enum

SUPPORTED: tuple[str, str] = ("0.10.2", "0.34.0")
"""(oldest, newest) vLLM release supported, both tested."""

STRUCTURED_OUTPUTS_SINCE = (0, 11, 0)
"""First release whose ``CompletionRequest`` takes ``structured_outputs``."""

Version = tuple[int, int, int]

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


class StructuredDialect(Enum):
    """How a request names its decoding constraint."""

    STRUCTURED_OUTPUTS = "structured_outputs"  # {"structured_outputs": {"regex": ...}}
    GUIDED = "guided"  # {"guided_regex": ...}


def parse_version(text: str) -> Version | None:
    """``major.minor[.patch]`` at the start of ``text`` (suffixes such as ``rc1``, ``.dev5``,
    ``+cu128`` or a fourth component are ignored); None when it does not start that way
    (e.g. a source build's ``dev``)."""
    m = _VERSION.match(text.strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def supported_range() -> tuple[Version, Version]:
    lo, hi = (parse_version(v) for v in SUPPORTED)
    assert lo is not None and hi is not None and lo <= hi
    return lo, hi


def is_supported(version: Version) -> bool:
    """Whether ``version`` lies in :data:`SUPPORTED` (both ends included; a pre-release or
    dev build of the newest counts as the newest, since only major.minor.patch is compared)."""
    lo, hi = supported_range()
    return lo <= version <= hi


def structured_dialect(version: Version | None) -> StructuredDialect:
    """The constraint fields a server of ``version`` reads; the current ones when unknown."""
    if version is not None and version < STRUCTURED_OUTPUTS_SINCE:
        return StructuredDialect.GUIDED
    return StructuredDialect.STRUCTURED_OUTPUTS


def guided_fields(structured: dict[str, object]) -> dict[str, object]:
    """``structured_outputs`` ``{"json"|"regex"|"choice"|"grammar": v}`` as the pre-0.11
    request fields ``{"guided_json"|...: v}``."""
    out: dict[str, object] = {}
    for key, value in structured.items():
        if key not in ("json", "regex", "choice", "grammar"):
            raise ValueError(f"structured output {key!r} has no guided_* field in vLLM < 0.11")
        out[f"guided_{key}"] = value
    return out
