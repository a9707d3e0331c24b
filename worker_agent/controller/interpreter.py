"""The interpreter: one program execution, its branch tree and its response stream.

Every engine request is an ordinary :class:`EngineRequest` whose prompt is the branch's whole
sequence so far, so the engine's prefix cache does the KV work (the AICI "stateless engine"
design): a fork is N requests sharing the parent's cached prefix (scheduled by
``fork_lead``); a backtrack or a fast-forward just edits the next request's prompt; a
grammar-forced run of tokens ends the current request and starts the next with those tokens
in the prompt (``constrained``). A split fork's moved children run on other workers
(``overflow``) as units beside the local ones, so the fork's select and the steps after it
run here exactly as for local children.

Contract of :class:`Run`: :meth:`Run.main` puts every response of the program on ``queue``
in order -- token chunks and events per branch, then one final response with every branch's
result (selected ones first) -- and then :data:`END`; a failure is stored in ``error``
before :data:`END`. Cancelling it cancels every branch (one task tree of TaskGroups), and
each branch closes its engine stream (``aclosing``), which frees the request's blocks at once.

Log-probabilities come from the engine's logits (``logprobs.LogitsTap``), else from the
chunk's own ``logprobs`` (vllm: the sampled token's, asked for with every program request),
else 0 (sim). The engine's exact ``cached_tokens`` may arrive only on a request's last chunk
(vllm: from ``usage``); the branch's figures are corrected from it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from kvroute.core.agent_client import AgentChannels
from kvroute.v1 import common_pb2, program_pb2
from kvroute.worker_agent.controller.branch import Branch, CaptureValue
from kvroute.worker_agent.controller.constrained import (
    Masker,
    check_output,
    enter_gen,
    force,
    region_constraint,
)
from kvroute.worker_agent.controller.continuation import Node
from kvroute.worker_agent.controller.decoding import (
    ROOT_BRANCH,
    GenState,
    TakenTokens,
    count_cached,
    engine_seed,
)
from kvroute.worker_agent.controller.fork_lead import Runner, Unit, lead
from kvroute.worker_agent.controller.grammars import MaskBuffer
from kvroute.worker_agent.controller.logprobs import LogitsTap
from kvroute.worker_agent.controller.overflow import Split, Target, run_remote
from kvroute.worker_agent.controller.program import (
    Backtrack,
    FastForward,
    Fork,
    Gen,
    Plan,
    Program,
    ProgramError,
    ProgramLimits,
    Select,
    SelectMode,
)
from kvroute.worker_agent.controller.stats import ProgramStats
from kvroute.worker_agent.controller.vocab import Vocab
from kvroute.worker_agent.engines.base import Engine, EngineRequest

Ev = program_pb2.ProgramEvent
END = object()
"""The last item a run puts on its queue."""

class Host(Protocol):
    """What a run reads of the agent's ``ProgramRuntime``, at each use (a benchmark sets
    ``mask_times`` between runs)."""

    @property
    def engine(self) -> Engine: ...
    @property
    def engine_kind(self) -> str: ...
    @property
    def grammar_engine(self) -> bool:
        """The engine takes a grammar per request (and enforces it) instead of masks."""
    @property
    def worker_id(self) -> str: ...
    @property
    def limits(self) -> ProgramLimits: ...
    @property
    def mask_times(self) -> list[float] | None: ...
    @property
    def channels(self) -> AgentChannels | None: ...
    @property
    def stats(self) -> ProgramStats: ...
    @property
    def logits_tap(self) -> LogitsTap | None: ...


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked program with everything it needs compiled: ready to run, no engine work
    done."""

    plan: Plan
    vocab: Vocab | None
    templates: Mapping[str, Any]
    """Template matchers by ``ConstraintSpec.grammar`` (``grammars.compile_constraints``)."""
    split: Split | None = None
    rests: Mapping[str, tuple[str, Node]] = field(default_factory=dict)
    """Regular constraints as (kind, nodes), by grammar: what a continued region is sent as
    on an engine that takes a whole grammar per request (``constrained``)."""


