"""Connection settings: credentials from URL, environment or file; TLS files; redaction."""

from __future__ import annotations

import argparse
import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.core.redis_conn import RedisAccess, connect, connect_config, explain, redact_url
from kvroute.core.settings import DefaultsFormatter, add_arguments, from_env


def test_redact_url_hides_the_password_only() -> None:
    assert redact_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:s3cret@h:6380/1") == "rediss://user:***@h:6380/1"
    assert redact_url("rediss+cluster://u:p%40ss@n1:7000") == "rediss+cluster://u:***@n1:7000"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("redis://user@h:6379/0") == "redis://user@h:6379/0"


def test_credentials_and_tls_files_reach_the_client(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    c = connect("rediss://h:6380/0", access=RedisAccess("kvr", "pw", str(ca), str(ca), str(ca)))
    kw = c.connection_pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["ssl_ca_certs"]) == ("kvr", "pw", str(ca))
    assert (kw["ssl_certfile"], kw["ssl_keyfile"]) == (str(ca), str(ca))
    assert kw["driver_info"] is None  # no CLIENT SETINFO: the least ACL needs no CLIENT
    cl = connect("rediss+cluster://h:7000", access=RedisAccess("kvr", "pw", str(ca)))
    assert isinstance(cl, aioredis.RedisCluster)
    ckw = cl.connection_kwargs
    assert (ckw["username"], ckw["password"], ckw["ssl_ca_certs"]) == ("kvr", "pw", str(ca))
    assert ckw["connection_class"].__name__ == "SSLConnection"
    plain = connect("redis+cluster://u:p@h:7000")
    assert plain.connection_kwargs["password"] == "p"
    assert plain.connection_kwargs["connection_class"].__name__ == "Connection"


@pytest.mark.parametrize(("url", "access", "message"), [
    ("redis://:p@h/0", RedisAccess(password="q"), r"credentials given twice.*redis://:\*\*\*@h"),
    ("redis://h/0", RedisAccess(ca_file="ca.pem"), "--redis-ca-file need a TLS URL"),
    ("redis+cluster://h:7000", RedisAccess(cert_file="c", key_file="k"),
     "--redis-cert-file, --redis-key-file need a TLS URL"),
    ("rediss://h/0", RedisAccess(cert_file="c.pem"), "go together"),
    ("rediss://h/0", RedisAccess(ca_file="/nonexistent/ca.pem"),
     "--redis-ca-file /nonexistent/ca.pem: no such file"),
])
def test_contradictions_are_named(url: str, access: RedisAccess, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        connect(url, access=access)


def test_the_password_comes_from_env_or_a_file_and_never_shows(tmp_path: Path) -> None:
    cfg = from_env(RouterConfig, {"KVROUTE_REDIS_PASSWORD": "from-env-pw"})
    assert RedisAccess.from_settings(cfg.redis).password == "from-env-pw"
    assert "from-env-pw" not in repr(cfg) and "from-env-pw" not in repr(
        RedisAccess.from_settings(cfg.redis))
    f = tmp_path / "pw"
    f.write_text("from-file-pw\n")
    cfg = RouterConfig.of(redis_password_file=str(f), redis_username="kvr-router")
    access = RedisAccess.from_settings(cfg.redis)
    assert (access.username, access.password) == ("kvr-router", "from-file-pw")
    with pytest.raises(SystemExit, match="not both"):
        connect_config(RouterConfig.of(redis_password_file=str(f), redis_password="x").redis)
    with pytest.raises(SystemExit, match="cannot be read"):
        connect_config(RouterConfig.of(redis_password_file=str(tmp_path / "missing")).redis)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="is empty"):
        connect_config(RouterConfig.of(redis_password_file=str(tmp_path / "empty")).redis)
    # --help shows every flag's default, but not a secret set in the environment.
    parser = argparse.ArgumentParser(formatter_class=DefaultsFormatter)  # as the CLI's
    add_arguments(parser, AgentConfig, {"KVROUTE_REDIS_PASSWORD": "env-secret-pw"})
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "--redis-password" in out.getvalue() and "env-secret-pw" not in out.getvalue()
    assert parser.parse_args([]).redis_password == "env-secret-pw"


async def test_an_unreachable_redis_is_said_plainly() -> None:
    from tests.support import free_port

    port = free_port()
    c = connect(f"redis://kvr:pw@127.0.0.1:{port}/0")
    try:
        await c.ping()
    except aioredis.ConnectionError as exc:
        text = explain(c, exc)
    await c.aclose()
    assert text.startswith(f"redis at 127.0.0.1:{port} not reachable:") and "pw" not in text
