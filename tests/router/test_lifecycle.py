"""A request's stay on a worker: everything begin() adds is undone once, however the
request ends (router/lifecycle.py)."""

from __future__ import annotations

from types import SimpleNamespace

from kvroute.core.index import PrefixIndex
from kvroute.core.redis_schema import Heartbeat
from kvroute.router.coalesce import InflightPrefixes
from kvroute.router.lifecycle import Lifecycle
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerRegistry


def setup() -> tuple[Lifecycle, WorkerRegistry, PrefixIndex]:
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats({w: Heartbeat(w, f"127.0.0.1:{i + 1}", "e")
                          for i, w in enumerate(("a", "b"))})
    index = PrefixIndex()
    mirror = SimpleNamespace(index=index, shared=None)
    life = Lifecycle(reg, mirror, InflightPrefixes(0.8), RouterMetrics(), 60.0)  # type: ignore[arg-type]
    return life, reg, index


def idle(reg: WorkerRegistry, w: str) -> bool:
    ld = reg.loads[w]
    return (ld.inflight, ld.pending_prefill_tokens, ld.pending_prefill_context) == (0, 0, 0)


def test_a_served_request_leaves_nothing_and_its_blocks_predicted() -> None:
    life, reg, index = setup()
    stay = life.begin("r1", "a", 100, 500, [1, 2, 3], extra=7, weight=2, predict=True)
    ld = reg.loads["a"]
    assert (ld.inflight, ld.pending_prefill_tokens, ld.pending_prefill_context) == (2, 107, 500)
    assert index.match([1, 2, 3]) == {"a": 3} and not stay.stored.is_set()
    life.first_token(stay)
    life.first_token(stay)  # once only
    assert stay.stored.is_set() and reg.loads["a"].pending_prefill_tokens == 7
    life.end(stay)
    life.end(stay)
    assert idle(reg, "a") and index.match([1, 2, 3]) == {"a": 3}  # still predicted


def test_a_failed_request_withdraws_its_predictions() -> None:
    life, reg, index = setup()
    stay = life.begin("r1", "a", 100, 500, [1, 2, 3], predict=True)
    life.end(stay)  # never started: its pending prefill goes too
    life.withdraw(stay)
    assert idle(reg, "a") and index.match([1, 2, 3]) == {}


def test_a_stay_moved_to_another_worker_ends_there() -> None:
    life, reg, index = setup()
    stay = life.begin("r1", "a", 100, 500, [1, 2], predict=True)
    life.move(stay, "b")
    assert idle(reg, "a") and index.match([1, 2]) == {}
    assert reg.loads["b"].pending_prefill_tokens == 100 and reg.loads["b"].inflight == 1
    life.first_token(stay)
    life.end(stay)
    assert idle(reg, "b")
