"""The router's gRPC server: validate, decide, forward to the agent, stream back."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvroute.core.agent_client import AgentChannels
from kvroute.core.config import RouterConfig
from kvroute.core.grpc_util import add_handlers, wire_keeping_handler
from kvroute.core.liveness import HungWorkerError, LivenessProbe, watched
from kvroute.core.placement import ForkSegment, Overflow, fork_segment, place_fork, program_load
from kvroute.core.program_bounds import BoundLimits, ProgramBoundsError, program_bounds
from kvroute.core.tokenizer import Tokenizer
from kvroute.core.validate import (
    InvalidRequestError,
    Limits,
    check_names,
    check_sampling,
    check_tokens,
)
from kvroute.core.wire import request_token_ids, with_string_field
from kvroute.router.coalesce import InflightPrefixes
from kvroute.router.copies import PrefixCopier
from kvroute.router.decide import Decider, Decision, NoWorkersError, rerank_confirmed
from kvroute.router.lifecycle import Lifecycle, Stay
from kvroute.router.metrics import RouterMetrics
from kvroute.router.mirror import IndexMirror
from kvroute.router.refusal import (
    RefusedError,
    UnavailableError,
    UnsupportedError,
    invalid_request,
    refused_field,
)
from kvroute.router.registry import WorkerRegistry
from kvroute.router.trust import ClaimAudit, promised_tokens
from kvroute.v1 import common_pb2, program_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger("kvroute.router")

SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
_DOWN_S = 2.0  # how long a worker that refused a request is skipped
_MAX_ATTEMPTS = 2  # the chosen worker, then the next-best once
# What a worker answers for the request's own content: passed back to the client as it is,
# the worker not marked down and no other tried (it would refuse the request too).
_REQUEST_CAUSED = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,  # e.g. a program the agent is not set up for
    grpc.StatusCode.UNIMPLEMENTED,        # ... or its engine cannot run
    grpc.StatusCode.OUT_OF_RANGE})
DEMOTE_S = 60.0  # how long a worker whose claims fell short is routed as if cold


def add_router_service(service: RouterService, server: grpc.aio.Server) -> None:
    """Serve ``service`` as kvroute.v1.Router, each request keeping its wire bytes."""
    add_handlers(server, router_pb2.DESCRIPTOR.services_by_name["Router"], {
        "Route": wire_keeping_handler(
            service.Route, router_pb2.RouteResponse.SerializeToString, stream=False,
            on_invalid=lambda: service.invalid("Route")),
        "Generate": wire_keeping_handler(
            service.Generate, common_pb2.GenerateResponse.SerializeToString, stream=True,
            on_invalid=lambda: service.invalid("Generate")),
    })


@dataclass(slots=True, eq=False)
class _Outgoing:
    """A request as it goes to workers: the bytes it came in (``payload``) or a rewritten
    message (``fwd``), and what a program weighs: ``fanout`` sequences and ``extra``
    prefill tokens on its worker, its fork segment (``seg``, ``weights``) for overflow."""

    rid: str
    decode_text: bool = False
    payload: bytes | None = None
    fwd: common_pb2.GenerateRequest = field(default_factory=common_pb2.GenerateRequest)
    program: program_pb2.ControllerProgram | None = None
    fanout: int = 1
    extra: int = 0
    seg: ForkSegment | None = None
    weights: list[int] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Attempt:
    """One worker's try: its stay, the tokens it sent, how it failed (None: it did not)."""

    worker: str
    address: str
    timeout: float | None
    stay: Stay | None = None
    tokens_out: int = 0
    failure: grpc.aio.AioRpcError | HungWorkerError | None = None


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, cfg: RouterConfig, decider: Decider, mirror: IndexMirror,
                 registry: WorkerRegistry, channels: AgentChannels, metrics: RouterMetrics,
                 tokenizer: Tokenizer | None) -> None:
        self._cfg = cfg
        self._decider = decider
        self._mirror = mirror
        self._registry = registry
        self._channels = channels
        self._m = metrics
        self._tok = tokenizer
        self._limits = Limits(cfg.model.vocab_size, cfg.limits.max_prompt_tokens,
                              cfg.limits.max_new_tokens)
        # Half the connect timeout to wait, half for the probe: a hung worker is left
        # within about --connect-timeout-s (core/liveness.py).
        self._probe = LivenessProbe(channels, cfg.workers.connect_timeout_s / 2)
        self._claims = ClaimAudit()  # promised vs reported cached tokens, per worker
        self._program_limits = BoundLimits(max_fanout=cfg.limits.program_fanout,
                                           max_steps=cfg.limits.program_steps)
        # Requests sent on with predicted entries whose first token has not come back.
        self._inflight: InflightPrefixes[asyncio.Event] = InflightPrefixes(
            cfg.policy.coalesce_share)
        if mirror.shared is not None:
            mirror.shared.inflight = self._inflight  # others' prefills are waited for too
        # Every request's stay on a worker, begun and ended alike (the endpoint picker's too).
        self.lifecycle = self._life = Lifecycle(registry, mirror, self._inflight, metrics,
                                                cfg.policy.predict_ttl_s)
        # The policy's background copies of hot prefixes, if it places any.
        policy = decider.policy
        self.copier = PrefixCopier(policy.replica if policy.places_replicas else None, registry,
                                   channels, mirror, self._inflight, self._life.release, metrics,
                                   decider.block_size, cfg.policy.predict_ttl_s,
                                   cfg.policy.max_copies, cfg.policy.copy_timeout_s)

    def invalid(self, method: str, api: str = "grpc") -> None:
        """Count a request refused as INVALID_ARGUMENT before it reached ``method``."""
        self._m.requests.labels(api, method, "invalid").inc()

    # -- shared front half -------------------------------------------------------------------

    def _prompt(self, req: common_pb2.GenerateRequest, wire: bytes | None) -> Sequence[int]:
        check_names(req, self._cfg.model.name)
        if req.token_ids and req.text:
            raise InvalidRequestError("text", "give token_ids or text, not both")
        if req.text:
            if self._tok is None:
                raise InvalidRequestError("text", "this router has no tokenizer configured "
                                             "(--tokenizer); send token_ids")
            tokens: Sequence[int] = self._tok.encode(req.text)
            check_tokens(tokens, self._limits, "text")
            return tokens
        tokens, top = request_token_ids(req, wire)
        check_tokens(tokens, self._limits, top=top)
        return tokens

    def _check_program(self, req: common_pb2.GenerateRequest) -> None:
        """A program's claimed size against this router's limits, before anything walks it
        child by child (placement weights, fork segments): ProgramBoundsError."""
        if req.HasField("program"):
            program_bounds(req.program, self._program_limits)

    def _decide(self, tokens: Sequence[int], req: common_pb2.GenerateRequest,
                t0: float) -> Decision:
        """``t0``: when the request's prompt began to be read (``_prompt``): the decision's
        latency includes reading its ids, which at 8k tokens once cost more than the rest."""
        self._registry.revive_due()
        if not self._registry.loads:
            raise NoWorkersError(self._registry.unroutable())  # each worker, and why not
        index = self._mirror.index if self._mirror.available else None
        d = self._decider.decide(tokens, index, self._registry, salt=req.cache_salt,
                                 session_id=req.session_id)
        self._m.decision_seconds.observe(time.perf_counter() - t0)
        return d

    # -- RPCs ------------------------------------------------------------------------------

    async def Route(  # noqa: N802 - gRPC method name
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
        wire: bytes | None = None,
    ) -> router_pb2.RouteResponse:
        """``wire``: the bytes ``request`` was parsed from (:func:`add_router_service`)."""
        try:
            tokens, d = self.decide_request(request, wire, rpc="Route", sampling=False)
        except RefusedError as exc:
            await context.abort(exc.code, exc.message)
        self._m.requests.labels("grpc", "Route", "ok").inc()
        resp = router_pb2.RouteResponse(
            request_id=request.request_id or uuid.uuid4().hex, worker_id=d.best,
            cached_tokens=d.cached_tokens(d.best), prompt_tokens=len(tokens),
            policy=self._decider.policy.name, degraded=not self._mirror.available,
        )
        most = self._cfg.policy.route_candidates
        add, matched = resp.candidates.add, d.query.matched_blocks
        for s in d.ranked[:most] if most else d.ranked:
            # add() then field sets: half the cost of add(**fields) in upb, and at 128
            # workers this list costs more than the decision.
            c = add()
            c.worker_id = s.worker
            c.cost = s.cost
            info = self._registry.get(s.worker)
            if info is not None:
                c.address = info.address
            if s.worker in matched:
                c.cached_tokens = d.cached_tokens(s.worker)
        resp.address = resp.candidates[0].address
        if request.HasField("program") and self._cfg.policy.program_overflow:
            seg = fork_segment(request.program)
            if seg is not None:
                fwd = common_pb2.GenerateRequest()
                self._place(fwd, seg, seg.weights(), d.best, d)
                resp.placement.CopyFrom(fwd.placement)
        return resp

    def decide_request(
        self, request: common_pb2.GenerateRequest, wire: bytes | None = None, *,
        api: str = "grpc", rpc: str = "Generate", t0: float | None = None,
        sampling: bool = True,
    ) -> tuple[Sequence[int], Decision]:
        """The front half of :meth:`generate`: validate, read or tokenize the prompt, decide.
        Nothing is sent: a front whose gateway carries the request itself (``kvroute epp``)
        stops here. Raises :class:`RefusedError` (counted under ``api`` and ``rpc``) for what
        is not served; ``t0``: when the request began to be read (default: now);
        ``sampling``: check the sampling fields too (``Route`` generates nothing)."""
        t0 = time.perf_counter() if t0 is None else t0
        try:
            self._check_program(request)
            tokens = self._prompt(request, wire)
            if sampling:
                check_sampling(request, self._limits)
            return tokens, self._decide(tokens, request, t0)
        except InvalidRequestError as exc:
            self.invalid(rpc, api)
            raise invalid_request(exc) from None
        except ProgramBoundsError as exc:
            self.invalid(rpc, api)
            raise UnsupportedError(exc.code, str(exc), exc.field) from None
        except NoWorkersError as exc:
            self._m.requests.labels(api, rpc, "unavailable").inc()
            raise UnavailableError(str(exc)) from None

    async def generate(
        self, request: common_pb2.GenerateRequest, wire: bytes | None = None,
        api: str = "grpc", deadline: float | None = None,
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """The one generation path every API takes: validate, decide (coalescing, copies),
        send to the best worker, retry the next-best once if it fails before its first
        token, stream its responses. Raises :class:`RefusedError` for what it does not serve;
        closing the iterator early (a client gone) cancels the agent call. ``api`` labels
        the request metrics (grpc, http). ``deadline`` (``time.monotonic()``): the client's,
        the agent calls' too; a worker that does not answer before the first token is
        probed and left for the next-best when hung (core/liveness.py)."""
        t0 = time.perf_counter()
        tokens, d = self.decide_request(request, wire, api=api, t0=t0)
        out = self._outgoing(request, wire, tokens)
        predicting = self._cfg.policy.predict_ttl_s > 0 and self._mirror.available and bool(d.keys)
        waited = False
        if predicting:
            d, waited = await self.coalesce(d, out.rid, api)
        if out.program is None:
            self.copier.maybe_copy(d, tokens, request, out.rid)
        errors: list[str] = []
        for w, address in self._candidates(d, waited):
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                self._m.requests.labels(api, "Generate", "deadline").inc()
                raise RefusedError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "the request's deadline passed before a worker answered")
            attempt = _Attempt(w, address, timeout)
            async for resp in self._attempt(attempt, out, d, len(tokens), predicting, t0, api):
                yield resp
            if attempt.failure is None:
                self._m.requests.labels(api, "Generate", "ok").inc()
                return
            errors.append(self._failed(attempt, out.rid, api, deadline))
        self._m.requests.labels(api, "Generate", "unavailable").inc()
        raise UnavailableError("no worker could serve the request: " + "; ".join(errors))

    def _outgoing(self, request: common_pb2.GenerateRequest, wire: bytes | None,
                  tokens: Sequence[int]) -> _Outgoing:
        """What goes to a worker. A plain request goes on as the bytes it came in, with the
        router's request id appended when it had none: serializing an 8k-token prompt again
        costs ~0.2 ms (32k: ~0.8 ms). A text prompt, a program or a client's placement is
        rewritten instead."""
        rid = request.request_id or uuid.uuid4().hex
        out = _Outgoing(rid, decode_text=bool(request.text) and self._tok is not None)
        if wire is not None and not request.text and not request.HasField("program") \
                and not request.HasField("placement"):
            out.payload = wire if request.request_id else with_string_field(wire, "request_id",
                                                                            rid)
            return out
        out.fwd.CopyFrom(request)
        out.fwd.request_id = rid
        if request.text:
            out.fwd.ClearField("text")
            out.fwd.token_ids.extend(tokens)
        if request.HasField("program"):
            # A program's branches run on the chosen worker (they weigh on its load as that
            # many sequences until it finishes), except fork children it has no room for;
            # its fast-forwards are prefill work too, pending until the program ends.
            out.program = request.program
            out.fanout, out.extra = program_load(out.program)
            if self._cfg.policy.program_overflow:
                out.seg = fork_segment(out.program)
                out.weights = out.seg.weights() if out.seg is not None else []
        return out

    def _candidates(self, d: Decision, waited: bool) -> Iterator[tuple[str, str]]:
        """(worker, address) to try, best first: the chosen one and the next-best once.
        A worker gone, or marked down since the decision (while this request waited for
        its producer, or while its first attempt waited on a worker that then failed), is
        skipped and does not use up the retry."""
        sent = 0
        for cand in d.ranked:
            if sent >= _MAX_ATTEMPTS:
                return
            info = self._registry.get(cand.worker)
            if info is None or ((waited or sent) and cand.worker not in self._registry.loads):
                continue
            if sent:
                self._m.retries.inc()
            sent += 1
            yield cand.worker, info.address

    async def _attempt(self, a: _Attempt, out: _Outgoing, d: Decision, prompt_tokens: int,
                       predicting: bool, t0: float, api: str
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """One worker's try: its stay (and its overflow workers') begun, its responses
        streamed, the stay ended however it ends; ``a.failure`` says how it failed."""
        w = a.worker
        overflow = () if out.payload is not None else \
            self._place(out.fwd, out.seg, out.weights, w, d)
        self._m.overflow.inc(sum(len(o.children) for o in overflow))
        if overflow:
            log.info("program fork split across workers", extra={"kv": {
                "request": out.rid, "worker": w,
                "overflow": {o.worker: list(o.children) for o in overflow}}})
        promised = self._promised(d, w, prompt_tokens) if out.program is None else 0
        a.stay = stay = self._life.begin(
            out.rid, w, *d.prefill(w), d.keys, extra=out.extra,
            weight=max(1, out.fanout - sum(o.weight for o in overflow)), predict=predicting)
        # Overflow workers' prefill is pending until their first chunk comes back.
        away = {o.worker: self._life.begin(out.rid, o.worker, *d.prefill(o.worker),
                                           weight=o.weight) for o in overflow}
        call = (self._channels.generate_wire(a.address)(out.payload, timeout=a.timeout)
                if out.payload is not None
                else self._channels.stub(a.address).Generate(out.fwd, timeout=a.timeout))
        done = False
        try:
            async for resp in watched(call, self._probe, a.address,
                                      self._cfg.workers.connect_timeout_s / 2):
                if not stay.started:
                    self._life.first_token(stay)
                    self._m.ttft.observe(time.perf_counter() - t0)
                    self._m.routed.labels(w).inc()
                    resp.ttft_ms = (time.perf_counter() - t0) * 1000
                if resp.worker_id in away:
                    self._life.first_token(away[resp.worker_id])
                if out.decode_text and resp.token_ids:
                    resp.text = self._tok.decode(resp.token_ids)  # type: ignore[union-attr]
                if resp.HasField("usage"):
                    self._m.prompt_tokens.inc(resp.usage.prompt_tokens)
                    self._m.cached_tokens.inc(resp.usage.cached_tokens)
                    if promised:
                        self._audit(w, promised, resp.usage.cached_tokens)
                a.tokens_out += len(resp.token_ids)
                yield resp
            done = True
        except (grpc.aio.AioRpcError, HungWorkerError) as exc:
            a.failure = exc
        finally:
            # However the attempt ended (the client may cancel or close the stream at any
            # await or yield), what it added is undone.
            self._life.end(stay)
            for other in away.values():
                self._life.end(other)
            if not done and a.failure is None:
                call.cancel()
                self._m.requests.labels(api, "Generate", "cancelled").inc()

    def _failed(self, a: _Attempt, rid: str, api: str, deadline: float | None) -> str:
        """After a failed attempt: the refusal to raise when a retry cannot help (output
        sent, the request's own fault, its deadline passed); else the worker is marked down
        and the error returned for the next-best's turn."""
        failure, w = a.failure, a.worker
        assert failure is not None and a.stay is not None
        started = a.stay.started
        if failure.code() in _REQUEST_CAUSED:
            # The request's own doing, before or after its first tokens: any worker would
            # do the same, so none is tried or marked down.
            if not started:
                self._life.withdraw(a.stay)
            self._m.requests.labels(api, "Generate", "rejected").inc()
            assert isinstance(failure, grpc.aio.AioRpcError)
            raise UnsupportedError(failure.code(), f"worker {w}: {failure.details()}",
                                   refused_field(failure), midstream=started,
                                   sent=a.tokens_out if started else 0)
        if started:
            # Tokens already reached the client: a retry would repeat them.
            self._m.requests.labels(api, "Generate", "failed_midstream").inc()
            raise UnavailableError(f"worker {w} failed mid-stream after {a.tokens_out} "
                                   f"tokens were sent (retrying repeats them): "
                                   f"{failure.details()}", midstream=True, sent=a.tokens_out)
        self._life.withdraw(a.stay)  # failed before its prefill
        if failure.code() == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None \
                and time.monotonic() >= deadline - 0.05:
            # The client's own deadline (the call's), not the worker's fault.
            self._m.requests.labels(api, "Generate", "deadline").inc()
            raise RefusedError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"worker {w}: the request's deadline passed")
        log.warning("agent failed before first token; trying next-best",
                    extra={"kv": {"worker": w, "request": rid, "code": failure.code().name,
                                  "details": failure.details()}})
        self._registry.mark_down(w, _DOWN_S, f"{failure.code().name}: {failure.details()}")
        return f"{w}: {failure.code().name} {failure.details()}"

    async def coalesce(self, d: Decision, rid: str, api: str) -> tuple[Decision, bool]:
        """Coalescing: when the chosen worker matched the prompt's prefix only by a
        prediction, hold the request until the request that prediction stands for has its
        first token (its prefix is then stored), so it is prefilled once: an engine admits
        a queue in batches, and siblings admitted together each compute the whole prefix.
        Gives up after ``coalesce_wait_s`` and sends it anyway. When that prefill is mostly
        the other request's own (``coalesce_share``), the request is decided again on what
        workers really hold instead of waiting. Returns the decision to send by and whether
        it waited."""
        w = d.best
        index = self._mirror.index
        matched = d.query.matched_blocks.get(w, 0)
        stored = self._inflight.producer(index, w, d.keys, matched)
        if stored is None or stored.is_set():
            return d, False
        if not self._inflight.worth_waiting(stored, index, w, d.keys, matched,
                                            self._decider.block_size):
            self._m.coalesce_declined.inc()
            return rerank_confirmed(self._decider.policy, index, d, d.keys), False
        self._m.coalesced.inc()
        t0 = time.perf_counter()
        # A held request is load on its worker already (other decisions see it queued).
        uncached, attended = d.prefill(w)
        self._registry.begin(w, uncached, arrival=False, context=attended)
        try:
            await asyncio.wait_for(stored.wait(), self._cfg.policy.coalesce_wait_s)
        except TimeoutError:
            log.warning("in-flight sibling's prefill not done; sending anyway",
                        extra={"kv": {"request": rid, "worker": w,
                                      "waited_s": self._cfg.policy.coalesce_wait_s}})
        except asyncio.CancelledError:
            self._m.requests.labels(api, "Generate", "cancelled").inc()
            raise
        finally:
            self._registry.first_token(w, uncached, attended)
            self._registry.end(w)
            self._m.coalesce_wait.observe(time.perf_counter() - t0)
        return d, True

    def _promised(self, d: Decision, worker: str, prompt_tokens: int) -> int:
        """The cached tokens the index promises on ``worker`` now: its confirmed leading
        blocks (the router's own predictions are no worker's claim)."""
        m = d.query.matched_blocks.get(worker, 0)
        if not m or not self._mirror.available:
            return 0
        index = self._mirror.index
        if index.predicted(worker):
            m = index.confirmed(worker, d.keys, m)
        return promised_tokens(m, self._decider.block_size, prompt_tokens)

    def _audit(self, worker: str, promised: int, reported: int) -> None:
        """Compare what the index promised with what the engine reported (router/trust.py):
        a worker that keeps falling short has its claims ignored for DEMOTE_S."""
        if reported < promised:
            self._m.claim_shortfall.labels(worker).inc(promised - reported)
        shortfall = self._claims.observe(worker, promised, reported)
        if shortfall is not None:
            self._registry.demote(worker, DEMOTE_S)
            self._m.demotions.labels(worker).inc()
            log.warning("worker's published blocks keep missing in its engine; ignoring them "
                        "for a while", extra={"kv": {
                            "worker": worker, "shortfall": round(shortfall, 2),
                            "demoted_s": DEMOTE_S}})

    def _place(self, fwd: common_pb2.GenerateRequest, seg: ForkSegment | None,
               weights: list[int], worker: str, d: Decision) -> tuple[Overflow, ...]:
        """Set ``fwd.placement`` for a program sent to ``worker``: the fork children that
        ``place_fork`` moves to other workers (none while ``worker`` has room)."""
        fwd.ClearField("placement")
        if seg is None:
            return ()
        ranked = [s for s in d.ranked if s.worker == worker]
        ranked += [s for s in d.ranked if s.worker != worker]
        overflow = tuple(o for o in place_fork(ranked, d.query, weights)
                         if self._registry.get(o.worker) is not None)
        if not overflow:
            return ()
        fwd.placement.fork_step = seg.step
        for o in overflow:
            info = self._registry.get(o.worker)
            assert info is not None
            fwd.placement.overflow.add(worker_id=o.worker, address=info.address,
                                       children=o.children)
        return overflow
