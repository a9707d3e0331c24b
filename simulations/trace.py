"""Traces: loading request traces into :class:`Trace`, with every bad line reported.

Two JSONL formats, one object per line:

* **Mooncake** (``kvcache-ai/Mooncake`` FAST'25 traces): ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` -- one id per ``block_size``-token block (default 512; an
  optional ``block_size`` field overrides it, as our generators write), where the id at
  position i stands for the whole prefix up to block i; the last block may be partial, so
  ``len(hash_ids) == ceil(input_length / block_size)``.
* **Tokens**: ``timestamp`` (ms), ``token_ids`` (the prompt), ``output_length``; keys are
  kvroute's chained block keys (:class:`kvroute.core.blocks.BlockHasher`) at ``block_size``.

Either format may carry ``program``: requests with the same id are the branches of one
controller-program fork (written by ``kvroute gen fork``); and ``session``: requests with the
same id belong to one conversation or agent run (written by ``kvroute gen``), so a reply is
looked for only in its own session's later requests (:func:`continuations`).

Either way a request becomes the keys of its *full* prompt blocks -- exactly what an engine
caches -- so the simulator and the router see the same units.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xxhash

from kvroute.core.blocks import DEFAULT_BLOCK_SIZE, BlockHasher

MOONCAKE_BLOCK = 512
# Requests ending at one block that :func:`continuations` keeps waiting for a continuation: a hot
# RAG document can end thousands of prompts' full blocks, few of them ever continued.
_REPLY_CANDIDATES = 8


class TraceError(ValueError):
    """A malformed trace line; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    keys: tuple[int, ...]  # keys of the full prompt blocks, in order
    program: str = ""  # requests sharing a program id are the branches of one fork
    session: str = ""  # requests sharing a session id are one conversation ("": unknown)

    @property
    def affinity(self) -> int:
        return self.keys[0] if self.keys else 0


@dataclass
class Trace:
    """A trace's requests in arrival order. ``requests`` is not changed once a trace is made:
    its reply keys are computed once and kept (a replay, its bounds and every rate it is
    scaled to read them)."""

    requests: list[TraceRequest]
    block_size: int
    source: str = ""
    skipped: list[str] = field(default_factory=list)  # "file:line: reason" of bad lines
    # The first ``warmup`` requests run but are left out of every figure: they fill the
    # caches and queues first, so the figures describe a cluster already serving this
    # traffic, not one whose caches are empty (:meth:`with_warmup`).
    warmup: int = 0
    _next: list[int] | None = field(default=None, repr=False, compare=False)
    _replies: list[tuple[int, ...]] | None = field(default=None, repr=False, compare=False)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def scaled(self, rate_scale: float) -> Trace:
        """The same requests arriving ``rate_scale`` times faster (2.0 = twice the rate)."""
        if rate_scale <= 0:
            raise ValueError(f"rate scale must be > 0, got {rate_scale}")
        t0 = self.requests[0].arrival_s if self.requests else 0.0
        return self._retimed([replace(r, arrival_s=t0 + (r.arrival_s - t0) / rate_scale)
                              for r in self.requests])

    def _retimed(self, reqs: list[TraceRequest]) -> Trace:
        """This trace with ``reqs``, its requests at other arrival times in the same order:
        the same keys, so the same continuations and replies (not recomputed)."""
        return Trace(reqs, self.block_size, self.source, self.skipped, self.warmup,
                     self.continuations(), self.reply_keys())

    def nudged(self, spread: float, seed: str) -> Trace:
        """The same requests in the same order, each arrival moved by a uniform draw (seeded
        by ``seed``) of up to ``spread`` x half the gap to its nearer neighbour.

        A rate factor scales every gap alike, so a cold start's first decisions (which
        worker first computes a shared system prompt, say) are the same at every rate
        jitter, and whatever they decide for the rest of a replay is in every jitter's
        figures; nudged arrivals change them too. Less than half of each gap either way
        keeps the order (and so the warm-up, the continuations and the bounds)."""
        if not 0.0 <= spread <= 1.0:
            raise ValueError(f"spread is a fraction of half the gap between arrivals, in "
                             f"[0, 1]; got {spread}")
        reqs = self.requests
        if not spread or len(reqs) < 2:
            return self
        rng = random.Random(seed)
        times = [r.arrival_s for r in reqs]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # The nearer neighbour's gap: the first and last requests have one neighbour each.
        near = [min(a, b) for a, b in zip([gaps[0], *gaps], [*gaps, gaps[-1]], strict=True)]
        # 0.499: a request and its neighbour moving toward each other never meet.
        k = 0.499 * spread
        return self._retimed([replace(r, arrival_s=r.arrival_s + rng.uniform(-k, k) * g)
                              for r, g in zip(reqs, near, strict=True)])

    def with_warmup(self, n: int) -> Trace:
        """The same trace with its first ``n`` requests run but not measured (``warmup``).

        A replay starts with empty caches, but a trace cut from running traffic (or made by
        ``kvroute gen``, whose sessions begin before time 0) opens mid-conversation: its
        first requests carry histories no cache could hold yet and arrive together, a cold
        start that no running cluster sees. Leaving them out of the figures measures the
        steady state."""
        if not 0 <= n < len(self.requests):
            raise ValueError(f"warm-up must leave a request to measure: 0 <= warmup < "
                             f"{len(self.requests)} (the trace's requests), got {n}")
        return Trace(self.requests, self.block_size, self.source, self.skipped, n,
                     self.continuations(), self.reply_keys())

    @property
    def measured(self) -> list[TraceRequest]:
        """The requests the figures count: all but the warm-up."""
        return self.requests[self.warmup:]

    def continuations(self) -> list[int]:
        """Per request, the index of the request that continues its reply, -1 if none (see
        :func:`continuations`); computed on first use."""
        if self._next is None:
            self._next = continuations(self.requests)
        return self._next

    def reply_keys(self) -> list[tuple[int, ...]]:
        """Per request, the keys of the blocks its reply fills (see :func:`reply_keys`);
        computed on first use."""
        if self._replies is None:
            self._replies = reply_keys(self.requests, self.block_size, self.continuations())
        return self._replies

    def tiled(self, copies: int) -> Trace:
        """``copies`` back-to-back repetitions with distinct keys (for speed tests)."""
        reqs = list(self.requests)
        span = self.duration_s + 1.0
        for c in range(1, copies):
            salt = c * 0x9E3779B97F4A7C15
            reqs += [TraceRequest(r.arrival_s + c * span, r.prompt_tokens, r.output_tokens,
                                  tuple((k ^ salt) & 0xFFFFFFFFFFFFFFFF for k in r.keys),
                                  f"{c}/{r.program}" if r.program else "",
                                  f"{c}/{r.session}" if r.session else "")
                     for r in self.requests]
        return Trace(reqs, self.block_size, self.source)


