"""The ``kvroute`` command line: what its help says."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.cli import build_parser
from kvroute.core.policies import DEFAULT_POLICY, REGISTRY, Kvroute, parameters
from kvroute.simulations.policies import PEERS, REPLAY_REGISTRY
from tests.support import RedisProc, free_port, stop_process


def _help(cmd: str) -> str:
    """``kvroute CMD --help``, its whitespace collapsed (argparse wraps at the terminal's width)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices[cmd].format_help().split())


@pytest.mark.parametrize("cmd", ["router", "epp", "agent", "demo", "replay", "gen"])
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
    ("replay", "(0 = off; default: the router's, 600000) --coalesce-share"),
    ("replay", "(0: always wait; default: the router's, 0.8) --no-copies"),
    ("demo", "2 suit 2 cores) (default: 4)"),
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
    env = "KVROUTE_" + which[2:].replace("-", "_").upper()
    assert f"{which} {port} ({env}): address 127.0.0.1:{port} is already in use" \
        in ran.stderr
    assert "Traceback" not in ran.stderr


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("cmd", [["router"], ["agent", "--engine", "sim", "--time-scale", "0"]])
def test_a_second_server_on_a_served_port_is_refused(redis_server: RedisProc,
                                                     cmd: list[str]) -> None:
    # gRPC's default SO_REUSEPORT let a second server bind a port one already served (the
    # kernel then spread calls over both); a held plain socket, as above, never showed it.
    port = free_port()
    argv = [sys.executable, "-m", "kvroute", *cmd, "--redis", redis_server.url, "--host",
            "127.0.0.1", "--port", str(port)]
    first = subprocess.Popen([*argv, "--log-level", "warning"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _serving(port):
            assert first.poll() is None and time.monotonic() < deadline, "first never served"
            time.sleep(0.1)
        second = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert (f"--port {port} (KVROUTE_PORT): address 127.0.0.1:{port} is already in use"
                in second.stderr), second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None and _serving(port)
    finally:
        stop_process(first)


def _policies(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvroute", "policies", *argv],
                          capture_output=True, text=True, timeout=60)


def _parameter_rows(out: str) -> dict[str, str]:
    """The lines after the docstring, under "parameters (...)", by parameter name."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    parameters"))
    return {line.split()[0]: line for line in lines[start + 1:]}


def test_policies_lists_the_routers_then_the_peers_the_default_marked() -> None:
    ran = _policies()
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    (router_head,) = [i for i, x in enumerate(lines) if "kvroute policies NAME" in x]
    (peers_head,) = [i for i, x in enumerate(lines) if "for `kvroute replay` only" in x]
    assert router_head == 0
    router, peers = lines[1:peers_head], lines[peers_head + 1:]
    assert [x.split()[0] for x in router] == sorted(REGISTRY)
    assert [x.split()[0] for x in peers] == sorted(PEERS)
    marked = [line.split()[0] for line in lines if "(default)" in line]
    assert marked == [DEFAULT_POLICY]
    for line in router + peers:
        name = line.split()[0]
        summary = line.split("  ", 2)[-1].strip()
        first = (type(REPLAY_REGISTRY[name]()).__doc__ or "").strip().splitlines()[0]
        assert summary.startswith(first.rstrip(",;:.")), line
        assert "Formula" not in line


@pytest.mark.parametrize("name", sorted(REPLAY_REGISTRY))
def test_policies_name_shows_its_formula_and_every_parameter(name: str) -> None:
    ran = _policies(name)
    assert ran.returncode == 0, ran.stderr
    policy = REPLAY_REGISTRY[name]()
    assert ran.stdout.splitlines()[0] == name and "Formula" in ran.stdout
    rows = _parameter_rows(ran.stdout)
    assert set(rows) == set(parameters(policy))
    for k, v in parameters(policy).items():
        assert rows[k].split()[1] == str(v), rows[k]
    assert ("parameters: none" in ran.stdout) == (not parameters(policy))


def test_policies_spec_shows_its_overrides_and_an_unknown_name_is_refused() -> None:
    ran = _policies("kvroute:delay=2")
    assert ran.returncode == 0, ran.stderr
    delay = _parameter_rows(ran.stdout)["delay"]
    assert f"2.0 (default {Kvroute().delay})" in delay
    bad = _policies("kvrout")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert f"unknown policy 'kvrout'; choose one of: {', '.join(sorted(REPLAY_REGISTRY))}" \
        in bad.stderr


def test_a_router_or_agent_parses_its_flags_without_the_simulator() -> None:
    """The simulator's modules (numpy, the replay) were a third of a router's start: a
    parser for a router or an agent does not import them; one for the replay, or for any
    command not yet known, has every subcommand's arguments."""
    from kvroute import cli

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(cli._COMMANDS)
    code = ("import sys; from kvroute.cli import build_parser; "
            "a = build_parser('router').parse_args(['router', '--port', '7']); "
            "b = build_parser('agent').parse_args(['agent']); "
            "print(a.port, [m for m in sys.modules if m.startswith('kvroute.simulations') "
            "or m == 'numpy'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split(maxsplit=1)
    assert out == ["7", "[]\n"]
    assert build_parser("replay").parse_args(["replay", "t.jsonl"]).trace == "t.jsonl"
    assert build_parser(None).parse_args(["gen", "chat"]).command == "gen"
