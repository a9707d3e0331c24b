"""TLS for every gRPC and HTTP hop: one config, the credentials made from it, and the
watching of its files so a rotated certificate (cert-manager rewrites a mounted Secret) is
served to new connections without a restart and without dropping open ones.

* A listener (router gRPC and HTTP, agent gRPC) serves ``--tls-cert``/``--tls-key``; with
  ``--tls-client-ca`` it requires a client certificate that CA signed (mTLS), and with
  ``--tls-allowed-sans`` one naming one of those SANs (checked per call: :func:`san_guard`).
* A caller (router -> agent, agent -> agent) verifies the agent against ``--tls-ca`` and
  presents ``--tls-client-cert``/``--tls-client-key`` (default: ``--tls-cert``/``--tls-key``).

gRPC servers re-read the files on a handshake after they changed (grpc's dynamic server
credentials); the HTTP front's ``ssl.SSLContext`` is reloaded by :meth:`ServerContext.watch`;
callers make new channels with the new client certificate (:class:`ClientCredentials`).
Open connections keep the certificate they were made with.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from kvroute.core.config import TlsSettings

log = logging.getLogger("kvroute.tls")

RELOAD_CHECK_S = 1.0
"""Files are stat'ed at most this often (a handshake or a new channel then costs nothing)."""
# Services a SAN allowlist does not cover: health probes (the kubelet's) and reflection.
_OPEN_SERVICES = ("grpc.health.v1.", "grpc.reflection.")


class TlsError(ValueError):
    """A TLS setting or file that cannot be used, in words naming the flag."""


@dataclass(frozen=True)
class TlsConfig:
    """The TLS settings of one process. Empty strings: not set (plaintext)."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""
    allowed_sans: tuple[str, ...] = ()
    ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsError("--tls-cert and --tls-key go together (the certificate and its key)")
        if bool(self.client_cert) != bool(self.client_key):
            raise TlsError("--tls-client-cert and --tls-client-key go together")
        if self.client_ca and not self.cert:
            raise TlsError("--tls-client-ca verifies callers of a TLS listener: it needs "
                           "--tls-cert and --tls-key")
        if self.allowed_sans and not self.client_ca:
            raise TlsError("--tls-allowed-sans checks client certificates: it needs "
                           "--tls-client-ca")
        if (self.client_cert or self.server_name) and not self.ca:
            raise TlsError("--tls-client-cert and --tls-server-name are for TLS calls to "
                           "agents: they need --tls-ca")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-client-ca", self.client_ca), ("--tls-ca", self.ca),
                           ("--tls-client-cert", self.client_cert),
                           ("--tls-client-key", self.client_key)):
            if path and not Path(path).is_file():
                raise TlsError(f"{flag} {path}: no such file")

    @classmethod
    def from_settings(cls, tls: TlsSettings) -> TlsConfig:
        sans = tuple(s.strip() for s in tls.allowed_sans.split(",") if s.strip())
        return cls(tls.cert, tls.key, tls.client_ca, sans, tls.ca,
                   tls.client_cert, tls.client_key, tls.server_name)

    @property
    def serving(self) -> bool:
        """Whether listeners serve TLS."""
        return bool(self.cert)

    @property
    def calling(self) -> bool:
        """Whether calls to agents use TLS."""
        return bool(self.ca)

    def identity(self) -> tuple[str, str]:
        """(certificate, key) presented when calling: the client pair, else the server's."""
        return (self.client_cert, self.client_key) if self.client_cert else (self.cert, self.key)


