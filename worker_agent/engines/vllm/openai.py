"""Streaming ``/v1/completions`` against vLLM's OpenAI-compatible server, token ids in and out.

Request (checked against ``CompletionRequest`` of both ends of :data:`.versions.SUPPORTED`)::

    {"model": M, "prompt": [token ids], "max_tokens": n, "temperature": t, "stream": true,
     "stream_options": {"include_usage": true}, "return_token_ids": true,
     "seed": s (if set), "stop_token_ids": [...] (if any), "cache_salt": salt (if any),
     "vllm_xargs": {"kv_cache_report_mode": "full"} (when asked to re-report reused blocks;
                    "kvroute_grammar", "kvroute_prefix": a continued constraint, for the mask
                    plugin),
     "structured_outputs": {"json"|"regex"|"grammar"|"choice": ...} (a constrained gen; vLLM
     < 0.11: "guided_json"|"guided_regex"|"guided_grammar"|"guided_choice": ...)}

* Structured outputs (a controller program's constraint, see :func:`structured_outputs`) go
  in the fields the server's release reads (:mod:`.versions`): ``structured_outputs`` (vLLM
  >= 0.11) or, for older servers, ``guided_json`` / ``guided_regex`` / ``guided_grammar`` /
  ``guided_choice``. :attr:`CompletionsClient.dialect` is set from the server's ``GET
  /version`` (:meth:`CompletionsClient.server_version`); vLLM ignores fields it does not know,
  so the wrong dialect would generate unconstrained. Either way the program runtime checks
  every constrained output against the same constraint (llguidance, locally) and fails the
  program instead of returning output outside it. Start vLLM with the llguidance backend
  (``--structured-outputs-config.backend guidance``; before 0.11 ``--guided-decoding-backend
  guidance``) so that both sides agree on Lark grammars and JSON-schema semantics.

* Token ids back: ``return_token_ids`` (vLLM >= 0.10.2) puts the delta ids in
  ``choices[0].token_ids`` of every chunk. A server that ignores it (older vLLM) is detected
  on the first chunk; the client then switches, once and for good, to ``logprobs: 0`` +
  ``return_tokens_as_token_ids`` (``"token_id:123"`` strings) and re-sends the request (safe:
  nothing was yielded yet).
* ``cached_tokens``: vLLM reports it only in the final usage chunk
  (``usage.prompt_tokens_details.cached_tokens``), after the chunk with the finish reason, and
  only when started with ``--enable-prompt-tokens-details``. :class:`Chunk` carries it on the
  last chunk when present; the engine holds the finish chunk back until the usage arrives.
* Errors: HTTP >= 400, a streamed ``{"error": ...}`` object, or a stream that ends without a
  finish reason raise :class:`~kvroute.worker_agent.engines.base.EngineError`. Closing the
  iterator closes the connection, and vLLM aborts the request.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvroute.core.blocks import split_adapter_salt
from kvroute.worker_agent.engines.base import (
    EngineError,
    EngineRequest,
    GrammarState,
)
from kvroute.worker_agent.engines.served.stream import Chunk, ServerHttp, json_object
from kvroute.worker_agent.engines.vllm.versions import StructuredDialect, guided_fields

_TOKEN_ID_PREFIX = "token_id:"
# What vLLM answers for a request it refuses for its own content (a prompt longer than the
# model's context, a bad parameter): the caller's doing, not the worker's failure.
_REQUEST_CAUSED = {400: "INVALID_ARGUMENT", 413: "RESOURCE_EXHAUSTED",
                   422: "INVALID_ARGUMENT"}


_STRUCTURED_KEYS = {"json_schema": "json", "regex": "regex", "lark": "grammar",
                    "choices": "choice"}


PLUGIN_GRAMMAR, PLUGIN_PREFIX = "kvroute_grammar", "kvroute_prefix"
"""The ``vllm_xargs`` kvroute's mask plugin reads (plugin/kvroute_vllm_mask.py)."""


