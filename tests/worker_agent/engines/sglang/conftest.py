"""Every test that takes ``sglang_kv``, ``sglang_release`` or ``fake_sglang`` runs once per
SGLang release of :data:`~tests.worker_agent.engines.sglang.sglang_wire.RELEASES`, with that
release's own code from its wheel."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.worker_agent.engines.sglang.sglang_wire import (
    RELEASES,
    load_kv_events,
    sglang_sources,
)
from tests.worker_agent.engines.vllm.conftest import FakeServerProc, fake_servers


@pytest.fixture(scope="session", params=RELEASES, ids=lambda v: f"sglang-{v}")
def sglang_kv(request: pytest.FixtureRequest) -> ModuleType:
    try:
        return load_kv_events(sglang_sources(request.param))
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session", params=RELEASES, ids=lambda v: f"sglang-{v}")
def sglang_release(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """(version, its sources) of each end of the supported range."""
    try:
        return request.param, sglang_sources(request.param)
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def fake_sglang(sglang_release: tuple[str, Path]) -> Iterator[Callable[..., FakeServerProc]]:
    """``start(*args)`` launches a fake SGLang of the release under test (fake_sglang.py);
    every one is stopped at the end of the test."""
    version, src = sglang_release
    yield from fake_servers("tests.worker_agent.engines.sglang.fake_sglang",
                            ["--sglang-src", str(src), "--sglang-version", version], version)