class PemFiles:
    """Files read together (a certificate, its key, a CA), re-read when one changed.

    :meth:`read` gives their bytes, or None when nothing changed since the last read (or
    the check is not yet due). A pair caught half-rewritten (a new certificate, the old key)
    does not load: it is skipped and read again on the next check."""

    def __init__(self, *paths: str, check_s: float = RELOAD_CHECK_S) -> None:
        self.paths = tuple(p for p in paths if p)
        self._check_s = check_s
        self._seen: tuple[tuple[int, int, int], ...] | None = None
        self._next = 0.0
        self.current: tuple[bytes, ...] = ()

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        # A mounted Secret is a symlink swapped to a new directory: stat follows it.
        out = []
        for p in self.paths:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def read(self, force: bool = False) -> tuple[bytes, ...] | None:
        now = time.monotonic()
        if not force and now < self._next:
            return None
        self._next = now + self._check_s
        try:
            stamp = self._stamp()
            if not force and stamp == self._seen:
                return None
            data = tuple(Path(p).read_bytes() for p in self.paths)
        except OSError as exc:
            if force:
                raise TlsError(f"{exc.filename}: cannot be read ({exc.strerror})") from None
            log.warning("TLS files not readable; keeping the loaded ones",
                        extra={"kv": {"error": f"{exc.filename}: {exc.strerror}"}})
            return None
        self._seen = stamp
        self.current = data
        return data


def _check_pair(cert: str, key: str, flags: str) -> None:
    """Raise TlsError unless ``cert`` and ``key`` load together (PEM, matching)."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(f"{flags} {cert}, {key}: not a usable certificate and key ({exc})") \
            from None


# -- gRPC servers -----------------------------------------------------------------------------

def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port``: ``tls.cert``/``tls.key`` (and client
    certificates signed by ``tls.client_ca`` required), re-read on the first handshake after
    a file changed. Connections open keep theirs: grpc asks the fetcher per handshake."""
    _check_pair(tls.cert, tls.key, "--tls-cert/--tls-key")
    files = PemFiles(tls.cert, tls.key, *([tls.client_ca] if tls.client_ca else []))

    def configuration(data: tuple[bytes, ...]) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(data[1], data[0])], root_certificates=data[2] if len(data) > 2 else None)

    initial = configuration(files.read(force=True) or files.current)

    def fetch() -> Any:
        # Called by grpc's core (any thread) at each handshake; None keeps the current one.
        data = files.read()
        if data is None:
            return None
        if not _consistent(files, tls.cert, tls.key):
            return None
        log.info("TLS certificate reloaded", extra={"kv": {"cert": tls.cert}})
        return configuration(data)

    return grpc.dynamic_ssl_server_credentials(
        initial, fetch, require_client_authentication=bool(tls.client_ca))


def _consistent(files: PemFiles, cert: str, key: str) -> bool:
    """Whether the bytes just read are a certificate and its key (not one half rewritten):
    they load together, and the files still hold what was read."""
    try:
        _check_pair(cert, key, "reload")
        again = tuple(Path(p).read_bytes() for p in files.paths)
    except (TlsError, OSError) as exc:
        log.warning("rotated TLS files do not load yet; keeping the loaded ones",
                    extra={"kv": {"error": str(exc)}})
        files._seen = None  # try again at the next check
        return False
    if again != files.current:
        files._seen = None
        return False
    return True


def peer_sans(context: grpc.aio.ServicerContext) -> list[str]:
    """The SANs of the caller's verified client certificate (none without mTLS)."""
    auth = context.auth_context()
    return [v.decode(errors="replace") for v in auth.get("x509_subject_alternative_name", [])]


def san_guard(allowed: Sequence[str]) -> grpc.aio.ServerInterceptor:
    """An interceptor refusing (PERMISSION_DENIED) a call whose client certificate names
    none of ``allowed`` among its SANs (DNS names, IPs, URIs as grpc reports them)."""
    wanted = frozenset(allowed)

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        sans = peer_sans(context)
        if not wanted.intersection(sans):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "the client certificate names none of the SANs this server "
                                f"accepts (--tls-allowed-sans); it names {sans or 'none'}")

    return CheckingInterceptor(check,
                               lambda method: not method.lstrip("/").startswith(_OPEN_SERVICES))


Check = Callable[[Any, grpc.aio.ServicerContext], Any]
"""``check(request, context)`` (awaited): aborts the call, or returns to let it run.
``request`` is None for a client-streaming call (checked before its first message)."""


