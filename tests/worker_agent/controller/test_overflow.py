"""A placement's moved fork children as calls to their workers, and remote branch ids
mapped back to local ones."""

from __future__ import annotations

from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from kvroute.worker_agent.controller.branch import Branch
from kvroute.worker_agent.controller.overflow import Target, check_placement, remote_id


def fork_program(n: int) -> P.ControllerProgram:
    gen = P.Step(gen=P.Gen(max_tokens=4))
    return P.ControllerProgram(steps=[P.Step(fork=P.Fork(
        branches=[P.ControllerProgram(steps=[gen])], n=n))])


def test_moved_children_go_one_call_per_worker_or_one_per_child() -> None:
    placement = P.Placement(fork_step=0, overflow=[
        P.Overflow(worker_id="w2", address="h2:1", children=[1, 3]),
        P.Overflow(worker_id="w3", address="h3:1", children=[4])])
    split = check_placement(fork_program(5), placement, "w1", 8)
    assert split is not None and split.moved == {1, 3, 4}
    w2, w3 = Target("w2", "h2:1", (1, 3)), Target("w3", "h3:1", (4,))
    assert split.targets == (w2, w3)
    assert split.groups(one_per_child=False) == [(w2, [1, 3]), (w3, [4])]
    assert split.groups(one_per_child=True) == [(w2, [1]), (w2, [3]), (w3, [4])]


def test_remote_branch_ids_map_to_the_local_children() -> None:
    members = [Branch("0.1", [], 0), Branch("0.3", [], 0)]
    assert remote_id("0", members) is None  # the remote root
    assert remote_id("0.0", members) == "0.1"
    assert remote_id("0.1.2", members) == "0.3.2"
    assert remote_id("0.2", members) is None  # no such member
