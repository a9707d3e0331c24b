"""Workload generators: synthetic traffic in the Mooncake trace format, so it replays like one.

Four kinds of traffic that real deployments see and that stress a cache-affinity router in
different ways:

* ``chat``  — multi-turn conversations over a few shared system prompts. Turn k+1's prompt is
  turn k's prompt + turn k's reply + a new user message, after a think time.
* ``agent`` — agent loops: every call extends the previous call's prompt with the model's
  output (a tool call) and the tool's result. Long, steadily growing prefixes.
* ``rag``   — few-shot / RAG prompts: a shared instruction template, then long documents drawn
  Zipf-like from a corpus (a few documents are hot), then a unique question.
* ``fork``  — controller programs: a shared prefix, then N sibling requests that arrive
  together, each adding its own branch prompt (optionally several rounds, each continuing
  from one branch).

Every record is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...], "block_size": tokens, "session": id}``: the session is the conversation,
agent run, RAG request or fork program it belongs to (the replay reads a reply's blocks only
from a later request of the same session, see :func:`kvroute.simulations.trace.continuations`).
The id at position i stands for the whole prefix up to and including block i (the last block
may be partial: ``ceil(input_length / block_size)`` ids), so two requests share a prefix
exactly as far as their leading ids agree. Ids are assigned from a content chain hash: each
piece of content (a system prompt, a document, a reply...) is a unique segment, and a block's
id hashes the previous block's id with the (segment, offset, count) pieces that fill it.

Arrivals are Poisson. For ``rag`` every request arrives independently at ``rate_per_s``; for
the others a session / program starts as a Poisson process at ``rate_per_s`` divided by its
expected number of requests, so the aggregate rate is close to ``rate_per_s``. Follow-up
requests are placed at a sampled gap after the previous one's *arrival* (open loop, as in a
recorded trace; the replay sends a follow-up no earlier than the end of the reply it carries,
which only the simulated cluster knows). Sessions start in steady state: the session process
begins well before time 0 (four mean session spans) and only arrivals from 0 on are kept, like
a trace recorded from a live service — so the rate holds from the first request instead of
ramping up, and some sessions are first seen mid-way. Everything is deterministic for a seed.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import xxhash

from kvroute.core.settings import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE

DEFAULT_BLOCK_SIZE = 64
KINDS = ("chat", "agent", "rag", "fork")
WARMUP_SPANS = 4  # sessions start this many mean session spans before time 0


# --- parameters -------------------------------------------------------------------------
# Token counts are means of a log-normal (sigma 0.5) unless said otherwise: real prompt and
# output lengths are right-skewed. Times are means of exponentials.

@dataclass(frozen=True, slots=True)
class ChatParams:
    """Multi-turn chat.

    system_prompts: distinct shared system prompts, chosen Zipf-like (1/rank).
    system_tokens: mean system prompt length (each prompt's length is fixed once drawn).
    user_tokens: mean user message length.
    output_tokens: mean reply length (the reply is part of the next turn's prompt).
    mean_turns: mean turns per conversation (geometric, >= 1).
    think_time_s: mean gap from one turn's arrival to the next (reply time + reading/typing).
    max_context_tokens: a conversation ends when its next prompt would exceed this.
    """

    system_prompts: int = 3
    system_tokens: int = 1500
    user_tokens: int = 200
    output_tokens: int = 300
    mean_turns: float = 5.0
    think_time_s: float = 30.0
    max_context_tokens: int = 32768


@dataclass(frozen=True, slots=True)
class AgentParams:
    """Agent loops (tool use).

    agent_types: distinct agents, each with its own system prompt (instructions + tool
        schemas), chosen Zipf-like.
    system_tokens: mean system prompt length.
    task_tokens: mean task description length (unique per run).
    output_tokens: mean model output per call (reasoning + a tool call).
    tool_result_tokens: mean tool result appended after each call.
    mean_calls: mean calls per run (geometric, >= 1).
    step_time_s: mean gap between calls' arrivals (generation + tool execution).
    max_context_tokens: a run ends when its next prompt would exceed this.
    """

    agent_types: int = 2
    system_tokens: int = 3000
    task_tokens: int = 400
    output_tokens: int = 150
    tool_result_tokens: int = 700
    mean_calls: float = 10.0
    step_time_s: float = 6.0
    max_context_tokens: int = 65536


@dataclass(frozen=True, slots=True)
class RagParams:
    """Few-shot / retrieval-augmented prompts over a shared corpus.

    templates: distinct instruction templates with few-shot examples, chosen Zipf-like.
    template_tokens: mean template length.
    documents: corpus size.
    document_tokens: mean document length (each document's length is fixed once drawn).
    docs_per_request: documents per prompt (only the leading ones can share a prefix).
    zipf_s: Zipf exponent of document popularity (document i has weight 1 / (i + 1)^s).
    question_tokens: mean question length (unique per request).
    output_tokens: mean answer length.
    """

    templates: int = 2
    template_tokens: int = 800
    documents: int = 500
    document_tokens: int = 3000
    docs_per_request: int = 1
    zipf_s: float = 1.1
    question_tokens: int = 80
    output_tokens: int = 200


@dataclass(frozen=True, slots=True)
class ForkParams:
    """Controller programs that fork after a shared prefix.

    system_prompts: distinct shared system prompts, chosen Zipf-like.
    system_tokens: mean system prompt length.
    context_tokens: mean program-specific context after the system prompt (unique).
    fanout: sibling requests per fork; they arrive together.
    branch_tokens: mean branch-specific prompt appended by each sibling.
    output_tokens: mean output per sibling (constrained generation is short).
    depth: fork rounds per program; each later round continues from one branch (its
        prompt + output), as after a select/join.
    step_time_s: mean gap between rounds.
    """

    system_prompts: int = 3
    system_tokens: int = 1000
    context_tokens: int = 1500
    fanout: int = 4
    branch_tokens: int = 40
    output_tokens: int = 64
    depth: int = 1
    step_time_s: float = 4.0


PARAMS: dict[str, type] = {"chat": ChatParams, "agent": AgentParams, "rag": RagParams,
                           "fork": ForkParams}


def _check_params(p: object) -> None:
    for f in dataclasses.fields(p):  # type: ignore[arg-type]
        v = getattr(p, f.name)
        want = int if isinstance(f.default, int) else (int, float)
        if not isinstance(v, want) or isinstance(v, bool) or v <= 0:
            kind = "an integer" if want is int else "a number"
            raise ValueError(f"{type(p).__name__}.{f.name} must be {kind} > 0, got {v!r}")
    if isinstance(p, ChatParams | AgentParams):
        mean = p.mean_turns if isinstance(p, ChatParams) else p.mean_calls
        if mean < 1:
            raise ValueError(f"mean turns/calls must be >= 1, got {mean}")


# --- prompts as block-hash chains -------------------------------------------------------

@dataclass(slots=True)
class _Namer:
    """Content ids and compact hash ids for one generated trace (no global state)."""

    next_segment: int = 0
    ids: dict[int, int] = field(default_factory=dict)

    def segment(self) -> int:
        self.next_segment += 1
        return self.next_segment

    def name(self, chain_hash: int) -> int:
        # Compact ids in order of first appearance, like the Mooncake trace's.
        return self.ids.setdefault(chain_hash, len(self.ids))


_EMPTY = 0x9E3779B97F4A7C15  # chain seed: the hash "before" the first block


def _chain(prev: int, pieces: Sequence[tuple[int, int, int]]) -> int:
    flat = [x for piece in pieces for x in piece]
    return xxhash.xxh64_intdigest(struct.pack(f"<Q{len(flat)}q", prev, *flat))


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as its chain of block ids. Extending it hashes only the new blocks, so a
    conversation of k turns costs O(its length), not O(k * length)."""

    block_size: int
    length: int = 0
    full: tuple[int, ...] = ()  # ids of the full blocks
    head: int = _EMPTY  # chain hash after the last full block
    tail: tuple[tuple[int, int, int], ...] = ()  # (segment, offset, count) of the partial

    def extend(self, namer: _Namer, segments: Iterable[tuple[int, int]]) -> Prompt:
        """This prompt followed by ``segments`` = (segment id, tokens) pairs."""
        bs = self.block_size
        full = list(self.full)
        head = self.head
        tail = list(self.tail)
        tail_len = self.length - len(full) * bs
        length = self.length
        for seg, n in segments:
            off = 0
            while off < n:
                take = min(n - off, bs - tail_len)
                tail.append((seg, off, take))
                tail_len += take
                off += take
                if tail_len == bs:
                    head = _chain(head, tail)
                    full.append(namer.name(head))
                    tail, tail_len = [], 0
            length += n
        return Prompt(bs, length, tuple(full), head, tuple(tail))

    def hash_ids(self, namer: _Namer) -> list[int]:
        ids = list(self.full)
        if self.tail:
            # A partial block has fewer tokens than a full one, so its pieces never collide.
            ids.append(namer.name(_chain(self.head, self.tail)))
        return ids


# --- requests and the arrival driver ----------------------------------------------------

@dataclass(frozen=True, slots=True)
class GenRequest:
    """One generated request. ``group`` is its session / run / program, ``step`` its turn
    (call, or fork round) within it; the group is written as the record's ``session``."""

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    group: int
    step: int
    seq: int  # generation order, for a stable sort of simultaneous arrivals

    def record(self, block_size: int, t0: float = 0.0) -> dict:
        return {
            "timestamp": round((self.arrival_s - t0) * 1000),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
            "block_size": block_size,
            "session": self.group,
        }


def _length(rng: random.Random, mean: float, sigma: float = 0.5) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that the mean is ``mean``
    return max(1, round(rng.lognormvariate(mu, sigma)))


def _zipf_cum(n: int, s: float = 1.0) -> list[float]:
    return list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))


def _poisson(rng: random.Random, rate: float, start: float = 0.0) -> Iterator[float]:
    t = start
    while True:
        t += rng.expovariate(rate)
        yield t


def _drive(starts: Iterator[float], session: Callable[[float, int], list[GenRequest]],
           n: int) -> list[GenRequest]:
    """Start sessions until the first ``n`` arrivals are known, then return exactly them.

    Sessions start in time order and never emit a request before their start, so once ``n``
    generated requests lie before the next start, no later session can change the first n.
    Requests before time 0 (sessions started during the warm-up) are dropped.
    """
    out: list[GenRequest] = []
    pending: list[float] = []  # arrivals not yet known to precede the next start
    settled = 0
    for group, t in enumerate(starts):
        while pending and pending[0] < t:
            heapq.heappop(pending)
            settled += 1
        if settled >= n:
            break
        for r in session(t, group):
            if r.arrival_s >= 0:
                out.append(r)
                heapq.heappush(pending, r.arrival_s)
    out.sort(key=lambda r: (r.arrival_s, r.seq))
    return out[:n]


@dataclass(slots=True)
class _Gen:
    """State of one generate() call: RNGs, the namer, the request counter."""

    block_size: int
    seed: int
    kind: str
    namer: _Namer = field(default_factory=_Namer)
    seq: itertools.count = field(default_factory=itertools.count)
    rng: random.Random = field(init=False)
    arrivals: random.Random = field(init=False)
    _prefixes: dict[tuple[tuple[int, int], ...], Prompt] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Separate streams: changing a content parameter does not move the arrivals.
        self.rng = random.Random(f"kvroute-gen:{self.kind}:{self.seed}:content")
        self.arrivals = random.Random(f"kvroute-gen:{self.kind}:{self.seed}:arrivals")

    def empty(self) -> Prompt:
        return Prompt(self.block_size)

    def prefix(self, segments: tuple[tuple[int, int], ...]) -> Prompt:
        """A prompt made of shared segments, hashed once per trace (rag re-uses documents
        thousands of times)."""
        p = self._prefixes.get(segments)
        if p is None:
            p = self._prefixes[segments] = self.empty().extend(self.namer, segments)
        return p

    def fresh(self, mean: float) -> tuple[int, int]:
        """A new, unique piece of content of about ``mean`` tokens."""
        return self.namer.segment(), _length(self.rng, mean)

    def request(self, t: float, prompt: Prompt, output: int, group: int, step: int
                ) -> GenRequest:
        return GenRequest(t, prompt.length, output, tuple(prompt.hash_ids(self.namer)),
                          group, step, next(self.seq))

    def shared(self, count: int, mean: float) -> list[tuple[int, int]]:
        """``count`` pieces of shared content (system prompts, documents), fixed per trace."""
        return [self.fresh(mean) for _ in range(count)]

    def pick(self, items: Sequence[tuple[int, int]], cum: list[float]) -> tuple[int, int]:
        return self.rng.choices(items, cum_weights=cum)[0]


def _chat(g: _Gen, p: ChatParams, n: int, rate: float) -> list[GenRequest]:
    # A turn: the model's reply, then the user's next message.
    return _growing(g, n, rate, g.shared(p.system_prompts, p.system_tokens), p.user_tokens,
                    p.user_tokens, p.output_tokens, p.mean_turns, p.think_time_s,
                    p.max_context_tokens)


def _agent(g: _Gen, p: AgentParams, n: int, rate: float) -> list[GenRequest]:
    # A call: the model's tool call, then the tool's result.
    return _growing(g, n, rate, g.shared(p.agent_types, p.system_tokens), p.task_tokens,
                    p.tool_result_tokens, p.output_tokens, p.mean_calls, p.step_time_s,
                    p.max_context_tokens)


def _growing(g: _Gen, n: int, rate: float, systems: list[tuple[int, int]], first_tokens: int,
             next_tokens: int, output_tokens: int, mean_steps: float, gap_s: float,
             max_context_tokens: int) -> list[GenRequest]:
    """Sessions whose every request extends the previous one's prompt (chat turns, agent
    calls): a Zipf-chosen shared system prompt plus ``first_tokens``; then, with probability
    ``1 - 1/mean_steps`` per step and ``gap_s`` apart on average, the previous output plus
    ``next_tokens`` more, until the context would pass ``max_context_tokens``."""
    cum = _zipf_cum(len(systems))
    go_on = 1.0 - 1.0 / mean_steps

    def session(t: float, group: int) -> list[GenRequest]:
        prompt = g.prefix((g.pick(systems, cum),)).extend(g.namer, [g.fresh(first_tokens)])
        reqs: list[GenRequest] = []
        for step in itertools.count():
            out = _length(g.rng, output_tokens)
            reqs.append(g.request(t, prompt, out, group, step))
            if g.rng.random() >= go_on:
                break
            nxt = prompt.extend(g.namer, [(g.namer.segment(), out), g.fresh(next_tokens)])
            if nxt.length > max_context_tokens:
                break
            prompt = nxt
            t += g.rng.expovariate(1.0 / gap_s)
        return reqs

    warmup = WARMUP_SPANS * (mean_steps - 1) * gap_s
    return _drive(_poisson(g.arrivals, rate / mean_steps, -warmup), session, n)


def _rag(g: _Gen, p: RagParams, n: int, rate: float) -> list[GenRequest]:
    templates = g.shared(p.templates, p.template_tokens)
    docs = g.shared(p.documents, p.document_tokens)
    cum_t = _zipf_cum(len(templates))
    cum_d = _zipf_cum(len(docs), p.zipf_s)
    # Popularity rank is independent of document length: shuffle which document is hot.
    g.rng.shuffle(docs)

    def one(t: float, group: int) -> list[GenRequest]:
        chosen: list[tuple[int, int]] = []
        while len(chosen) < min(p.docs_per_request, len(docs)):
            d = g.pick(docs, cum_d)
            if d not in chosen:
                chosen.append(d)
        shared = g.prefix((g.pick(templates, cum_t), *chosen))
        prompt = shared.extend(g.namer, [g.fresh(p.question_tokens)])
        return [g.request(t, prompt, _length(g.rng, p.output_tokens), group, 0)]

    return _drive(_poisson(g.arrivals, rate), one, n)


def _fork(g: _Gen, p: ForkParams, n: int, rate: float) -> list[GenRequest]:
    systems = g.shared(p.system_prompts, p.system_tokens)
    cum = _zipf_cum(len(systems))

    def program(t: float, group: int) -> list[GenRequest]:
        prefix = g.prefix((g.pick(systems, cum),)).extend(g.namer, [g.fresh(p.context_tokens)])
        reqs: list[GenRequest] = []
        for rnd in range(p.depth):
            branches = []
            for _ in range(p.fanout):
                seg = g.fresh(p.branch_tokens)
                out = _length(g.rng, p.output_tokens)
                reqs.append(g.request(t, prefix.extend(g.namer, [seg]), out, group, rnd))
                branches.append((seg, out))
            seg, out = branches[g.rng.randrange(p.fanout)]
            prefix = prefix.extend(g.namer, [seg, (g.namer.segment(), out)])
            t += g.rng.expovariate(1.0 / p.step_time_s)
        return reqs

    warmup = WARMUP_SPANS * (p.depth - 1) * p.step_time_s
    return _drive(_poisson(g.arrivals, rate / (p.fanout * p.depth), -warmup), program, n)


_KIND_FN: dict[str, Callable] = {"chat": _chat, "agent": _agent, "rag": _rag, "fork": _fork}


def build(kind: str, n_requests: int, rate_per_s: float, seed: int = 0,
          block_size: int = DEFAULT_BLOCK_SIZE, **params: float) -> list[GenRequest]:
    """The first ``n_requests`` requests of a ``kind`` workload, in arrival order, with
    their session structure (``group``, ``step``). See :func:`generate` for the records."""
    if kind not in PARAMS:
        raise ValueError(f"unknown workload kind {kind!r}; choose one of: {', '.join(KINDS)}")
    # (A rate of inf made every gap 0: the arrival loop never advanced.)
    for name, value, rng, integer in (("n_requests", n_requests, NON_NEGATIVE, True),
                                      ("rate_per_s", rate_per_s, POSITIVE, False),
                                      ("block_size", block_size, AT_LEAST_ONE, True)):
        if not rng.accepts(value):
            raise ValueError(f"{name} must be {rng.wanted(integer)}, got {value}")
    cls = PARAMS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - names)
    if unknown:
        raise ValueError(f"unknown {kind} parameter(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(names))}")
    p = cls(**params)
    _check_params(p)
    if n_requests == 0:
        return []
    return _KIND_FN[kind](_Gen(block_size, seed, kind), p, n_requests, rate_per_s)


def generate(kind: str, n_requests: int, rate_per_s: float, seed: int = 0,
             block_size: int = DEFAULT_BLOCK_SIZE, **params: float) -> list[dict]:
    """Mooncake-format records of a ``kind`` workload (see the module docstring), in
    timestamp order, the first at 0 ms. ``params`` override the kind's defaults
    (:class:`ChatParams`, :class:`AgentParams`, :class:`RagParams`, :class:`ForkParams`)."""
    reqs = build(kind, n_requests, rate_per_s, seed, block_size, **params)
    t0 = reqs[0].arrival_s if reqs else 0.0
    records = [r.record(block_size, t0) for r in reqs]
    if kind == "fork":
        # The siblings of one fork round are one controller program: `kvroute replay
        # --programs` runs them as the agent would (prefix once, then the branches).
        for rec, r in zip(records, reqs, strict=True):
            rec["program"] = f"{r.group}.{r.step}"
    return records
