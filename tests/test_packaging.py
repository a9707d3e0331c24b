"""The installable artefacts: the wheel the Dockerfile installs, and the Dockerfile against the
Helm chart that runs its image.

No Docker engine runs here, so the image itself is not built: the wheel is built the way the
Dockerfile's build stage builds it (``pip wheel``), unpacked, and run on its own (every module
imported from it, its C builds loaded, its commands answering); the Dockerfile is read for
what the chart relies on (user, command, extras, ports) and for files it copies."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def test_the_wheel_holds_the_c_builds_the_stubs_and_the_command(wheel: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert wheel.name.startswith(f"kvroute-{version}-cp{sys.version_info.major}"
                                 f"{sys.version_info.minor}-")
    names = zipfile.ZipFile(wheel).namelist()
    built = {re.sub(r"\..*", "", Path(n).name) for n in names if n.endswith(".so")}
    assert built == {"_chainhash", "_holders", "_wire", "_costs"}
    for stub in ("common_pb2.py", "router_pb2_grpc.py", "worker_agent_pb2_grpc.py",
                 "program_pb2.py"):
        assert f"kvroute/v1/{stub}" in names
    assert "kvroute/simulations/replay.py" in names  # kvroute replay / gen
    # kvroute's mask plugin, which vLLM loads from its own environment (docs/engines.md)
    assert "kvroute/worker_agent/engines/vllm/plugin/kvroute_vllm_mask.py" in names
    # kvroute epp's Envoy ext_proc stubs, under kvroute.envoy_api (scripts/envoy_stubs.py)
    assert "kvroute/envoy_api/envoy/service/ext_proc/v3/external_processor_pb2_grpc.py" in names
    assert "kvroute/envoy_api/validate/validate_pb2.pyi" in names
    entry = zipfile.ZipFile(wheel).read(
        f"kvroute-{version}.dist-info/entry_points.txt").decode()
    assert re.search(r"^kvroute = kvroute\.cli:main$", entry, re.M)


def test_the_unpacked_wheel_runs_on_its_own(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = """
import importlib, json, pkgutil
import kvroute
from kvroute.core.native import native_builds
mods = [m.name for p in (kvroute,)
        for m in pkgutil.walk_packages(p.__path__, p.__name__ + ".")
        if not m.name.endswith("__main__")]
files = [importlib.import_module(m).__file__ for m in mods]
print(json.dumps({"mods": len(mods), "files": files, "native": native_builds()}))
"""
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["mods"] > 60
    # Every module came from the wheel, not from the source tree.
    assert all(f.startswith(str(site)) for f in got["files"] if f), got["files"][:3]
    assert got["native"] == {"chainhash": True, "holders": True, "wire": True, "costs": True}
    for command in ("router", "epp", "agent", "replay"):
        run = subprocess.run([sys.executable, "-m", "kvroute", command, "--help"], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert f"kvroute {command}" in run.stdout


def dockerfile() -> str:
    return DOCKERFILE.read_text()


def test_the_dockerfile_runs_the_image_as_the_chart_expects() -> None:
    text = dockerfile()
    helpers = (ROOT / "helm/kvroute/templates/_helpers.tpl").read_text()
    ctx = re.search(r'define "kvroute.containerSecurityContext".*?end', helpers, re.S)
    assert ctx is not None
    uid = re.search(r"runAsUser: (\d+)", ctx.group(0))
    gid = re.search(r"runAsGroup: (\d+)", ctx.group(0))
    assert uid and gid
    # The chart's pods run as non-root with this UID/GID: the image's user must be it.
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users[-1] == f"{uid.group(1)}:{gid.group(1)}"
    # The chart runs `kvroute router` / `kvroute agent` with command ["kvroute"].
    for template in ("router/deployment.yaml", "workers/statefulset.yaml"):
        assert 'command: ["kvroute"]' in (ROOT / "helm/kvroute/templates" / template).read_text()
    assert re.findall(r"^ENTRYPOINT (.*)$", text, re.M)[-1] == '["kvroute"]'
    # The chart's default discovery watches pods: the kubernetes extra must be installed.
    values = yaml.safe_load((ROOT / "helm/kvroute/values.yaml").read_text())
    assert values["router"]["discovery"] == "kubernetes"
    # ... and router.modelSource (router and agents load the model's tokenizer) the models one.
    assert '"kvroute[kubernetes,models]"' in text and '".[kubernetes,models]"' in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {"kubernetes", "models"} <= set(extras)
    # The ports the chart's containers listen on are the ones the image declares.
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.*)$", text, re.M)
               for p in line.split()}
    agent = values["workers"]["agent"]
    assert exposed == {values["router"]["grpcPort"], values["router"]["metricsPort"],
                       agent["grpcPort"], agent["metricsPort"]}
    # `make image` tags it as the chart pulls it by default: repository:appVersion.
    chart = yaml.safe_load((ROOT / "helm/kvroute/Chart.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    make = subprocess.run(["make", "--no-print-directory", "-n", "image"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30, check=True)
    tag = f"{values['image']['repository']}:{chart['appVersion']}"
    assert make.stdout.strip() == f"docker build -t {tag} ."
    # `make image-smoke` runs that tag as the chart runs it: its user, a read-only root.
    smoke = subprocess.run(["make", "--no-print-directory", "-n", "image-smoke"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=30, check=True)
    assert smoke.stdout.strip() == f"scripts/image_smoke.sh {tag}"
    script = (ROOT / "scripts/image_smoke.sh").read_text()
    assert f"--user {uid.group(1)}:{gid.group(1)}" in script
    assert "readOnlyRootFilesystem: true" in ctx.group(0) and "--read-only" in script


def test_the_dockerfile_builds_from_files_that_exist() -> None:
    text = dockerfile()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "requires-python"]
    python = re.search(r"^ARG PYTHON=(\S+)$", text, re.M)
    assert python and requires == f">={python.group(1)}"
    copies = [line.split()[1:-1] for line in re.findall(r"^COPY (?!--from).*$", text, re.M)]
    assert copies
    ignored = (ROOT / ".dockerignore").read_text().split()
    for sources in copies:
        for src in sources:
            assert (ROOT / src).exists(), src
            assert src not in ignored, f"{src} is copied but .dockerignore drops it"
    # setup.py compiles these: they must be in the build context
    setup = (ROOT / "setup.py").read_text()
    sources = re.findall(r'sources=\["([^"]+)"\]', setup)
    include_dirs = re.findall(r'include_dirs=\["([^"]+)"\]', setup)
    assert sources and include_dirs
    for c in (*sources, *include_dirs):
        assert (ROOT / c).exists(), c
        assert any(c.startswith(src) for copied in copies for src in copied), c
