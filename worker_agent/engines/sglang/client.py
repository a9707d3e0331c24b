"""Streaming ``POST /generate`` (SGLang's native API), token ids in and out.

The native API is used rather than SGLang's OpenAI one because it takes and returns token ids
in every supported release and reports the exact cache hit (``meta_info.cached_tokens``) on
every chunk, without a server flag. Request (``GenerateReqInput`` / ``SamplingParams`` of
both ends of :data:`.versions.SUPPORTED`)::

    {"input_ids": [...], "stream": true, "rid": ID,
     "sampling_params": {"max_new_tokens": n, "temperature": t, "top_p": p (if < 1),
                         "top_k": k (if set), "stop_token_ids": [...] (if any),
                         "sampling_seed": s (if set and the release takes it),
                         "json_schema" | "regex" | "ebnf": constraint (a constrained gen)},
     "return_logprob": true (when asked), "lora_path": ADAPTER (a LoRA adapter's request),
     "routed_dp_rank" (before 0.5.10 "data_parallel_rank"): R (an agent of one DP rank),
     "cache_salt": salt (if any; refused by releases without it, see :mod:`.versions`)}

Each streamed ``data:`` object is ``{"output_ids": [...], "meta_info": {"completion_tokens":
k, "cached_tokens": c, "prompt_tokens": n, "finish_reason": null | {"type": "stop" |
"length" | "abort", ...}, "output_token_logprobs": [[logprob, id, text], ...]}}``;
``output_ids`` (and the logprobs) hold either every id so far or only the new ones, by a server
flag, so the new ones are the last ``k - seen``. After the finish chunk the client yields a
usage chunk carrying ``cached_tokens``, as the engine expects of every server.

Constraints (a controller program's): ``json_schema`` -> ``json_schema`` (the schema text),
``regex`` -> ``regex``, ``choices`` -> ``regex`` (the escaped options as alternatives),
``lark`` -> ``ebnf``, which SGLang reads as Lark only with ``--grammar-backend llguidance``
(start SGLang with it, as the runtime checks every constrained output with llguidance).

Errors: HTTP 400/413/422 (the request's own: a prompt past the context, a bad parameter) ->
:class:`~..base.RequestRefusedError`; other HTTP errors, an ``abort`` finish or a stream that
ends without a finish -> :class:`~..base.EngineError`. Closing the iterator closes the
connection, and SGLang aborts the request.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvroute.core.blocks import split_adapter_salt
from kvroute.worker_agent.engines.base import EngineError, EngineRequest, RequestRefusedError
from kvroute.worker_agent.engines.served.stream import (
    Chunk,
    ServerHttp,
    error_text,
    json_object,
)
from kvroute.worker_agent.engines.sglang.versions import Features

log = logging.getLogger("kvroute.agent.sglang")

_REQUEST_CAUSED = {400: "INVALID_ARGUMENT", 413: "RESOURCE_EXHAUSTED",
                   422: "INVALID_ARGUMENT"}
_CONSTRAINT_FIELDS = {"json_schema": "json_schema", "regex": "regex", "lark": "ebnf",
                      "choices": "regex"}


def grammar_field(kind: str, source: str | Sequence[str]) -> dict[str, str]:
    """SGLang's ``sampling_params`` field for one controller-program constraint."""
    key = _CONSTRAINT_FIELDS.get(kind)
    if key is None:
        raise ValueError(f"no SGLang grammar field for constraint kind {kind!r}")
    if kind == "choices":
        return {key: "|".join(re.escape(str(c)) for c in source)}
    assert isinstance(source, str)
    return {key: source}


