"""The program runtime in the agent: runs a checked program against a mask-capable engine.

Every engine request is an ordinary :class:`EngineRequest` whose prompt is the branch's whole
sequence so far, so the engine's prefix cache does the KV work (the AICI "stateless engine"
design): a fork is N requests sharing the parent's cached prefix; a backtrack or a
fast-forward just edits the next request's prompt; a grammar-forced run of tokens
(``compute_ff_tokens``) ends the current request and starts the next with those tokens in the
prompt (prefilled in one pass instead of decoded one by one).

Per output token of a constrained gen, the engine calls the request's ``mask_fn`` on the
event loop: it feeds the matcher the tokens generated since its last call, then fills
llguidance's bitmask (the mask time the benchmark measures). The matcher may run ahead of
what the consumer has read; after each engine request the branch reconciles it
(``Branch.sync_matcher``: ``rollback`` or ``consume_tokens``).

Log-probabilities come from the engine's ``logits_observer`` (tiny): the model's raw
log-softmax (temperature 1, before the mask) of each chosen token; on vllm from its
completions ``logprobs`` (the sampled token's, asked for with every program request).
Engines without logits (sim) report 0. The sim honours masks too (its deterministic token
moves to the first allowed id), so constrained programs run on it; only their content is
meaningless.

On an engine that takes grammars per request instead of masks (``vllm``: structured
outputs), a constrained gen is one engine request carrying the constraint (its whole
constrained region: no local grammar fast-forward, no split); the engine enforces it, and the
local matcher only checks and tracks the returned tokens (output outside the constraint --
e.g. an old vLLM that ignored ``structured_outputs`` -- fails the program with INTERNAL).
``continue_constraint`` needs the grammar state mid-region, which such an engine cannot take:
a regular constraint (regex, choices, a JSON schema without recursion: ``json_regex``) is
sent as the regex of its rest after the region's text so far (``continuation``); a program
that continues a region and has any other constraint (lark, a schema with no regex) is
refused with UNIMPLEMENTED. Forks, backtracks and fast-forwards are as on
the other engines (N requests sharing the prefix; the next request's prompt edited). The
engine's exact ``cached_tokens`` may arrive only on a request's last chunk (vllm: from
``usage``); the branch's figures are corrected from it.

Cancellation: everything runs in one task tree (TaskGroups); cancelling the consumer cancels
every branch, and each branch closes its engine stream (``aclosing``), which frees the
request's blocks at once.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import xxhash

from kvroute.core.agent_client import AgentChannels
from kvroute.v1 import common_pb2, program_pb2
from kvroute.worker_agent.controller import continuation
from kvroute.worker_agent.controller.branch import Branch, CaptureValue
from kvroute.worker_agent.controller.grammars import MaskBuffer, compile_constraints
from kvroute.worker_agent.controller.overflow import (
    Split,
    Target,
    branch_from_result,
    check_placement,
    relay,
    remote_id,
)
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
    check_program,
)
from kvroute.worker_agent.controller.vocab import Vocab, make_vocab
from kvroute.worker_agent.engines.base import Engine, EngineError, EngineRequest

log = logging.getLogger("kvroute.agent.programs")

Ev = program_pb2.ProgramEvent
PROGRAM_ENGINES = frozenset({"tiny", "sim", "vllm"})
"""Engines the runtime drives (one engine request per branch step, prompt = the branch)."""
MASK_ENGINES = frozenset({"tiny", "sim"})
"""Engines that honour ``EngineRequest.mask_fn`` (the sim, without logits, moves its token to
the first allowed id: see ``engines.sim``)."""
GRAMMAR_ENGINES = frozenset({"vllm"})
"""Engines that take a constraint per request (``generate(request, constraint=(kind,
source))``) and enforce it themselves."""
VOCAB_ENGINES = frozenset({"tiny"})
"""Engines whose programs always load the vocabulary (eos stops, capture text); others only
when the program needs it (constraints, text fast-forwards, stop strings)."""
FF_SPLIT_MIN = 2
"""Forced tokens worth ending an engine request for (one forced token is just decoded)."""
_END = object()


class LogitsTap:
    """Chains onto ``engine.logits_observer`` and hands each subscribed request's logits to
    its subscriber (``step -> logits``); other requests pass through untouched."""

    def __init__(self, engine: Any) -> None:
        self._prev = engine.logits_observer
        self._subs: dict[str, dict[int, npt.NDArray[np.float32]]] = {}
        engine.logits_observer = self._observe

    def _observe(self, request_id: str, step: int, logits: npt.NDArray[np.float32]) -> None:
        if self._prev is not None:
            self._prev(request_id, step, logits)
        sub = self._subs.get(request_id)
        if sub is not None:
            sub[step] = logits

    @contextlib.contextmanager
    def subscribe(self, request_id: str) -> Any:
        pending: dict[int, npt.NDArray[np.float32]] = {}
        self._subs[request_id] = pending
        try:
            yield pending
        finally:
            del self._subs[request_id]


def token_logprob(logits: npt.NDArray[np.float32] | None, token: int) -> float:
    if logits is None:
        return 0.0
    # float32 throughout: ~4x cheaper than float64 on a 50k vocabulary, ample for ranking.
    top = logits.max()
    return float(logits[token] - top - np.log(np.exp(logits - top).sum(dtype=np.float32)))


@dataclass(slots=True)
class _Masker:
    """``mask_fn`` of one constrained engine request (see module doc)."""

    branch: Branch
    buf: MaskBuffer
    consumed: int = 0  # of this request's generated tokens
    split_at: int | None = None  # step after which the consumer ends the request (ff)
    mask_times: list[float] | None = None

    def __call__(self, step: int, generated: Sequence[int]) -> npt.NDArray[np.bool_]:
        t0 = time.perf_counter()
        b, m = self.branch, self.branch.matcher
        new = generated[self.consumed:]
        if new:
            m.consume_tokens(list(new))
            self.consumed += len(new)
            b.m_consumed += len(new)
        if self.split_at is None and not m.is_stopped() \
                and len(m.compute_ff_tokens()) >= FF_SPLIT_MIN:
            self.split_at = step  # this step's token is the first forced one
        mask = self.buf.fill(m)
        if self.mask_times is not None:
            self.mask_times.append(time.perf_counter() - t0)
        return mask


@dataclass(slots=True)
class ProgramStats:
    """Counters the agent's metrics read (the runtime does not know them)."""

    overflow_sent: int = 0
    """Fork children sent to another worker's agent (the router's placement)."""
    overflow_fallback: int = 0
    """Of those, children run here instead because their worker failed before answering."""
    overflow_kept: int = 0
    """Children a placement would move but that stayed: an open constraint cannot travel."""
    forks_led: int = 0
    """Forks of 2+ local children whose first child prefilled the parent's prefix while the
    others waited for it (``_Run.led``)."""
    forks_cached: int = 0
    """Forks of 2+ local children that found the prefix cached: all started at once."""
    forks_warmed: int = 0
    """Of the led forks, those whose leader ended before any prefill: a warm-up request ran."""


