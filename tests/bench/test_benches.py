"""Every benchmark still runs: each script in ``bench/`` on a tiny case, as a subprocess.

Benchmarks print figures and assert nothing about speed (speed is measured there, not in
tests); what is checked here is that they run to the end and print their tables, so that a
change to the code they drive (an interface, a module they import) cannot leave them broken
unnoticed, as it once left ``gc_pause.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from simulations.generators import generate, write_jsonl

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "chat.jsonl"
    write_jsonl(generate("chat", 200, 20.0, seed=1), path)
    return path


@pytest.fixture(scope="module")
def scored(chat: Path) -> Path:
    """A ``policy_jitter.py --json`` file for ``score_cells.py`` to read."""
    out = chat.with_name("jitter.json")
    run = subprocess.run([sys.executable, str(BENCH / "policy_jitter.py"), str(chat),
                          "--loads", "0.5,0.8", "--jitters", "0.98,1.02", "--policies",
                          "kvroute,llmd,round_robin", "--workers", "4", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    return out


CASES = {
    "routing_decision.py": (["--entries", "20000", "--iters", "20"],
                            ["p99 ratio", "policy (python)  replica", "  8192     128    0-4 |"]),
    "router_rpc.py": (["--workers", "8", "--entries", "5000", "--iters", "20", "--agents", "2"],
                      ["added p50", "Generate, 1 token, 2 sim agents"]),
    "gc_pause.py": (["--entries", "20000", "--workers", "8", "--repeats", "1", "--iters", "50"],
                    ["full-collection pause, baseline/kvroute"]),
    "agent_events.py": (["--batches", "200"], ["agent ingest + publish to Redis"]),
    "controller.py": (["--tokens", "8", "--branches", "2", "--rounds", "1", "--prefix", "100"],
                      ["first child leads (the agent)", "independent via router"]),
    "tiny_engine.py": (["--prompt", "64", "--batch", "2", "--decode", "4", "--capacity", "64"],
                       ["decode   batch   2 x 4 tokens"]),
    "policy_jitter.py": (["{chat}", "--loads", "0.8", "--jitters", "1", "--closed-loop",
                          "--match-load", "--policies", "kvroute,llmd", "--workers", "4",
                          "--others-predict-ttl-ms", "0", "--nudge", "0.5"],
                         ["TTFT floor (no queueing", "hit ratio: ",
                          "closed loop: requests were sent at "]),
    "score_cells.py": (["{scored}"], ["jitter  ", " 50%  ", " 80%  ", "as replayed: 2 cells",
                                      "all three won consistently: "]),
    "program_overflow.py": (["--fanout", "4", "--loads", "0.8", "--max-batch", "32",
                             "--workers", "4"], ["0.80"]),
    "replay_speed.py": (["--trace", "{chat}", "--tile", "2", "--policies", "kvroute"],
                        ["400 requests, 16 workers", "kvroute ", "x round_robin"]),
}


def test_every_bench_is_covered() -> None:
    assert {p.name for p in BENCH.glob("*.py")} == set(CASES)


@pytest.mark.parametrize("script", sorted(CASES))
def test_the_bench_runs_to_its_table(script: str, chat: Path,
                                     request: pytest.FixtureRequest) -> None:
    args, expected = CASES[script]
    # Only score_cells.py reads a --json file: the replays that write it run for it alone.
    scored = request.getfixturevalue("scored") if script == "score_cells.py" else ""
    run = subprocess.run([sys.executable, str(BENCH / script),
                          *(a.format(chat=chat, scored=scored) for a in args)],
                         capture_output=True, text=True, timeout=240, cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    for text in expected:
        assert text in run.stdout, (text, run.stdout[-2000:])