def _first_error(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


@dataclass(slots=True)
class Run:
    """One program execution: the branch tree and its response stream (see module doc)."""

    rt: Host
    prep: Prepared
    request: common_pb2.GenerateRequest
    request_id: str
    queue: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue(256))
    dropped: list[Branch] = field(default_factory=list)
    decoded: int = 0
    n_requests: int = 0
    error: Exception | None = None

    # -- output ---------------------------------------------------------------------------

    async def emit(self, b: Branch, tokens: Sequence[int] = (),
                   events: Sequence[program_pb2.ProgramEvent] = ()) -> None:
        await self.queue.put(common_pb2.GenerateResponse(
            request_id=self.request_id, worker_id=self.rt.worker_id, branch_id=b.id,
            cached_tokens=b.last_cached, token_ids=tokens, events=events))

    def text(self, tokens: Sequence[int]) -> str:
        return self.prep.vocab.decode(tokens) if self.prep.vocab is not None else ""

    def result(self, b: Branch, selected: bool) -> program_pb2.BranchResult:
        out = program_pb2.BranchResult(
            branch_id=b.id, token_ids=b.tokens[b.prompt_len:],
            text=self.text(b.tokens[b.prompt_len:]), logprob=b.logprob, selected=selected,
            cached_tokens=b.first_cached or 0, engine_requests=b.engine_requests,
            prefill_tokens=b.prefill_tokens, generated_tokens=b.generated,
            token_logprobs=b.lps)
        for name, v in b.variables.items():
            out.variables[name].CopyFrom(program_pb2.Capture(
                text=v.text, token_ids=v.token_ids, complete=v.complete))
        return out

    # -- driver ---------------------------------------------------------------------------

    async def main(self) -> None:
        """Run the program; always ends the stream with :data:`END` (after storing a failure
        in ``error``) unless cancelled, when nobody reads the stream any more."""
        try:
            await self._main()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = exc
        await self.queue.put(END)

    async def _main(self) -> None:
        prompt = list(self.request.token_ids)
        root = Branch(ROOT_BRANCH, list(prompt), len(prompt))
        try:
            live = await self.program([root], self.prep.plan.program, self.prep.split)
        except BaseExceptionGroup as eg:
            raise _first_error(eg) from None
        final = common_pb2.GenerateResponse(
            request_id=self.request_id, worker_id=self.rt.worker_id,
            cached_tokens=root.first_cached or 0,
            finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=self.decoded,
                                   cached_tokens=root.first_cached or 0))
        final.results.extend([self.result(b, True) for b in live]
                             + [self.result(b, False) for b in self.dropped])
        await self.queue.put(final)

    async def program(self, live: list[Branch], steps: Program,
                      split: Split | None = None) -> list[Branch]:
        """Run ``steps`` in every live branch (concurrently); return the live branches.
        ``split``: the top level of a program whose fork children are partly moved."""
        i = 0
        while i < len(steps):
            step = steps[i]
            i += 1
            if split is not None and i - 1 == split.seg.step and isinstance(step, Fork):
                live = await self.split_fork(live[0], step, steps[i:split.seg.end], split)
                i = split.seg.end
            elif isinstance(step, Fork):
                groups = await self.each(live, lambda b, s=step: self.fork(b, s))
                live = [c for g in groups for c in g]
            elif isinstance(step, Select):
                live = await self.select(live, step.mode)
            else:
                await self.each(live, lambda b, s=step: self.simple(b, s))
        for b in live:
            if not b.finished_at:
                b.mark_finished()
        return live

    async def each(self, live: list[Branch], fn: Callable[[Branch], Any]) -> list[Any]:
        if len(live) == 1:
            return [await fn(live[0])]
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(fn(b)) for b in live]
        return [t.result() for t in tasks]

    async def simple(self, b: Branch, step: Gen | FastForward | Backtrack) -> None:
        if isinstance(step, Gen):
            await self.gen(b, step)
        elif isinstance(step, FastForward):
            await self.fast_forward(b, step)
        else:
            await self.backtrack(b, step.tokens)
        b.mark_finished()

    async def select(self, live: list[Branch], mode: SelectMode) -> list[Branch]:
        if mode == SelectMode.ALL or len(live) <= 1:
            return live
        if mode == SelectMode.BEST_LOGPROB:
            keep = max(live, key=lambda b: b.logprob)  # ties: the first
        else:
            keep = min(live, key=lambda b: b.finished_at)
        for b in live:
            if b is not keep:
                self.dropped.append(b)
                await self.emit(b, events=[Ev(kind=Ev.KIND_DROPPED, reason=mode.name.lower())])
        await self.emit(keep, events=[Ev(kind=Ev.KIND_SELECTED, reason=mode.name.lower())])
        return [keep]

    # -- fork -----------------------------------------------------------------------------

    async def fork(self, parent: Branch, step: Fork) -> list[Branch]:
        children = await self.forked(parent, len(step.branches))
        return await self.join(self.lead(parent, [
            Unit([c], self.runner(c, sub))
            for c, sub in zip(children, step.branches, strict=True)]), step.select)

    async def forked(self, parent: Branch, n: int) -> list[Branch]:
        children = [parent.child(f"{parent.id}.{i}") for i in range(n)]
        await self.emit(parent, events=[Ev(kind=Ev.KIND_FORKED,
                                           branch_ids=[c.id for c in children])])
        return children

    def runner(self, c: Branch, steps: Program) -> Runner:
        return lambda: self.program([c], steps)

    def lead(self, parent: Branch, units: list[Unit]) -> list[Unit]:
        """``units`` scheduled to share ``parent``'s prefix prefill (``fork_lead``)."""
        return lead(parent, units, self.rt.engine, self.request_id, self.request.cache_salt,
                    self.rt.stats)

    async def join(self, units: list[Unit], mode: SelectMode) -> list[Branch]:
        """Run a fork's units concurrently and apply its select over all their branches."""
        if mode != SelectMode.FIRST_FINISHED:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(u.run()) for u in units]
            live = [b for t in tasks for b in t.result()]
            return await self.select(live, mode)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(u.run()) for u in units]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()  # closes their engine streams: blocks freed at once
        winner = next(t for t in tasks if t in done)
        for t, u in zip(tasks, units, strict=True):
            if t is not winner:
                for c in u.members:
                    self.dropped.append(c)
                    await self.emit(c, events=[Ev(kind=Ev.KIND_DROPPED,
                                                  reason="first_finished")])
        live = winner.result()
        for b in live:
            await self.emit(b, events=[Ev(kind=Ev.KIND_SELECTED, reason="first_finished")])
        return live

    async def split_fork(self, parent: Branch, step: Fork, rest: Program,
                         split: Split) -> list[Branch]:
        """The split fork and its segment (``rest``: the steps each child runs after its
        sub-program), with the moved children run on their workers (``overflow``)."""
        if parent.matcher is not None:
            # The open constraint's state cannot travel: everything stays here.
            self.rt.stats.overflow_kept += len(split.moved)
            return await self.program([parent], (step, *rest))
        moved = split.moved
        children = await self.forked(parent, len(step.branches))
        units = self.lead(parent, [
            Unit([c], self.runner(c, (*sub, *rest)))
            for i, (c, sub) in enumerate(zip(children, step.branches, strict=True))
            if i not in moved])
        for t, idx in split.groups(step.select == SelectMode.FIRST_FINISHED):
            members = [children[i] for i in idx]
            local = [self.runner(c, (*step.branches[i], *rest))
                     for c, i in zip(members, idx, strict=True)]
            units.append(Unit(members, self.remoter(parent, split, t, idx, members, local)))
        return await self.join(units, step.select)

    def remoter(self, parent: Branch, split: Split, target: Target, idx: list[int],
                members: list[Branch], fallback: list[Runner]) -> Runner:
        async def run() -> list[Branch]:
            assert self.rt.channels is not None
            out = await run_remote(
                channels=self.rt.channels, stats=self.rt.stats, request=self.request,
                request_id=self.request_id, seg=split.seg, parent=parent, target=target,
                idx=idx, members=members, send=self.queue.put, fallback=fallback,
                probe=self.rt.probe)
            self.decoded += out.decoded
            self.dropped.extend(out.dropped)
            return out.live

        return run

    # -- simple steps ---------------------------------------------------------------------

    async def fast_forward(self, b: Branch, step: FastForward) -> None:
        if step.text is not None:
            assert self.prep.vocab is not None
            toks = self.prep.vocab.encode(step.text)
        else:
            toks = list(step.tokens)
        events = [Ev(kind=Ev.KIND_FAST_FORWARD, count=len(toks), reason="step")]
        for t in toks:
            b.append(t)
        if b.matcher is not None and not b.sync_matcher():
            events.append(Ev(kind=Ev.KIND_CONSTRAINT_CLOSED, reason="fast_forward"))
        await self.emit(b, toks, events)

    async def backtrack(self, b: Branch, k: int) -> None:
        if k > b.appended:
            raise ProgramError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"backtrack: {k} tokens on branch {b.id}, which has only "
                               f"{b.appended} after the prompt")
        b.truncate(k)
        events = [Ev(kind=Ev.KIND_BACKTRACK, count=k, reason="step")]
        if b.matcher is not None and not b.sync_matcher():
            events.append(Ev(kind=Ev.KIND_CONSTRAINT_CLOSED, reason="backtrack"))
        await self.emit(b, events=events)

    # -- gen ------------------------------------------------------------------------------

    async def gen(self, b: Branch, g: Gen) -> None:
        if enter_gen(b, g, self.prep.templates):
            await self.emit(b, events=[Ev(kind=Ev.KIND_CONSTRAINT_CLOSED, reason="gen")])
        s = GenState(start=len(b.tokens), remaining=g.max_tokens, stops=g.stop)
        vocab = self.prep.vocab
        local = not self.rt.grammar_engine  # else the engine runs the whole region
        while s.reason is None:
            m = b.matcher
            if m is not None and local:
                ff = force(b, s.remaining)
                if ff:
                    s.remaining -= len(ff)
                    await self.emit(b, ff, [Ev(kind=Ev.KIND_FAST_FORWARD, count=len(ff),
                                               reason="grammar")])
                    if await self.check_stop(b, s, ff):
                        break
                if m.is_stopped():
                    s.reason = "grammar"
                    break
            if s.remaining <= 0:
                s.reason = "length"
                break
            await self.decode(b, g, s, vocab)
            if not local and s.reason is None:
                s.reason = "length"  # one engine request per gen: never split
        await self.finish_gen(b, g, s)

    async def decode(self, b: Branch, g: Gen, s: GenState, vocab: Vocab | None) -> None:
        """One engine request; sets ``s.reason`` unless it ended for a grammar fast-forward."""
        constraint = None
        if b.matcher is not None and self.rt.grammar_engine:
            assert vocab is not None
            constraint = region_constraint(b, g, vocab, self.prep.rests,
                                           self.rt.limits.max_grammar_bytes,
                                           from_state=self.rt.continues_grammars)
            if constraint is None:
                s.reason = "grammar"  # the region is complete: nothing to ask for
                return
        ereq, stop_ids, masker = self._engine_request(b, g, s, vocab)
        tap = self.rt.logits_tap
        logits_of = tap.subscribe(ereq.request_id) if tap is not None \
            else contextlib.nullcontext({})
        engine: Any = self.rt.engine
        stream_it = engine.generate(ereq) if constraint is None \
            else engine.generate(ereq, constraint=constraint)
        first_request = b.first_cached is None
        took = TakenTokens(stop_ids, masker)
        with logits_of as logits:
            async with contextlib.aclosing(stream_it) as stream:
                async for chunk in stream:
                    count_cached(b, chunk.cached_tokens, len(ereq.token_ids),
                                 first=took.chunks == 0,
                                 first_request=first_request)
                    kept = took.take(b, s, chunk, logits)
                    self.decoded += len(kept)
                    if kept:
                        await self.emit(b, kept)
                        if await self.check_stop(b, s, kept):
                            break
                    if s.reason is None and s.remaining <= 0:
                        s.reason = "length"
                    if s.reason is None and chunk.finish_reason == "stop":
                        # A stop the engine applied itself (vllm: end of grammar or eos).
                        s.reason = "grammar" if b.matcher is not None else "eos"
                    if s.reason is not None or s.split or chunk.finish_reason is not None:
                        break
        split, s.split = s.split, False
        if s.reason is None and not split:
            s.reason = "length"  # the engine's own limit (a prompt near its whole cache)
        check_output(b, constraint, self.rt.engine_kind)

    def _engine_request(self, b: Branch, g: Gen, s: GenState, vocab: Vocab | None
                        ) -> tuple[EngineRequest, frozenset[int], Masker | None]:
        """The engine request of ``b``'s gen now (its whole sequence as the prompt), the ids
        that end it (the request's and EOS), and its token mask (an engine that takes masks)."""
        req = self.request
        self.n_requests += 1
        stop_ids = set(req.sampling.stop_token_ids)
        eos = vocab.eos_token_id if vocab is not None else getattr(self.rt.engine,
                                                                   "eos_token_id", None)
        if eos is not None:
            stop_ids.add(eos)
        masker = None
        if b.matcher is not None and not self.rt.grammar_engine:
            assert vocab is not None
            masker = Masker(b, MaskBuffer(vocab.size), mask_times=self.rt.mask_times)
        temperature = g.temperature if g.temperature is not None else req.sampling.temperature
        ereq = EngineRequest(
            request_id=f"{self.request_id}/{b.id}/{self.n_requests}",
            token_ids=list(b.tokens), max_tokens=s.remaining, cache_salt=req.cache_salt,
            seed=engine_seed(req.sampling.seed, b.id, b.engine_requests),
            stop_token_ids=frozenset(stop_ids), temperature=temperature,
            top_p=req.sampling.top_p or 1.0, top_k=req.sampling.top_k, mask_fn=masker,
            logprobs=self.rt.grammar_engine)
        return ereq, frozenset(stop_ids), masker

    async def check_stop(self, b: Branch, s: GenState, new: Sequence[int]) -> bool:
        """Track the gen's text; on a stop string, drop the tokens from the one where it
        starts and end the gen (reason "stop")."""
        if not s.stops or self.prep.vocab is None:
            return False
        vocab = self.prep.vocab
        old = len(s.text)
        for t in new:
            s.text += vocab.token_bytes(t)
            s.ends.append(len(s.text))
        longest = max(len(x) for x in s.stops)
        lo = max(0, old - longest + 1)
        hits = [(i, k) for k, x in enumerate(s.stops) if (i := s.text.find(x, lo)) >= 0]
        if not hits:
            return False
        cut, k = min(hits)
        s.stop_hit = s.stops[k]
        keep = bisect.bisect_right(s.ends, cut)
        drop = len(s.ends) - keep
        b.truncate(drop)
        del s.ends[keep:]
        s.stop_text = bytes(s.text[:cut])
        s.reason = "stop"
        if drop:
            await self.emit(b, events=[Ev(kind=Ev.KIND_BACKTRACK, count=drop, reason="stop")])
        return True

    async def finish_gen(self, b: Branch, g: Gen, s: GenState) -> None:
        if b.matcher is not None and not b.sync_matcher():
            raise ProgramError(grpc.StatusCode.INTERNAL, f"branch {b.id}: constraint lost")
        events = [Ev(kind=Ev.KIND_GEN_END, reason=s.reason or "length",
                     count=len(b.tokens) - s.start,
                     value=s.stop_hit.decode(errors="replace") if s.reason == "stop" else "")]
        if g.capture:
            if b.matcher is not None:
                ids = tuple(b.tokens[b.region_start:])
                complete = bool(b.matcher.is_accepting())
            else:
                ids = tuple(b.tokens[s.start:])
                complete = True
            if s.stop_text is not None and b.matcher is None:
                text = s.stop_text.decode(errors="replace")
            else:
                text = self.text(ids)
            b.variables[g.capture] = CaptureValue(text, ids, complete)
            events.append(Ev(kind=Ev.KIND_CAPTURED, name=g.capture, value=text))
        await self.emit(b, events=events)