class CheckingInterceptor(grpc.aio.ServerInterceptor):
    """Runs ``check`` before each call of a method ``covers(method)`` accepts: the one way
    a server puts a condition (a certificate's SAN, an API key) in front of its handlers."""

    def __init__(self, check: Check, covers: Callable[[str], bool]) -> None:
        self._check = check
        self._covers = covers

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not self._covers(details.method):
            return handler
        return checked_handler(handler, self._check)


def checked_handler(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """``handler`` with ``check`` run first (unary and streaming, async functions and async
    generators alike)."""
    kind = next(k for k in _HANDLER_KINDS if getattr(handler, k) is not None)
    inner = getattr(handler, kind)
    streamed_in = kind.startswith("stream")  # no request to check yet: None

    if inspect.isasyncgenfunction(inner):
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(None if streamed_in else request, context)
            async for resp in inner(request, context):
                yield resp
    else:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
            await check(None if streamed_in else request, context)
            return await inner(request, context)
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(wrapped, handler.request_deserializer, handler.response_serializer)


_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


# -- HTTP (aiohttp) servers -------------------------------------------------------------------

@dataclass
class ServerContext:
    """An ``ssl.SSLContext`` for an HTTP listener, reloaded in place when its files change:
    ``load_cert_chain`` on a live context applies to the handshakes after it."""

    tls: TlsConfig
    context: ssl.SSLContext = field(init=False)
    _files: PemFiles = field(init=False)

    def __post_init__(self) -> None:
        _check_pair(self.tls.cert, self.tls.key, "--tls-cert/--tls-key")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls.cert, self.tls.key)
        if self.tls.client_ca:
            try:
                ctx.load_verify_locations(self.tls.client_ca)
            except ssl.SSLError as exc:
                raise TlsError(f"--tls-client-ca {self.tls.client_ca}: not a PEM CA bundle "
                               f"({exc})") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        self.context = ctx
        self._files = PemFiles(self.tls.cert, self.tls.key)
        self._files.read(force=True)

    def reload(self) -> bool:
        """Load the files again if they changed; whether it did."""
        if self._files.read() is None or not _consistent(self._files, self.tls.cert,
                                                          self.tls.key):
            return False
        self.context.load_cert_chain(self.tls.cert, self.tls.key)
        log.info("TLS certificate reloaded", extra={"kv": {"cert": self.tls.cert}})
        return True

    async def watch(self) -> None:
        """Reload every :data:`RELOAD_CHECK_S` until cancelled."""
        while True:
            await asyncio.sleep(RELOAD_CHECK_S)
            self.reload()


# -- gRPC clients -----------------------------------------------------------------------------

class ClientCredentials:
    """Channel credentials for calls to agents: verify against ``tls.ca`` (the name checked
    is ``tls.server_name`` when set, else the address's host), present the client pair.
    :meth:`current` says when the files changed (its generation grows): callers then open
    new channels, whose handshakes use the new certificate."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        cert, key = tls.identity()
        if cert:
            _check_pair(cert, key, "--tls-client-cert/--tls-client-key")
        self._files = PemFiles(tls.ca, cert, key)
        self.generation = 0
        self._creds = self._make(self._files.read(force=True) or self._files.current)

    def _make(self, data: tuple[bytes, ...]) -> grpc.ChannelCredentials:
        if len(data) == 3:
            return grpc.ssl_channel_credentials(data[0], private_key=data[2],
                                                certificate_chain=data[1])
        return grpc.ssl_channel_credentials(data[0])

    def current(self) -> tuple[int, grpc.ChannelCredentials]:
        data = self._files.read()
        cert, key = self.tls.identity()
        if data is not None and (not cert or _consistent(self._files, cert, key)):
            self._creds = self._make(data)
            self.generation += 1
            log.info("TLS client certificate reloaded", extra={"kv": {"cert": cert}})
        return self.generation, self._creds

    def options(self) -> list[tuple[str, str]]:
        if self.tls.server_name:
            return [("grpc.ssl_target_name_override", self.tls.server_name)]
        return []