def structured_outputs(kind: str, source: str | Sequence[str]) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` for one controller-program constraint: ``json_schema`` ->
    ``json`` (the parsed schema), ``regex`` -> ``regex``, ``lark`` -> ``grammar``, ``choices``
    -> ``choice`` (the options)."""
    key = _STRUCTURED_KEYS.get(kind)
    if key is None:
        raise ValueError(f"no vLLM structured output for constraint kind {kind!r}")
    if kind == "choices":
        return {key: list(source)}
    assert isinstance(source, str)
    return {key: json.loads(source) if kind == "json_schema" else source}


class _NoTokenIdsError(Exception):
    """The server ignored ``return_token_ids``."""


class CompletionsClient:
    def __init__(self, base_url: str, model: str, *, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 600.0) -> None:
        self.model = model
        self.token_mode = "token_ids"  # or "logprobs" (older vLLM)
        self.dialect = StructuredDialect.STRUCTURED_OUTPUTS  # set from /version by the engine
        self._http = ServerHttp(base_url, "vllm", _REQUEST_CAUSED,
                                connect_timeout_s=connect_timeout_s,
                                read_timeout_s=read_timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    def body(self, token_ids: list[int], max_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             stop_token_ids: frozenset[int] = frozenset(), cache_salt: str = "",
             report_reused: bool = False, structured: dict[str, Any] | None = None,
             state: GrammarState | None = None, logprobs: bool = False) -> dict[str, Any]:
        """``cache_salt``: the request's; a LoRA adapter's salt (core/blocks.py
        ``adapter_salt``, from a router's ``--lora``) asks vLLM for that adapter as the
        model, with the caller's own salt. ``state``: a grammar continued from a state, for
        the mask plugin."""
        adapter, cache_salt = split_adapter_salt(cache_salt)
        b: dict[str, Any] = {
            "model": adapter or self.model, "prompt": token_ids, "max_tokens": max_tokens,
            "temperature": temperature,  # 0 = greedy, as in EngineRequest
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.token_mode == "token_ids":
            b["return_token_ids"] = True
            if logprobs:
                b["logprobs"] = 0  # the sampled token's own, no alternatives
        else:
            b["logprobs"] = 0
            b["return_tokens_as_token_ids"] = True
        if top_p < 1.0:
            b["top_p"] = top_p
        if top_k:
            b["top_k"] = top_k
        if seed:
            b["seed"] = seed
        if stop_token_ids:
            b["stop_token_ids"] = sorted(stop_token_ids)
        if cache_salt:
            b["cache_salt"] = cache_salt
        xargs: dict[str, Any] = {}
        if report_reused:
            xargs["kv_cache_report_mode"] = "full"
        if state is not None:
            xargs[PLUGIN_GRAMMAR] = state.grammar
            xargs[PLUGIN_PREFIX] = list(state.prefix)
        if xargs:
            b["vllm_xargs"] = xargs
        if structured:
            if self.dialect is StructuredDialect.GUIDED:
                b.update(guided_fields(structured))
            else:
                b["structured_outputs"] = structured
        return b

    async def server_version(self) -> str | None:
        """``version`` from vLLM's ``GET /version``; None when the server does not answer
        (not up yet); EngineError when it answers something else (not a vLLM server?)."""
        got = await self._http.get("/version")
        if got is None:
            return None
        status, text = got
        try:
            version = json.loads(text).get("version") if status == 200 else None
        except (json.JSONDecodeError, AttributeError):
            version = None
        if not isinstance(version, str):
            raise EngineError(f"vllm GET /version answered HTTP {status}: "
                              f"{text[:200]!r}, not {{\"version\": ...}}")
        return version

    async def stream(self, request_id: str, request: EngineRequest, *,
                     constraint: tuple[str, str | Sequence[str] | GrammarState] | None = None,
                     report_reused: bool = False) -> AsyncIterator[Chunk]:
        """Chunks of one completion; see the module doc."""
        structured, state = None, None
        if constraint is not None:
            kind, source = constraint
            if isinstance(source, GrammarState):
                state = source  # for the mask plugin
            else:
                structured = structured_outputs(kind, source)
        for attempt in range(2):
            body = self.body(
                list(request.token_ids), request.max_tokens, temperature=request.temperature,
                top_p=request.top_p, top_k=request.top_k, seed=request.seed,
                stop_token_ids=request.stop_token_ids, cache_salt=request.cache_salt,
                report_reused=report_reused, structured=structured, state=state,
                logprobs=request.logprobs)
            try:
                async for chunk in self._stream_once(request_id, body, first_try=attempt == 0):
                    yield chunk
                return
            except _NoTokenIdsError:
                self.token_mode = "logprobs"  # and retry: nothing was yielded yet
        raise EngineError("vllm returned no token ids")  # pragma: no cover - loop returns

    async def _stream_once(self, request_id: str, body: dict[str, Any], *, first_try: bool
                           ) -> AsyncIterator[Chunk]:
        yielded = False
        finished = False
        # aclosing: leaving early (an error, the caller gone) closes the connection now.
        async with contextlib.aclosing(self._http.events(
                "/v1/completions", body, {"X-Request-Id": request_id})) as events:
            async for data in events:
                if data == "[DONE]":
                    break
                chunk = self._parse(data, probe=first_try and not yielded)
                if chunk is None:
                    continue
                finished = finished or chunk.finish_reason is not None
                yielded = True
                yield chunk
        if not finished:
            raise EngineError("vllm stream ended without a finish reason")

    def _parse(self, data: str, *, probe: bool) -> Chunk | None:
        obj = json_object(data, "vllm")
        if "error" in obj or obj.get("object") == "error":
            err = obj.get("error", obj)
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise EngineError(f"vllm error: {msg}")
        choices = obj.get("choices") or []
        usage = obj.get("usage")
        if not choices:
            if isinstance(usage, dict):
                details = usage.get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens") if isinstance(details, dict) else None
                return Chunk((), None, cached if isinstance(cached, int) else None,
                             usage.get("prompt_tokens"), usage=True)
            return None
        ch = choices[0]
        finish = ch.get("finish_reason")
        if self.token_mode == "token_ids":
            ids = ch.get("token_ids")
            if ids is None:
                if probe and (ch.get("text") or finish is not None):
                    raise _NoTokenIdsError()
                ids = []
        else:
            lp = ch.get("logprobs") or {}
            ids = [_token_id(t) for t in (lp.get("tokens") or [])]
        return Chunk(tuple(ids), finish, logprobs=_logprobs(ch.get("logprobs"), len(ids)))


def _logprobs(lp: Any, n: int) -> tuple[float, ...] | None:
    """``choices[0].logprobs.token_logprobs`` (None when absent or not one per token)."""
    vals = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if not isinstance(vals, list) or len(vals) != n:
        return None
    return tuple(float(v) if isinstance(v, int | float) and v == v else 0.0 for v in vals)


def _token_id(tok: str) -> int:
    if not isinstance(tok, str) or not tok.startswith(_TOKEN_ID_PREFIX):
        raise EngineError(f"vllm logprobs token {tok!r} is not token_id:N")
    return int(tok[len(_TOKEN_ID_PREFIX):])
