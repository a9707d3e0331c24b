"""``kvroute replay`` after a plain ``pip install kvroute``: no ``sim`` extra, so neither
matplotlib nor tqdm imports. It still writes its tables, JSON and CSV, says in one line that
the plots were skipped and how to get them, and shows progress without tqdm."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from kvroute.simulations.gen_cli import write_jsonl
from kvroute.simulations.generators import generate
from kvroute.simulations.report import PLOTS_SKIPPED

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "chat.jsonl"
    write_jsonl(generate("chat", 120, 20.0, seed=5), path)
    return path


def uninstalled(root: Path, *names: str) -> Path:
    """A directory that, first on PYTHONPATH, makes each of ``names`` fail to import as an
    uninstalled package does."""
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return root


def replay_on_a_terminal(trace: Path, out: Path, env: dict[str, str]
                         ) -> tuple[subprocess.CompletedProcess[str], str]:
    """``kvroute replay`` with its stderr a terminal (progress is shown only on one):
    the process, and what it wrote to the terminal."""
    master, slave = pty.openpty()
    # A window size: on a 0-column terminal tqdm draws empty bars.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute", "replay", str(trace), "--workers", "2",
             "--policies", "kvroute,round_robin", "--load", "0.8", "--out", str(out)],
            stdout=subprocess.PIPE, stderr=slave, text=True, env=env)
        os.close(slave)
        slave = -1
        terminal = b""
        while True:  # read as it comes: a full terminal buffer would block the replay
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every end of the terminal's other side is closed
                break
            if not chunk:
                break
            terminal += chunk
        stdout = proc.stdout.read() if proc.stdout else ""
        proc.wait(120)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    return (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""),
            terminal.decode(errors="replace"))


def test_replay_without_the_sim_extra_writes_everything_but_the_plots(
        trace: Path, tmp_path: Path) -> None:
    blocked = uninstalled(tmp_path / "site", "matplotlib", "tqdm")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(blocked), *filter(None, [os.environ.get("PYTHONPATH")])])}
    probe = subprocess.run([sys.executable, "-c", "import matplotlib"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'matplotlib'" in probe.stderr

    bare, terminal = replay_on_a_terminal(trace, tmp_path / "bare", env)
    assert bare.returncode == 0, terminal
    assert "Traceback" not in terminal and "Traceback" not in bare.stdout
    skipped = [line for line in bare.stdout.splitlines() if "plots" in line]
    assert skipped == [PLOTS_SKIPPED] and "pip install 'kvroute[sim]'" in PLOTS_SKIPPED
    # Progress without tqdm: a plain line per policy.
    assert "  kvroute ..." in terminal and "  round_robin ..." in terminal
    assert "it/s" not in terminal and "req/s]" not in terminal
    for name in ("results.json", "results.csv", "requests.csv"):
        assert (tmp_path / "bare" / name).stat().st_size > 0, name
    assert not list((tmp_path / "bare").glob("*.png"))
    assert "policy" in bare.stdout and "TTFT mean" in bare.stdout  # the table

    # With the extra: the same figures, and the plots.
    full, terminal = replay_on_a_terminal(trace, tmp_path / "full", dict(os.environ))
    assert full.returncode == 0, terminal
    assert PLOTS_SKIPPED not in full.stdout and "req/s]" in terminal  # a tqdm bar
    for png in ("ttft_cdf.png", "hit_ratio.png", "load_over_time.png"):
        assert (tmp_path / "full" / png).read_bytes()[:8] == PNG, png

    def figures(run: str) -> list[dict[str, object]]:
        doc = json.loads((tmp_path / run / "results.json").read_text())
        return [{k: v for k, v in p.items() if k != "wall_s"} for p in doc["policies"]]

    assert figures("bare") == figures("full")
    assert (tmp_path / "bare" / "requests.csv").read_text() == (
        tmp_path / "full" / "requests.csv").read_text()
