from __future__ import annotations

import pytest

from kvroute.core.holders import NATIVE_AVAILABLE


@pytest.fixture(params=[True, False], ids=["c", "dict"])
def native(request: pytest.FixtureRequest) -> bool:
    """Run an index test on both holder maps: the C table and the dict it is checked
    against (``kvroute.core.holders``)."""
    if request.param and not NATIVE_AVAILABLE:
        pytest.fail("the C holder map (kvroute.core._holders) was not built; see setup.py")
    return bool(request.param)
