"""The command lines of the README and the engine and HTTP guides run as written.

Each fenced block's ``kvroute agent``/``kvroute router`` lines are started as they stand, with
three substitutions a reader makes too: every port becomes a free one (the same doc port, the
same free port, within a block and the client blocks after it), ``/models/...`` becomes a
small real model directory (the byte vocabulary's tokenizer.json and chat template), and the
Redis they default to is this test's own (``KVROUTE_REDIS``; an explicit
``redis://127.0.0.1:6379/DB`` keeps its database). Then the block's ``curl`` and ``grpcurl``
lines must succeed (retried while workers register). A block without services talks to the
previous block's. vLLM agents are parsed and configured, not started: no vLLM runs in this
suite."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvroute.cli import build_parser
from kvroute.core.config import AgentConfig
from kvroute.core.settings import from_namespace
from kvroute.demo.openai_model import write_byte_model
from tests.support import ROOT, RedisProc, free_port, stop_process

DOCS = ("README.md", "docs/http.md", "docs/engines.md")
SERVICES = ("agent", "router")
PORT_FLAG = re.compile(r"(--(?:port|metrics-port|http-port)[ =])(\d+)")
HOST_PORT = re.compile(r"((?:127\.0\.0\.1|localhost):)(\d+)")
MODEL_PATH = re.compile(r"/models/[\w.\-]+")


def blocks(text: str) -> list[list[str]]:
    """Each untagged fenced block's command lines, continuations joined."""
    out: list[list[str]] = []
    fence: str | None = None  # the open fence's info string (None: outside)
    lines: list[str] = []
    for line in text.splitlines():
        if not line.startswith("```"):
            lines.append(line)
        elif fence is None:
            fence, lines = line[3:].strip(), []
        else:
            if not fence:
                out.append(commands(lines))
            fence = None
    return out


def commands(lines: list[str]) -> list[str]:
    """Shell lines as commands: a trailing backslash or an open quote continues a line."""
    out, buf = [], ""
    for line in re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines():
        buf = f"{buf} {line.strip()}" if buf else line
        try:
            shlex.split(buf, comments=True)
        except ValueError:  # a quote still open
            continue
        if buf.strip():
            out.append(buf)
        buf = ""
    return out


def is_service(argv: list[str]) -> bool:
    return len(argv) > 1 and argv[0] == "kvroute" and argv[1] in SERVICES


@dataclass
class Runner:
    redis: RedisProc
    model_dir: Path
    logs: Path
    ports: dict[str, int] = field(default_factory=dict)
    procs: list[tuple[subprocess.Popen[bytes], Path, str]] = field(default_factory=list)

    def substitute(self, line: str) -> str:
        line = MODEL_PATH.sub(str(self.model_dir), line)

        def port(m: re.Match[str]) -> str:
            if m.group(2) == "6379":  # the README's Redis: this test's
                return m.group(1) + str(self.redis.port)
            return m.group(1) + str(self.ports.setdefault(m.group(2), free_port()))
        return HOST_PORT.sub(port, PORT_FLAG.sub(port, line))

    @property
    def env(self) -> dict[str, str]:
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**os.environ, "PATH": path, "KVROUTE_REDIS": self.redis.url,
                "PYTHONUNBUFFERED": "1"}

    def start(self, argv: list[str], line: str) -> None:
        if argv[1] == "agent" and "vllm" in argv:
            # No vLLM here: the line must parse and make a valid agent config.
            from_namespace(AgentConfig, build_parser("agent").parse_args(argv[1:]))
            return
        log = self.logs / f"{len(list(self.logs.glob('*.log')))}-{argv[1]}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kvroute", *argv[1:]], stdout=out,
                                    stderr=out, env=self.env)
        self.procs.append((proc, log, line))

    def alive(self) -> None:
        for proc, log, line in self.procs:
            assert proc.poll() is None, f"{line}\nexited:\n{log.read_text()[-3000:]}"

    def client(self, argv: list[str], line: str) -> str:
        deadline = time.monotonic() + 60
        while True:
            self.alive()
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                 env=self.env)
            if out.returncode == 0 and out.stdout.strip() and "error" not in out.stdout[:200]:
                return out.stdout
            if time.monotonic() > deadline:
                raise AssertionError(f"{line}\nexit {out.returncode}:\n{out.stdout[-2000:]}"
                                     f"\n{out.stderr[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        for proc, _, _ in self.procs:
            stop_process(proc)
        self.procs.clear()


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runner]:
    redis = RedisProc()
    redis.start()
    r = Runner(redis, write_byte_model(tmp_path / "model"), tmp_path)
    try:
        yield r
    finally:
        r.stop()
        redis.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_command_lines_run(doc: str, runner: Runner) -> None:
    if shutil.which("curl") is None:
        pytest.fail("curl is not installed (scripts/install_tools.sh installs it)")
    ran = 0
    for block in blocks((ROOT / doc).read_text()):
        if any(is_service(shlex.split(line, comments=True)) for line in block):
            runner.stop()  # a block with services of its own: the previous ones go
            runner.ports.clear()
        for line in block:
            argv = shlex.split(runner.substitute(line), comments=True)
            if is_service(argv):
                runner.start(argv, line)
            elif argv and argv[0] in ("curl", "grpcurl"):
                out = runner.client(argv, line)
                if "chat/completions" in line:
                    assert "chat.completion" in out, out
            else:
                continue
            ran += 1
        runner.alive()
    assert ran, f"{doc}: no command line found"
