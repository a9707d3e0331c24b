"""``kvroute replay`` as users run it: a real subprocess, its files, its errors."""

from __future__ import annotations

import csv
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.simulations.gen_cli import write_jsonl
from kvroute.simulations.generators import generate


def replay(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvroute", "replay", *map(str, args),
                           "--no-progress"], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "chat.jsonl"
    write_jsonl(generate("chat", 240, 20.0, seed=4), path)
    return path


def test_replay_writes_results_and_plots(chat: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    ran = replay(chat, "--workers", "4", "--policies", "kvroute,round_robin", "--load", "0.8",
                 "--out", out)
    assert ran.returncode == 0, ran.stderr
    assert "replaying at rate x" in ran.stdout and "= 80% of capacity" in ran.stdout
    doc = json.loads((out / "results.json").read_text())
    assert {p["policy"] for p in doc["policies"]} == {"kvroute", "round_robin"}
    assert doc["meta"]["load"] == pytest.approx(0.8) and doc["meta"]["jitters"] == []
    # The router's settings are in the results, and said up front: the router's defaults.
    assert (doc["meta"]["predict_ttl_ms"], doc["meta"]["coalesce_share"]) == (600000, 0.8)
    assert (doc["meta"]["workers"], doc["meta"]["programs"]) == (4, False)
    assert "router: coalescing on (predictions until stored, at most 600 s" in ran.stdout
    # Chat turns carry the previous reply: said up front, and in the results.
    replies = doc["meta"]["replies"]
    assert 0 < replies < 240 and doc["meta"]["reply_tokens"] > 0
    assert f"replies: {replies} requests' replies are continued by a later prompt" in ran.stdout
    # ... and their continuations are sent at their trace times (open loop), unless
    # --closed-loop (below).
    assert doc["meta"]["closed_loop"] is False
    assert "requests carry an earlier reply; each is sent at its trace time, even before" \
        in ran.stdout
    assert all(p["waited_ratio"] == 0 for p in doc["policies"])
    assert "runs" not in doc and "verdicts" not in doc
    inf = doc["bounds"]["infinite cache"]
    floor = doc["ttft_floor"]
    assert 0 < floor["p50_s"] <= floor["p99_s"] and floor["mean_s"] > 0
    assert f"p99 {floor['p99_s']:.2f}s; no policy's TTFT can be lower" in ran.stdout
    for p in doc["policies"]:
        assert p["requests"] == 240 and 0 < p["hit_ratio"] <= inf
        assert p["ttft_p50_s"] <= p["ttft_p99_s"]
        for key in ("mean_s", "p50_s", "p99_s"):
            assert p[f"ttft_{key}"] >= floor[key]
    with (out / "results.csv").open() as f:
        assert [r["policy"] for r in csv.DictReader(f)] == [p["policy"] for p in doc["policies"]]
    # requests.csv: a row per request and policy, adding up to the policy's figures.
    assert "requests.csv (a row per request and policy)" in ran.stdout
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    for p in doc["policies"]:
        mine = [r for r in rows if r["policy"] == p["policy"]]
        assert [int(r["request"]) for r in mine] == list(range(240))
        tokens = {col: sum(int(r[col]) for r in mine) for col in (
            "prompt_tokens", "cached_tokens", "moved_tokens", "flight_tokens", "stale_tokens",
            "evicted_tokens")}
        for col, ratio in (("cached_tokens", "hit_ratio"), ("moved_tokens", "moved_ratio"),
                           ("flight_tokens", "inflight_ratio"),
                           ("stale_tokens", "stale_ratio"), ("evicted_tokens", "evicted_ratio")):
            assert tokens[col] / tokens["prompt_tokens"] == pytest.approx(p[ratio]), col
        # Every token the infinite cache hits is got or missed for one reason.
        assert sum(p[k] for k in ("hit_ratio", "moved_ratio", "inflight_ratio", "stale_ratio",
                                  "evicted_ratio")) == pytest.approx(
            doc["bounds"]["infinite cache"]), p["policy"]
        assert tokens["flight_tokens"] > 0  # open loop: turns overtake their replies
        assert statistics.mean(float(r["ttft_s"]) for r in mine) == pytest.approx(
            p["ttft_mean_s"])
        assert len({r["worker"] for r in mine}) == 4
        sent = {int(r["request"]): float(r["sent_s"]) for r in mine}
        for r in mine:
            assert float(r["floor_s"]) - 1e-9 <= float(r["ttft_s"]) <= float(r["e2e_s"])
            # a token missed is missed for one reason: flight and stale only where the
            # request neither got it nor was sent away from it
            assert int(r["flight_tokens"]) + int(r["stale_tokens"]) <= max(
                0, int(r["prompt_tokens"]) - int(r["cached_tokens"]) - int(r["moved_tokens"]))
            if r["held_for"] == "copy":  # held for a background copy: only kvroute makes them
                assert p["policy"] == "kvroute"
            elif r["held_for"]:  # coalesced: waited for a request sent before it
                assert sent[int(r["held_for"])] <= sent[int(r["request"])]
    for png in ("ttft_cdf.png", "hit_ratio.png", "load_over_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Deterministic: the same replay gives the same figures (wall time aside).
    again = replay(chat, "--workers", "4", "--policies", "kvroute,round_robin", "--load",
                   "0.8", "--out", tmp_path / "again")
    assert again.returncode == 0, again.stderr
    doc2 = json.loads((tmp_path / "again" / "results.json").read_text())
    strip = [{k: v for k, v in p.items() if k != "wall_s"} for p in doc["policies"]]
    assert strip == [{k: v for k, v in p.items() if k != "wall_s"} for p in doc2["policies"]]



def test_a_warm_up_runs_but_is_left_out_of_every_figure(chat: Path, tmp_path: Path) -> None:
    ran = replay(chat, "--workers", "4", "--policies", "kvroute,round_robin", "--load", "0.8",
                 "--warmup", "60", "--out", tmp_path / "warm")
    assert ran.returncode == 0, ran.stderr
    assert "warm-up: the first 60 requests run but are not measured (180 are)" in ran.stdout
    doc = json.loads((tmp_path / "warm" / "results.json").read_text())
    assert doc["meta"]["warmup"] == 60 and doc["meta"]["requests"] == 240
    with (tmp_path / "warm" / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    for p in doc["policies"]:
        mine = [r for r in rows if r["policy"] == p["policy"]]
        assert [int(r["warmup"]) for r in mine] == [1] * 60 + [0] * 180  # all 240 rows
        measured = mine[60:]
        assert p["requests"] == 180
        assert statistics.mean(float(r["ttft_s"]) for r in measured) == pytest.approx(
            p["ttft_mean_s"])
        assert sum(int(r["cached_tokens"]) for r in measured) / sum(
            int(r["prompt_tokens"]) for r in measured) == pytest.approx(p["hit_ratio"])
        assert p["hit_ratio"] <= doc["bounds"]["infinite cache"]
        assert p["ttft_mean_s"] >= doc["ttft_floor"]["mean_s"]
    # The same replay measured whole: every request ran alike, only the figures differ.
    whole = replay(chat, "--workers", "4", "--policies", "kvroute,round_robin", "--load",
                   "0.8", "--out", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    with (tmp_path / "whole" / "requests.csv").open() as f:
        same = list(csv.DictReader(f))
    assert [(r["worker"], r["ttft_s"]) for r in same] == [(r["worker"], r["ttft_s"])
                                                          for r in rows]
    # The warm-up's first requests find the caches empty: leaving them out raises the bounds.
    doc0 = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert doc["bounds"]["infinite cache"] > doc0["bounds"]["infinite cache"]
    assert doc0["meta"]["warmup"] == 0 and all(p["requests"] == 240 for p in doc0["policies"])
    ran = replay(chat, "--policies", "kvroute", "--warmup", "240")
    assert ran.returncode == 1 and "--warmup: warm-up must leave a request to measure" \
        in ran.stderr and "Traceback" not in ran.stderr
    # In seconds of trace time: the requests that arrive in the trace's first 3 s.
    secs = replay(chat, "--workers", "4", "--policies", "kvroute", "--warmup", "3s", "--out",
                  tmp_path / "secs")
    assert secs.returncode == 0, secs.stderr
    with (tmp_path / "secs" / "requests.csv").open() as f:
        timed = list(csv.DictReader(f))
    early = sum(1 for r in timed if float(r["sent_s"]) - float(timed[0]["sent_s"]) < 3.0)
    assert 0 < early < 240 and [int(r["warmup"]) for r in timed] == [1] * early + [0] * (
        240 - early)
    assert json.loads((tmp_path / "secs" / "results.json").read_text())["meta"]["warmup"] \
        == early


def test_closed_loop_sends_continuations_when_their_replies_end(chat: Path,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "res"
    ran = replay(chat, "--workers", "4", "--policies", "kvroute", "--load", "0.8",
                 "--closed-loop", "--out", out)
    assert ran.returncode == 0, ran.stderr
    assert "each is sent at its trace time or when that reply ends, whichever is later" \
        in ran.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["closed_loop"] is True
    (p,) = doc["policies"]
    assert 0 < p["waited_ratio"] < 1 and p["waited_mean_s"] > 0 and p["requests"] == 240
    assert f"sent when the reply they carry ended, after their trace time: kvroute " \
           f"{p['waited_ratio']:.1%} of requests" in ran.stdout
    # The sessions set the pace: the load actually offered is said, at most the one asked for.
    m = re.search(r"closed loop: requests were sent at (\d+)% of capacity \(kvroute\)",
                  ran.stdout)
    assert m is not None and 0 < int(m.group(1)) <= 80


def test_jitter_averages_the_runs_and_gives_verdicts(chat: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    ran = replay(chat, "--workers", "4", "--policies", "kvroute,round_robin,llmd", "--load",
                 "0.8", "--jitter", "0.97,1,1.03", "--out", out)
    assert ran.returncode == 0, ran.stderr
    assert "averaged over rate jitters x0.97, x1, x1.03" in ran.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["jitters"] == [0.97, 1.0, 1.03]
    for p in doc["policies"]:
        runs = doc["runs"][p["policy"]]
        assert len(runs) == 3
        for field in ("ttft_mean_s", "ttft_p99_s", "hit_ratio"):
            assert p[field] == pytest.approx(sum(r[field] for r in runs) / 3)
        # Faster replays are different replays.
        assert len({r["ttft_mean_s"] for r in runs}) > 1
    verdicts = {v["metric"]: v for v in doc["verdicts"]}
    assert set(verdicts) == {"mean TTFT", "p99 TTFT", "hit ratio"}
    best = min(doc["policies"], key=lambda p: p["ttft_mean_s"])
    mean = verdicts["mean TTFT"]
    assert mean["leader"] == best["policy"] and mean["value"] == pytest.approx(best["ttft_mean_s"])
    lead = doc["runs"][mean["leader"]]
    behind = doc["runs"][mean["runner_up"]]
    ahead = sum(a["ttft_mean_s"] < b["ttft_mean_s"] for a, b in zip(lead, behind, strict=True))
    assert mean["ahead_in"] == ahead and mean["consistent"] == (ahead == 3)
    assert mean["tie_chance"] == pytest.approx(0.25 if ahead in (0, 3) else 1.0)
    line = next(ln for ln in ran.stdout.splitlines() if ln.strip().startswith("mean TTFT:"))
    assert f"ahead at {ahead}/3 jitters" in line
    assert ("within noise" in line) == (ahead < 3)
    # --focus: that policy against the best of the others, whoever leads.
    ran = replay(chat, "--workers", "4", "--policies", "kvroute,round_robin,llmd", "--load",
                 "0.8", "--jitter", "0.97,1.03", "--focus", "round_robin", "--out", out)
    assert ran.returncode == 0, ran.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["focus"] == "round_robin"
    for v in doc["verdicts"]:
        assert "round_robin" in (v["leader"], v["runner_up"]), v


def test_nudged_jitters_are_other_replays_and_the_same_on_every_run(chat: Path,
                                                                      tmp_path: Path) -> None:
    """--nudge moves each jitter's arrivals too (a seed per rate): the figures differ from
    the plain jitters', a second run gives the same ones, and the results say so."""
    def runs(*extra: str) -> dict[str, list[tuple[float, ...]]]:
        out = tmp_path / "-".join(extra or ("plain",))
        ran = replay(chat, "--workers", "4", "--policies", "kvroute,llmd", "--load", "0.8",
                     "--jitter", "0.99,1.01", "--out", out, *extra)
        assert ran.returncode == 0, ran.stderr
        doc = json.loads((out / "results.json").read_text())
        assert doc["meta"]["nudge"] == (float(extra[1]) if extra else 0.0)
        if extra:
            assert "arrivals nudged by up to 1 x half their gaps" in ran.stdout
        return {p: [(r["ttft_mean_s"], r["ttft_p99_s"], r["hit_ratio"]) for r in rs]
                for p, rs in doc["runs"].items()}  # wall times differ

    plain, nudged = runs(), runs("--nudge", "1")
    assert nudged != plain
    assert runs("--nudge", "1") == nudged
    bad = replay(chat, "--nudge", "1.5", "--jitter", "1")
    assert bad.returncode != 0 and "--nudge" in bad.stderr


def test_match_load_compares_a_slower_policy_at_the_focus_load(chat: Path,
                                                                tmp_path: Path) -> None:
    # Mooncake-local ignores decode load, so its replies end later and its clients send less
    # than round-robin's; it leads round-robin, so it is replayed faster until they send as
    # much.
    out = tmp_path / "res"
    ran = replay(chat, "--workers", "4", "--policies", "round_robin,mooncake_local", "--load",
                 "0.8", "--closed-loop", "--jitter", "0.97,1.03", "--focus", "round_robin",
                 "--match-load", "--out", out)
    assert ran.returncode == 0, ran.stderr
    doc = json.loads((out / "results.json").read_text())
    (m,) = doc["matched"]
    sent = {p["policy"]: p["sent_rps"] for p in doc["policies"]}
    assert m["policy"] == "mooncake_local" and m["reached"] is True
    assert sent["mooncake_local"] < sent["round_robin"] and m["rate_factor"] > 1.0
    assert m["target_load"] - 0.01 <= m["sent_load"] and len(m["runs"]) == 2
    assert m["mean"]["sent_rps"] > sent["mooncake_local"]
    assert [r["ttft_mean_s"] for r in m["runs"]] != [
        r["ttft_mean_s"] for r in doc["runs"]["mooncake_local"]]
    assert {v["metric"] for v in doc["matched_verdicts"]} == {"mean TTFT", "p99 TTFT",
                                                             "hit ratio"}
    assert "at round_robin's load (the lighter policies that lead it, replayed faster):" \
        in ran.stdout
    assert f"mooncake_local: sent {m['sent_load']:.0%} at {m['rate_factor']:.3g}x the rate" \
        in ran.stdout
    ran = replay(chat, "--workers", "4", "--policies", "round_robin,mooncake_local", "--load",
                 "0.8", "--jitter", "0.97,1.03", "--focus", "round_robin", "--match-load")
    assert ran.returncode != 0 and "it needs --closed-loop, --jitter and --focus" in ran.stderr


def test_a_jittered_sweep_writes_each_load_and_the_plot(chat: Path, tmp_path: Path) -> None:
    ran = replay(chat, "--workers", "4", "--policies", "kvroute,round_robin", "--sweep",
                 "--jitter", "0.98,1.02", "--out", tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.count("averaged over rate jitters x0.98, x1.02") == 4
    for ld in (50, 65, 80, 95):
        doc = json.loads((tmp_path / f"load_{ld}" / "results.json").read_text())
        assert doc["meta"]["load"] == pytest.approx(ld / 100)
        assert doc["meta"]["workers"] == 4 and doc["meta"]["trace"] == str(chat)
        assert {k: len(v) for k, v in doc["runs"].items()} == {"kvroute": 2, "round_robin": 2}
        assert len(doc["verdicts"]) == 3
        with (tmp_path / f"load_{ld}" / "requests.csv").open() as f:
            assert len(list(csv.DictReader(f))) == 2 * 240
    assert (tmp_path / "sweep_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_over_loads_of_ones_own(chat: Path, tmp_path: Path) -> None:
    ran = replay(chat, "--workers", "4", "--policies", "round_robin", "--sweep", "0.9,0.3",
                 "--out", tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert re.findall(r"== load (\d+)% of capacity", ran.stdout) == ["30", "90"]
    assert sorted(p.name for p in tmp_path.glob("load_*")) == ["load_30", "load_90"]
    for bad in ("0,0.5", "2.5", "half"):
        ran = replay(chat, "--sweep", bad)
        assert ran.returncode == 2
        assert (f"argument --sweep: expected comma-separated fractions of capacity in (0, 2], "
                f"got {bad!r}") in ran.stderr


def test_variants_of_one_policy_replay_side_by_side(chat: Path, tmp_path: Path) -> None:
    ran = replay(chat, "--workers", "4", "--policies", "kvroute,kvroute:decode=1000",
                 "--load", "0.9", "--out", tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "kvroute:decode=1000 " in ran.stdout  # the table names the variant
    rows = {p["policy"]: p for p in json.loads((tmp_path / "results.json").read_text())
            ["policies"]}
    assert set(rows) == {"kvroute", "kvroute:decode=1000"}
    # Running sequences 200x dearer: requests leave their caches for smaller batches.
    variant, default = rows["kvroute:decode=1000"], rows["kvroute"]
    assert variant["hit_ratio"] < default["hit_ratio"]
    assert variant["moved_ratio"] > default["moved_ratio"]


def test_background_copies_are_reported_apart_from_the_hit_ratio(tmp_path: Path) -> None:
    rag = tmp_path / "rag.jsonl"
    write_jsonl(generate("rag", 600, 20.0, seed=1, block_size=64), rag)

    def run(*extra: str) -> tuple[dict, str]:  # type: ignore[type-arg]
        out = tmp_path / f"out{len(extra)}"
        ran = replay(rag, "--workers", "4", "--policies", "kvroute", "--load", "0.6",
                     "--out", out, *extra)
        assert ran.returncode == 0, ran.stderr
        doc = json.loads((out / "results.json").read_text())
        return doc, ran.stdout

    (copying, stdout), (moving, moving_out) = run(), run("--no-copies")
    assert copying["meta"]["copies"] is True and moving["meta"]["copies"] is False
    copied, moved = copying["policies"][0], moving["policies"][0]
    assert copied["copies"] > 0 and copied["copied_ratio"] > 0
    assert moved["copies"] == 0 and moved["copied_ratio"] == 0
    line = next(x for x in stdout.splitlines() if x.startswith("kvroute also copied"))
    noun = "copy" if copied["copies"] == 1 else "copies"
    assert f"{copied['copies']} {noun} prefilled {copied['copied_ratio']:.2%}" in line
    assert f"the hit ratio would be {copied['hit_ratio'] - copied['copied_ratio']:.1%}" in line
    assert "also copied" not in moving_out


def test_bad_input_is_refused_with_a_clear_error(chat: Path, tmp_path: Path) -> None:
    ran = replay(chat, "--policies", "kvroute", "--jitter", "1,1")
    assert ran.returncode != 0 and "--jitter factors must differ" in ran.stderr
    ran = replay(chat, "--policies", "kvroute,nope")
    assert ran.returncode != 0 and "unknown policy 'nope'" in ran.stderr
    ran = replay(chat, "--policies", "kvroute:delay=x")
    assert ran.returncode != 0 and "delay takes a number, got 'x'" in ran.stderr
    ran = replay(chat, "--policies", "kvroute,llmd", "--jitter", "1,1.02", "--focus", "preble")
    assert ran.returncode != 0 and "--focus needs --jitter and one of --policies" in ran.stderr
    ran = replay(chat, "--policies", "kvroute, kvroute")
    assert ran.returncode != 0 and "lists a policy twice" in ran.stderr
    # Numbers out of range are refused by name (--load 0 was a traceback, a negative
    # --propagation-ms ran).
    for option, value, want in [("--load", "0", "a finite number > 0"),
                                ("--rate-scale", "nan", "a finite number > 0"),
                                ("--propagation-ms", "-1", "a finite number >= 0"),
                                ("--coalesce-share", "1.5", "a finite number in [0, 1]"),
                                ("--capacity-blocks", "-1", "an integer >= 0"),
                                ("--warmup", "-5", "a number of requests (600) or seconds "
                                                   "of trace time (30s)"),
                                ("--warmup", "nans", "a number of requests (600) or seconds "
                                                     "of trace time (30s)"),
                                ("--long-prefill-threshold", "-1", "an integer >= 0"),
                                ("--workers", "two", "an integer >= 1")]:
        ran = replay(chat, "--policies", "kvroute", option, value)
        assert ran.returncode == 2, (option, ran.stderr)
        assert f"argument {option}: expected {want}, got '{value}'" in ran.stderr
        assert "Traceback" not in ran.stderr
    # A cap on a prefill's chunks needs chunks.
    ran = replay(chat, "--policies", "kvroute", "--long-prefill-threshold", "2048")
    assert ran.returncode != 0 and "needs chunked prefill (--chunked-prefill)" in ran.stderr
    assert "Traceback" not in ran.stderr
    ran = replay(chat, "--policies", "kvroute", "--chunked-prefill", "--prefill-budget", "4096",
                 "--long-prefill-threshold", "512", "--out", tmp_path / "capped")
    assert ran.returncode == 0, ran.stderr
    meta = json.loads((tmp_path / "capped" / "results.json").read_text())["meta"]
    assert (meta["chunked_prefill"], meta["long_prefill_threshold"]) == (True, 512)
    bad = tmp_path / "bad.jsonl"
    lines = chat.read_text().splitlines()
    bad.write_text("\n".join([lines[0], "{broken", *lines[1:5]]) + "\n")
    ran = replay(bad, "--policies", "kvroute", "--strict")
    assert ran.returncode == 2 and f"{bad}:2:" in ran.stderr
    ran = replay(bad, "--policies", "kvroute", "--workers", "2")
    assert ran.returncode == 0, ran.stderr
    assert "warning: skipped" in ran.stderr and ":2:" in ran.stderr
