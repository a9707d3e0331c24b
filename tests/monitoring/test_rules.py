"""The chart's alert rules with promtool: syntax (`check rules`) and behaviour (`test rules`,
tests/monitoring/alerts_test.yaml: each alert fires when it should and not before)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

HERE = Path(__file__).parent


def promtool(tool: str, *args: str, cwd: Path | None = None) -> str:
    proc = subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_check_rules(prom_tools: tuple[str, str], rules_file: Path) -> None:
    out = promtool(prom_tools[1], "check", "rules", str(rules_file))
    assert "SUCCESS" in out


def test_alert_unit_tests(prom_tools: tuple[str, str], rules_file: Path,
                          tmp_path: Path) -> None:
    shutil.copy(rules_file, tmp_path / "kvroute-rules.yaml")
    shutil.copy(HERE / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    out = promtool(prom_tools[1], "test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert "SUCCESS" in out


def test_every_alert_has_a_firing_case(rules_file: Path) -> None:
    rules = yaml.safe_load(rules_file.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert {"KvrouteNoHealthyWorkers", "KvrouteChangeFeedLag", "KvrouteRedisUnreachable",
            "KvrouteHitRatioCollapsed", "KvrouteRoutingLatencyHigh"} <= alerts
    cases = yaml.safe_load((HERE / "alerts_test.yaml").read_text())
    fired = {t["alertname"] for case in cases["tests"] for t in case.get("alert_rule_test", [])
             if t["exp_alerts"]}
    quiet = {t["alertname"] for case in cases["tests"] for t in case.get("alert_rule_test", [])
             if not t["exp_alerts"]}
    assert alerts == fired, f"alerts without a firing test: {alerts - fired}"
    assert len(quiet) >= 4  # and several are shown not to fire early