@dataclass(slots=True)
class ProgramRuntime:
    """Per agent: checks programs against its limits and runs them on its engine."""

    engine: Engine
    limits: ProgramLimits
    tokenizer: str
    """The agent's ``--tokenizer``; used only when its vocabulary equals the engine's."""
    worker_id: str
    mask_times: list[float] | None = None
    """When set (benchmarks), every mask_fn call appends its duration in seconds."""
    channels: AgentChannels | None = None
    """To other agents, for fork children a placement moves (None: placements refused)."""
    stats: ProgramStats = field(default_factory=ProgramStats)
    _vocab: Vocab | None = None
    _tap: LogitsTap | None = None

    def __post_init__(self) -> None:
        if hasattr(self.engine, "logits_observer"):
            self._tap = LogitsTap(self.engine)

    @property
    def engine_kind(self) -> str:
        return str(getattr(self.engine, "kind", type(self.engine).__name__))

    @property
    def grammar_engine(self) -> bool:
        return self.engine_kind in GRAMMAR_ENGINES

    async def vocab(self) -> Vocab | None:
        """The program vocabulary, or None when the tokenizer does not match the engine."""
        if self._vocab is None:
            try:
                from kvroute.core.tokenizer import vocab_size

                if vocab_size(self.tokenizer) != self.limits.vocab_size:
                    return None
                self._vocab = await asyncio.to_thread(make_vocab, self.tokenizer)
            except ValueError:
                return None
        return self._vocab

    async def prepare(self, program: program_pb2.ControllerProgram,
                      placement: program_pb2.Placement | None = None) -> _Prepared:
        """Check limits, engine support and the placement, compile the constraints: all
        before any engine work. Raises :class:`ProgramError`."""
        kind = self.engine_kind
        if kind not in PROGRAM_ENGINES:
            raise ProgramError(grpc.StatusCode.UNIMPLEMENTED,
                               f"program: controller programs run on the tiny, sim and vllm "
                               f"engines; this agent's engine is {kind}")
        plan = check_program(program, self.limits)
        split = None
        if placement is not None and placement.overflow:
            if self.channels is None:
                raise ProgramError(grpc.StatusCode.UNIMPLEMENTED,
                                   "placement: this agent cannot reach other workers")
            split = check_placement(program, placement, self.worker_id,
                                    self.limits.max_fanout)
        if plan.constraints and kind not in MASK_ENGINES | GRAMMAR_ENGINES:
            raise ProgramError(grpc.StatusCode.UNIMPLEMENTED,
                               f"program: constrained gen needs an engine with token masks "
                               f"(tiny, sim) or per-request grammars (vllm); the {kind} "
                               f"engine has neither")
        # JSON as the engine's grammar backend writes it (whitespace and all), for the local
        # check of what it returns and for the rest of a continued region alike.
        json_flexible = kind in GRAMMAR_ENGINES
        rests: dict[str, tuple[str, continuation.Node]] = {}
        if plan.continues_constraint and kind not in MASK_ENGINES:
            # The engine takes a whole grammar per request: a continued region is sent as
            # what is left of its constraint, which only a regular one has as a regex.
            for spec in plan.constraints:
                try:
                    rests[spec.grammar] = (spec.kind, continuation.constraint_node(
                        spec.kind, spec.source, self.limits.max_grammar_bytes, json_flexible))
                except continuation.UnsupportedError as exc:
                    raise ProgramError(grpc.StatusCode.UNIMPLEMENTED,
                                       f"gen.continue_constraint on the {kind} engine, which "
                                       f"takes a whole grammar per request: {exc}") from None
        vocab = await self.vocab() if (plan.constraints or plan.needs_text
                                       or kind in VOCAB_ENGINES) else None
        if vocab is None and (plan.constraints or plan.needs_text):
            raise ProgramError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"program: constraints, text fast-forwards and stop strings "
                               f"need --tokenizer with the engine's vocabulary "
                               f"({self.limits.vocab_size} ids; --tokenizer is "
                               f"{self.tokenizer!r})")
        templates = {} if vocab is None else await compile_constraints(
            plan.constraints, vocab, self.limits.compile_timeout_s,
            json_whitespace_flexible=json_flexible)
        return _Prepared(plan, vocab, templates, split, rests)

    async def run(self, prepared: _Prepared, request: common_pb2.GenerateRequest,
                  request_id: str) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Stream the program's responses; ProgramError / EngineError on failure."""
        run = _Run(self, prepared, request, request_id)
        task = asyncio.create_task(run.main(), name=f"program:{request_id}")
        try:
            while True:
                item = await run.queue.get()
                if item is _END:
                    break
                yield item
            await task
            if run.error is not None:
                raise run.error
        finally:
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ProgramError, EngineError):
                await task


