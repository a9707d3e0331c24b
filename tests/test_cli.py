"""The ``kvroute`` command line: what its help says."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys

import pytest

from kvroute.cli import build_parser
from tests.support import RedisProc


def _help(cmd: str) -> str:
    """``kvroute CMD --help``, its whitespace collapsed (argparse wraps at the terminal's width)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices[cmd].format_help().split())


@pytest.mark.parametrize("cmd", ["router", "agent", "demo", "replay", "tune", "gen"])
def test_help_states_each_default_once_and_not_for_switches(cmd: str) -> None:
    text = _help(cmd)
    # One entry runs from its flag to the next. argparse appends "(default: X)" at its end;
    # a help that already says its default must not get it a second time.
    for entry in re.split(r" (?=--[a-z])", text):
        appended = re.search(r"\(default: [^()]*\)$", entry)
        if appended:
            assert "default" not in entry[:appended.start()], entry
        assert "(default: False)" not in entry, entry


@pytest.mark.parametrize(("cmd", "expected"), [
    ("gen", "--requests REQUESTS number of requests (default: 1000)"),
    ("gen", "--rate RATE mean arrival rate, requests per second (default: 10.0)"),
    ("replay", "--workers WORKERS simulated workers (default: 16)"),
    ("replay", "(0 = off; default: the router's, 30000) --coalesce-share"),
    ("replay", "(0: always wait; default: the router's, 0.8) --programs"),
    ("demo", "--workers WORKERS sim agents to start (default: 4)"),
])
def test_help_shows_defaults(cmd: str, expected: str) -> None:
    assert expected in _help(cmd)


@pytest.mark.parametrize("cmd", [["router"], ["agent", "--engine", "sim"]])
@pytest.mark.parametrize("which", ["--port", "--metrics-port"])
def test_a_taken_port_ends_the_server_with_a_clear_error(redis_server: RedisProc, cmd: list[str],
                                                         which: str) -> None:
    # A taken metrics port used to surface only after the gRPC server had started: the
    # process then hung, not serving, and ignored SIGTERM (seen running the image).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = {"--port": "0", "--metrics-port": "0", which: str(port)}
        ran = subprocess.run(
            [sys.executable, "-m", "kvroute", *cmd, "--redis", redis_server.url, "--host",
             "127.0.0.1", *(x for kv in ports.items() for x in kv)],
            capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0
    what = "listen on" if which == "--port" else "serve metrics on"
    assert f"cannot {what} 127.0.0.1:{port} (in use or not permitted)" in ran.stderr
    assert "Traceback" not in ran.stderr
