"""``kvroute tune``: the scoring, the search space, the search, and the command as users run
it (a real subprocess, forked replay workers)."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.core.policies import make_policy, parameters
from kvroute.core.policies.cost_model import CostModel
from kvroute.simulations.cli import Setup
from kvroute.simulations.generators import generate, write_jsonl
from kvroute.simulations.metrics import capacity_rps
from kvroute.simulations.replay import ClusterSpec
from kvroute.simulations.trace import load
from kvroute.simulations.tune import (
    Evaluator,
    Search,
    margins,
    neighbours,
    random_params,
    tune,
    tuning_grid,
)
from tests.simulations.test_compare import metrics
from tests.support import stop_process


def test_margins_are_against_the_best_peer_on_each_metric_separately() -> None:
    peers = [metrics("fast", 0.10, 0.80, 0.70), metrics("tail", 0.20, 0.50, 0.60),
             metrics("sticky", 0.30, 0.90, 0.80)]
    m = margins(metrics("mine", 0.09, 0.55, 0.79), peers, ("t", 0.8))
    assert (m.trace, m.load) == ("t", 0.8)
    assert m.mean == pytest.approx(0.1) and m.p99 == pytest.approx(-0.1)
    assert m.hit == pytest.approx(-1.0)  # points below "sticky"
    assert not m.won
    assert m.worst(10.0) == pytest.approx(-0.1)  # -1 point x 10 %/point = -10%
    assert m.worst(20.0) == pytest.approx(-0.2)
    won = margins(metrics("mine", 0.10, 0.50, 0.80), peers, ("t", 0.8))
    assert won.won and won.worst(10.0) == pytest.approx(0.0)  # a tie on each counts as won
    with pytest.raises(ValueError, match="no peers"):
        margins(metrics("mine", 0.1, 0.5, 0.8), [], ("t", 0.8))


@pytest.mark.parametrize("name", ["kvroute", "llmd", "sglang", "dynamo", "chwbl"])
def test_the_grid_holds_only_values_the_policy_accepts_and_its_defaults(name: str) -> None:
    grid = tuning_grid(name)
    assert grid.name == name and set(grid.values) <= set(grid.defaults)
    assert grid.start == {k: float(grid.defaults[k]) for k in grid.values}  # type: ignore[arg-type]
    assert not grid.fixed
    for k, values in grid.values.items():
        assert list(values) == sorted(set(values)), k
        assert grid.defaults[k] in values, f"{k}: the default is not on the grid"
        for v in values:
            policy = make_policy(grid.spec({**grid.start, k: v}))  # accepted, in range
            assert getattr(policy, k) == v
    assert "seed" not in grid.values


def test_what_is_not_tuned_and_a_start_off_the_grid() -> None:
    grid = tuning_grid("kvroute")
    assert "attn" not in grid.values and "transfer_cost" not in grid.values
    with pytest.raises(ValueError, match="no TUNING grid; tunable: chwbl, dynamo, kvroute, "
                                         "kvroute_fetch, llmd, sglang"):
        tuning_grid("preble")
    # A start off the grid joins it, so the search can step from it.
    off = tuning_grid("kvroute:hold=4")
    assert off.start["hold"] == 4.0 and 4.0 in off.values["hold"]
    assert list(off.values["hold"]) == sorted(off.values["hold"])
    assert off.spec(off.start) == "kvroute:hold=4"


def test_a_best_at_the_end_of_its_grid_is_pointed_out() -> None:
    grid = tuning_grid("dynamo")
    top = grid.values["prefill_load_scale"][-1]
    assert grid.edges(grid.start) == []  # defaults inside the grid; temperature 0 is a floor
    assert grid.edges({**grid.start, "prefill_load_scale": top}) == [
        f"prefill_load_scale={top:g} (largest tried)"]
    low = grid.values["prefill_load_scale"][0]
    assert grid.edges({**grid.start, "prefill_load_scale": low}) == [
        f"prefill_load_scale={low:g} (smallest tried)"]
    kv = tuning_grid("kvroute")
    # hold 1000 stands for "never leave a holder": nothing lies beyond it
    assert kv.edges({**kv.start, "hold": 1000.0, "miss_weight": 4.0}) == [
        "miss_weight=4 (largest tried)"]
    # an extended start (off the grid) moves the edge
    further = tuning_grid(f"dynamo:prefill_load_scale={2 * top:g}")
    assert further.edges({**further.start}) == [f"prefill_load_scale={2 * top:g} (largest tried)"]
    assert further.edges({**further.start, "prefill_load_scale": top}) == []


def test_specs_name_only_what_differs_keep_what_is_not_tuned_and_round_trip() -> None:
    grid = tuning_grid("kvroute")
    assert grid.spec(grid.start) == "kvroute"
    rng = random.Random(3)
    for _ in range(20):
        params = random_params(grid.values, rng)
        assert all(params[k] in grid.values[k] for k in grid.values)
        policy = make_policy(grid.spec(params))
        assert {k: float(v) for k, v in parameters(policy).items()
                if k in grid.values} == params
    # An override of a parameter that is not tuned stays in every variant.
    fetch = tuning_grid("kvroute:transfer_cost=0.2:hold=5")
    assert fetch.fixed == {"transfer_cost": "0.2"}
    variant = make_policy(fetch.spec({**fetch.start, "miss_weight": 4.0}))
    assert variant.transfer_cost == 0.2 and variant.hold == 5 and variant.miss_weight == 4
    # Each step moves exactly one parameter to an adjacent grid value.
    steps = neighbours(grid.values, grid.start)
    for step in steps:
        moved = [k for k in grid.values if step[k] != grid.start[k]]
        assert len(moved) == 1
        values = grid.values[moved[0]]
        assert abs(values.index(step[moved[0]]) - values.index(grid.start[moved[0]])) == 1
    inner = sum(2 if 0 < v.index(grid.start[k]) < len(v) - 1 else 1
                for k, v in grid.values.items())
    assert len(steps) == inner


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "chat.jsonl"
    write_jsonl(generate("chat", 160, 20.0, seed=5), path)
    return path


def small_setup(path: Path) -> Setup:
    trace = load(str(path))
    cap = 480_000 // trace.block_size
    spec = ClusterSpec(workers=4, capacity_blocks=cap, predict_ttl_s=0.0)
    return Setup(trace, spec, len(trace.requests) / trace.duration_s,
                 capacity_rps(trace, 4, cap, CostModel()))


def test_forked_workers_give_the_same_figures_as_one_process(chat: Path,
                                                             tmp_path: Path) -> None:
    other = tmp_path / "rag.jsonl"
    write_jsonl(generate("rag", 120, 20.0, seed=2), other)
    setups = {"chat": small_setup(chat), "rag": small_setup(other)}
    specs = ["kvroute", "llmd", "kvroute:hold=10"]
    ticks: list[int] = []
    with Evaluator(setups, (0.5, 0.9), (0.98, 1.0), jobs=1, seed=0) as one:
        inline = one.run(specs)
    with Evaluator(setups, (0.5, 0.9), (0.98, 1.0), jobs=2, seed=0,
                   on_replay=lambda: ticks.append(1)) as two:
        forked = two.run(specs)
        assert len(two._procs) == 2 and all(p.is_alive() for p in two._procs)
    assert not any(p.is_alive() for p in two._procs)  # stopped on leaving
    assert len(ticks) == len(specs) * 2 * 2 * 2  # traces x loads x jitters
    assert list(inline["kvroute"]) == [("chat", 0.5), ("chat", 0.9), ("rag", 0.5), ("rag", 0.9)]
    # Each cell is its own trace's replay: the traces' request counts tell them apart.
    assert {c: m.requests for c, m in inline["llmd"].items()} == {
        ("chat", 0.5): 160, ("chat", 0.9): 160, ("rag", 0.5): 120, ("rag", 0.9): 120}
    strip = {s: {ld: {k: v for k, v in m.row().items() if k != "wall_s"}
                 for ld, m in per.items()} for s, per in inline.items()}
    assert strip == {s: {ld: {k: v for k, v in m.row().items() if k != "wall_s"}
                         for ld, m in per.items()} for s, per in forked.items()}
    # The variant is really replayed as itself: a different policy gives other figures.
    assert strip["kvroute"] != strip["llmd"]


def test_a_failing_replay_is_reported_not_hung(chat: Path) -> None:
    with Evaluator({"chat": small_setup(chat)}, (0.5,), (1.0,), jobs=2, seed=0) as ev, \
            pytest.raises(RuntimeError, match=r"replay of kvroute:hold_min=2 .* failed"):
        ev.run(["kvroute:hold_min=2"])  # out of range: raised inside the worker


def run_search(setup: Setup, trials: int, seed: int) -> Search:
    with Evaluator({"chat": setup}, (0.8,), (1.0,), jobs=1, seed=0) as ev:
        peers = ev.run(["llmd", "round_robin"])
        cell = ("chat", 0.8)
        search = Search(tuning_grid("kvroute"),
                        {cell: [peers["llmd"][cell], peers["round_robin"][cell]]}, 10.0)
        tune(ev, search, trials, random.Random(seed), lambda t: None)
    return search


def test_the_search_starts_from_the_default_never_repeats_and_keeps_the_best(
        chat: Path) -> None:
    setup = small_setup(chat)
    search = run_search(setup, 5, seed=1)
    specs = [t.spec for t in search.trials]
    assert specs[0] == "kvroute" and len(specs) == len(set(specs))
    assert 2 <= len(specs) <= 5
    best = search.best()
    assert all(best.score(10.0) >= t.score(10.0) for t in search.trials)
    # Margins are recomputed from the figures, not carried over.
    for t in search.trials:
        cell = ("chat", 0.8)
        assert t.margins == (margins(t.metrics[cell], search.peers[cell], cell),)
    # Deterministic for a seed; another seed draws other variants.
    assert [t.spec for t in run_search(setup, 5, seed=1).trials] == specs
    assert [t.spec for t in run_search(setup, 5, seed=2).trials] != specs


def tune_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvroute", "tune", *map(str, args),
                           "--no-progress"], capture_output=True, text=True, timeout=300)


def test_tune_prints_the_spec_to_deploy_and_writes_every_trial(chat: Path,
                                                               tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    write_jsonl(generate("chat", 160, 20.0, seed=6), other)
    ran = tune_cli(chat, "--workers", "4", "--loads", "0.6,0.9", "--jitter", "1",
                   "--trials", "4", "--peers", "llmd,round_robin", "--jobs", "2",
                   "--predict-ttl-ms", "0", "--check", other, "--out", tmp_path)
    assert ran.returncode == 0, ran.stderr
    doc = json.loads((tmp_path / "tune.json").read_text())
    # The check replays the start and the best on the other trace; the best is recommended
    # only if it scores at least the start's there.
    (check,) = doc["checks"]
    assert check["trace"] == str(other) and {"kvroute", doc["best"]} <= set(check)
    start, best = check["kvroute"], check[doc["best"]]
    holds = (best["wins"], best["worst"]) >= (start["wins"], start["worst"])
    assert doc["recommended"] == (doc["best"] if holds else "kvroute")
    assert f"deploy: kvroute router --policy '{doc['recommended']}'" in ran.stdout
    assert f"check on {other}:" in ran.stdout
    assert doc["peers"] == ["llmd", "round_robin"] and doc["loads"] == [0.6, 0.9]
    trials = doc["trials"]
    assert trials[0]["spec"] == "kvroute" and 2 <= len(trials) <= 4
    assert doc["best"] in [t["spec"] for t in trials]
    best = next(t for t in trials if t["spec"] == doc["best"])
    assert all((best["wins"], best["worst"]) >= (t["wins"], t["worst"]) for t in trials)
    for t in trials:
        assert t["wins"] == sum(m["mean"] >= 0 and m["p99"] >= 0 and m["hit"] >= 0
                                for m in t["margins"])
        make_policy(t["spec"])  # every spec deploys as printed
    assert "best peer at each load" in ran.stdout and " 60%  peers " in ran.stdout


def test_tuning_on_several_traces_scores_every_trace_at_every_load(chat: Path,
                                                                    tmp_path: Path) -> None:
    rag = tmp_path / "rag.jsonl"
    write_jsonl(generate("rag", 120, 20.0, seed=2), rag)
    ran = tune_cli(chat, "--also", rag, "--workers", "4", "--loads", "0.6,0.9", "--jitter",
                   "1", "--trials", "2", "--peers", "llmd", "--jobs", "2", "--out", tmp_path)
    assert ran.returncode == 0, ran.stderr
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["traces"] == {"chat.jsonl": str(chat), "rag.jsonl": str(rag)}
    cells = [("chat.jsonl", 0.6), ("chat.jsonl", 0.9), ("rag.jsonl", 0.6), ("rag.jsonl", 0.9)]
    assert [(p["trace"], p["load"]) for p in doc["peer_metrics"]] == cells
    for t in doc["trials"]:
        assert [(m["trace"], m["load"]) for m in t["margins"]] == cells
        assert [(m["trace"], m["load"]) for m in t["metrics"]] == cells
        assert {m["trace"]: m["requests"] for m in t["metrics"]} == {"chat.jsonl": 160,
                                                                     "rag.jsonl": 120}
    assert "2 traces x loads 60%, 90%" in ran.stdout
    assert "cells (trace x load)" in ran.stdout and "  rag.jsonl 90%  peers " in ran.stdout


def test_a_peer_is_tuned_against_kvroute_and_the_other_peers(chat: Path,
                                                              tmp_path: Path) -> None:
    ran = tune_cli(chat, "--policy", "llmd", "--workers", "4", "--loads", "0.9", "--jitter",
                   "1", "--trials", "3", "--jobs", "2", "--out", tmp_path)
    assert ran.returncode == 0, ran.stderr
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["peers"] == ["kvroute", "preble", "chwbl", "sglang", "dynamo",
                            "mooncake_local"]
    trials = doc["trials"]
    assert trials[0]["spec"] == "llmd" and len(trials) == 3
    for t in trials[1:]:
        assert t["spec"].startswith("llmd:")
        assert set(make_policy(t["spec"]).name.split(":")[1:]) <= {
            f"{k}={v:g}" for k, vs in tuning_grid("llmd").values.items() for v in vs}
    assert f"deploy: kvroute router --policy '{doc['recommended']}'" in ran.stdout
    best = next(t for t in trials if t["spec"] == doc["best"])
    assert doc["best_at_grid_edge"] == tuning_grid("llmd").edges(best["params"])
    assert ("at the end of the grid: " in ran.stdout) == bool(doc["best_at_grid_edge"])


@pytest.mark.parametrize(("args", "message"), [
    (["--policy", "preble"], "declares no TUNING grid"),
    (["--policy", "llmd", "--peers", "llmd:queue_weight=2"],
     "--peers must name at least one policy other than llmd"),
    (["--peers", "kvroute:hold=2"], "--peers must name at least one policy other than"),
    (["--peers", "nope"], "unknown policy 'nope'"),
    (["--trials", "0"], "argument --trials: expected an integer >= 1"),
    (["--hit-weight", "nan"], "argument --hit-weight: expected a finite number >= 0"),
    (["--loads", "0,0.5"], "argument --loads: expected comma-separated fractions of capacity"),
    (["--loads", "half"], "argument --loads: expected comma-separated fractions of capacity"),
    (["--jitter", "1,1"], "--jitter factors must differ"),
    (["--policy", "kvroute:hold=x"], "hold takes a number, got 'x'"),
    (["--check", "/nonexistent.jsonl"], "--check: no such file: /nonexistent.jsonl"),
    (["--also", "/nonexistent.jsonl"], "--also: no such file: /nonexistent.jsonl"),
])
def test_bad_arguments_are_refused_before_any_replay(chat: Path, args: list[str],
                                                     message: str) -> None:
    ran = tune_cli(chat, *args)
    assert ran.returncode != 0 and message in ran.stderr, ran.stderr
    assert "tuning" not in ran.stdout  # nothing was replayed



def test_ctrl_c_stops_the_workers_and_reports_the_best_so_far(chat: Path,
                                                              tmp_path: Path) -> None:
    # SIGINT's default disposition restored: a shell's background job would ignore it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute", "tune", str(chat), "--workers", "4", "--loads",
         "0.5,0.6,0.7,0.8,0.9", "--jitter", "0.98,1,1.02", "--trials", "400", "--peers",
         "round_robin", "--jobs", "2", "--no-progress", "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # wait for two variants, so there is a best so far
            lines.append(line)
            if sum(" wins " in x for x in lines) >= 2:
                break
        kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
        assert len(kids) == 2
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        stop_process(proc)  # type: ignore[arg-type]
    assert proc.returncode == 130, err
    assert "interrupted: " in out and "deploy: kvroute router --policy" in out
    assert "Traceback" not in err
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["interrupted"] and 2 <= len(doc["trials"]) < 400
    assert not [k for k in kids if Path(f"/proc/{k}").exists()]  # no replay left running


def test_kvroute_policies_shows_the_grid_tune_searches() -> None:
    def described(name: str) -> str:
        ran = subprocess.run([sys.executable, "-m", "kvroute", "policies", name],
                             capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        return ran.stdout

    for policy in ("kvroute", "llmd", "sglang", "dynamo", "chwbl"):
        out = described(policy)
        assert f"`kvroute tune --policy {policy}` searches the values listed" in out
        for k, values in tuning_grid(policy).values.items():
            assert re.search(rf"^\s+{k}\s+\S+\s+searched: "
                             rf"{re.escape(', '.join(f'{v:g}' for v in values))}$", out, re.M), k
    # A policy without a grid says nothing of tuning.
    assert "searched" not in described("preble")
