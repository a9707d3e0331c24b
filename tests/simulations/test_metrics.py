"""What a replay's p99 tail is made of (``kvroute.simulations.metrics.tail_of``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvroute.core.policies.cost_model import CostModel
from kvroute.simulations.cli import make_policies
from kvroute.simulations.cluster import SimRequest
from kvroute.simulations.generators import generate
from kvroute.simulations.metrics import Tail, measure, tail_of
from kvroute.simulations.replay import ClusterSpec, Replayer
from kvroute.simulations.report import table
from kvroute.simulations.trace import parse

COST = CostModel()


def served(idx: int, prompt: int, cached: int, ttft: float) -> SimRequest:
    r = SimRequest(idx=idx, arrival_s=float(idx), prompt_tokens=prompt, output_tokens=1,
                   keys=())
    r.cached_tokens = cached
    r.first_token_s = r.arrival_s + ttft
    return r


def test_the_tail_says_what_its_requests_waited_for() -> None:
    # 297 quick requests, then the three slowest (at or above the p99 of 300):
    reqs = [served(i, 200, 0, 0.02) for i in range(297)]
    long_prompt = served(297, 8000, 0, COST.prefill_s(8000, 0) + 0.01)  # its own prefill
    held = served(298, 4000, 3800, 0.9)  # most of it cached there, waited for other work
    queued = served(299, 3000, 1000, 1.0)  # less than half cached, waited for other work
    reqs += [long_prompt, held, queued]
    ttft = np.array([r.first_token_s - r.arrival_s for r in reqs])
    tail = tail_of(reqs, ttft, COST)
    own = [COST.prefill_s(8000, 0), COST.prefill_s(200, 3800), COST.prefill_s(2000, 1000)]
    assert tail == Tail(3, pytest.approx(sum(own) / sum(ttft[-3:])), 1, 1)
    # A request that waited less than its own prefill took is its prefill's, not the queue's.
    reqs[-1] = served(299, 3000, 1000, 2 * COST.prefill_s(2000, 1000) - 1e-3)
    ttft[-1] = reqs[-1].first_token_s - reqs[-1].arrival_s
    assert tail_of(reqs, ttft, COST)[2:] == (1, 0)
    assert tail_of([], np.array([]), COST) == Tail(0, 0.0, 0, 0)


def test_a_replay_reports_its_tail() -> None:
    trace = parse(json.dumps(r) for r in generate("chat", 400, 40.0, seed=2))
    spec = ClusterSpec(workers=4, capacity_blocks=2000)
    rows = []
    for name in ("kvroute", "round_robin"):
        res = Replayer(trace, make_policies(name, 0)[0](), spec).run()
        m = measure(res)
        ttft = np.array([r.first_token_s - r.arrival_s for r in res.measured])
        assert m.tail_requests == int((ttft >= np.percentile(ttft, 99)).sum()) >= 4
        assert m.tail_held + m.tail_queued <= m.tail_requests
        assert 0 < m.tail_own_share <= 1
        rows.append(m)
    text = table(rows, {"infinite cache": 1.0})
    (line,) = [x for x in text.splitlines() if x.startswith("p99 tail")]
    for m in rows:
        assert (f"{m.policy} {m.tail_own_share:.0%} / {m.tail_held:.3g} / "
                f"{m.tail_queued:.3g} of {m.tail_requests:.3g}") in line
