"""A real Prometheus server for tests: Debian's binary on a free loopback port, its own
data directory, stopped by PID."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import free_port


@dataclass
class PrometheusProc:
    binary: str
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, config: dict[str, Any], timeout: float = 30.0) -> None:
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(json.dumps(config))  # YAML is a superset of JSON
        log = (self.workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={cfg}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not start:\n" + self.log_tail())
            time.sleep(0.1)

    def log_tail(self) -> str:
        p = self.workdir / "prometheus.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def api(self, path: str, **params: str | list[str]) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])
