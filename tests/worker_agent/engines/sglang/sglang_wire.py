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

import re
import types
from pathlib import Path

from tests.worker_agent.engines.wheels import load_with_stubs, stub, wheel_files

KV_FILE = "sglang/srt/disaggregation/kv_events.py"
RELEASES = ("0.5.1", "0.5.23")
"""The oldest release whose publisher the tests run (August 2025: array events, no medium)
and the newest (October 2026: tagged maps with medium, cache_salt, lora_name)."""


def sglang_sources(version: str, cache_dir: Path | None = None) -> Path:
    """A directory holding SGLang ``version``'s ``kv_events.py``; downloads the wheel the
    first time."""
    return wheel_files("sglang", version, re.compile(re.escape(KV_FILE)), (KV_FILE,),
                       "KVROUTE_SGLANG_SOURCES", cache_dir)


def load_kv_events(src: Path) -> types.ModuleType:
    """Execute SGLang's ``kv_events.py`` from ``src`` with the stubs above; sys.modules is
    restored afterwards (the returned module keeps what it imported)."""
    stubs = {
        "sglang": stub("sglang"),
        "sglang.srt": stub("sglang.srt"),
        "sglang.srt.runtime_context": stub("sglang.srt.runtime_context",
                                            get_parallel=lambda: None),
        "sglang.srt.utils": stub("sglang.srt.utils"),
        "sglang.srt.utils.network": stub("sglang.srt.utils.network", NetworkAddress=object),
        "sglang.srt.disaggregation": stub("sglang.srt.disaggregation"),
    }
    return load_with_stubs(stubs, [("sglang.srt.disaggregation.kv_events", src / KV_FILE)])
