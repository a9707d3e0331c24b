"""Validation of GenerateRequest fields: each failure names the field it is about."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.v1 import common_pb2


class InvalidRequestError(ValueError):
    """Reported to gRPC callers as INVALID_ARGUMENT with this message. ``too_large``: the
    request is over a size limit (HTTP says 413)."""

    def __init__(self, field: str, problem: str, too_large: bool = False) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.too_large = too_large


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int


def check_sampling(req: common_pb2.GenerateRequest, limits: Limits) -> int:
    """Return max_tokens after checking the sampling fields (0 only with a program)."""
    s = req.sampling
    if req.HasField("program") and s.max_tokens == 0:
        pass  # a program's gen steps carry their own max_tokens (checked by the agent)
    elif not req.HasField("sampling") or s.max_tokens <= 0:
        raise InvalidRequestError("sampling.max_tokens", f"must be > 0, got {s.max_tokens}")
    if s.max_tokens > limits.max_new_tokens:
        raise InvalidRequestError("sampling.max_tokens",
                             f"{s.max_tokens} exceeds the limit of {limits.max_new_tokens}")
    if not (s.temperature >= 0 and math.isfinite(s.temperature)):  # NaN fails both
        raise InvalidRequestError("sampling.temperature",
                                  f"must be finite and >= 0, got {s.temperature}")
    if not 0 <= s.top_p <= 1:
        raise InvalidRequestError("sampling.top_p", f"must be in [0, 1], got {s.top_p}")
    bad = [t for t in s.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequestError("sampling.stop_token_ids",
                             f"id {bad[0]} is out of range [0, {limits.vocab_size})")
    return s.max_tokens


def check_tokens(tokens: Sequence[int], limits: Limits, field: str = "token_ids",
                 top: int | None = None) -> None:
    """``top`` is the largest id when the caller has it already (``request_token_ids``):
    ``max`` over a protobuf container costs ~80 ns a token."""
    if not tokens:
        raise InvalidRequestError(field, "the prompt is empty")
    if len(tokens) > limits.max_prompt_tokens:
        raise InvalidRequestError(field, f"prompt of {len(tokens)} tokens exceeds the limit of "
                                         f"{limits.max_prompt_tokens}", too_large=True)
    if top is None:
        top = max(tokens)
    if top >= limits.vocab_size:
        raise InvalidRequestError(field, f"token id {top} is out of range [0, {limits.vocab_size})")


def check_names(req: common_pb2.GenerateRequest, default_model: str) -> str:
    """The model this request is for; it must be the one this service serves."""
    model = req.model or default_model
    if model != default_model:
        # Truncated: the message goes back in a trailer, which gRPC caps at 16 KiB.
        raise InvalidRequestError(
            "model", f"{model[:80]!r}{'...' if len(model) > 80 else ''} is not served here "
                     f"(serving {default_model!r})")
    if len(req.cache_salt) > 256:
        raise InvalidRequestError("cache_salt", "longer than 256 characters")
    if len(req.session_id) > 256:
        raise InvalidRequestError("session_id", "longer than 256 characters")
    if len(req.request_id) > 200:
        raise InvalidRequestError("request_id", "longer than 200 characters")
    return model
