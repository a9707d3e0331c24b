"""SGLang's own KV-event code, for tests: ``sglang/srt/disaggregation/kv_events.py`` (its
structs *and* ``ZmqEventPublisher``) executed unmodified from the wheel of each release in
:data:`RELEASES`, without SGLang installed. Importing it needs two small parts of SGLang; only
those are stubbed, with what the publisher uses of them (nothing, on the paths these tests
take): ``sglang.srt.runtime_context.get_parallel`` and ``sglang.srt.utils.network
.NetworkAddress`` (0.5.23; 0.5.1 imports neither).

A wheel (~40 MB) is downloaded once per release with ``pip download --no-deps
sglang==VERSION``; only that file is kept, under ``.cache/sglang-VERSION/`` (gitignored).
``KVROUTE_SGLANG_SOURCES`` may name another directory holding such ``sglang-VERSION/`` trees,
to run offline."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

from tests.worker_agent.engines.vllm.vllm_wire import _exec, _stub

REPO = Path(__file__).resolve().parents[4]
KV_FILE = "sglang/srt/disaggregation/kv_events.py"
RELEASES = ("0.5.1", "0.5.23")
"""The oldest release whose publisher the tests run (August 2025: array events, no medium)
and the newest (October 2026: tagged maps with medium, cache_salt, lora_name)."""
_COMPLETE = ".kvroute-complete"


def sglang_sources(version: str, cache_dir: Path | None = None) -> Path:
    """A directory holding SGLang ``version``'s ``kv_events.py``; downloads the wheel the
    first time."""
    env = os.environ.get("KVROUTE_SGLANG_SOURCES")
    if env:
        root = Path(env) / f"sglang-{version}"
        if not (root / KV_FILE).is_file():
            raise RuntimeError(f"KVROUTE_SGLANG_SOURCES={env} lacks sglang-{version}/{KV_FILE}")
        return root
    root = (cache_dir or REPO / ".cache") / f"sglang-{version}"
    if (root / _COMPLETE).is_file():
        return root
    with tempfile.TemporaryDirectory(prefix="sglang-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", f"sglang=={version}", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob("sglang-*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(
                f"cannot download the SGLang {version} wheel for its kv_events.py "
                f"({' '.join(cmd)}): {res.stderr.strip()[-500:]}; set KVROUTE_SGLANG_SOURCES "
                "to a directory of unpacked sglang-VERSION trees to run these tests offline")
        with zipfile.ZipFile(wheels[0]) as zf:
            dest = root / KV_FILE
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(zf.read(KV_FILE))
    (root / _COMPLETE).write_text(version)
    return root


def load_kv_events(src: Path) -> types.ModuleType:
    """Execute SGLang's ``kv_events.py`` from ``src`` with the stubs above; sys.modules is
    restored afterwards (the returned module keeps what it imported)."""
    stubs = {
        "sglang": _stub("sglang"),
        "sglang.srt": _stub("sglang.srt"),
        "sglang.srt.runtime_context": _stub("sglang.srt.runtime_context",
                                            get_parallel=lambda: None),
        "sglang.srt.utils": _stub("sglang.srt.utils"),
        "sglang.srt.utils.network": _stub("sglang.srt.utils.network", NetworkAddress=object),
        "sglang.srt.disaggregation": _stub("sglang.srt.disaggregation"),
    }
    names = [*stubs, "sglang.srt.disaggregation.kv_events"]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        sys.modules.update(stubs)
        return _exec("sglang.srt.disaggregation.kv_events", src / KV_FILE)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
