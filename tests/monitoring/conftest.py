from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helm.chart import Manifests, template
from tests.helm.conftest import helm  # noqa: F401 - the session fixture, shared
from tests.tools import ToolMissingError, prometheus_binaries


@pytest.fixture(scope="session")
def prom_tools() -> tuple[str, str]:
    """(prometheus, promtool). Missing is a failure, not a skip: CI installs them."""
    try:
        return prometheus_binaries()
    except ToolMissingError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def rules_file(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The alert rules exactly as the chart ships them (PrometheusRule spec, default
    thresholds), as a plain Prometheus rules file."""
    m = Manifests.parse(template(helm, sets=("metrics.prometheusRule.enabled=true",)))
    rule = m.one("PrometheusRule")
    path = tmp_path_factory.mktemp("rules") / "kvroute-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path