def continuations(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, the index of the later request that continues its reply; -1 if none.

    A trace gives only prompts, so a reply is known by its continuation: the first later
    request whose keys extend this one's full prompt blocks and whose prompt holds at least
    this prompt and reply (``prompt_tokens >= prompt + output``), of the same session when
    both name one (``session``). Without sessions (the Mooncake format has none), a request
    that merely shares this prompt's full blocks (a RAG prompt whose question sits in its
    partial last block) may be taken for its continuation when it is long enough; of several
    requests ending at the same block, the one whose prompt and reply fill most of the
    continuation is taken. A request continues at most one other (the latest it extends).
    Keys are chained (a key stands for its whole prefix), so one lookup per block finds the
    requests a prompt extends: O(total blocks)."""
    out = [-1] * len(requests)
    # last full-block key -> the latest requests ending there with no continuation found yet
    waiting: dict[int, list[int]] = {}
    for j, r in enumerate(requests):
        keys = r.keys
        found = -1
        for pos, key in enumerate(keys):
            cands = waiting.get(key)
            if not cands:
                continue
            fits = [i for i in cands if len(requests[i].keys) == pos + 1 and
                    requests[i].prompt_tokens + requests[i].output_tokens <= r.prompt_tokens
                    and not (r.session and requests[i].session
                             and r.session != requests[i].session)]
            if fits:
                found = max(reversed(fits),
                            key=lambda i: requests[i].prompt_tokens + requests[i].output_tokens)
        if found >= 0:
            out[found] = j
            waiting[requests[found].keys[-1]].remove(found)
        if keys:
            cands = waiting.setdefault(keys[-1], [])
            cands.append(j)
            if len(cands) > _REPLY_CANDIDATES:
                del cands[0]
    return out


def reply_keys(requests: Sequence[TraceRequest], block_size: int,
               nxt: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Per request, the keys of the full blocks its reply fills, in order; () if unknown.

    Engines cache generated tokens as well as the prompt (vLLM's and SGLang's prefix caches,
    and kvroute's ``sim`` engine: the blocks covered by ``prompt + output - 1`` computed
    tokens), so a chat turn or an agent call that carries the previous reply hits it where
    that reply was generated. The reply's keys are read from the request that continues it
    (``nxt``, :func:`continuations` when not given)."""
    if nxt is None:
        nxt = continuations(requests)
    out: list[tuple[int, ...]] = [()] * len(requests)
    for i, j in enumerate(nxt):
        if j >= 0:
            prev, keys = requests[i], requests[j].keys
            full = (prev.prompt_tokens + prev.output_tokens - 1) // block_size
            out[i] = keys[len(prev.keys):min(len(keys), full)]
    return out


def _hash_id_key(hash_id: int) -> int:
    # Spread ids over 64 bits so they never collide with chained token keys in one index.
    return xxhash.xxh3_64_intdigest(hash_id.to_bytes(8, "little", signed=True), 0x6D6F6F6E)


