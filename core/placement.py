"""Where a controller program's branches run: all on the chosen worker, unless that would
overload it, in which case the overflow goes to the workers with the next-longest prefix.

One module owns this rule; the router applies it to real programs (and the agent follows the
:class:`~kvroute.v1.program_pb2.Placement` it is sent), the replay simulator to trace
programs.

Terms:

* A program's **split fork** is its first top-level fork. Only there can branches leave the
  chosen worker: before it the program is one branch; inside it every child continues on its
  own. Each child runs its sub-program and then, when the fork keeps all its children
  (``select`` ALL), the top-level steps after the fork up to the next ``select`` (they run in
  each branch independently, so a remote child can run them too). That is the child's
  **segment**.
* A child's **weight** is the most sequences its segment runs at once
  (:func:`program_fanout`).
* A worker's **headroom** is the sequences it can start now without queueing:
  ``max_running - occupied`` (:attr:`WorkerLoad.occupied`), and none while anything is queued there
  (it is out of batch slots or KV blocks); unknown (no split) when the worker does not report
  ``max_running``.

Rule (:func:`place_fork`): when the children's total weight fits the chosen worker's headroom,
nothing moves. Otherwise the chosen worker keeps the first child and then every child, in
order, that still fits; the others go to the other workers, longest cached prefix of the
prompt first (ties: the policy's order), each taking the children that fit its headroom --
provided they start sooner there: a worker ``w`` qualifies only if
``pending_prefill_w + (P - c_w) < pending_prefill_chosen`` when the chosen worker has a
queue (its queued prefill is what they would wait for; ``P - c_w`` is the prefix ``w`` must
compute first), always when it is merely out of batch slots (they would wait for decodes to
finish). Children no worker takes stay on the chosen worker: when the whole cluster is full,
spreading only adds prefill. (``bench/program_overflow.py`` measures it in the replay
simulator, 16 workers: with forks of 16 branches, splitting cuts mean TTFT to 0.07-0.44x and
p99 to 0.06-0.51x with 32-sequence batches at 0.8-2.5x the trace's nominal capacity, and to
0.77x / 0.65x with 256-sequence batches at 2.5x; with the default 4-branch forks it moves
few branches and changes mean TTFT by -2% to +6%.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.core.load import WorkerLoad
from kvroute.core.policies.base import RouteQuery, Scored
from kvroute.core.program_bounds import program_bounds
from kvroute.v1 import program_pb2

MAX_FANOUT_WEIGHT = 1024
"""Cap of :func:`program_fanout` (the agent enforces its own, smaller limit)."""


def program_fanout(program: program_pb2.ControllerProgram) -> int:
    """Most branches a program can run at once: each fork multiplies the sequences alive,
    a joining select brings them back down (:mod:`~kvroute.core.program_bounds`, the walk the
    agent bounds programs with; placement only needs the weight, capped)."""
    return min(program_bounds(program).fanout, MAX_FANOUT_WEIGHT)


def program_prefill_tokens(program: program_pb2.ControllerProgram) -> int:
    """Tokens a program prefills beyond its prompt: its fast-forwards, in every branch that
    runs them (text counted by its UTF-8 bytes, an upper bound for byte-level vocabularies,
    as the agent's token limit counts it)."""
    return min(program_bounds(program).prefill_tokens, 1 << 30)


def program_load(program: program_pb2.ControllerProgram) -> tuple[int, int]:
    """:func:`program_fanout` and :func:`program_prefill_tokens` of one walk."""
    b = program_bounds(program)
    return min(b.fanout, MAX_FANOUT_WEIGHT), min(b.prefill_tokens, 1 << 30)


def fork_children(fork: program_pb2.Fork) -> list[program_pb2.ControllerProgram]:
    """The fork's children's sub-programs (``n`` copies of its one branch, or of nothing)."""
    if fork.n and len(fork.branches) <= 1:
        sub = fork.branches[0] if fork.branches else program_pb2.ControllerProgram()
        return [sub] * fork.n
    return list(fork.branches)


@dataclass(frozen=True, slots=True)
class ForkSegment:
    """A program's split fork (see module doc)."""

    step: int
    """Index of the fork in ``ControllerProgram.steps``."""
    children: list[program_pb2.ControllerProgram]
    rest: list[program_pb2.Step]
    """Top-level steps after the fork that every child runs on its own (empty unless the
    fork's select is ALL)."""
    select: program_pb2.SelectMode

    @property
    def end(self) -> int:
        """Index of the first top-level step after the segment."""
        return self.step + 1 + len(self.rest)

    def weights(self) -> list[int]:
        # A fork's n copies are one sub-program: weighed once (n of 1000 copies of a
        # 4000-step branch once took the router's loop 7 s).
        memo: dict[int, int] = {}
        out = []
        for c in self.children:
            w = memo.get(id(c))
            if w is None:
                w = memo[id(c)] = program_fanout(
                    program_pb2.ControllerProgram(steps=list(c.steps) + self.rest))
            out.append(w)
        return out

    def remote_program(self, children: Sequence[int]) -> program_pb2.ControllerProgram:
        """What an overflow worker runs for ``children``: a fork of just those, keeping them
        all (the fork's own select is applied where the program runs, over every child),
        then the segment's rest. Its branch ``0.k`` is the fork's child ``children[k]``."""
        fork = program_pb2.Fork(branches=[self.children[i] for i in children])
        return program_pb2.ControllerProgram(steps=[program_pb2.Step(fork=fork), *self.rest])


def fork_segment(program: program_pb2.ControllerProgram) -> ForkSegment | None:
    """The program's split fork, or None when it has no top-level fork of 2+ children."""
    steps = program.steps
    for i, step in enumerate(steps):
        if not step.HasField("fork"):
            continue
        children = fork_children(step.fork)
        if len(children) < 2:
            return None
        rest: list[program_pb2.Step] = []
        if step.fork.select == program_pb2.SELECT_MODE_ALL:
            for s in steps[i + 1:]:
                if s.HasField("select"):
                    break
                rest.append(s)
        return ForkSegment(i, children, rest, step.fork.select)
    return None


def headroom(load: WorkerLoad | None) -> int | None:
    """Sequences the worker can start now without queueing; None when unknown."""
    if load is None or load.max_running <= 0:
        return None
    if load.queued > 0:
        return 0
    return load.max_running - load.occupied


@dataclass(frozen=True, slots=True)
class Overflow:
    worker: str
    children: tuple[int, ...]
    weight: int
    """Sequences these children run at once (the load they add to ``worker``)."""


def place_fork(ranked: Sequence[Scored], query: RouteQuery,
               weights: Sequence[int]) -> tuple[Overflow, ...]:
    """The children of the split fork that leave the chosen worker ``ranked[0]``, and where
    they go (see module doc). Empty: every child stays."""
    if len(ranked) < 2 or len(weights) < 2:
        return ()
    loads = query.loads
    free = headroom(loads.get(ranked[0].worker))
    if free is None or sum(weights) <= free:
        return ()
    used = weights[0]
    rest: list[int] = []
    for i in range(1, len(weights)):
        if used + weights[i] <= free:
            used += weights[i]
        else:
            rest.append(i)
    targets = sorted((-query.cached_tokens(s.worker), r, s.worker)
                     for r, s in enumerate(ranked[1:], 1))
    out: list[Overflow] = []
    # What the moved children would wait for on the chosen worker, in prefill tokens: its
    # queue's prefill when it has a queue; else a batch slot (decodes to finish: long).
    first = loads[ranked[0].worker]
    wait = first.pending_prefill_tokens if first.queued > 0 else math.inf
    for _, _, w in targets:
        if not rest:
            break
        ld = loads.get(w)
        room = headroom(ld)
        if not room or room <= 0 or ld is None:
            continue
        if ld.pending_prefill_tokens + query.prompt_tokens - query.cached_tokens(w) >= wait:
            continue
        take: list[int] = []
        used = 0
        for i in rest:
            if used + weights[i] <= room:
                take.append(i)
                used += weights[i]
        if take:
            out.append(Overflow(w, tuple(take), used))
            rest = [i for i in rest if i not in take]
    return tuple(out)
