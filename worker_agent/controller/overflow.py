"""A program's fork children that run on another worker (the router's ``Placement``).

The chosen worker runs the program; at its split fork (:mod:`kvroute.core.placement`) the
children the router moved are sent, per overflow worker, as one program to that worker's
agent: prompt = the parent branch's whole sequence, program = a fork of those children that
keeps them all, then the rest of their segment. The remote stream is relayed with branch ids
mapped back (remote ``0.k...`` -> the local child ``children[k]``...), and the remote
branches' results become local branches, so the fork's select and the steps after the
segment run here exactly as for local children.

A remote worker that fails before sending anything (unreachable, over its limits) costs
nothing: its children run here instead. One that fails mid-stream has already streamed
tokens of those branches, so the program fails with UNAVAILABLE naming it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from kvroute.core.placement import ForkSegment, fork_segment
from kvroute.v1 import common_pb2, program_pb2
from kvroute.worker_agent.controller.branch import Branch, CaptureValue
from kvroute.worker_agent.controller.program import ProgramError


@dataclass(frozen=True, slots=True)
class Target:
    worker_id: str
    address: str
    children: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Split:
    """A validated placement: the split fork and where its moved children go."""

    seg: ForkSegment
    targets: tuple[Target, ...]

    @property
    def moved(self) -> frozenset[int]:
        return frozenset(i for t in self.targets for i in t.children)


def check_placement(program: program_pb2.ControllerProgram, placement: program_pb2.Placement,
                    worker_id: str, max_targets: int) -> Split | None:
    """The placement as a :class:`Split`, None when it moves nothing; ProgramError
    (INVALID_ARGUMENT, naming the field) when it does not fit the program."""
    if not placement.overflow:
        return None

    def bad(where: str, problem: str) -> ProgramError:
        return ProgramError(grpc.StatusCode.INVALID_ARGUMENT, f"placement.{where}: {problem}")

    seg = fork_segment(program)
    if seg is None or seg.step != placement.fork_step:
        raise bad("fork_step", f"step {placement.fork_step} is not the program's first "
                               "top-level fork of 2+ children")
    if len(placement.overflow) > max_targets:
        raise bad("overflow", f"{len(placement.overflow)} workers, over the limit of "
                              f"{max_targets}")
    seen: set[int] = set()
    targets = []
    for i, o in enumerate(placement.overflow):
        at = f"overflow[{i}]"
        if not o.worker_id or o.worker_id == worker_id:
            raise bad(f"{at}.worker_id", "must name another worker")
        host, _, port = o.address.rpartition(":")
        if not host or not port.isdigit():
            raise bad(f"{at}.address", f"must be host:port, got {o.address!r}")
        if not o.children:
            raise bad(f"{at}.children", "empty")
        for c in o.children:
            if c >= len(seg.children) or c in seen:
                raise bad(f"{at}.children", f"child {c} is out of range "
                                            f"[0, {len(seg.children)}) or listed twice")
            seen.add(c)
        targets.append(Target(o.worker_id, o.address, tuple(o.children)))
    if len(seen) == len(seg.children):
        raise bad("overflow", "moves every child; the program's worker keeps at least one")
    return Split(seg, tuple(targets))


def remote_id(remote: str, members: list[Branch]) -> str | None:
    """The local id of remote branch ``remote`` (None for the remote root, ``0``)."""
    parts = remote.split(".", 2)
    if len(parts) < 2 or parts[0] != "0" or not parts[1].isdigit() \
            or int(parts[1]) >= len(members):
        return None
    local = members[int(parts[1])].id
    return f"{local}.{parts[2]}" if len(parts) == 3 else local


def branch_from_result(parent: Branch, r: program_pb2.BranchResult, local_id: str) -> Branch:
    """A remote branch as a local one: the parent's sequence plus what the remote added."""
    added = list(r.token_ids)
    lps = list(r.token_logprobs)
    if len(lps) != len(added):  # an agent that does not report them: the sum on the last
        lps = [0.0] * len(added)
        if added:
            lps[-1] = r.logprob
    b = Branch(local_id, parent.tokens + added, parent.prompt_len, parent.lps + lps,
               dict(parent.variables), first_cached=r.cached_tokens,
               last_cached=r.cached_tokens, engine_requests=r.engine_requests,
               prefill_tokens=r.prefill_tokens, generated=r.generated_tokens,
               finished_at=time.monotonic())
    for name, v in r.variables.items():
        b.variables[name] = CaptureValue(v.text, tuple(v.token_ids), v.complete)
    return b


def relay(resp: common_pb2.GenerateResponse, members: list[Branch],
          request_id: str) -> common_pb2.GenerateResponse | None:
    """A remote chunk as this program's chunk (None: nothing to relay)."""
    bid = remote_id(resp.branch_id, members)
    if bid is None:
        return None  # the remote root: its fork event (the local one was sent)
    out = common_pb2.GenerateResponse(
        request_id=request_id, worker_id=resp.worker_id, branch_id=bid,
        cached_tokens=resp.cached_tokens, token_ids=resp.token_ids)
    for ev in resp.events:
        e = out.events.add()
        e.CopyFrom(ev)
        if ev.branch_ids:
            del e.branch_ids[:]
            e.branch_ids.extend(remote_id(x, members) or x for x in ev.branch_ids)
    return out