@dataclass(frozen=True, slots=True)
class _Prepared:
    plan: Plan
    vocab: Vocab | None
    templates: dict[str, Any]
    split: Split | None = None
    rests: dict[str, tuple[str, continuation.Node]] = field(default_factory=dict)
    """Regular constraints as (kind, nodes), by grammar: what a continued region is sent as
    on an engine that takes a whole grammar per request (``continuation.rest_of``)."""


def _first_error(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


@dataclass(slots=True)
class _Run:
    """One program execution: the branch tree and its response stream."""

    rt: ProgramRuntime
    prep: _Prepared
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
        """Run the program; always ends the stream with ``_END`` (after storing a failure in
        ``error``) unless cancelled, when nobody reads the stream any more."""
        try:
            await self._main()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = exc
        await self.queue.put(_END)

    async def _main(self) -> None:
        prompt = list(self.request.token_ids)
        root = Branch("0", list(prompt), len(prompt))
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

    async def fork(self, parent: Branch, step: Fork) -> list[Branch]:
        children = await self.forked(parent, len(step.branches))
        return await self.join(self.led(parent, [
            _Unit([c], self.runner(c, sub))
            for c, sub in zip(children, step.branches, strict=True)]), step.select)

    async def forked(self, parent: Branch, n: int) -> list[Branch]:
        children = [parent.child(f"{parent.id}.{i}") for i in range(n)]
        await self.emit(parent, events=[Ev(kind=Ev.KIND_FORKED,
                                           branch_ids=[c.id for c in children])])
        return children

    def runner(self, c: Branch, steps: Program) -> Callable[[], Any]:
        return lambda: self.program([c], steps)

    async def join(self, units: list[_Unit], mode: SelectMode) -> list[Branch]:
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

    # -- overflow (a placement moved some fork children to other workers) ------------------

    async def split_fork(self, parent: Branch, step: Fork, rest: Program,
                         split: Split) -> list[Branch]:
        """The split fork and its segment (``rest``: the steps each child runs after its
        sub-program), with the moved children run on their workers."""
        st = self.rt.stats
        if parent.matcher is not None:
            # The open constraint's state cannot travel: everything stays here.
            st.overflow_kept += len(split.moved)
            return await self.program([parent], (step, *rest))
        moved = split.moved
        children = await self.forked(parent, len(step.branches))
        units = self.led(parent, [
            _Unit([c], self.runner(c, (*sub, *rest)))
            for i, (c, sub) in enumerate(zip(children, step.branches, strict=True))
            if i not in moved])
        # First-finished needs one unit per child (a unit ends when all its members do).
        groups = [(t, [i]) for t in split.targets for i in t.children] \
            if step.select == SelectMode.FIRST_FINISHED \
            else [(t, list(t.children)) for t in split.targets]
        for t, idx in groups:
            members = [children[i] for i in idx]
            local = [self.runner(c, (*step.branches[i], *rest))
                     for c, i in zip(members, idx, strict=True)]
            units.append(_Unit(members, self.remoter(parent, t, idx, members, local)))
        return await self.join(units, step.select)

    def remoter(self, parent: Branch, target: Target, idx: list[int], members: list[Branch],
                fallback: list[Callable[[], Any]]) -> Callable[[], Any]:
        return lambda: self.remote(parent, target, idx, members, fallback)

    async def remote(self, parent: Branch, target: Target, idx: list[int],
                     members: list[Branch], fallback: list[Callable[[], Any]]) -> list[Branch]:
        """Run ``members`` (the fork's children ``idx``) on ``target``; their live branches.
        A failure before any of their output reached the client runs them here instead."""
        assert self.rt.channels is not None and self.prep.split is not None
        st = self.rt.stats
        req = common_pb2.GenerateRequest(
            token_ids=parent.tokens, model=self.request.model,
            cache_salt=self.request.cache_salt,
            request_id=f"{self.request_id}/{members[0].id}@{target.worker_id}",
            program=self.prep.split.seg.remote_program(idx))
        req.sampling.CopyFrom(self.request.sampling)
        # Per child, like a local branch's seed: reproducible, and siblings differ.
        req.sampling.seed = xxhash.xxh3_64_intdigest(
            f"{self.request.sampling.seed}/{members[0].id}".encode()) & ((1 << 63) - 1) or 1
        st.overflow_sent += len(members)
        call = self.rt.channels.stub(target.address).Generate(req)
        relayed = False  # once the client has seen the remote's output, it cannot move
        final: common_pb2.GenerateResponse | None = None
        try:
            async for resp in call:
                if resp.results:
                    final = resp
                    continue
                out = relay(resp, members, self.request_id)
                if out is not None:
                    relayed = True
                    await self.queue.put(out)
        except grpc.aio.AioRpcError as exc:
            if relayed:
                raise ProgramError(grpc.StatusCode.UNAVAILABLE,
                                   f"overflow worker {target.worker_id} failed mid-program: "
                                   f"{exc.code().name} {exc.details()}") from None
            st.overflow_fallback += len(members)
            log.warning("overflow worker failed; running its fork children here",
                        extra={"kv": {"request": self.request_id, "worker": target.worker_id,
                                      "code": exc.code().name, "details": exc.details()}})
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(f()) for f in fallback]
            return [b for t in tasks for b in t.result()]
        finally:
            call.cancel()  # no-op once finished; frees the remote's branches otherwise
        if final is None:
            raise ProgramError(grpc.StatusCode.UNAVAILABLE,
                               f"overflow worker {target.worker_id} ended without results")
        self.decoded += final.usage.completion_tokens
        live: list[Branch] = []
        for r in final.results:
            bid = remote_id(r.branch_id, members)
            if bid is not None:
                b = branch_from_result(parent, r, bid)
                (live if r.selected else self.dropped).append(b)
        return live

    def led(self, parent: Branch, units: list[_Unit]) -> list[_Unit]:
        """``units`` (a fork's local children) run so that the engine computes ``parent``'s
        prefix once: children submitted together would all miss it (blocks are shared only
        once computed). The first child leads: its first engine request prefills the prefix
        with its own suffix, and the others start once that request's first token is out,
        finding the prefix cached -- as the router coalesces requests on a prefix in flight.
        (A separate 1-token warm-up request instead put every child's suffix an engine
        iteration after the prefix: 3-4% later first tokens on fork traffic in the replay
        simulator.) Under ``FIRST_FINISHED`` the leader starts that one prefill ahead. A
        leader that ends before its first prefill (a program of fast-forwards only, or a
        failure) releases the others after a warm-up request (:meth:`warm`). When the prefix
        is cached already, all start at once. The parent's first hit (the prompt's, for the
        root) is the leader's first request's."""
        if not units:
            return units  # every child moved to other workers
        leader, lead_run = units[0].members[0], units[0].run
        gated = len(units) > 1 and not self.prefix_cached(parent)
        st = self.rt.stats
        if len(units) > 1:
            if gated:
                st.forks_led += 1
            else:
                st.forks_cached += 1
        ready = asyncio.Event()
        # A parent that leads a fork itself is prefilled when its own leader is.
        leader.on_prefill = [ready, *(e for e in parent.on_prefill if not e.is_set())]
        warming = asyncio.Lock()
        cold = warmed = False  # the leader ended before a prefill; a warm-up has run

        async def lead() -> Any:
            nonlocal cold
            try:
                return await lead_run()
            finally:
                if not ready.is_set():
                    cold = True
                    ready.set()
                if parent.first_cached is None and leader.first_cached is not None:
                    # The prompt's hit is what the first engine request after it found.
                    parent.first_cached = min(leader.first_cached, len(parent.tokens))

        async def follow(run: Callable[[], Any]) -> Any:
            nonlocal warmed
            await ready.wait()
            if cold:
                async with warming:
                    if not warmed:
                        st.forks_warmed += 1
                        await self.warm(parent)
                        warmed = True
            return await run()

        return [_Unit(units[0].members, lead),
                *(_Unit(u.members, lambda r=u.run: follow(r)) if gated else u
                  for u in units[1:])]

    def prefix_cached(self, b: Branch) -> bool:
        """Whether the engine holds every full block of ``b``'s sequence (vllm: by its
        published cache view)."""
        engine: Any = self.rt.engine
        pool, bs = getattr(engine, "pool", None), getattr(engine, "block_size", 0)
        full = (len(b.tokens) - 1) // bs if bs else 0
        if not full:
            return True  # nothing a child could share
        if pool is not None:
            from kvroute.core.blocks import BlockHasher

            keys = BlockHasher(bs, engine.model, self.request.cache_salt).keys(b.tokens)
            return pool.longest_cached_prefix(keys[:full]) >= full
        return hasattr(engine, "cached_blocks") and engine.cached_blocks(
            b.tokens[: full * bs], self.request.cache_salt) >= full

    async def warm(self, b: Branch) -> None:
        """Make the engine cache ``b``'s full blocks: one 1-token request whose token is
        discarded (see :meth:`led`)."""
        engine: Any = self.rt.engine
        ereq = EngineRequest(request_id=f"{self.request_id}/{b.id}/warm",
                             token_ids=list(b.tokens), max_tokens=1,
                             cache_salt=self.request.cache_salt)
        async with contextlib.aclosing(engine.generate(ereq)) as stream:
            async for chunk in stream:
                b.prefilled()
                b.engine_requests += 1
                b.prefill_tokens += len(ereq.token_ids) - chunk.cached_tokens
                b.last_cached = chunk.cached_tokens
                if b.first_cached is None:
                    b.first_cached = chunk.cached_tokens
                break  # one token: this chunk is the last (vllm: with its exact hit)

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
        if g.constraint is not None:
            b.open_constraint(self.prep.templates[g.constraint.grammar].deep_copy(),
                              g.constraint.grammar)
        elif g.continue_constraint:
            if b.matcher is None:
                raise ProgramError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"gen.continue_constraint: branch {b.id} has no open "
                                   "constraint")
        elif b.matcher is not None:
            b.matcher = None
            await self.emit(b, events=[Ev(kind=Ev.KIND_CONSTRAINT_CLOSED, reason="gen")])
        s = _GenState(start=len(b.tokens), remaining=g.max_tokens, stops=g.stop)
        vocab = self.prep.vocab
        local = not self.rt.grammar_engine  # else the engine runs the whole region
        while s.reason is None:
            m = b.matcher
            if m is not None and local:
                ff = m.compute_ff_tokens()[: s.remaining]
                if ff:
                    m.consume_tokens(ff)
                    b.m_consumed += len(ff)
                    for t in ff:
                        b.append(t)
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

    def _rest_of_region(self, b: Branch, vocab: Vocab) -> str | None:
        """The regex an engine taking whole grammars is sent to continue ``b``'s open
        region: its constraint's rest after the text generated in it (None: complete)."""
        try:
            text = vocab.decode(b.tokens[b.region_start:], errors="strict")
        except UnicodeDecodeError:
            raise ProgramError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"gen.continue_constraint: branch {b.id}'s constrained text so "
                               f"far ends inside a UTF-8 character; its rest cannot be written "
                               f"as a regex") from None
        kind, node = self.prep.rests[b.region_grammar]
        try:
            return continuation.rest_of(node, text, self.rt.limits.max_grammar_bytes)
        except continuation.UnsupportedError as exc:
            raise ProgramError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"gen.continue_constraint: {exc}") from None
        except continuation.NotAPrefixError as exc:
            if kind == "json_schema":  # valid JSON for it, outside the subset written
                raise ProgramError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"gen.continue_constraint: branch {b.id}: {exc} (its "
                                   f"regex takes JSON with the schema's properties only, "
                                   f"in its order: json_regex)") from None
            # A regex's derivative refusing what the matcher accepted: a bug here.
            raise ProgramError(grpc.StatusCode.INTERNAL,
                               f"gen.continue_constraint: branch {b.id}: {exc}") from None

    async def decode(self, b: Branch, g: Gen, s: _GenState, vocab: Vocab | None) -> None:
        """One engine request; sets ``s.reason`` unless it ended for a grammar fast-forward."""
        constraint = None
        if b.matcher is not None and self.rt.grammar_engine:
            if g.constraint is not None:
                constraint = (g.constraint.kind, g.constraint.source)
            else:  # continue_constraint: what is left of the region's constraint
                assert vocab is not None
                rest = self._rest_of_region(b, vocab)
                if rest is None:
                    s.reason = "grammar"  # the region is complete: nothing to ask for
                    return
                constraint = ("regex", rest)
        req = self.request
        self.n_requests += 1
        rid = f"{self.request_id}/{b.id}/{self.n_requests}"
        # Per branch and request, independent of the request id: reruns are reproducible and
        # siblings of a fork sample differently.
        seed = xxhash.xxh3_64_intdigest(
            f"{req.sampling.seed}/{b.id}/{b.engine_requests}".encode()) & ((1 << 63) - 1) or 1
        stop_ids = set(req.sampling.stop_token_ids)
        eos = vocab.eos_token_id if vocab is not None else getattr(self.rt.engine,
                                                                   "eos_token_id", None)
        if eos is not None:
            stop_ids.add(eos)
        masker = None
        if b.matcher is not None and not self.rt.grammar_engine:
            assert vocab is not None
            masker = _Masker(b, MaskBuffer(vocab.size), mask_times=self.rt.mask_times)
        temperature = g.temperature if g.temperature is not None else req.sampling.temperature
        ereq = EngineRequest(
            request_id=rid, token_ids=list(b.tokens), max_tokens=s.remaining,
            cache_salt=req.cache_salt, seed=seed, stop_token_ids=frozenset(stop_ids),
            temperature=temperature, mask_fn=masker, logprobs=self.rt.grammar_engine)
        tap = self.rt._tap.subscribe(rid) if self.rt._tap is not None \
            else contextlib.nullcontext({})
        engine: Any = self.rt.engine
        stream_it = engine.generate(ereq) if constraint is None \
            else engine.generate(ereq, constraint=constraint)
        first = True
        first_request = b.first_cached is None
        step = 0
        with tap as logits:
            async with contextlib.aclosing(stream_it) as stream:
                async for chunk in stream:
                    if first:
                        first = False
                        b.prefilled()  # its prefix is cached: siblings may start
                        b.engine_requests += 1
                        b.prefill_tokens += len(ereq.token_ids) - chunk.cached_tokens
                        b.last_cached = chunk.cached_tokens
                        if b.first_cached is None:
                            b.first_cached = chunk.cached_tokens
                    elif chunk.cached_tokens != b.last_cached:
                        # The engine's exact hit, known only now (vllm: its usage).
                        b.prefill_tokens += b.last_cached - chunk.cached_tokens
                        b.last_cached = chunk.cached_tokens
                        if first_request:
                            b.first_cached = chunk.cached_tokens
                    kept: list[int] = []
                    lps = chunk.logprobs
                    for j, tok in enumerate(chunk.token_ids):
                        lg = logits.pop(step, None)
                        at, step = step, step + 1
                        if tok in stop_ids:
                            s.reason = "grammar" if b.matcher is not None else "eos"
                            break
                        b.append(tok, lps[j] if lps is not None and lg is None
                                 else token_logprob(lg, tok))
                        b.generated += 1
                        self.decoded += 1
                        s.remaining -= 1
                        kept.append(tok)
                        if masker is not None and masker.split_at == at:
                            s.split = True
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
        if b.matcher is not None and not b.sync_matcher():
            if constraint is not None:
                raise ProgramError(grpc.StatusCode.INTERNAL,
                                   f"branch {b.id}: the {self.rt.engine_kind} engine returned "
                                   f"output outside the {constraint[0]} constraint (does it "
                                   f"take structured_outputs? vLLM >= 0.10.2)")
            raise ProgramError(grpc.StatusCode.INTERNAL,
                               f"branch {b.id}: the constraint rejected a masked token")

    async def check_stop(self, b: Branch, s: _GenState, new: Sequence[int]) -> bool:
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
        hits = [i for i in (s.text.find(x, lo) for x in s.stops) if i >= 0]
        if not hits:
            return False
        cut = min(hits)
        keep = bisect.bisect_right(s.ends, cut)
        drop = len(s.ends) - keep
        b.truncate(drop)
        del s.ends[keep:]
        s.stop_text = bytes(s.text[:cut])
        s.reason = "stop"
        if drop:
            await self.emit(b, events=[Ev(kind=Ev.KIND_BACKTRACK, count=drop, reason="stop")])
        return True

    async def finish_gen(self, b: Branch, g: Gen, s: _GenState) -> None:
        if b.matcher is not None and not b.sync_matcher():
            raise ProgramError(grpc.StatusCode.INTERNAL, f"branch {b.id}: constraint lost")
        events = [Ev(kind=Ev.KIND_GEN_END, reason=s.reason or "length",
                     count=len(b.tokens) - s.start)]
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


@dataclass(frozen=True, slots=True)
class _Unit:
    """What a fork runs as one task: one local child, or children on another worker."""

    members: list[Branch]
    run: Callable[[], Any]


@dataclass(slots=True)
class _GenState:
    start: int
    remaining: int
    stops: tuple[bytes, ...]
    reason: str | None = None
    split: bool = False
    text: bytearray = field(default_factory=bytearray)
    ends: list[int] = field(default_factory=list)
    stop_text: bytes | None = None
