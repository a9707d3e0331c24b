"""API keys on the router's public API: who may call it, for which models, how often.

Keys are read from ``--api-keys-file`` (a mounted Kubernetes Secret works: it is re-read
when it changes), which holds only their SHA-256 hashes, one record per key, as JSON lines,
a JSON or YAML list, or a YAML/JSON mapping ``{"keys": [...]}``::

    {"name": "team-a", "sha256": "9f86d0...", "models": ["llama-3-8b"], "rate": 5, "burst": 10}

``models`` (optional): the models the key may use (default: any); ``rate`` (optional):
requests per second the key may make on average, ``burst`` how many at once (a token
bucket; default burst: the rate, at least 1). ``kvroute keys hash`` prints a new key's line.

The same :class:`KeyRing` serves the gRPC API (:func:`grpc_interceptor`: ``authorization:
Bearer KEY`` metadata) and the HTTP API (:func:`http_middleware`: the ``Authorization``
header): a missing or unknown key is UNAUTHENTICATED / 401, a model the key may not use
PERMISSION_DENIED / 403, a key over its rate RESOURCE_EXHAUSTED / 429 with the seconds to
wait (``Retry-After`` header, ``retry-after`` trailer). Health, reflection and metrics stay
open. No key is ever logged: only a key's name is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from kvroute.core.grpc_util import Received
from kvroute.core.program_bounds import ProgramBoundsError, program_bounds
from kvroute.core.tls import CheckingInterceptor
from kvroute.router.api_error import ApiError

log = logging.getLogger("kvroute.router.auth")

RELOAD_CHECK_S = 1.0  # the keys file is stat'ed at most this often
MAX_RATE = 1e6
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"name", "sha256", "models", "rate", "burst"}


class KeysFileError(ValueError):
    """A keys file that cannot be used, naming the record and field."""


class AuthError(Exception):
    """A call refused: ``reason`` (missing, invalid, model, rate), ``retry_after`` seconds
    for a rate refusal."""

    def __init__(self, reason: str, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    @property
    def retry_after_s(self) -> int:
        """Whole seconds to wait, as ``Retry-After`` takes them (at least 1)."""
        return max(1, math.ceil(self.retry_after))


def hash_key(key: str) -> str:
    """The hash a keys file holds for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    models: frozenset[str] = frozenset()  # empty: any model
    rate: float = 0.0  # requests per second; 0: unlimited
    burst: float = 0.0

    @classmethod
    def parse(cls, rec: object, where: str) -> ApiKey:
        name, digest = _identity(rec, where)
        assert isinstance(rec, Mapping)
        models = rec.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise KeysFileError(f"{where} ({name}): models must be a list of model names")
        rate, burst = _limits(rec, f"{where} ({name})")
        return cls(name, digest.lower(), frozenset(models), rate, burst or max(1.0, rate))


def _identity(rec: object, where: str) -> tuple[str, str]:
    """A key record's name and hash, its fields checked."""
    if not isinstance(rec, Mapping):
        raise KeysFileError(f"{where}: a key record must be a mapping, got "
                            f"{type(rec).__name__}")
    unknown = set(rec) - _FIELDS
    if unknown:
        raise KeysFileError(f"{where}: unknown fields {sorted(map(str, unknown))} "
                            f"(known: {sorted(_FIELDS)})")
    name, digest = rec.get("name"), rec.get("sha256")
    if not isinstance(name, str) or not name or len(name) > 200:
        raise KeysFileError(f"{where}: name must be a non-empty string (<= 200 characters)")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest.lower()):
        raise KeysFileError(f"{where} ({name}): sha256 must be 64 hex digits (the key's "
                            "hash, as `kvroute keys hash` prints it), not the key itself")
    return name, digest


