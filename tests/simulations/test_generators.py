"""Workload generators: valid Mooncake records, deterministic, with the intended sharing."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from kvroute.simulations.gen_cli import infinite_cache_hit_ratio, main, write_jsonl
from kvroute.simulations.generators import KINDS, build, generate

BS = 64


def by_group(kind: str, n: int = 400, **params: float) -> dict[int, list]:
    groups: dict[int, list] = defaultdict(list)
    for r in build(kind, n, 5.0, seed=1, block_size=BS, **params):
        groups[r.group].append(r)
    return groups


def shared_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("kind", KINDS)
def test_records_are_valid_mooncake_lines(kind: str) -> None:
    recs = generate(kind, 300, 10.0, seed=3, block_size=BS)
    assert len(recs) == 300
    assert recs[0]["timestamp"] == 0
    stamps = [r["timestamp"] for r in recs]
    assert stamps == sorted(stamps)
    for r in recs:
        fields = {"timestamp", "input_length", "output_length", "hash_ids", "block_size",
                  "session"}
        # Fork siblings carry their controller program's id (for `replay --programs`).
        assert set(r) == (fields | {"program"} if kind == "fork" else fields)
        assert isinstance(r["timestamp"], int)
        assert r["block_size"] == BS
        assert r["input_length"] >= 1 and r["output_length"] >= 1
        assert len(r["hash_ids"]) == math.ceil(r["input_length"] / BS)
        assert all(isinstance(h, int) and h >= 0 for h in r["hash_ids"])
        assert len(set(r["hash_ids"])) == len(r["hash_ids"])  # each id is a distinct prefix
    # The session is the request's group: a conversation, agent run or fork program.
    groups = {r.group for r in build(kind, 300, 10.0, seed=3, block_size=BS)}
    assert {r["session"] for r in recs} == groups


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_for_a_seed(kind: str) -> None:
    a = generate(kind, 200, 5.0, seed=11, block_size=BS)
    assert a == generate(kind, 200, 5.0, seed=11, block_size=BS)
    assert a != generate(kind, 200, 5.0, seed=12, block_size=BS)


@pytest.mark.parametrize("kind", KINDS)
def test_arrivals_are_poisson_at_the_rate(kind: str) -> None:
    recs = generate(kind, 2000, 10.0, seed=5, block_size=BS)
    span_s = recs[-1]["timestamp"] / 1000
    assert 2000 / span_s == pytest.approx(10.0, rel=0.15)
    if kind == "rag":  # independent arrivals: exponential gaps, coefficient of variation 1
        gaps = [b["timestamp"] - a["timestamp"] for a, b in itertools.pairwise(recs)]
        assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.1)


def test_the_first_n_are_a_prefix_of_a_longer_run() -> None:
    # Asking for more requests extends the trace; it never changes its beginning.
    for kind in KINDS:
        short = generate(kind, 150, 3.0, seed=2, block_size=BS)
        long = generate(kind, 400, 3.0, seed=2, block_size=BS)
        assert [r["timestamp"] for r in short] == [r["timestamp"] for r in long[:150]]
        assert [r["input_length"] for r in short] == [r["input_length"] for r in long[:150]]


def test_chat_turns_extend_the_previous_turn() -> None:
    checked = 0
    for turns in by_group("chat", mean_turns=6).values():
        for prev, cur in itertools.pairwise(turns):
            assert cur.step == prev.step + 1
            assert cur.arrival_s > prev.arrival_s  # after a think time
            # this prompt = previous prompt + previous reply + a new message
            assert cur.input_length > prev.input_length + prev.output_length
            full = prev.input_length // BS
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            if prev.input_length % BS:  # the old partial block is now full and different
                assert cur.hash_ids[full] != prev.hash_ids[full]
            checked += 1
    assert checked > 50


def test_chat_shares_a_few_system_prompts_between_conversations() -> None:
    groups = by_group("chat", system_prompts=3, system_tokens=1024)
    firsts = [g[0].hash_ids[0] for g in groups.values()]
    assert len(set(firsts)) == 3
    sessions = list(groups.values())
    other_session = [shared_prefix(a[0].hash_ids, b[0].hash_ids)
                     for a, b in itertools.pairwise(sessions)
                     if a[0].hash_ids[0] == b[0].hash_ids[0]]
    # sessions with the same system prompt share about its blocks, then diverge
    assert other_session and max(other_session) < 1024 * 3 // BS


def test_agent_calls_extend_the_previous_call_with_output_and_tool_result() -> None:
    checked = 0
    for calls in by_group("agent").values():
        for prev, cur in itertools.pairwise(calls):
            growth = cur.input_length - prev.input_length
            assert growth > prev.output_length  # the tool call + its result
            full = prev.input_length // BS
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            checked += 1
    assert checked > 100


def test_rag_documents_are_shared_zipf_like() -> None:
    reqs = build("rag", 1000, 10.0, seed=4, block_size=BS, templates=1, template_tokens=640,
                 document_tokens=2000)
    template_blocks = 640 // BS  # roughly: the template's length is drawn around its mean
    # the block right after the template names (template, document): count documents
    heads = defaultdict(int)
    for r in reqs:
        heads[r.hash_ids[: template_blocks // 2]] += 1
    assert len(heads) == 1  # one template: every prompt starts the same
    docs = defaultdict(int)
    for r in reqs:
        docs[r.hash_ids[min(len(r.hash_ids) - 1, 40)]] += 1  # deep inside the document
    counts = sorted(docs.values(), reverse=True)
    assert counts[0] > 5 * statistics.median(counts)  # a hot document
    assert infinite_cache_hit_ratio([r.record(BS) for r in reqs]) > 0.5


def test_fork_siblings_arrive_together_share_the_prefix_then_diverge() -> None:
    groups = by_group("fork", fanout=4)
    whole = [g for g in groups.values() if len(g) == 4]
    assert len(whole) > 50
    for sibs in whole:
        assert len({s.arrival_s for s in sibs}) == 1
        lengths = [s.input_length for s in sibs]
        prefix_full = (min(lengths) - 4 * 40 * 3) // BS  # well inside the shared prefix
        assert all(s.hash_ids[:prefix_full] == sibs[0].hash_ids[:prefix_full] for s in sibs)
        lasts = {s.hash_ids[-1] for s in sibs}
        assert len(lasts) == 4  # each branch ends in its own blocks
        common = min(shared_prefix(a.hash_ids, b.hash_ids) for a in sibs for b in sibs
                     if a is not b)
        assert common >= prefix_full


def test_fork_rounds_continue_from_one_branch() -> None:
    # branches long enough to own full blocks, so the ids tell which one was continued
    groups = by_group("fork", n=300, fanout=3, depth=2, branch_tokens=400)
    checked = 0
    for sibs in list(groups.values())[5:40]:
        rounds = defaultdict(list)
        for s in sibs:
            rounds[s.step].append(s)
        if len(rounds) < 2:
            continue
        first, second = rounds[0], rounds[1]
        assert second[0].arrival_s > first[0].arrival_s
        # round 1's prefix extends exactly one round-0 branch
        parents = [f for f in first
                   if second[0].hash_ids[: f.input_length // BS] == f.hash_ids[
                       : f.input_length // BS]]
        assert len(parents) == 1
        checked += 1
    assert checked > 10


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="unknown workload kind"):
        generate("nope", 10, 1.0)
    with pytest.raises(ValueError, match="fanout"):
        generate("fork", 10, 1.0, fanout=0)
    with pytest.raises(ValueError, match="unknown chat parameter"):
        generate("chat", 10, 1.0, fanout=2)
    with pytest.raises(ValueError, match="rate_per_s"):
        generate("rag", 10, 0.0)
    with pytest.raises(ValueError, match="rate_per_s must be a finite number"):
        generate("chat", 10, math.inf)  # every gap 0: it never returned
    assert generate("rag", 0, 1.0) == []


def test_write_jsonl_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = generate("fork", 20, 2.0, seed=1, block_size=BS)
    path = tmp_path / "a.jsonl"
    assert write_jsonl(recs, path) == 20
    assert [json.loads(line) for line in path.read_text().splitlines()] == recs

    out = tmp_path / "b.jsonl"
    rc = main(["fork", "--requests", "20", "--rate", "2", "--seed", "1", "--block-size",
               str(BS), "--out", str(out)])
    assert rc == 0
    assert out.read_text() == path.read_text()
    assert "20 requests" in capsys.readouterr().err

    rc = main(["chat", "--requests", "5", "--param", "mean_turns=2", "--param", "turns=3",
               "--out", str(out)])
    assert rc == 2
    assert "turns=3" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "wanted"), [
    ("--requests", "0", "an integer >= 1"),
    ("--requests", "many", "an integer >= 1"),
    ("--rate", "0", "a finite number > 0"),
    ("--rate", "inf", "a finite number > 0"),
    ("--block-size", "0", "an integer >= 1"),
])
def test_cli_refuses_a_bad_number_by_its_flag(flag: str, value: str, wanted: str,
                                              tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    with pytest.raises(SystemExit) as exc:
        main(["chat", flag, value, "--out", str(out)])
    assert exc.value.code == 2
    assert f"argument {flag}: expected {wanted}, got {value!r}" in capsys.readouterr().err
    assert not out.exists()


def test_infinite_cache_hit_ratio_counts_leading_seen_blocks() -> None:
    recs = [
        {"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1, 2],
         "block_size": 64},
        {"timestamp": 1, "input_length": 150, "output_length": 1, "hash_ids": [1, 3, 4],
         "block_size": 64},
        {"timestamp": 2, "input_length": 100, "output_length": 1, "hash_ids": [1, 2],
         "block_size": 64},
    ]
    # Only full blocks are cached, as by an engine: hits 0, then block 1 (64 tokens), then
    # block 1 again (the identical prompt's second block is partial).
    assert infinite_cache_hit_ratio(recs) == pytest.approx((64 + 64) / 350)
