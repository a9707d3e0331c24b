"""Opening Redis connections from a URL, with timeouts suited to a router's hot loop.

``redis://`` / ``rediss://`` / ``unix://`` open a single-node client; ``redis+cluster://`` and
``rediss+cluster://`` (any one node of the cluster) open a Redis Cluster client. Every key
of one model shares a hash tag (:mod:`kvroute.core.redis_schema`), so each transaction
kvroute runs touches one slot and works unchanged on a cluster.

Credentials come from the URL (``redis://USER:PASSWORD@host``) or from :class:`RedisAccess`
(``--redis-username``, ``KVROUTE_REDIS_PASSWORD`` or ``--redis-password-file``), never both;
``rediss`` URLs verify the server against ``--redis-ca-file`` (else the system's CAs) and may
present a client certificate. The password never appears in a log line: :func:`redact_url`
is what logs show, and :func:`explain` words a failure without it.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import (
    AuthenticationError,
    ClusterError,
    NoPermissionError,
    RedisClusterException,
)

if TYPE_CHECKING:
    from kvroute.core.config import RedisSettings

# Errors that mean "Redis is unreachable or misbehaving", as opposed to programming errors.
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    aioredis.ConnectionError,
    aioredis.TimeoutError,
    aioredis.ResponseError,
    ClusterError,
    RedisClusterException,
    OSError,
)

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
TLS_SCHEMES = {"rediss", "rediss+cluster"}

RedisClient = aioredis.Redis | aioredis.RedisCluster

# redis-py sends CLIENT SETINFO on every connect (refusal ignored); kvroute does not, so the
# least ACL (redis_schema.acl_rules) needs no CLIENT command and Redis's ACL LOG stays clean.
try:
    import redis.driver_info  # noqa: F401  (redis-py >= 7: driver_info=None turns it off)

    _NO_CLIENT_SETINFO: dict[str, object] = {"driver_info": None}
except ImportError:  # older redis-py: lib_name=None does
    _NO_CLIENT_SETINFO = {"lib_name": None, "lib_version": None}


@dataclass(frozen=True)
class RedisAccess:
    """Credentials and TLS files for a Redis connection, besides its URL. Empty: not set.

    ``password`` is left out of ``repr`` so a dumped config never shows it."""

    username: str = ""
    password: str = field(default="", repr=False)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_settings(cls, redis: RedisSettings) -> RedisAccess:
        """From ``--redis-username``, ``--redis-password`` (its env variable) or
        ``--redis-password-file`` (one of the two), and the TLS file flags. A password file's
        trailing newline is not part of the password (``echo pw > file`` writes one)."""
        password = redis.password
        if redis.password_file:
            if password:
                raise ValueError("give the redis password once: --redis-password "
                                 "(KVROUTE_REDIS_PASSWORD) or --redis-password-file, not both")
            try:
                password = Path(redis.password_file).read_text().rstrip("\r\n")
            except OSError as exc:
                raise ValueError(f"--redis-password-file {redis.password_file}: "
                                 f"cannot be read ({exc.strerror})") from None
            if not password:
                raise ValueError(f"--redis-password-file {redis.password_file} is empty")
        return cls(redis.username, password, redis.ca_file, redis.cert_file,
                   redis.key_file)

    def client_kwargs(self, url: str) -> dict[str, object]:
        """redis-py keyword arguments for ``url``; ValueError names a contradiction."""
        parts = urlsplit(url)
        tls = parts.scheme in TLS_SCHEMES
        if (parts.username or parts.password) and (self.username or self.password):
            raise ValueError(f"redis credentials given twice: in the URL ({redact_url(url)}) "
                             "and in --redis-username/--redis-password(-file); use one")
        tls_files = {"--redis-ca-file": self.ca_file, "--redis-cert-file": self.cert_file,
                     "--redis-key-file": self.key_file}
        if not tls and any(tls_files.values()):
            given = ", ".join(k for k, v in tls_files.items() if v)
            raise ValueError(f"{given} need a TLS URL (rediss:// or rediss+cluster://), "
                             f"got {redact_url(url)}")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("--redis-cert-file and --redis-key-file go together "
                             "(the client certificate and its key)")
        for flag, path in tls_files.items():
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        kw: dict[str, object] = {}
        if self.username:
            kw["username"] = self.username
        if self.password:
            kw["password"] = self.password
        if tls:  # verify the chain and the host name whatever redis-py's defaults
            kw["ssl_cert_reqs"] = "required"
            kw["ssl_check_hostname"] = True
            if self.ca_file:
                kw["ssl_ca_certs"] = self.ca_file
            if self.cert_file:
                kw["ssl_certfile"] = self.cert_file
                kw["ssl_keyfile"] = self.key_file
        return kw


def connect(url: str, *, block_timeout_s: float = 0.0,
            access: RedisAccess | None = None) -> RedisClient:
    """A client for ``url``. Commands fail fast rather than hang.

    ``block_timeout_s`` leaves room for blocking reads (XREAD BLOCK) under the socket timeout.
    ValueError names a bad combination of URL, credentials and TLS files.
    """
    kw: dict[str, object] = {"socket_connect_timeout": 2.0,
                             "socket_timeout": 5.0 + block_timeout_s, **_NO_CLIENT_SETINFO}
    kw.update((access or RedisAccess()).client_kwargs(url))
    scheme, sep, rest = url.partition("://")
    if sep and scheme in CLUSTER_SCHEMES:
        return aioredis.RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}", **kw)
    return aioredis.Redis.from_url(url, health_check_interval=0, retry_on_timeout=False, **kw)


def connect_config(redis: RedisSettings, *, block_timeout_s: float = 0.0) -> RedisClient:
    """:func:`connect` to ``redis.url`` with its credentials and TLS files; a bad
    combination stops the service at start, naming it."""
    try:
        return connect(redis.url, block_timeout_s=block_timeout_s,
                       access=RedisAccess.from_settings(redis))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: what logs and errors show."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def target(client: RedisClient) -> tuple[str, str]:
    """(``host:port`` or socket path, ACL user) ``client`` connects as, for messages."""
    if isinstance(client, aioredis.RedisCluster):
        nodes = client.get_nodes() or client.nodes_manager.startup_nodes.values()
        node = next(iter(nodes), None)
        where = f"{node.host}:{node.port} (cluster)" if node is not None else "(cluster)"
        user = str(client.connection_kwargs.get("username") or "default")
        return where, user
    ckw = client.connection_pool.connection_kwargs
    where = str(ckw["path"]) if "path" in ckw else f"{ckw.get('host')}:{ckw.get('port')}"
    return where, str(ckw.get("username") or "default")


def refusal(client: RedisClient, exc: BaseException) -> str | None:
    """Why Redis was reached but would not serve us, in words an operator acts on (refused
    credentials, a command the ACL denies, a failed TLS handshake); None for anything else."""
    where, user = target(client)
    cause = exc.__cause__ or exc.__context__
    # redis-py strips the reply's code (WRONGPASS, NOPERM): say it, it is what Redis said.
    code = getattr(exc, "status_code", None)
    said = f"{code} {exc}" if code and not str(exc).startswith(code) else str(exc)
    if isinstance(exc, AuthenticationError):
        return f"redis at {where} refused the credentials for user {unquote(user)}: {said}"
    if isinstance(exc, NoPermissionError):
        return (f"redis at {where} denied user {unquote(user)} a command or key (its ACL "
                f"lacks what docs/security.md lists): {said}")
    if isinstance(exc, ssl.SSLError) or isinstance(cause, ssl.SSLError) or "SSL" in str(exc):
        return f"TLS with redis at {where} failed (check --redis-ca-file and the URL): {exc}"
    return None


def explain(client: RedisClient, exc: BaseException) -> str:
    """:func:`refusal`, else ``redis at HOST:PORT not reachable: ...``."""
    return refusal(client, exc) or f"redis at {target(client)[0]} not reachable: {exc}"