def _limits(rec: Mapping[str, object], where: str) -> tuple[float, float]:
    """A key record's rate and burst (0: unlimited, and the rate's default)."""
    rate, burst = rec.get("rate", 0), rec.get("burst", 0)
    for fname, v in (("rate", rate), ("burst", burst)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not \
                (math.isfinite(v) and 0 <= v <= MAX_RATE):
            raise KeysFileError(f"{where}: {fname} must be a number in "
                                f"[0, {MAX_RATE:g}], got {v!r}")
    assert isinstance(rate, (int, float)) and isinstance(burst, (int, float))
    if burst and not rate:
        raise KeysFileError(f"{where}: burst needs a rate")
    if rate and burst and burst < 1:
        raise KeysFileError(f"{where}: burst must be at least 1")
    return float(rate), float(burst)


def parse_keys(text: str, where: str) -> dict[str, ApiKey]:
    """The keys of a keys file's text, by hash; KeysFileError names what is wrong."""
    records: list[object]
    stripped = text.strip()
    lines = [line for line in stripped.splitlines() if line.strip()]
    try:
        # JSON first: YAML 1.1 would read a JSON number such as 1e6 as a string.
        try:
            doc: object = json.loads(stripped) if stripped else []
        except json.JSONDecodeError:
            if all(line.lstrip().startswith("{") for line in lines):  # JSON lines
                doc = [json.loads(line) for line in lines]
            else:
                doc = yaml.safe_load(stripped)
        if isinstance(doc, Mapping) and "keys" in doc:
            doc = doc["keys"]
        elif isinstance(doc, Mapping):
            doc = [doc]
        if not isinstance(doc, list):
            raise KeysFileError(f"{where}: expected a list of key records")
        records = doc
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise KeysFileError(f"{where}: not JSON lines, JSON or YAML ({exc})") from None
    keys: dict[str, ApiKey] = {}
    names: set[str] = set()
    for i, rec in enumerate(records, 1):
        k = ApiKey.parse(rec, f"{where}: record {i}")
        if k.sha256 in keys or k.name in names:
            raise KeysFileError(f"{where}: record {i} ({k.name}): a key or name given twice")
        keys[k.sha256] = k
        names.add(k.name)
    return keys


@dataclass
class TokenBucket:
    rate: float
    burst: float
    tokens: float
    at: float

    def take(self, now: float, n: float = 1.0) -> float:
        """Take ``n`` tokens: 0 if there were, else the seconds until there are."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate


class AuthMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.failures = Counter("kvroute_router_auth_failures_total",
                                "Requests refused by API-key authentication, by reason "
                                "(missing, invalid, model)", ["reason"], registry=registry)
        self.rate_limited = Counter("kvroute_router_rate_limited_total",
                                    "Requests refused for a key over its rate limit",
                                    ["key"], registry=registry)
        for reason in ("missing", "invalid", "model"):
            self.failures.labels(reason)


@dataclass
class KeyRing:
    """The keys of ``path``, re-read when it changes (a bad new version is logged and the
    old keys kept), and each key's token bucket."""

    path: str
    metrics: AuthMetrics | None = None
    keys: dict[str, ApiKey] = field(init=False)
    _buckets: dict[str, TokenBucket] = field(init=False, default_factory=dict)
    _stamp: tuple[int, int, int] | None = field(init=False, default=None)
    _next: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.keys = self._load()

    def _load(self) -> dict[str, ApiKey]:
        try:
            st = os.stat(self.path)
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"--api-keys-file {self.path}: cannot be read ({exc})") \
                from None
        keys = parse_keys(text, f"--api-keys-file {self.path}")
        self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        return keys

    def refresh(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + RELOAD_CHECK_S
        try:
            st = os.stat(self.path)
        except OSError as exc:
            log.error("API keys file not readable; keeping the loaded keys",
                      extra={"kv": {"path": self.path, "error": exc.strerror}})
            return
        if (st.st_mtime_ns, st.st_size, st.st_ino) == self._stamp:
            return
        try:
            keys = self._load()
        except KeysFileError as exc:
            self._stamp = None  # retry at the next check
            log.error("API keys file not loaded; keeping the loaded keys",
                      extra={"kv": {"error": str(exc)}})
            return
        self.keys = keys
        # A key's bucket survives a reload unless its limit changed.
        names = {k.name: k for k in keys.values()}
        self._buckets = {n: b for n, b in self._buckets.items()
                         if n in names and (names[n].rate, names[n].burst) == (b.rate, b.burst)}
        log.info("API keys reloaded", extra={"kv": {"keys": len(keys)}})

    def check(self, authorization: str | None, model: str | None) -> ApiKey:
        """The key a call's ``Authorization`` value names, if it may use ``model`` (None: not
        known yet) now; AuthError otherwise."""
        self.refresh()
        try:
            key = self._key(authorization)
            if model is not None and key.models and model not in key.models:
                raise AuthError("model", f"this API key may not use model {model!r}")
        except AuthError as exc:
            if self.metrics is not None:
                self.metrics.failures.labels(exc.reason).inc()
            raise
        return key

    def _key(self, authorization: str | None) -> ApiKey:
        if not authorization:
            raise AuthError("missing", "an API key is required: send 'Authorization: Bearer "
                                       "KEY'")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError("missing", "the Authorization header must be 'Bearer KEY'")
        key = self.keys.get(hash_key(token))
        if key is None:
            raise AuthError("invalid", "the API key is not valid")
        return key

    def admit(self, key: ApiKey, now: float | None = None, n: int = 1,
              whole: int = 0) -> None:
        """Count ``n`` generations of ``key`` against its rate; AuthError (rate) when over
        it. ``whole``: the request's generations, ``n`` of them counted now (a request of
        more than the burst can never pass: said so)."""
        if not key.rate:
            return
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(key.name)
        if bucket is None:
            bucket = self._buckets[key.name] = TokenBucket(key.rate, key.burst, key.burst, now)
        whole = max(whole, n)
        wait = bucket.take(now, n) if whole <= key.burst else float("inf")
        if wait:
            if self.metrics is not None:
                self.metrics.rate_limited.labels(key.name).inc()
            if wait == float("inf"):
                raise AuthError("rate", f"this request asks for {whole} generations, more "
                                        f"than API key {key.name!r}'s burst of "
                                        f"{key.burst:g} allows at once; send fewer prompts "
                                        "or a smaller n", retry_after=1.0)
            raise AuthError("rate", f"API key {key.name!r} is over its rate limit of "
                                    f"{key.rate:g} requests/s (burst {key.burst:g}); retry "
                                    f"after {wait:.2f} s", retry_after=wait)


# -- gRPC --------------------------------------------------------------------------------------

_GRPC_CODES = {"missing": grpc.StatusCode.UNAUTHENTICATED,
               "invalid": grpc.StatusCode.UNAUTHENTICATED,
               "model": grpc.StatusCode.PERMISSION_DENIED,
               "rate": grpc.StatusCode.RESOURCE_EXHAUSTED}


def generations(request: Any) -> int:
    """The generations a kvroute.v1 request runs at once: its program's widest fork (1 for
    a plain request, bytes that did not parse, or a program its limits will refuse)."""
    msg = request.msg if isinstance(request, Received) else request
    program = getattr(msg, "program", None)
    if program is None or not msg.HasField("program"):
        return 1
    try:
        return max(1, program_bounds(program).fanout)
    except ProgramBoundsError:
        return 1


def grpc_interceptor(ring: KeyRing, services: Iterable[str],
                     model_of: Callable[[Any], str | None]) -> grpc.aio.ServerInterceptor:
    """Checks the key of every call to ``services`` (full names) and counts its generations
    (:func:`generations`) against the key's rate; ``model_of(request)``: the model a request
    asks for (None: unknown)."""
    prefixes = tuple(f"/{s}/" for s in services)

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        md = {k: v for k, v in (context.invocation_metadata() or ())}
        try:
            key = ring.check(md.get("authorization"),
                             model_of(request) if request is not None else None)
            n = generations(request) if request is not None else 1
            ring.admit(key, n=n)
        except AuthError as exc:
            trailer = (("retry-after", str(exc.retry_after_s)),) if exc.reason == "rate" else ()
            await context.abort(_GRPC_CODES[exc.reason], exc.message, trailing_metadata=trailer)

    return CheckingInterceptor(check, lambda method: method.startswith(prefixes))


# -- HTTP --------------------------------------------------------------------------------------

_HTTP = {"missing": (401, "missing_api_key"), "invalid": (401, "invalid_api_key"),
         "model": (403, "model_not_allowed"), "rate": (429, "rate_limit_exceeded")}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


CHARGE_MORE = web.RequestKey("kvroute_charge_more", Callable[[int], None])
"""Set on an HTTP request by :func:`http_middleware`, which counted it as one generation:
``request[CHARGE_MORE](n)`` counts ``n`` more against the same key (a batched completion's
other prompts, its other choices), raising the 429 ApiError when over the rate."""


def _http_error(exc: AuthError) -> ApiError:
    status, code = _HTTP[exc.reason]
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.reason == "rate" else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return ApiError(status, exc.message, code=code, headers=headers)


def http_middleware(ring: KeyRing, default_model: str,
                    open_paths: Iterable[str] = ("/health",)) -> Any:
    """An aiohttp middleware checking the key of every request but to ``open_paths``; it
    raises ApiError, so the front's error middleware must run outside it. The model of a
    POST body is read only for a key limited to some models (the body is read once: aiohttp
    keeps it for the handler)."""
    open_set = frozenset(open_paths)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_set:
            return await handler(request)
        authorization = _authorization(request)
        try:
            key = ring.check(authorization, None)
            if key.models and request.method == "POST":
                ring.check(authorization, await _body_model(request, default_model))
            ring.admit(key)
        except AuthError as exc:
            raise _http_error(exc) from None

        def charge(n: int) -> None:
            try:
                ring.admit(key, n=n, whole=n + 1)
            except AuthError as exc:
                raise _http_error(exc) from None
        request[CHARGE_MORE] = charge
        return await handler(request)

    return auth


def _authorization(request: web.Request) -> str | None:
    """The request's ``Authorization``, else its ``x-api-key`` (Anthropic's clients) as a
    bearer key."""
    given = request.headers.get("Authorization")
    if given is None and (key := request.headers.get("x-api-key")):
        return f"Bearer {key}"
    return given


async def _body_model(request: web.Request, default_model: str) -> str | None:
    """The body's ``model`` (the router's own when it gives none); None when the body is not
    a JSON object: the handler then refuses it as it would without a key."""
    try:
        body = json.loads(await request.read())
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    model = body.get("model")
    return model if isinstance(model, str) and model else default_model


# -- wiring ------------------------------------------------------------------------------------

def load_key_ring(path: str, registry: CollectorRegistry) -> KeyRing | None:
    """The keys of ``--api-keys-file`` (None: not set, no key needed); a file that does not
    load stops the router at start, naming what is wrong."""
    if not path:
        return None
    try:
        return KeyRing(path, AuthMetrics(registry))
    except KeysFileError as exc:
        raise SystemExit(str(exc)) from None


def request_model(default_model: str) -> Callable[[Any], str | None]:
    """The model a kvroute.v1 request asks for (its ``model``, else the router's); None for
    bytes that did not parse (the handler refuses them)."""
    def model_of(request: Any) -> str | None:
        msg = request.msg if isinstance(request, Received) else request
        return None if msg is None else (getattr(msg, "model", "") or default_model)
    return model_of


def api_interceptors(ring: KeyRing | None, services: Iterable[str],
                     default_model: str) -> list[grpc.aio.ServerInterceptor]:
    return [] if ring is None else [grpc_interceptor(ring, services, request_model(default_model))]


def api_middlewares(ring: KeyRing | None, default_model: str) -> list[Any]:
    return [] if ring is None else [http_middleware(ring, default_model)]


def key_record(name: str, key: str, models: Iterable[str] = (), rate: float = 0.0,
               burst: float = 0.0) -> str:
    """The keys-file line (JSON) for ``key``: what ``kvroute keys hash`` prints. The record
    is checked as the router will check it (KeysFileError)."""
    rec: dict[str, Any] = {"name": name, "sha256": hash_key(key)}
    if models:
        rec["models"] = list(models)
    if rate:
        rec["rate"] = rate
    if burst:
        rec["burst"] = burst
    ApiKey.parse(rec, "the new key")
    return json.dumps(rec)
