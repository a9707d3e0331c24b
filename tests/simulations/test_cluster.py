"""One simulated worker: held requests (coalesced siblings, program branches)."""

from __future__ import annotations

import math

from simulations.cluster import SimRequest, SimWorker
from simulations.costmodel import CostModel


def worker() -> SimWorker:
    return SimWorker("w", 1000, 16, CostModel(), lambda *a: None)


def test_a_held_request_joins_the_queue_at_its_parents_first_token_and_hits() -> None:
    w = worker()
    parent = SimRequest(0, 0.0, 1600, 4, tuple(range(100)))
    w.submit(parent, 0.0)
    child = SimRequest(1, 0.0, 1616, 4, tuple(range(101)))
    child.after = parent
    w.submit(child, 0.0)
    other = SimRequest(2, 0.0, 160, 4, tuple(range(1000, 1010)))
    w.submit(other, 0.0)
    assert (len(w.held), len(w.waiting)) == (1, 2)
    assert w.load(0, 0.0).inflight == 3  # held is the router's load, not the engine queue
    w.advance(math.inf)
    assert other.first_token_s == parent.first_token_s  # the held one blocked no one
    assert child.first_token_s > parent.first_token_s
    assert child.cached_tokens == 1600  # admitted after the prefix was stored
    assert all(math.isfinite(r.finished_s) for r in (parent, child, other))


def test_only_held_requests_left_idle_until_their_release() -> None:
    """The parent's first token can come after it finished here (a KV transfer it waited
    for ends late): the worker waits for that, it does not give up."""
    w = worker()
    parent = SimRequest(0, 0.0, 160, 1, tuple(range(10)))
    parent.ready_s = 5.0
    w.submit(parent, 0.0)
    child = SimRequest(1, 0.001, 160, 2, tuple(range(10)))
    child.after = parent
    w.submit(child, 0.001)
    w.advance(1.0)
    assert w.held == [child]  # not yet: its parent's first token is at 5 s
    w.advance(math.inf)
    assert child.first_token_s > 5.0 and math.isfinite(child.finished_s)
