"""The chart's hardening (issue 38): NetworkPolicies on by default and selecting the right
pods and ports, a locked-down securityContext on every container, the built-in Redis over
TLS with ACL users whose passwords never reach a command line (the ACL file its init
container writes is loaded by a real redis-server here), and gRPC reflection off."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.core.redis_schema import RedisKeys
from kvroute.core.settings import from_env
from tests.helm.chart import (
    CHART,
    CI_VALUES,
    Manifests,
    container,
    env_of,
    flag,
    pod_spec,
    template,
)
from tests.support import free_port, redis_binary, stop_process

HARDENED = CHART / "ci" / "hardened-values.yaml"
MODEL = "Qwen/Qwen2.5-7B-Instruct"


@pytest.fixture(scope="module")
def hardened(helm: Path) -> Manifests:
    return Manifests.parse(template(helm, HARDENED))


@pytest.fixture(scope="module")
def defaults(helm: Path) -> Manifests:
    return Manifests.parse(template(helm))


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"]["labels"]


def peers_allowed(pol: dict[str, Any], port: int, pod: dict[str, str],
                  ns: dict[str, str] | None = None) -> bool:
    """Whether ``pol`` lets a pod with labels ``pod`` (in a namespace labelled ``ns``; None:
    the policy's own) reach ``port``."""
    for rule in pol["spec"]["ingress"]:
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for p in peers:
            nsel = p.get("namespaceSelector")
            if nsel is None and ns is not None:
                continue  # a bare podSelector: the policy's namespace only
            if nsel is not None and (ns is None or not nsel["matchLabels"].items() <= ns.items()):
                continue
            if "podSelector" in p and not p["podSelector"]["matchLabels"].items() <= pod.items():
                continue
            return True
    return False


def policies(m: Manifests) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"].rsplit("-", 1)[-1]: p for p in m.of("NetworkPolicy")}


@pytest.mark.parametrize("which", ["defaults", "hardened"])
def test_network_policies_are_on_and_select_the_right_pods_and_ports(
        which: str, request: pytest.FixtureRequest) -> None:
    m: Manifests = request.getfixturevalue(which)
    pols = policies(m)
    assert set(pols) == {"worker", "router", "redis"}  # on by default
    router, worker = labels(m.one("Deployment", "-router")), labels(m.one("StatefulSet", "-worker"))
    redis_pod = labels(m.one("StatefulSet", "-redis"))
    stranger = {"app": "something-else"}
    for name, pod in (("worker", worker), ("router", router), ("redis", redis_pod)):
        assert pols[name]["spec"]["podSelector"]["matchLabels"].items() <= pod.items()
        assert pols[name]["spec"]["policyTypes"] == ["Ingress"]
    w = pols["worker"]
    # Agents: gRPC from routers and agents (a program's overflow), nobody else.
    assert peers_allowed(w, 50061, router) and peers_allowed(w, 50061, worker)
    assert not peers_allowed(w, 50061, stranger) and not peers_allowed(w, 50061, redis_pod)
    assert not peers_allowed(w, 50061, router, ns={"kubernetes.io/metadata.name": "other"})
    assert not peers_allowed(w, 8000, router)  # vLLM stays private to its pod
    r = pols["redis"]
    assert peers_allowed(r, 6379, router) and peers_allowed(r, 6379, worker)
    assert not peers_allowed(r, 6379, stranger)
    rt = pols["router"]
    apps, monitoring = ({"kubernetes.io/metadata.name": n} for n in ("apps", "monitoring"))
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    if which == "defaults":  # API and metrics ports open; no health ports without TLS
        for port in (50051, 8000, 9100):
            assert peers_allowed(rt, port, stranger)
        assert peers_allowed(w, 9101, stranger)
        assert not peers_allowed(rt, 50052, stranger) and not peers_allowed(w, 50062, stranger)
    else:  # the API from routerFrom, metrics from metricsFrom only
        for port in (50051, 8000):
            assert peers_allowed(rt, port, stranger, ns=apps)
            assert not peers_allowed(rt, port, stranger)
        for pol, port in ((rt, 9100), (w, 9101)):
            assert peers_allowed(pol, port, prometheus, ns=monitoring)
            assert not peers_allowed(pol, port, stranger, ns=monitoring)
            assert not peers_allowed(pol, port, prometheus, ns=apps)
        # The plaintext health ports the probes use (for CNIs that police the node).
        assert peers_allowed(rt, 50052, stranger) and peers_allowed(w, 50062, stranger)
        c = container(m.one("StatefulSet", "-worker"), "agent")
        assert c["readinessProbe"]["grpc"]["port"] == 50062


def every_container(m: Manifests) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, container, pod spec) of every container and init container rendered."""
    out = []
    for obj in m.docs:
        spec = obj["spec"] if obj["kind"] == "Pod" else \
            obj.get("spec", {}).get("template", {}).get("spec")
        if not isinstance(spec, dict) or "containers" not in spec:
            continue
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            out.append((f"{obj['metadata']['name']}/{c['name']}", c, spec))
    return out


@pytest.mark.parametrize("values", [*CI_VALUES, HARDENED],
                         ids=[p.name for p in [*CI_VALUES, HARDENED]])
def test_every_container_is_locked_down(helm: Path, values: Path) -> None:
    m = Manifests.parse(template(helm, values))
    found = every_container(m)
    assert found
    for name, c, spec in found:
        sc = c.get("securityContext")
        assert sc, f"{name}: no securityContext"
        assert sc["allowPrivilegeEscalation"] is False, name
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
        assert sc["readOnlyRootFilesystem"] is True, name
        seccomp = sc.get("seccompProfile") or spec.get("securityContext", {}).get(
            "seccompProfile")
        assert seccomp == {"type": "RuntimeDefault"}, name
        non_root = sc.get("runAsNonRoot", spec.get("securityContext", {}).get("runAsNonRoot"))
        # vLLM's and SGLang's images run as root (the chart's README); nothing else does.
        assert non_root is True or name.endswith(("/vllm", "/sglang")), name
        assert not sc.get("privileged"), name


def test_vllm_caches_go_to_writable_volumes(defaults: Manifests) -> None:
    sts = defaults.one("StatefulSet", "-worker")
    c = container(sts, "vllm")
    mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    assert "emptyDir" in vols[mounts["/tmp"]] and "emptyDir" in vols[mounts["/dev/shm"]]
    env = env_of(c)
    for var in ("XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR",
                "TORCHINDUCTOR_CACHE_DIR", "VLLM_CONFIG_ROOT"):
        assert env[var].startswith("/tmp/"), var
    assert env["HF_HOME"] in mounts


def test_reflection_is_off_in_the_chart_and_can_be_turned_on(helm: Path,
                                                             defaults: Manifests) -> None:
    on = Manifests.parse(template(helm, sets=("grpcReflection=true",)))
    for m, want in ((defaults, False), (on, True)):
        for obj, name, cls in ((m.one("Deployment", "-router"), "router", RouterConfig),
                               (m.one("StatefulSet", "-worker"), "agent", AgentConfig)):
            env = {k: v for k, v in env_of(container(obj, name)).items() if isinstance(v, str)}
            assert from_env(cls, env).listen.grpc_reflection is want
    assert RouterConfig.of().listen.grpc_reflection is True  # the CLI keeps grpcurl working


# -- the built-in Redis: TLS, ACL users, passwords only in Secrets --------------------------


def test_builtin_redis_serves_tls_and_the_parts_verify_it(hardened: Manifests) -> None:
    redis_sts = hardened.one("StatefulSet", "-redis")
    rc = container(redis_sts, "redis")
    args = rc["args"]
    assert flag(args, "--port") == "0" and flag(args, "--tls-port") == "6379"
    assert flag(args, "--tls-auth-clients") == "yes"
    mounts = {v["mountPath"]: v["name"] for v in rc["volumeMounts"]}
    vols = {v["name"]: v for v in pod_spec(redis_sts)["volumes"]}
    for f in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file"):
        secret = vols[mounts[str(Path(flag(args, f)).parent)]]["secret"]["secretName"]
        assert secret == "rel-kvroute-redis-tls"
    (cert,) = [c for c in hardened.of("Certificate")
               if c["spec"]["secretName"] == "rel-kvroute-redis-tls"]
    assert "rel-kvroute-redis" in cert["spec"]["dnsNames"]
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    assert "--tls" in rc["readinessProbe"]["exec"]["command"]
    for obj, name, cls in ((hardened.one("Deployment", "-router"), "router", RouterConfig),
                           (hardened.one("StatefulSet", "-worker"), "agent", AgentConfig)):
        c = container(obj, name)
        env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
        cfg = from_env(cls, env)
        assert cfg.redis.url == "rediss://rel-kvroute-redis:6379/0"
        assert cfg.redis.username == name
        pmounts = {v["mountPath"] for v in c["volumeMounts"]}
        for path in (cfg.redis.ca_file, cfg.redis.cert_file, cfg.redis.key_file):
            assert str(Path(path).parent) in pmounts  # their own TLS Secret (same CA)


def test_tls_without_a_redis_certificate_is_refused(helm: Path) -> None:
    from tests.helm.chart import RELEASE, run_helm

    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "tls.enabled=true",
                    "--set", "tls.routerSecret=r", "--set", "tls.agentSecret=a", check=False)
    assert proc.returncode != 0 and "redis.builtin.tls.secret" in proc.stderr


@pytest.mark.parametrize("which", ["defaults", "hardened"])
def test_no_password_on_a_command_line(which: str, request: pytest.FixtureRequest) -> None:
    m: Manifests = request.getfixturevalue(which)
    secret = m.one("Secret", "-redis")
    passwords = [base64.b64decode(v).decode() for v in secret["data"].values()]
    secret_envs = set()
    for _, c, _ in every_container(m):
        for e in c.get("env", []):
            if "secretKeyRef" in e.get("valueFrom", {}):
                secret_envs.add(e["name"])
    assert {"KVROUTE_REDIS_PASSWORD", "REDISCLI_AUTH", "ROUTER_PASSWORD"} <= secret_envs
    for name, c, _ in every_container(m):
        line = " ".join([*c.get("command", []), *c.get("args", [])])
        assert not any(p in line for p in passwords), name
        # The kubelet expands $(VAR) in arguments: a Secret's variable must not be named so.
        assert not any(f"$({v})" in line for v in secret_envs), name
        for e in c.get("env", []):
            assert not any(f"$({v})" in e.get("value", "") for v in secret_envs), name
    # ... and nowhere else in the rendered objects but the Secret itself.
    others = str([d for d in m.docs if d is not secret])
    assert not any(p in others for p in passwords)


def test_the_acl_file_the_init_container_writes_works_in_a_real_redis(
        defaults: Manifests, tmp_path: Path) -> None:
    """Run the init container's script (the real `kvroute redis-acl`), start redis-server
    with the ACL file it wrote, and log in as each user: each may do what its part does,
    and no more."""
    sts = defaults.one("StatefulSet", "-redis")
    (init,) = pod_spec(sts)["initContainers"]
    script = init["args"][0].replace("/run/redis", str(tmp_path))
    pw = {"ADMIN_PASSWORD": "admin-pw", "ROUTER_PASSWORD": "router pw", "AGENT_PASSWORD": "a#g"}
    assert {e["name"] for e in init["env"]} == set(pw)
    env = {**os.environ, **pw, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run([*init["command"], script], env=env, check=True, timeout=60)
    acl = (tmp_path / "users.acl").read_text()
    assert not (tmp_path / "users.acl.new").exists()
    assert not any(p in acl for p in pw.values())  # hashes only
    assert flag(container(sts, "redis")["args"], "--aclfile") == "/run/redis/users.acl"
    port = free_port()
    proc = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no",
                             "--aclfile", str(tmp_path / "users.acl")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def login(user: str, password: str) -> redis.Redis:
            c = redis.Redis(port=port, username=user, password=password,
                            socket_connect_timeout=0.5)
            for _ in range(100):
                try:
                    c.execute_command("MULTI")  # allowed to every role; a login check
                    c.execute_command("DISCARD")
                    return c
                except redis.ConnectionError:
                    if proc.poll() is not None:
                        raise
                    import time

                    time.sleep(0.05)
            raise AssertionError("redis-server did not come up")

        admin = login("default", "admin-pw")
        assert admin.ping()
        keys = RedisKeys(MODEL)
        agent = login("agent", "a#g")
        agent.xadd(keys.feed, {"e": "1"})
        agent.set(keys.heartbeat("rel-kvroute-worker-0"), "{}")
        with pytest.raises(redis.exceptions.NoPermissionError):
            agent.xread({keys.feed: "0"})  # reading the feed is the router's
        with pytest.raises(redis.exceptions.NoPermissionError):
            agent.set("kvr:{other-model}:hb:x", "{}")  # another model's keys
        router = login("router", "router pw")
        assert router.xrevrange(keys.feed, count=1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            router.xadd(keys.feed, {"e": "forged"})  # routers never write the feed
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, username="router", password="wrong").ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port).ping()  # no anonymous access: default needs its password
    finally:
        stop_process(proc)
