"""What a vLLM release's own code declares, read (with :mod:`ast`, never executed) from the
files :func:`vllm_wire.vllm_sources` keeps of its wheel.

* the fields of its OpenAI server's pydantic models (``CompletionRequest``,
  ``CompletionResponseStreamChoice``, ``UsageInfo``, ...) and of ``StructuredOutputsParams``:
  the class bodies' annotated names, searched in every ``vllm/entrypoints/**/protocol.py``
  (those under ``entrypoints/openai/`` first: other entrypoints reuse some class names) and in
  ``vllm/sampling_params.py``;
* whether its scheduler honours ``vllm_xargs.kv_cache_report_mode`` (``vllm/v1/request.py``
  reads it).

The fake vLLM takes its behaviour from this, so that it is derived from each release's code
rather than from the agent's own table (:mod:`kvroute.worker_agent.engines.vllm.versions`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Release:
    version: str
    classes: dict[str, frozenset[str]] = field(repr=False)
    reports_reused: bool
    """Re-reports reused blocks as ``BlockStored`` when asked (``kv_cache_report_mode``)."""

    def fields(self, cls: str) -> frozenset[str]:
        if cls not in self.classes:
            raise KeyError(f"vLLM {self.version} declares no class {cls}")
        return self.classes[cls]

    @property
    def constraint_fields(self) -> frozenset[str]:
        """The constrained-decoding fields its ``CompletionRequest`` reads, of
        ``structured_outputs`` and ``guided_json|regex|choice|grammar``."""
        wanted = {"structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar"}
        return self.fields("CompletionRequest") & wanted


def class_fields(tree: ast.Module) -> dict[str, frozenset[str]]:
    out: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = frozenset(
                st.target.id for st in node.body
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name))
    return out


def read_release(version: str, src: Path) -> Release:
    files = sorted(src.glob("vllm/entrypoints/**/protocol.py"),
                   key=lambda p: ("entrypoints/openai/" not in p.as_posix(), p.as_posix()))
    files.append(src / "vllm/sampling_params.py")
    classes: dict[str, frozenset[str]] = {}
    for path in files:
        for name, fields in class_fields(ast.parse(path.read_text())).items():
            classes.setdefault(name, fields)
    if "CompletionRequest" not in classes:
        raise RuntimeError(f"no CompletionRequest in vLLM {version}'s sources under {src}")
    request = src / "vllm/v1/request.py"
    reports = request.is_file() and "kv_cache_report_mode" in request.read_text()
    return Release(version, classes, reports)
