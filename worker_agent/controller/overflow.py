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

:func:`run_remote` is that call for one overflow worker; the interpreter runs it as one unit
of the split fork (``Split.groups``) beside the local children.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import xxhash

from kvroute.core.agent_client import AgentChannels
from kvroute.core.liveness import HungWorkerError, LivenessProbe, watched
from kvroute.core.placement import ForkSegment, fork_segment
from kvroute.v1 import common_pb2, program_pb2
from kvroute.worker_agent.controller.branch import Branch, CaptureValue
from kvroute.worker_agent.controller.program import ProgramError
from kvroute.worker_agent.controller.stats import ProgramStats

log = logging.getLogger("kvroute.agent.programs")

PROBE_S = 1.0
"""An overflow worker not answering yet is probed every PROBE_S and left (its children run
here) when a probe goes unanswered for PROBE_S (core/liveness.py)."""


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

    def groups(self, one_per_child: bool) -> list[tuple[Target, list[int]]]:
        """The moved children as (worker, child indices) calls: one per worker, or one per
        child (``one_per_child``: a first-finished fork, since a call ends when all its
        children do)."""
        if one_per_child:
            return [(t, [i]) for t in self.targets for i in t.children]
        return [(t, list(t.children)) for t in self.targets]


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


@dataclass(frozen=True, slots=True)
class RemoteOutcome:
    """What one overflow call added to the program."""

    live: list[Branch]
    """The children's branches the remote's program kept (or the local fallback's)."""
    dropped: list[Branch]
    """Those it dropped (their results are reported as not selected)."""
    decoded: int
    """Tokens the remote generated (0 on fallback: the local runs count their own)."""


async def run_remote(*, channels: AgentChannels, stats: ProgramStats,
                     request: common_pb2.GenerateRequest, request_id: str, seg: ForkSegment,
                     parent: Branch, target: Target, idx: list[int], members: list[Branch],
                     send: Callable[[common_pb2.GenerateResponse], Awaitable[None]],
                     fallback: Sequence[Callable[[], Awaitable[list[Branch]]]],
                     probe: LivenessProbe | None = None) -> RemoteOutcome:
    """Run ``members`` (the split fork's children ``idx``) on ``target``, relaying its
    stream to ``send`` under local branch ids. A failure before any of their output was sent
    runs ``fallback`` (their local runs) here instead; one after fails the program
    (UNAVAILABLE), as does a remote stream that ends without results. With ``probe``, a
    target that hangs before its first response counts as failed then."""
    req = common_pb2.GenerateRequest(
        token_ids=parent.tokens, model=request.model, cache_salt=request.cache_salt,
        request_id=f"{request_id}/{members[0].id}@{target.worker_id}",
        program=seg.remote_program(idx))
    req.sampling.CopyFrom(request.sampling)
    # Per child, like a local branch's seed: reproducible, and siblings differ.
    req.sampling.seed = xxhash.xxh3_64_intdigest(
        f"{request.sampling.seed}/{members[0].id}".encode()) & ((1 << 63) - 1) or 1
    stats.overflow_sent += len(members)
    call = channels.stub(target.address).Generate(req)
    relayed = False  # once the client has seen the remote's output, it cannot move
    final: common_pb2.GenerateResponse | None = None
    stream = watched(call, probe, target.address, PROBE_S) if probe is not None else call
    try:
        async for resp in stream:
            if resp.results:
                final = resp
                continue
            out = relay(resp, members, request_id)
            if out is not None:
                relayed = True
                await send(out)
    except (grpc.aio.AioRpcError, HungWorkerError) as exc:
        if relayed:
            raise ProgramError(grpc.StatusCode.UNAVAILABLE,
                               f"overflow worker {target.worker_id} failed mid-program: "
                               f"{exc.code().name} {exc.details()}") from None
        stats.overflow_fallback += len(members)
        log.warning("overflow worker failed; running its fork children here",
                    extra={"kv": {"request": request_id, "worker": target.worker_id,
                                  "code": exc.code().name, "details": exc.details()}})
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(f()) for f in fallback]
        return RemoteOutcome([b for t in tasks for b in t.result()], [], 0)
    finally:
        call.cancel()  # no-op once finished; frees the remote's branches otherwise
    if final is None:
        raise ProgramError(grpc.StatusCode.UNAVAILABLE,
                           f"overflow worker {target.worker_id} ended without results")
    live: list[Branch] = []
    dropped: list[Branch] = []
    for r in final.results:
        bid = remote_id(r.branch_id, members)
        if bid is not None:
            b = branch_from_result(parent, r, bid)
            (live if r.selected else dropped).append(b)
    return RemoteOutcome(live, dropped, final.usage.completion_tokens)
