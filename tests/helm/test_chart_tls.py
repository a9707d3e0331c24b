"""The chart with TLS and API keys on (tls.*, router.apiKeys): what it renders validates
strictly, its environment is a valid kvroute config whose TLS files are where the Secrets
are mounted, and probes use the plaintext health ports."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.core.settings import from_env
from tests.helm.chart import (
    CHART,
    RELEASE,
    Manifests,
    container,
    env_of,
    expand,
    pod_spec,
    run_helm,
    template,
)
from tests.tools import kubernetes_validate

SETS = ("tls.enabled=true", "tls.routerSecret=router-tls", "tls.agentSecret=agent-tls",
        "redis.builtin.tls.secret=redis-tls", "router.apiKeys.secretName=api-keys",
        "tls.requireClientCerts=true")


@pytest.fixture(scope="module")
def rendered(helm: Path) -> str:
    return template(helm, sets=SETS)


def mounted_secret(obj: dict, c: dict, path: str) -> str:
    """The Secret whose volume is mounted at the directory holding ``path``."""
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v["secret"]["secretName"] for v in pod_spec(obj)["volumes"]
            if "secret" in v}
    return vols[mounts[str(Path(path).parent)]]


def test_tls_and_keys_render_a_valid_config(rendered: str, tmp_path: Path) -> None:
    m = Manifests.parse(rendered)
    for obj, name, cls, secret in (
            (m.one("Deployment", "-router"), "router", RouterConfig, "router-tls"),
            (m.one("StatefulSet", "-worker"), "agent", AgentConfig, "agent-tls")):
        c = container(obj, name)
        env = {k: expand(v, {"REDIS_PASSWORD": "pw"}) for k, v in env_of(c).items()
               if isinstance(v, str)}
        cfg = from_env(cls, env)
        for path in (cfg.tls.cert, cfg.tls.key, cfg.tls.ca, cfg.tls.client_ca):
            assert path and mounted_secret(obj, c, path) == secret
        assert cfg.tls.server_name == "kvroute-agent"
        health = cfg.listen.health_port
        assert health in (50052, 50062) and health != cfg.listen.port
        assert c["readinessProbe"]["grpc"]["port"] == health
        assert c["livenessProbe"]["grpc"]["port"] == health
        assert {"name": "health", "containerPort": health, "protocol": "TCP"} in c["ports"]
        if name == "agent":
            assert set(cfg.tls.allowed_sans.split(",")) == {"kvroute-router", "kvroute-agent"}
        else:
            assert mounted_secret(obj, c, cfg.auth.keys_file) == "api-keys"
            assert not any(m.get("subPath") for m in c["volumeMounts"])  # updates arrive
    path = tmp_path / "tls.yaml"
    path.write_text(rendered)
    proc = subprocess.run([kubernetes_validate(), "--strict", "--quiet", str(path)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR" not in out, out


def test_tls_without_its_secrets_is_refused(helm: Path) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "tls.enabled=true",
                    "--set", "tls.agentSecret=a", check=False)
    assert proc.returncode != 0 and "tls.enabled needs tls.routerSecret" in proc.stderr


def test_lint_strict_with_tls(helm: Path) -> None:
    args = ["lint", "--strict", str(CHART)]
    for s in SETS:
        args += ["--set", s]
    proc = run_helm(helm, *args, check=False)
    assert proc.returncode == 0 and "[WARNING]" not in proc.stdout, proc.stdout + proc.stderr


def test_cert_manager_certificates_are_the_secrets_mounted(helm: Path) -> None:
    m = Manifests.parse(template(helm, sets=("tls.enabled=true", "tls.certManager.enabled=true",
                                             "tls.certManager.issuerRef.name=kvroute-ca")))
    certs = {c["spec"]["secretName"]: c["spec"] for c in m.of("Certificate")}
    assert len(certs) == 3  # the built-in Redis's too (tests/helm/test_chart_hardening.py)
    for obj, name, san in ((m.one("Deployment", "-router"), "router", "kvroute-router"),
                           (m.one("StatefulSet", "-worker"), "agent", "kvroute-agent")):
        c = container(obj, name)
        secret = mounted_secret(obj, c, env_of(c)["KVROUTE_TLS_CERT"])
        spec = certs[secret]
        assert san in spec["dnsNames"] and {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["issuerRef"] == {"name": "kvroute-ca", "kind": "Issuer",
                                     "group": "cert-manager.io"}
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "tls.enabled=true",
                    "--set", "tls.certManager.enabled=true", check=False)
    assert proc.returncode != 0 and "issuerRef.name" in proc.stderr