class GenerateClient:
    def __init__(self, base_url: str, *, dp_rank: int = -1, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 600.0) -> None:
        """``dp_rank``: the data-parallel rank every request is pinned to (-1: none)."""
        self.dp_rank = dp_rank
        self.features = Features()
        """Set from the server's version by the engine."""
        self.version_tried = ""  # the last info path asked
        self._warned_lora = False
        self._ids = itertools.count()
        self._http = ServerHttp(base_url, "SGLang", _REQUEST_CAUSED,
                                connect_timeout_s=connect_timeout_s,
                                read_timeout_s=read_timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    def body(self, rid: str, request: EngineRequest,
             constraint: tuple[str, str | Sequence[str]] | None = None) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": request.max_tokens,
                              "temperature": request.temperature}  # 0: greedy
        if request.top_p < 1.0:
            sp["top_p"] = request.top_p
        if request.top_k:
            sp["top_k"] = request.top_k
        if request.stop_token_ids:
            sp["stop_token_ids"] = sorted(request.stop_token_ids)
        if request.seed and self.features.sampling_seed:
            sp["sampling_seed"] = request.seed
        if constraint is not None:
            sp.update(grammar_field(*constraint))
        b: dict[str, Any] = {"input_ids": list(request.token_ids), "sampling_params": sp,
                             "stream": True, "rid": rid}
        if request.logprobs:
            b["return_logprob"] = True
        if self.dp_rank >= 0:
            b[self.features.dp_rank_field] = self.dp_rank
        adapter, salt = split_adapter_salt(request.cache_salt)
        if adapter:
            b["lora_path"] = adapter
            if not self.features.lora_events and not self._warned_lora:
                self._warned_lora = True
                log.warning("this SGLang release's KV events do not name LoRA adapters (0.5.22 "
                            "and later do): the blocks of adapter requests are published as "
                            "the base model's, so routers match them wrongly",
                            extra={"kv": {"adapter": adapter}})
        if salt:
            if not self.features.cache_salt:
                raise RequestRefusedError(
                    "this SGLang release takes no cache_salt in /generate (0.5.18 and later "
                    "do): the request would share cache with unsalted ones", "FAILED_PRECONDITION")
            b["cache_salt"] = salt
        return b

    async def server_version(self) -> dict[str, Any] | None:
        """SGLang's ``/server_info`` (``/get_server_info`` before 0.5.12): its server
        arguments, scheduler facts and ``version``. None while it does not answer;
        EngineError when it answers neither path."""
        status, text = 0, ""
        for path in ("/server_info", "/get_server_info"):
            self.version_tried = path
            got = await self._http.get(path)
            if got is None:
                return None
            status, text = got
            if status == 404:
                continue
            try:
                info = json.loads(text) if status == 200 else None
            except json.JSONDecodeError:
                info = None
            if isinstance(info, dict) and isinstance(info.get("version"), str):
                return info
            break
        raise EngineError(f"SGLang GET {self.version_tried} answered HTTP {status}: "
                          f"{text[:200]!r}, not its server info")

    async def stream(self, request_id: str, request: EngineRequest, *,
                     constraint: tuple[str, str | Sequence[str]] | None = None,
                     report_reused: bool = False) -> AsyncIterator[Chunk]:
        """Chunks of one generation; see the module doc. ``report_reused`` is vLLM's: SGLang
        has no such switch."""
        # A router may send one id twice (a retry); SGLang rejects a duplicate rid in flight.
        rid = f"{request_id}-{next(self._ids)}"
        body = self.body(rid, request, constraint)
        seen = 0
        finished = False
        # aclosing: leaving early (an error, the caller gone) closes the connection now.
        async with contextlib.aclosing(self._http.events("/generate", body)) as events:
            async for data in events:
                if data == "[DONE]":
                    break
                chunk, meta, seen = _parse(data, seen)
                yield chunk
                if chunk.finish_reason is not None:
                    finished = True
                    cached = meta.get("cached_tokens")
                    yield Chunk((), None, cached if isinstance(cached, int) else None,
                                meta.get("prompt_tokens"), usage=True)
        if not finished:
            raise EngineError("SGLang stream ended without a finish reason")


def _parse(data: str, seen: int) -> tuple[Chunk, dict[str, Any], int]:
    """One ``data:`` object -> (its chunk of new ids, its meta_info, ids seen after it)."""
    obj = json_object(data, "SGLang")
    if "error" in obj:
        raise EngineError(f"SGLang error: {error_text(data)}")
    meta = obj.get("meta_info")
    ids = obj.get("output_ids")
    done = meta.get("completion_tokens") if isinstance(meta, dict) else None
    if not (isinstance(meta, dict) and isinstance(ids, list) and isinstance(done, int)):
        raise EngineError(f"SGLang stream chunk lacks output_ids or meta_info."
                          f"completion_tokens: {data[:200]!r}")
    new = done - seen
    if not 0 <= new <= len(ids):
        raise EngineError(f"SGLang stream chunk has {len(ids)} output ids for {new} new "
                          f"tokens ({seen} seen, {done} generated)")
    tokens = tuple(int(t) for t in ids[len(ids) - new:])
    return Chunk(tokens, _finish(meta), logprobs=_logprobs(meta, new)), meta, done


def _finish(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length"):
        return kind
    message = reason.get("message", reason) if isinstance(reason, dict) else reason
    status = reason.get("status_code") if isinstance(reason, dict) else None
    if status in _REQUEST_CAUSED:
        raise RequestRefusedError(f"SGLang refused the request: {message}",
                                  _REQUEST_CAUSED[status])
    raise EngineError(f"SGLang finished with {kind!r}: {message}")


def _logprobs(meta: dict[str, Any], new: int) -> tuple[float, ...] | None:
    """The new tokens' own log-probabilities (``output_token_logprobs``: ``[logprob, id,
    text]`` each), None when absent."""
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) < new:
        return None
    out = []
    for e in entries[len(entries) - new:]:
        v = e[0] if isinstance(e, list | tuple) and e else None
        out.append(float(v) if isinstance(v, int | float) and v == v else 0.0)
    return tuple(out)
