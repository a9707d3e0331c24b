"""Every test that takes ``sglang_kv`` runs once per SGLang release of
:data:`~tests.worker_agent.engines.sglang.sglang_wire.RELEASES`, with that release's own
``kv_events.py`` executed from its wheel."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.worker_agent.engines.sglang.sglang_wire import (
    RELEASES,
    load_kv_events,
    sglang_sources,
)


@pytest.fixture(scope="session", params=RELEASES, ids=lambda v: f"sglang-{v}")
def sglang_kv(request: pytest.FixtureRequest) -> ModuleType:
    try:
        return load_kv_events(sglang_sources(request.param))
    except RuntimeError as exc:
        pytest.fail(str(exc))