def _int(obj: dict, name: str, minimum: int = 0) -> int:
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


def _id(obj: dict, name: str) -> str:
    """An optional id field (string or integer) as a string; "" when absent."""
    v = obj.get(name, "")
    if not isinstance(v, str | int) or isinstance(v, bool):
        raise ValueError(f"{name} must be a string or integer id, got {v!r}")
    return str(v)


def parse_line(obj: object, default_block: int, hasher: BlockHasher | None
               ) -> tuple[TraceRequest, int]:
    """One record -> (request, its block size). ValueError says what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    ts = obj.get("timestamp")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0 or math.isnan(ts):
        raise ValueError(f"timestamp must be a number >= 0 (ms), got {ts!r}")
    out = _int(obj, "output_length", 0)
    program, session = _id(obj, "program"), _id(obj, "session")
    if "hash_ids" in obj:
        length, keys, bs = _hash_ids(obj, default_block)
    elif "token_ids" in obj:
        assert hasher is not None
        length, keys, bs = _token_ids(obj, hasher)
    else:
        raise ValueError("needs hash_ids (Mooncake format) or token_ids")
    return TraceRequest(ts / 1000.0, length, out, keys, program, session), bs


def _hash_ids(obj: dict[str, Any], default_block: int) -> tuple[int, tuple[int, ...], int]:
    """A Mooncake record's prompt: its length, the keys of its full blocks, its block size."""
    length = _int(obj, "input_length", 1)
    bs = obj.get("block_size", default_block)
    if not isinstance(bs, int) or bs <= 0:
        raise ValueError(f"block_size must be a positive integer, got {bs!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError("hash_ids must be a list of integers")
    if len(ids) != math.ceil(length / bs):
        raise ValueError(f"{len(ids)} hash_ids for input_length {length} at block size "
                         f"{bs} (expected {math.ceil(length / bs)})")
    return length, tuple(_hash_id_key(i) for i in ids[: length // bs]), bs


def _token_ids(obj: dict[str, Any], hasher: BlockHasher) -> tuple[int, tuple[int, ...], int]:
    """A record of token ids: its length, its block keys (the router's), the block size."""
    toks = obj["token_ids"]
    if not isinstance(toks, list) or not toks or not all(
            isinstance(t, int) and 0 <= t < 2**32 for t in toks):
        raise ValueError("token_ids must be a non-empty list of uint32 token ids")
    return len(toks), tuple(hasher.keys(toks)), hasher.block_size


def load(path: str | Path, *, strict: bool = False, token_block_size: int = DEFAULT_BLOCK_SIZE,
         model: str = "default") -> Trace:
    """Load a trace file. Bad lines are skipped and listed in ``Trace.skipped``, or with
    ``strict`` the first one raises :class:`TraceError`. Requests are sorted by arrival."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(lines, source=str(path), strict=strict, token_block_size=token_block_size,
                 model=model)


def parse(lines: Iterable[str], *, source: str = "<trace>", strict: bool = False,
          token_block_size: int = DEFAULT_BLOCK_SIZE, model: str = "default") -> Trace:
    hasher = BlockHasher(token_block_size, model)
    reqs: list[TraceRequest] = []
    skipped: list[str] = []
    block_size: int | None = None
    for lineno, line in _numbered(lines):
        try:
            req, bs = parse_line(json.loads(line), MOONCAKE_BLOCK, hasher)
            if block_size is None:
                block_size = bs
            elif bs != block_size:
                raise ValueError(f"block size {bs} differs from the trace's {block_size}")
        except (ValueError, json.JSONDecodeError) as exc:
            where = f"{source}:{lineno}: {exc}"
            if strict:
                raise TraceError(where) from None
            skipped.append(where)
            continue
        reqs.append(req)
    if not reqs:
        raise TraceError(f"{source}: no valid requests"
                         + (f" (first problem: {skipped[0]})" if skipped else ""))
    reqs.sort(key=lambda r: r.arrival_s)
    return Trace(reqs, block_size or MOONCAKE_BLOCK, source, skipped)


def _numbered(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    for i, line in enumerate(lines, 1):
        if line.strip():
            yield i, line


def expand_tokens(hash_ids: list[int], input_length: int, block_size: int = MOONCAKE_BLOCK,
                  vocab_size: int = 50257) -> list[int]:
    """Token ids for a Mooncake record, for engines that need real tokens: each hash id
    becomes a fixed pseudo-random block (the same id always gives the same tokens), cut to
    ``input_length``. Requests sharing leading ids then share leading tokens exactly."""
    out: list[int] = []
    for h in hash_ids:
        seed = h.to_bytes(8, "little", signed=True)
        out.extend(xxhash.xxh3_64_intdigest(seed + i.to_bytes(4, "little")) % vocab_size
                   for i in range(block_size))
    return out[:input_length]
