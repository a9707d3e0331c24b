"""Render the chart with the real helm binary and look inside what it renders."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.tools import ROOT

CHART = ROOT / "helm" / "kvroute"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "rel"
NAMESPACE = "kvr"


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120,
                          env={"HOME": "/tmp", "PATH": "/usr/bin:/bin",
                               "HELM_CACHE_HOME": "/tmp/kvroute-helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/kvroute-helm-config",
                               "HELM_DATA_HOME": "/tmp/kvroute-helm-data"})
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def template(helm: Path, *values: Path, sets: tuple[str, ...] = ()) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return run_helm(helm, *args).stdout


@dataclass
class Manifests:
    docs: list[dict[str, Any]]

    @classmethod
    def parse(cls, text: str) -> Manifests:
        return cls([d for d in yaml.safe_load_all(text) if d])

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [d for d in self.of(kind) if d["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {len(found)}"
        return found[0]

    def kinds(self) -> set[str]:
        return {d["kind"] for d in self.docs}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in pod_spec(obj)["containers"] if c["name"] == name]
    assert found, f"no container {name!r}"
    return found[0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion."""
    for k, v in env.items():
        value = value.replace(f"$({k})", v)
    return value


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return all(labels.get(k) == v for k, v in terms)


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} not in {args}"
    return args[args.index(name) + 1]


# Free-form maps documented as a whole (Kubernetes resource, probe, label and annotation maps).
WHOLE = {"resources", "probes", "labels", "annotations", "securityContext",
         "podSecurityContext"}


def leaf_keys(values: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of values.yaml leaves (maps that default to {} count as leaves)."""
    if isinstance(values, dict) and values and prefix.rsplit(".", 1)[-1] not in WHOLE:
        for k, v in values.items():
            yield from leaf_keys(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix
