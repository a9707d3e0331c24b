"""`kvroute demo` end to end as a subprocess: it runs, compares, and leaves nothing behind.

The demo runs in its own session; its children (Redis, agents, routers) inherit it, so any
process still in that session afterwards is a leak.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One repeat unless a test is about the repeats: every repeat starts a fresh cluster.
TINY = ["--conversations", "3", "--turns", "2", "--one-off", "2", "--repeats", "1"]


def _session_members(sid: int) -> list[str]:
    assert Path("/proc/self/stat").exists(), "these tests find leftover processes in /proc"
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = stat.rsplit(")", 1)[1].split()
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            out.append(f"{entry.name} {stat.split(' ', 1)[1][:60]}")
    return out


def _assert_no_leftovers(sid: int) -> None:
    deadline = time.monotonic() + 2.0  # reparented zombies are reaped by init shortly
    while (left := _session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


def _demo(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvroute", "demo", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})


def _kill_session(proc: subprocess.Popen[str]) -> None:
    """Test safety net only: the demo itself must not need this."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_tiny_demo_repeats_both_policies_gives_verdicts_and_cleans_up() -> None:
    proc = _demo(*TINY, "--quiet", "--repeats", "2")
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        _kill_session(proc)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    for repeat in (1, 2):
        for policy in ("kvroute", "round_robin"):
            assert re.search(rf"^== {policy} {repeat}/2: 8 requests in [\d.]+ s$", out,
                             re.M), out
            assert f"[{policy} {repeat}/2] sending 8 requests" in err
    # Rounds in turn: every policy once, then again.
    order = re.findall(r"^== (\S+ \d)/2", out, re.M)
    assert order == ["kvroute 1", "round_robin 1", "kvroute 2", "round_robin 2"]
    # Four summaries and the comparison (the closing sentences may name the metric too).
    assert len(re.findall(r"^\s*prefix-hit ratio", out, re.M)) == 5
    assert re.search(r"^median of 2 +kvroute +round_robin +kvroute/round_robin +verdict$",
                     out, re.M), out
    spread = r"\d\.\d\dx \(\d\.\d\d-\d\.\d\d\) +(higher, beyond noise|lower, beyond noise|" \
             r"within noise)"
    for metric in ("mean TTFT", "p99 TTFT", "workload time"):
        assert re.search(rf"^{metric}.* {spread}$", out, re.M), out
    # On so tiny a workload round_robin may hit nothing in a repeat: then fewer ratios.
    assert re.search(rf"^prefix-hit ratio.* ({spread}|\d\.\d\dx +noise unknown \(one ratio\)|"
                     r"- +no ratio \(divides by 0\))$", out, re.M), out
    assert "Beyond run-to-run noise, kvroute vs round_robin: " in out
    assert "Within run-to-run noise (no difference shown): " in out
    assert "conv 00 turn" not in out  # --quiet: no per-request lines
    assert "starting Redis" in err
    _assert_no_leftovers(proc.pid)


def test_the_demo_on_real_vllm_reports_vllms_cached_tokens_and_cleans_up() -> None:
    """``make demo ENGINE=vllm``, smaller: two real vLLM-CPU servers (kvroute/demo/vllm_cpu.py)
    behind each policy's agents and router."""
    proc = _demo("--engine", "vllm", "--workers", "2", *TINY)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        _kill_session(proc)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "starting 2 vLLM servers" in err and "warming vLLM up" in err
    for policy in ("kvroute", "round_robin"):
        assert re.search(rf"^== {policy}: 8 requests in [\d.]+ s$", out, re.M), out
        assert f"[{policy}] starting 2 vllm agents and a router" in err
    # A chat's second turn reads its first turn's prefix from vLLM's own cache.
    cached = [int(m) for m in re.findall(r"^kvroute +conv \d+ turn 2/2 .* cached +(\d+)", out,
                                         re.M)]
    assert len(cached) == 3 and all(c >= 32 for c in cached), out
    _assert_no_leftovers(proc.pid)


def test_per_request_lines_come_from_the_first_repeat_only() -> None:
    proc = _demo(*TINY, "--policies", "round_robin", "--repeats", "2")
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        _kill_session(proc)
    assert proc.returncode == 0, err
    lines = re.findall(r"^round_robin +(?:conv|one-off) .* ttft ", out, re.M)
    assert len(lines) == 8, out  # repeat 1's eight requests, none of repeat 2's
    before_first = out.split("== round_robin 1/2")[0]
    assert before_first.count(" ttft ") == 8


def test_sigterm_midway_stops_every_child() -> None:
    proc = _demo(*TINY, "--policies", "kvroute")
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # wait until the cluster is up and serving requests
            if "sending" in line:
                break
        else:
            pytest.fail("the demo never started sending")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        _kill_session(proc)
    assert proc.returncode in (0, 130), err  # 0 if the tiny workload won the race
    _assert_no_leftovers(proc.pid)


def test_child_failing_to_start_is_reported_with_its_log() -> None:
    # Every child parses KVROUTE_LOG_LEVEL and exits at once on a bad value.
    proc = _demo(*TINY, env={"KVROUTE_LOG_LEVEL": "bogus"})
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        _kill_session(proc)
    assert proc.returncode == 1, err
    assert "kvroute demo failed:" in err and "exited with code" in err
    assert "unknown log level" in err  # the tail of the child's log
    m = re.search(r"logs of every process: (\S+)", err)
    assert m and Path(m.group(1)).is_dir()
    shutil.rmtree(m.group(1))
    _assert_no_leftovers(proc.pid)


@pytest.mark.parametrize(("args", "message"), [
    (("--policies", "kvroute,nope"), "unknown policy 'nope'"),
    # It used to pass `< 0` and start four agents that each refused it.
    (("--time-scale", "nan"), "--time-scale must be a finite number >= 0, got nan"),
    (("--repeats", "0"), "--repeats must be >= 1, got 0"),
    (("--engine", "vllm", "--serve"), "--serve keeps tiny agents up; it does not go with"),
])
def test_bad_arguments_fail_before_starting_anything(args: tuple[str, ...],
                                                     message: str) -> None:
    proc = _demo(*args)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        _kill_session(proc)
    assert proc.returncode == 2
    assert message in err
    assert "starting" not in err


def test_serve_keeps_a_tiny_cluster_up_for_the_examples_until_interrupted() -> None:
    # Started with SIGINT ignored, as a background job of a script would be: Ctrl-C (the
    # documented way to stop it) must still work.
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = _demo(*TINY, "--quiet", "--policies", "kvroute", "--workers", "2", "--serve")
    finally:
        signal.signal(signal.SIGINT, saved)
    try:
        assert proc.stdout is not None
        address = ""
        deadline = time.monotonic() + 90
        for line in proc.stdout:
            m = re.search(r"run_all\.py --router (\S+)", line)
            if m:
                address = m.group(1)
                break
            assert time.monotonic() < deadline, "no serving line in time"
        assert address, "the demo never served"
        examples = Path(__file__).resolve().parents[2] / "examples"
        ex = subprocess.run([sys.executable, str(examples / "run_all.py"), "--router", address],
                            capture_output=True, text=True, timeout=120)
        assert ex.returncode == 0, ex.stderr
        assert "parsed:" in ex.stdout and "worker t" not in ex.stdout  # the demo's w0/w1
        assert re.search(r"worker w[01]", ex.stdout), ex.stdout
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        _kill_session(proc)
    assert proc.returncode == 0, err
    assert "stopping the served cluster" in err
    _assert_no_leftovers(proc.pid)
