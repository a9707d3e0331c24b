"""Generate the Python stubs of the vendored Envoy ext_proc protos (proto/envoy_api).

protoc writes ``from envoy.config.core.v3 import base_pb2``: the protos' own top-level
packages (envoy, udpa, xds, validate). Installed as top-level packages they would clash with
any other distribution of them (``validate`` is a common name), so the stubs live under
``kvroute.envoy_api`` and their imports are rewritten to say so. The proto files' names in
the descriptor pool stay upstream's (``envoy/config/core/v3/base.proto``): the wire and the
descriptors are Envoy's exactly.

    python scripts/envoy_stubs.py [--out DIR]   # default: proto/envoy_api (make proto)

tests/test_grpc_surface.py runs it into a temporary folder and compares: stale stubs fail.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "proto" / "envoy_api"
PACKAGE = "kvroute.envoy_api"
TOP = ("envoy", "udpa", "xds", "validate")
_IMPORT = re.compile(rf"^(from|import) ({'|'.join(TOP)})(\.| )", re.M)
# The module name the classes report (``__module__``), given to the builder as a string.
_MODULE = re.compile(rf"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')({'|'.join(TOP)})\.")


def protos() -> list[str]:
    return sorted(str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.proto"))


def rewrite(text: str) -> str:
    text = _IMPORT.sub(rf"\1 {PACKAGE}.\2\3", text)
    return _MODULE.sub(rf"\1{PACKAGE}.\2.", text)


def generate(out: Path) -> list[Path]:
    """Run protoc over every vendored proto into ``out``, rewrite the imports, and give each
    folder an ``__init__.py``; the files written, relative to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(SOURCE),
                    f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
                    *protos()], check=True)
    written = []
    for path in sorted(out.rglob("*_pb2*.py*")):
        text = path.read_text()
        if path.name.endswith("_pb2_grpc.py") and "Stub:" not in text:
            path.unlink()  # protoc writes one per file; only ext_proc has a service
            continue
        path.write_text(rewrite(text))
        written.append(path.relative_to(out))
    for folder in sorted({p.parent for p in out.rglob("*_pb2.py")}):
        while folder != out and folder.is_relative_to(out):
            init = folder / "__init__.py"
            if not init.exists():
                init.write_text("")
            if init.relative_to(out) not in written:
                written.append(init.relative_to(out))
            folder = folder.parent
    return sorted(written)


def packages(files: list[Path]) -> list[str]:
    """The dotted packages (for pyproject's list) the generated ``__init__.py`` files make."""
    return sorted(".".join([PACKAGE, *f.parent.parts]) for f in files
                  if f.name == "__init__.py")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=SOURCE)
    p.add_argument("--packages", action="store_true",
                   help="print the packages for pyproject.toml afterwards")
    args = p.parse_args()
    files = generate(args.out)
    if args.packages:
        print("\n".join(packages(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
