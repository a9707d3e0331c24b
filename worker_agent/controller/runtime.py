"""The program runtime in the agent: checks a program and runs it against the agent's engine.

:class:`ProgramRuntime` is the agent's one entry point. :meth:`ProgramRuntime.prepare` does
every check before any engine work -- the program against the agent's limits, the engine's
support for what it uses, the router's placement -- and compiles its constraints
(``grammars``); :meth:`ProgramRuntime.run` streams its execution (``interpreter``) and
raises what failed it. Failures are :class:`ProgramError` (with the status the client sees)
or the engine's :class:`EngineError`.

Engines: the tiny engine and the sim take token masks (``MASK_ENGINES``: the sim, without
logits, moves its deterministic token to the first allowed id, so constrained programs run
on it; only their content is meaningless). vllm takes a grammar per request instead
(``GRAMMAR_ENGINES``: structured outputs) and enforces it; a program that continues a
constrained region there needs every constraint regular (regex, choices, a JSON schema
without recursion: ``json_regex``), and is refused with UNIMPLEMENTED otherwise
(``constrained``), unless vLLM runs kvroute's mask plugin, which continues any grammar from
the region's tokens. Fork children a placement moves run on other agents (``overflow``), over
``channels``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from kvroute.core.agent_client import AgentChannels
from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.liveness import LivenessProbe
from kvroute.core.redis_conn import REDIS_ERRORS
from kvroute.core.tokenizer import vocab_size
from kvroute.v1 import common_pb2, program_pb2
from kvroute.worker_agent.controller.constrained import continuation_rests
from kvroute.worker_agent.controller.grammars import compile_constraints
from kvroute.worker_agent.controller.interpreter import END, Prepared, Run
from kvroute.worker_agent.controller.logprobs import LogitsTap
from kvroute.worker_agent.controller.overflow import PROBE_S, Split, check_placement
from kvroute.worker_agent.controller.program import ProgramError, ProgramLimits, check_program
from kvroute.worker_agent.controller.stats import ProgramStats
from kvroute.worker_agent.controller.vocab import Vocab, make_vocab
from kvroute.worker_agent.engines.base import Engine, EngineError

log = logging.getLogger("kvroute.agent.programs")

PROGRAM_ENGINES = frozenset({"tiny", "sim", "vllm", "sglang"})
"""Engines the runtime drives (one engine request per branch step, prompt = the branch)."""
MASK_ENGINES = frozenset({"tiny", "sim"})
"""Engines that honour ``EngineRequest.mask_fn`` (the sim, without logits, moves its token to
the first allowed id: see ``engines.sim``)."""
GRAMMAR_ENGINES = frozenset({"vllm", "sglang"})
"""Engines that take a constraint per request (``generate(request, constraint=(kind,
source))``) and enforce it themselves."""
VOCAB_ENGINES = frozenset({"tiny"})
"""Engines whose programs always load the vocabulary (eos stops, capture text); others only
when the program needs it (constraints, text fast-forwards, stop strings)."""


@dataclass(slots=True)
class ProgramRuntime:
    """Per agent: checks programs against its limits and runs them on its engine."""

    engine: Engine
    limits: ProgramLimits
    tokenizer: str | ChatTokenizer
    """The agent's tokenizer: its ``--model-source``'s, else its ``--tokenizer`` (a name);
    used only when its vocabulary equals the engine's."""
    worker_id: str
    mask_times: list[float] | None = None
    """When set (benchmarks), every mask_fn call appends its duration in seconds."""
    channels: AgentChannels | None = None
    """To other agents, for fork children a placement moves (None: placements refused)."""
    peers: Callable[[str], Awaitable[str | None]] | None = None
    """A worker's address from its live heartbeat (None: not live). A placement may send
    children (and the whole prompt) only there; without it placements run here."""
    stats: ProgramStats = field(default_factory=ProgramStats)
    probe: LivenessProbe | None = None
    """Watches overflow workers for hangs (set from ``channels``)."""
    _vocab: Vocab | None = None
    _tap: LogitsTap | None = None

    def __post_init__(self) -> None:
        if hasattr(self.engine, "logits_observer"):
            self._tap = LogitsTap(self.engine)
        if self.channels is not None and self.probe is None:
            self.probe = LivenessProbe(self.channels, PROBE_S)

    @property
    def engine_kind(self) -> str:
        return str(getattr(self.engine, "kind", type(self.engine).__name__))

    @property
    def grammar_engine(self) -> bool:
        return self.engine_kind in GRAMMAR_ENGINES

    @property
    def continues_grammars(self) -> bool:
        """The grammar engine takes a constraint continued from a state (``GrammarState``:
        vLLM with kvroute's mask plugin), so any constrained region continues there."""
        return bool(getattr(self.engine, "continues_grammars", False))

    @property
    def logits_tap(self) -> LogitsTap | None:
        """The engine's logits by request (None: the engine has no logits)."""
        return self._tap

    async def vocab(self) -> Vocab | None:
        """The program vocabulary, or None when the tokenizer does not match the engine."""
        if self._vocab is None:
            try:
                size = (self.tokenizer.vocab_size if isinstance(self.tokenizer, ChatTokenizer)
                        else vocab_size(self.tokenizer))
                if size != self.limits.vocab_size:
                    return None
                self._vocab = await asyncio.to_thread(make_vocab, self.tokenizer)
            except ValueError:
                return None
        return self._vocab

    @property
    def _tokenizer_name(self) -> str:
        t = self.tokenizer
        return f"{t.name} ({t.fingerprint})" if isinstance(t, ChatTokenizer) else t

    async def prepare(self, program: program_pb2.ControllerProgram,
                      placement: program_pb2.Placement | None = None) -> Prepared:
        """Check limits, engine support and the placement, compile the constraints: all
        before any engine work. Raises :class:`ProgramError`."""
        kind = self.engine_kind
        if kind not in PROGRAM_ENGINES:
            raise ProgramError(grpc.StatusCode.UNIMPLEMENTED,
                               f"program: controller programs run on the tiny, sim, vllm and "
                               f"sglang engines; this agent's engine is {kind}")
        # Off the loop: a program within its limits can still cost milliseconds to parse
        # (schema conversion), and other requests must not wait for it.
        plan = await asyncio.to_thread(check_program, program, self.limits)
        split = None
        if placement is not None and placement.overflow:
            if self.channels is None:
                raise ProgramError(grpc.StatusCode.UNIMPLEMENTED,
                                   "placement: this agent cannot reach other workers")
            split = check_placement(program, placement, self.worker_id,
                                    self.limits.max_fanout)
            split = await self._known_targets(split)
        if plan.constraints and kind not in MASK_ENGINES | GRAMMAR_ENGINES:
            raise ProgramError(grpc.StatusCode.UNIMPLEMENTED,
                               f"program: constrained gen needs an engine with token masks "
                               f"(tiny, sim) or per-request grammars (vllm, sglang); the {kind} "
                               f"engine has neither")
        # JSON as the engine's grammar backend writes it (whitespace and all), for the local
        # check of what it returns and for the rest of a continued region alike.
        json_flexible = kind in GRAMMAR_ENGINES
        # An engine taking a whole grammar per request is sent a continued region as what is
        # left of its constraint, which only a regular one has as a regex.
        # (Schema -> regex conversion: CPU work, off the loop.)
        rests = await asyncio.to_thread(
            continuation_rests, plan.constraints, kind, self.limits.max_grammar_bytes,
            json_flexible) if plan.continues_constraint and kind not in MASK_ENGINES \
            and not self.continues_grammars else {}
        vocab = await self.vocab() if (plan.constraints or plan.needs_text
                                       or kind in VOCAB_ENGINES) else None
        if vocab is None and (plan.constraints or plan.needs_text):
            raise ProgramError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"program: constraints, text fast-forwards and stop strings "
                               f"need the agent's --model-source (or --tokenizer) with "
                               f"the engine's vocabulary ({self.limits.vocab_size} ids; the "
                               f"agent's tokenizer is {self._tokenizer_name!r})")
        templates = {} if vocab is None else await compile_constraints(
            plan.constraints, vocab, self.limits.compile_timeout_s,
            json_whitespace_flexible=json_flexible)
        return Prepared(plan, vocab, templates, split, rests)

    async def _known_targets(self, split: Split | None) -> Split | None:
        """``split`` if every worker it names is live at the address given; ProgramError
        (INVALID_ARGUMENT) naming one that is not (a client calling the agent directly
        must not make it send the prompt to any host:port). None (children run here)
        when that cannot be checked now: no Redis."""
        if split is None:
            return None
        if self.peers is None:
            return None
        for i, t in enumerate(split.targets):
            try:
                live = await asyncio.wait_for(self.peers(t.worker_id), 2.0)
            except (TimeoutError, *REDIS_ERRORS) as exc:
                log.warning("cannot check a placement's workers; its children run here",
                            extra={"kv": {"worker": t.worker_id, "error": repr(exc)}})
                return None
            if live is None or _host_port(live) != _host_port(t.address):
                raise ProgramError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"placement.overflow[{i}].worker_id: {t.worker_id!r} at "
                                   f"{t.address!r} is not a live worker of this model")
        return split

    async def run(self, prepared: Prepared, request: common_pb2.GenerateRequest,
                  request_id: str) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Stream the program's responses; ProgramError / EngineError on failure."""
        run = Run(self, prepared, request, request_id)
        task = asyncio.create_task(run.main(), name=f"program:{request_id}")
        try:
            while True:
                item = await run.queue.get()
                if item is END:
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


def _host_port(address: str) -> str:
    """``[::1]:5`` and ``::1:5`` alike (Kubernetes discovery brackets IPv6 hosts)."""
    host, _, port = address.rpartition(":")
    return f"{host.strip('[]')}:{port}"
