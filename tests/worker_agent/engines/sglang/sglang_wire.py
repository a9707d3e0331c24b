"""SGLang's own code, for tests, from the wheel of each release in :data:`RELEASES`, without
SGLang installed: ``sglang/srt/disaggregation/kv_events.py`` (its structs *and*
``ZmqEventPublisher``) executed unmodified, and the request fields its ``/generate`` takes
(:func:`request_fields`, read with :mod:`ast` from ``io_struct.py`` and
``sampling_params.py``). Importing it needs two small parts of SGLang; only
those are stubbed, with what the publisher uses of them (nothing, on the paths these tests
take): ``sglang.srt.runtime_context.get_parallel`` and ``sglang.srt.utils.network
.NetworkAddress`` (0.5.23; 0.5.1 imports neither).

A wheel (~40 MB) is downloaded once per release with ``pip download --no-deps
sglang==VERSION``; only that file is kept, under ``.cache/sglang-VERSION/`` (gitignored).
``KVROUTE_SGLANG_SOURCES`` may name another directory holding such ``sglang-VERSION/`` trees,
to run offline."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

from kvroute.worker_agent.engines.sglang.versions import SUPPORTED
from tests.worker_agent.engines.vllm.vllm_release import class_fields
from tests.worker_agent.engines.wheels import load_with_stubs, stub, wheel_files

KV_FILE = "sglang/srt/disaggregation/kv_events.py"
IO_FILE = "sglang/srt/managers/io_struct.py"
SAMPLING_FILE = "sglang/srt/sampling/sampling_params.py"
FILES = (KV_FILE, IO_FILE, SAMPLING_FILE)
RELEASES = SUPPORTED
"""The oldest release supported (August 2025: array events, no medium) and the newest
(October 2026: tagged maps with medium, cache_salt, lora_name)."""


def sglang_sources(version: str, cache_dir: Path | None = None) -> Path:
    """A directory holding SGLang ``version``'s :data:`FILES`; downloads the wheel the first
    time."""
    return wheel_files("sglang", version, re.compile("|".join(map(re.escape, FILES))), FILES,
                       "KVROUTE_SGLANG_SOURCES", cache_dir)


def request_fields(src: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(the fields of ``GenerateReqInput``, the names ``SamplingParams`` takes): a class's
    annotated names, or, for a class without them (0.5.1's ``SamplingParams``), its
    ``__init__``'s parameters."""
    io = class_fields(ast.parse((src / IO_FILE).read_text()))["GenerateReqInput"]
    tree = ast.parse((src / SAMPLING_FILE).read_text())
    sampling = class_fields(tree).get("SamplingParams") or frozenset()
    if not sampling:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "SamplingParams":
                init = next(f for f in node.body
                            if isinstance(f, ast.FunctionDef) and f.name == "__init__")
                sampling = frozenset(a.arg for a in init.args.args[1:] + init.args.kwonlyargs)
    return io, sampling


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
