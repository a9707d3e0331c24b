"""Redis over TLS with least-privilege ACL users: a real redis-server with ``--tls-port``,
certificates made here with the openssl CLI, and the ACL users of docs/security.md built by
the function that document is generated from (:func:`kvroute.core.redis_schema.acl_rules`)."""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvroute.core.redis_conn import RedisAccess, connect
from kvroute.core.redis_schema import RedisKeys, acl_rules
from kvroute.router.app import RouterApp
from kvroute.router.mirror import IndexMirror
from kvroute.router.registry import WorkerRegistry
from kvroute.worker_agent.server import AgentApp
from tests.conftest import agent_config, router_config
from tests.support import RedisProc, free_port, generate, wait_for

KEYS = RedisKeys("default")
ROUTER_PW = "r0uter-s3cret-pw"
AGENT_PW = {"a": "agent-a-pw-4x9", "b": "agent-b-pw-7q2"}


def openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("openssl not found: apt-get install openssl")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.crt", cwd=d)


def make_cert(d: Path, ca: str, name: str, san: str) -> None:
    """``name``.crt / ``name``.key signed by ``ca``, valid for ``san``."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
            cwd=d)


@dataclass
class TlsRedis:
    proc: RedisProc
    tls_port: int
    certs: Path

    def url(self, user: str = "", password: str = "") -> str:
        cred = f"{user}:{password}@" if user else ""
        return f"rediss://{cred}127.0.0.1:{self.tls_port}/0"

    def files(self, **kw: object) -> dict[str, object]:
        """Config fields for CA and client certificate (mutual TLS is required)."""
        c = self.certs
        return {"redis_ca_file": str(c / "ca.crt"), "redis_cert_file": str(c / "client.crt"),
                "redis_key_file": str(c / "client.key"), **kw}

    def admin(self) -> redis.Redis:
        return self.proc.client()  # the plaintext port, default user: for the test only


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TlsRedis]:
    certs = tmp_path / "certs"
    certs.mkdir()
    make_ca(certs, "ca")
    make_ca(certs, "otherca")
    make_cert(certs, "ca", "server", "IP:127.0.0.1,DNS:localhost")
    make_cert(certs, "ca", "client", "DNS:kvroute-client")
    tls_port = free_port()
    proc = RedisProc(extra=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.crt"),
        "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"),
        "--tls-auth-clients", "yes"])
    proc.start()
    admin = proc.client()
    # The least ACLs, exactly as docs/security.md gives them: one user per agent, one router.
    for w, pw in AGENT_PW.items():
        admin.execute_command("ACL", "SETUSER", f"kvr-agent-{w}", "reset", "on", f">{pw}",
                              *acl_rules("agent", "default", w))
    admin.execute_command("ACL", "SETUSER", "kvr-router", "reset", "on", f">{ROUTER_PW}",
                          *acl_rules("router", "default"))
    admin.execute_command("ACL", "LOG", "RESET")
    admin.close()
    try:
        yield TlsRedis(proc, tls_port, certs)
    finally:
        proc.stop()


@pytest.fixture
async def started() -> AsyncIterator[list[AgentApp | RouterApp]]:
    apps: list[AgentApp | RouterApp] = []
    yield apps
    for app in reversed(apps):
        await app.stop(grace_s=0.5)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(n)]


async def test_agents_and_router_route_by_cache_over_tls_with_the_least_acl(
        tls_redis: TlsRedis, started: list, tmp_path: Path, monkeypatch, caplog) -> None:
    # Three ways to give a password: the URL, the environment and a mounted file.
    monkeypatch.setenv("KVROUTE_REDIS_PASSWORD", AGENT_PW["b"])
    from kvroute.core.config import AgentConfig
    from kvroute.core.settings import from_env

    pw_file = tmp_path / "agent-a-password"
    pw_file.write_text(AGENT_PW["a"] + "\n")  # as `echo` or a Secret written by hand leaves it
    caplog.set_level(logging.DEBUG)
    a = AgentApp(agent_config(tls_redis.url(), "a", **tls_redis.files(
        redis_username="kvr-agent-a", redis_password_file=str(pw_file))))
    b = AgentApp(from_env(AgentConfig, redis=tls_redis.url(), port=0, worker_id="b",
                          time_scale=0.0, heartbeat_s=0.1, heartbeat_ttl_s=1.0,
                          redis_username="kvr-agent-b", **tls_redis.files()))
    assert b.cfg.redis.password == AGENT_PW["b"]
    for app in (a, b):
        await app.start()
        started.append(app)
    router = RouterApp(router_config(tls_redis.url("kvr-router", ROUTER_PW),
                                     **tls_redis.files()))
    await router.start(wait_for_redis_s=5.0)
    started.append(router)
    assert router.mirror.available, router.mirror.last_error
    await wait_for(lambda: len(router.registry.loads) == 2, what="both agents joined over TLS")
    system = prompt(1024, 1)
    first = await generate(router.port, system + prompt(50, 2))
    w = first[0].worker_id
    await wait_for(lambda: router.mirror.index.count(w) >= 1024 // 16,
                   what="the agent's feed reached the router over TLS")
    second = await generate(router.port, system + prompt(80, 3))
    assert second[0].worker_id == w and second[0].cached_tokens >= 1024
    # Nothing kvroute sent was denied, clean stops included: the ACL is enough, not only
    # not too much.
    for app in reversed(started):
        await app.stop(grace_s=0.5)
    started.clear()
    admin = tls_redis.admin()
    assert admin.execute_command("ACL", "LOG") == []
    assert admin.get(KEYS.heartbeat("a")) is None  # its clean stop deleted its heartbeat
    admin.close()
    # No password in any log line, the router's start line included (which shows the URL).
    text = "\n".join(f"{r.getMessage()} {getattr(r, 'kv', '')}" for r in caplog.records)
    assert f"rediss://kvr-router:***@127.0.0.1:{tls_redis.tls_port}/0" in text  # start line
    for pw in (ROUTER_PW, *AGENT_PW.values()):
        assert pw not in text
    assert AGENT_PW["b"] not in repr(b.cfg)


def acl_client(tls: TlsRedis, user: str, password: str) -> redis.Redis:
    c = tls.certs
    return redis.Redis(host="127.0.0.1", port=tls.tls_port, ssl=True, username=user,
                       password=password, ssl_ca_certs=str(c / "ca.crt"),
                       ssl_certfile=str(c / "client.crt"), ssl_keyfile=str(c / "client.key"))


def test_the_acl_users_can_do_their_job_and_nothing_else(tls_redis: TlsRedis) -> None:
    agent = acl_client(tls_redis, "kvr-agent-a", AGENT_PW["a"])
    router = acl_client(tls_redis, "kvr-router", ROUTER_PW)
    agent.set(KEYS.heartbeat("a"), "{}", px=1000)  # its own keys: allowed
    agent.sadd(KEYS.snapshot("a"), b"\x00" * 8)
    agent.xadd(KEYS.feed, {"w": "a", "e": "e", "s": 1, "op": "clear"})
    assert router.smembers(KEYS.snapshot("a")) == {b"\x00" * 8}
    # Heartbeats are read-only to other agents (a placement goes only to a live worker).
    assert agent.get(KEYS.heartbeat("a")) == b"{}"
    denied = [
        (agent, lambda c: c.flushall()),
        (agent, lambda c: c.config_get("*")),
        (agent, lambda c: c.set(KEYS.heartbeat("b"), "{}")),  # another agent's heartbeat
        (agent, lambda c: c.sadd(KEYS.snapshot("b"), b"\x01" * 8)),  # its snapshot
        (agent, lambda c: c.hset(KEYS.meta("b"), "seq", 9)),  # its meta
        (agent, lambda c: c.set("kvr:{other}:hb:a", "{}")),  # another model's keys
        (agent, lambda c: c.get("kvr:{other}:hb:a")),  # ... nor another model's heartbeats
        (agent, lambda c: c.delete(KEYS.meta("b"))),  # nor delete another agent's state
        (agent, lambda c: c.publish("ch", "x")),
        (agent, lambda c: c.eval("return 1", 0)),
        (router, lambda c: c.flushall()),
        (router, lambda c: c.config_set("requirepass", "x")),
        (router, lambda c: c.xadd(KEYS.feed, {"w": "a", "e": "e", "s": 2, "op": "clear"})),
        (router, lambda c: c.set(KEYS.heartbeat("evil"), "{}")),  # routers register no one
        (router, lambda c: c.delete(KEYS.heartbeat("a"))),  # ... nor forget anyone
        (router, lambda c: c.delete(KEYS.snapshot("a"))),
        (router, lambda c: c.eval("return 1", 0)),  # scripts only read-only (EVAL_RO)
        (router, lambda c: c.get("kvr:{other}:hb:a")),
        (router, lambda c: c.keys("*")),
    ]
    for client, call in denied:
        with pytest.raises(redis.exceptions.NoPermissionError):
            call(client)
    agent.close()
    router.close()


# Each command the agent ACL grants, as an agent's client sends it against ``key``.
AGENT_CALLS = {
    "+set": lambda c, key: c.set(key, "{}"),
    "+sadd": lambda c, key: c.sadd(key, b"\x01" * 8),
    "+srem": lambda c, key: c.srem(key, b"\x01" * 8),
    "+scard": lambda c, key: c.scard(key),
    "+del": lambda c, key: c.delete(key),
    "+hget": lambda c, key: c.hget(key, "epoch"),
    "+hset": lambda c, key: c.hset(key, "seq", 9),
    "+xadd": lambda c, key: c.xadd(key, {"w": "b", "e": "x", "s": 1, "op": "clear"},
                                   maxlen=0),
    "+get": lambda c, key: c.get(key),
    "+pexpire": lambda c, key: c.pexpire(key, 1),
}


def test_an_agent_credential_reaches_no_other_workers_keys(tls_redis: TlsRedis) -> None:
    """Every command the per-worker agent user has, against every key of another worker
    and every shared key of the model (and another model's): Redis refuses all but reading
    another's heartbeat and appending to the feed (docs/security.md says what those allow).
    The command list is the ACL's own, so a command granted later is tried here too."""
    from kvroute.core.redis_schema import _ACL_AGENT

    assert set(AGENT_CALLS) == set(_ACL_AGENT), "try every command the agent ACL grants"
    agent = acl_client(tls_redis, "kvr-agent-a", AGENT_PW["a"])
    other = {"snapshot": KEYS.snapshot("b"), "lower": KEYS.lower("b"), "meta": KEYS.meta("b"),
             "heartbeat": KEYS.heartbeat("b"), "feed": KEYS.feed, "decisions": KEYS.decisions,
             "other model": "kvr:{other}:hb:a", "unknown": "kvr:{default}:workers"}
    allowed = {("+get", "heartbeat"), ("+xadd", "feed")}
    granted: set[tuple[str, str]] = set()
    for command, call in AGENT_CALLS.items():
        for name, key in other.items():
            try:
                call(agent, key)
            except redis.exceptions.NoPermissionError:
                continue
            except redis.exceptions.ResponseError:
                pass  # past the ACL (a wrong type, say): granted
            granted.add((command, name))
    assert granted == allowed
    # Nor in a transaction: one denied command fails the whole of it, nothing is applied.
    tls_redis.proc.client().set(KEYS.heartbeat("b"), "b's", px=60_000)
    pipe = agent.pipeline(transaction=True)
    pipe.set(KEYS.heartbeat("a"), "{}")
    pipe.delete(KEYS.heartbeat("b"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        pipe.execute()
    assert tls_redis.proc.client().get(KEYS.heartbeat("b")) == b"b's"
    agent.close()


async def run_mirror(url: str, access: RedisAccess) -> tuple[IndexMirror, asyncio.Task[None]]:
    m = IndexMirror(connect(url, block_timeout_s=0.05, access=access), KEYS,
                    WorkerRegistry({}, 16), poll_interval_s=0.05, retry_s=0.1)
    return m, asyncio.create_task(m.run())


async def test_a_server_certificate_from_another_ca_is_refused_clearly(
        tls_redis: TlsRedis, caplog) -> None:
    c = tls_redis.certs
    access = RedisAccess("kvr-router", ROUTER_PW, str(c / "otherca.crt"), str(c / "client.crt"),
                         str(c / "client.key"))
    m, task = await run_mirror(tls_redis.url(), access)
    await wait_for(lambda: m.last_error != "", what="the handshake failed")
    await asyncio.sleep(0.3)
    await m.stop(task)
    assert not m.available and not m.ready.is_set()
    assert m.last_error.startswith(f"TLS with redis at 127.0.0.1:{tls_redis.tls_port} failed")
    assert "certificate verify failed" in m.last_error.lower()
    logged = [r for r in caplog.records if "TLS with redis" in r.getMessage()]
    assert len(logged) == 1  # said at start, once, not at every retry


async def test_a_server_certificate_for_another_name_is_refused(tls_redis: TlsRedis) -> None:
    c = tls_redis.certs
    make_cert(c, "ca", "elsewhere", "DNS:redis.elsewhere.example")  # right CA, wrong name
    tls_port = free_port()
    other = RedisProc(extra=["--tls-port", str(tls_port), "--tls-cert-file",
                             str(c / "elsewhere.crt"), "--tls-key-file", str(c / "elsewhere.key"),
                             "--tls-ca-cert-file", str(c / "ca.crt"), "--tls-auth-clients", "no"])
    other.start()
    try:
        m, task = await run_mirror(f"rediss://127.0.0.1:{tls_port}/0",
                                   RedisAccess(ca_file=str(c / "ca.crt")))
        await wait_for(lambda: m.last_error != "", what="the handshake failed")
        await m.stop(task)
    finally:
        other.stop()
    assert not m.ready.is_set()
    assert m.last_error.startswith("TLS with redis"), m.last_error
    assert "IP address mismatch" in m.last_error or "hostname" in m.last_error, m.last_error


async def test_no_client_certificate_is_refused(tls_redis: TlsRedis) -> None:
    access = RedisAccess("kvr-router", ROUTER_PW, str(tls_redis.certs / "ca.crt"))
    m, task = await run_mirror(tls_redis.url(), access)
    await wait_for(lambda: m.last_error != "", what="the server refused the handshake")
    await m.stop(task)
    assert not m.ready.is_set()


async def test_a_wrong_password_is_reported_as_refused_credentials(
        tls_redis: TlsRedis, caplog) -> None:
    c = tls_redis.certs
    access = RedisAccess("kvr-router", "not-the-password", str(c / "ca.crt"),
                         str(c / "client.crt"), str(c / "client.key"))
    m, task = await run_mirror(tls_redis.url(), access)
    await wait_for(lambda: m.last_error != "", what="the login failed")
    await m.stop(task)
    assert m.last_error.startswith(f"redis at 127.0.0.1:{tls_redis.tls_port} refused the "
                                   "credentials for user kvr-router: WRONGPASS"), m.last_error
    [rec] = [r for r in caplog.records if "refused the credentials" in r.getMessage()]
    assert rec.levelno == logging.ERROR and "not-the-password" not in rec.getMessage()


async def test_an_acl_that_denies_a_command_is_reported_as_such(tls_redis: TlsRedis) -> None:
    admin = tls_redis.admin()
    admin.execute_command("ACL", "SETUSER", "kvr-agent-only", "reset", "on", ">pw",
                          *acl_rules("agent", "default"))
    admin.close()
    c = tls_redis.certs
    access = RedisAccess("kvr-agent-only", "pw", str(c / "ca.crt"), str(c / "client.crt"),
                         str(c / "client.key"))
    m, task = await run_mirror(tls_redis.url(), access)  # a router with an agent's ACL
    await wait_for(lambda: m.last_error != "", what="the first read was denied")
    await m.stop(task)
    assert "denied user kvr-agent-only a command or key" in m.last_error
    assert "NOPERM" in m.last_error or "permission" in m.last_error


async def test_routing_over_a_redis_cluster_with_tls_and_acl_users(
        tmp_path: Path, started: list) -> None:
    """rediss+cluster://: three TLS cluster nodes (cluster bus over TLS too), the same least
    ACL users on every node, agents and a router routing through them."""
    from tests.e2e.test_redis_cluster import cluster_port, redis_cli

    certs = tmp_path / "certs"
    certs.mkdir()
    make_ca(certs, "ca")
    make_cert(certs, "ca", "server", "IP:127.0.0.1,DNS:localhost")
    make_cert(certs, "ca", "client", "DNS:kvroute-client")
    tls = ["--tls-cert-file", str(certs / "server.crt"), "--tls-key-file",
           str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt")]
    nodes: list[tuple[RedisProc, int]] = []
    try:
        for _ in range(3):
            tport = cluster_port()  # its bus port (tport + 10000) is free too
            n = RedisProc(extra=["--tls-port", str(tport), *tls, "--tls-cluster", "yes",
                                 "--cluster-enabled", "yes", "--cluster-config-file",
                                 f"nodes-{tport}.conf", "--dir", str(tmp_path)])
            n.start()
            nodes.append((n, tport))
        cli_tls = ["--tls", "--cacert", str(certs / "ca.crt"), "--cert",
                   str(certs / "client.crt"), "--key", str(certs / "client.key")]
        subprocess.run([redis_cli(), *cli_tls, "--cluster", "create",
                        *(f"127.0.0.1:{t}" for _, t in nodes), "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        for n, _ in nodes:  # ACL users are per node
            admin = n.client()
            for w in ("a", "b"):
                admin.execute_command("ACL", "SETUSER", f"kvr-agent-{w}", "reset", "on",
                                      f">{AGENT_PW[w]}", *acl_rules("agent", "default", w))
            admin.execute_command("ACL", "SETUSER", "kvr-router", "reset", "on",
                                  f">{ROUTER_PW}", *acl_rules("router", "default"))
            await wait_for(lambda a=admin: a.execute_command("CLUSTER", "INFO").decode()
                           .find("cluster_state:ok") >= 0, 20, "cluster state ok")
            admin.close()
        url = f"rediss+cluster://127.0.0.1:{nodes[1][1]}"
        files = {"redis_ca_file": str(certs / "ca.crt"),
                 "redis_cert_file": str(certs / "client.crt"),
                 "redis_key_file": str(certs / "client.key")}
        for w in ("a", "b"):
            app = AgentApp(agent_config(url, w, redis_username=f"kvr-agent-{w}",
                                        redis_password=AGENT_PW[w], **files))
            await app.start()
            started.append(app)
        router = RouterApp(router_config(url, redis_username="kvr-router",
                                         redis_password=ROUTER_PW, **files))
        await router.start(wait_for_redis_s=10.0)
        started.append(router)
        await wait_for(lambda: len(router.registry.loads) == 2, 15, "workers via the cluster")
        system = prompt(1024, 7)
        first = await generate(router.port, system + prompt(30, 8))
        w = first[0].worker_id
        await wait_for(lambda: router.mirror.index.count(w) >= 64, 10, "feed over TLS cluster")
        second = await generate(router.port, system + prompt(40, 9))
        assert second[0].worker_id == w and second[0].cached_tokens >= 1024
        for n, _ in nodes:
            admin = n.client()
            assert admin.execute_command("ACL", "LOG") == []
            admin.close()
    finally:
        for app in reversed(started):
            await app.stop(grace_s=0.5)
        started.clear()
        for n, _ in nodes:
            n.stop()


async def test_an_agent_with_a_wrong_password_says_so(tls_redis: TlsRedis, started: list,
                                                      caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvroute")
    app = AgentApp(agent_config(tls_redis.url(), "a", redis_username="kvr-agent-a",
                                redis_password="wrong-agent-pw", **tls_redis.files()))
    await app.start()
    started.append(app)
    await wait_for(lambda: "refused the credentials" in caplog.text, what="the agent's warning")
    assert (f"redis at 127.0.0.1:{tls_redis.tls_port} refused the credentials for user "
            "kvr-agent-a: WRONGPASS") in caplog.text
    assert "wrong-agent-pw" not in caplog.text
