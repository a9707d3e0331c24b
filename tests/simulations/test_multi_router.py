"""The replay's multi-router mode (``ClusterSpec.routers``, ``kvroute replay --routers``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.core.policies import make_policy
from kvroute.simulations.replay import ClusterSpec, Replayer, ReplayResult
from kvroute.simulations.trace import Trace, load
from tests.support import MOONCAKE_TRACE


@pytest.fixture(scope="module")
def trace() -> Trace:
    full = load(MOONCAKE_TRACE)
    return Trace(full.requests[:600], full.block_size, full.source).scaled(2.0)


def run(trace: Trace, **spec: object) -> ReplayResult:
    return Replayer(trace, make_policy("kvroute"),
                    ClusterSpec(workers=4, capacity_blocks=600, **spec)).run()  # type: ignore[arg-type]


def outcome(res: ReplayResult) -> list[tuple[str, float, float, int]]:
    return [(r.worker, r.first_token_s, r.finished_s, r.cached_tokens)
            for r in [*res.requests, *res.copies]]


def test_one_router_is_the_single_router_replay(trace: Trace) -> None:
    single = run(trace)
    # The multi-router settings change nothing for one router: its own counts are all the
    # traffic there is, and no decision is shared with anyone.
    for spec in ({"routers": 1}, {"routers": 1, "heartbeat_s": 0.01, "share_inflight": True}):
        assert outcome(run(trace, **spec)) == outcome(single)
    assert single.routed_by == [len(trace.requests)]


@pytest.mark.parametrize("share", [False, True])
def test_several_routers_conserve_requests(trace: Trace, share: bool) -> None:
    res = run(trace, routers=3, share_inflight=share)
    every = [*res.requests, *res.copies]
    # Every request routed once, by the router its turn fell to, and run to its end.
    assert res.routed_by == [200, 200, 200]
    assert [r.router for r in res.requests] == [i % 3 for i in range(len(res.requests))]
    assert {id(r) for w in res.workers for r in w.finished} == {id(r) for r in every}
    assert sum(len(w.finished) for w in res.workers) == len(every)
    for r in every:
        assert r.worker and r.arrival_s <= r.first_token_s <= r.finished_s
    prompt = sum(r.prompt_tokens for r in every)
    assert sum(w.prefill_tokens for w in res.workers) + sum(
        r.cached_tokens for r in every) == prompt
    for w in res.workers:
        assert w.pool.free_blocks == w.pool.capacity_blocks


def test_several_routers_see_others_traffic_late(trace: Trace) -> None:
    # Routers that see each other's traffic only in heartbeats decide otherwise than one
    # router; the same routers with every decision shared decide otherwise again.
    one, blind, shared = (outcome(run(trace, **s)) for s in (
        {}, {"routers": 4}, {"routers": 4, "share_inflight": True}))
    assert blind != one and shared != blind


def test_bad_router_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="routers must be >= 1"):
        ClusterSpec(routers=0)
    with pytest.raises(ValueError, match="heartbeat_s must be > 0"):
        ClusterSpec(routers=2, heartbeat_s=0)


def test_kvroute_replay_routers_option(tmp_path: Path) -> None:
    import subprocess
    import sys

    from kvroute.simulations.gen_cli import write_jsonl
    from kvroute.simulations.generators import generate

    path = tmp_path / "chat.jsonl"
    write_jsonl(generate("chat", 150, 20.0, seed=1), path)
    base = [sys.executable, "-m", "kvroute", "replay", str(path), "--policies", "kvroute",
            "--workers", "4", "--no-progress", "--load", "0.5"]
    run = subprocess.run([*base, "--routers", "3", "--share-inflight"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert any(line.startswith("kvroute ") for line in run.stdout.splitlines())
    bad = subprocess.run([*base, "--routers", "2", "--heartbeat-ms", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "heartbeat_s must be > 0" in bad.stderr
