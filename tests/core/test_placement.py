"""The program placement rule: split fork, child weights, and where overflow goes."""

from __future__ import annotations

from kvroute.core.load import WorkerLoad
from kvroute.core.placement import fork_segment, headroom, place_fork, program_fanout
from kvroute.core.policies.base import RouteQuery, Scored
from kvroute.v1 import program_pb2 as P  # noqa: N812


def gen(n: int = 4) -> P.Step:
    return P.Step(gen=P.Gen(max_tokens=n))


def fork(*subs: list[P.Step], n: int = 0, select: int = 0) -> P.Step:
    return P.Step(fork=P.Fork(branches=[P.ControllerProgram(steps=s) for s in subs], n=n,
                              select=select))


def prog(*steps: P.Step) -> P.ControllerProgram:
    return P.ControllerProgram(steps=list(steps))


def test_the_split_fork_is_the_first_top_level_fork_and_its_segment_ends_at_a_select() -> None:
    p = prog(gen(), fork([gen()], n=3), gen(), fork([gen()], n=2), P.Step(select=P.Select(
        mode=P.SELECT_MODE_BEST_LOGPROB)), gen())
    seg = fork_segment(p)
    assert seg is not None and seg.step == 1 and len(seg.children) == 3
    assert len(seg.rest) == 2 and seg.end == 4  # gen + the nested fork, not the select
    assert seg.weights() == [2, 2, 2]  # each child forks in two after the fork
    remote = seg.remote_program([0, 2])
    assert len(remote.steps[0].fork.branches) == 2
    assert remote.steps[0].fork.select == P.SELECT_MODE_ALL and len(remote.steps) == 3


def test_a_joining_fork_keeps_its_rest_here_and_tiny_forks_do_not_split() -> None:
    seg = fork_segment(prog(fork([gen()], [gen()], select=P.SELECT_MODE_BEST_LOGPROB), gen()))
    assert seg is not None and seg.rest == [] and seg.end == 1
    assert fork_segment(prog(gen(), fork([gen()]))) is None
    assert fork_segment(prog(gen())) is None
    assert program_fanout(prog(fork([gen()], n=4), gen())) == 4


def query(loads: dict[str, WorkerLoad], matched: dict[str, int]) -> RouteQuery:
    return RouteQuery(64, 16, matched, loads, 0)


def ranked(*ws: str) -> list[Scored]:
    return [Scored(w, float(i)) for i, w in enumerate(ws)]


def test_headroom_counts_running_queued_and_inflight() -> None:
    assert headroom(WorkerLoad()) is None  # max_running unknown: never split
    assert headroom(WorkerLoad(running=3, max_running=8)) == 5
    assert headroom(WorkerLoad(inflight=6, running=1, max_running=8)) == 2
    assert headroom(WorkerLoad(running=3, queued=1, max_running=8)) == 0  # KV or slots full


def test_nothing_moves_while_the_chosen_worker_has_room() -> None:
    loads = {"a": WorkerLoad(max_running=8), "b": WorkerLoad(max_running=8)}
    assert place_fork(ranked("a", "b"), query(loads, {}), [1] * 8) == ()
    unknown = {"a": WorkerLoad(running=100), "b": WorkerLoad(max_running=8)}
    assert place_fork(ranked("a", "b"), query(unknown, {}), [1] * 4) == ()


def test_overflow_goes_to_the_next_longest_prefix_with_room_and_the_rest_stays() -> None:
    loads = {"a": WorkerLoad(running=6, max_running=8),   # room for 2
             "b": WorkerLoad(max_running=8),              # ranked 2nd, no prefix
             "c": WorkerLoad(running=7, max_running=8),   # longest other prefix, room 1
             "d": WorkerLoad(running=8, max_running=8)}   # full, though it has the prefix
    q = query(loads, {"a": 4, "c": 3, "d": 4})
    out = place_fork(ranked("a", "b", "c", "d"), q, [1] * 6)
    assert [(o.worker, o.children, o.weight) for o in out] == [("c", (2,), 1),
                                                               ("b", (3, 4, 5), 3)]
    full = {w: WorkerLoad(running=8, max_running=8) for w in "ab"}
    assert place_fork(ranked("a", "b"), query(full, {}), [1] * 4) == ()


def test_children_are_placed_by_weight() -> None:
    loads = {"a": WorkerLoad(max_running=4), "b": WorkerLoad(max_running=3)}
    out = place_fork(ranked("a", "b"), query(loads, {}), [3, 2, 2, 1])
    # a keeps child 0 (3) and child 3 (1); b takes child 1 (2); child 2 fits nowhere: stays.
    assert [(o.worker, o.children, o.weight) for o in out] == [("b", (1,), 2)]


def test_a_programs_fast_forwards_count_as_prefill_in_every_branch() -> None:
    from kvroute.core.placement import program_prefill_tokens

    def ff_text(t: str) -> P.Step:
        return P.Step(fast_forward=P.FastForward(text=t))

    def ff_ids(*ids: int) -> P.Step:
        return P.Step(fast_forward=P.FastForward(tokens=P.TokenIds(ids=list(ids))))

    p = prog(ff_text("héllo"), fork([ff_ids(1, 2, 3), gen()], n=4), ff_ids(9),
             P.Step(select=P.Select(mode=P.SELECT_MODE_BEST_LOGPROB)), ff_ids(8, 8))
    # 6 UTF-8 bytes, 3 in each of 4 children, 1 in each of the 4 live branches, 2 after the join
    assert program_prefill_tokens(p) == 6 + 12 + 4 + 2
    assert program_prefill_tokens(prog(gen())) == 0


def test_behind_a_queue_children_move_only_where_they_start_sooner() -> None:
    # The prompt is 64 tokens (query()): a's queue holds 100 tokens of prefill.
    busy = WorkerLoad(running=2, queued=1, pending_prefill_tokens=100, max_running=8)
    loads = {"a": busy,
             "b": WorkerLoad(pending_prefill_tokens=50, max_running=8),  # 50 + 64 >= 100
             "c": WorkerLoad(pending_prefill_tokens=40, max_running=8)}  # 40 + 64 - 48 < 100
    out = place_fork(ranked("a", "b", "c"), query(loads, {"c": 3}), [1, 1, 1])
    assert [(o.worker, o.children) for o in out] == [("c", (1, 2))]
    loads["c"] = WorkerLoad(pending_prefill_tokens=90, max_running=8)
    assert place_fork(ranked("a", "b", "c"), query(loads, {"c": 3}), [1, 1, 1]) == ()
