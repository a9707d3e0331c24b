"""The demo's workload: multi-turn chats over shared system prompts, plus one-off requests.

Only the token ids are generated here, deterministically from a seed; the follow-up prompts
depend on the replies, so :func:`drive` builds each next turn from what ``send`` returned:

    prompt(turn 0)  = system prompt + user message 0
    prompt(turn k)  = prompt(turn k-1) + reply(turn k-1) + user message k

A turn therefore reuses the whole previous exchange, but only on the worker that served it.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvroute.core.blocks import DEFAULT_BLOCK_SIZE, BlockHasher

VOCAB_SIZE = 50257


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    conversations: int = 24
    turns: int = 4
    one_off: int = 24
    seed: int = 7
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (1024, 2048)
    user_tokens: tuple[int, int] = (150, 450)
    one_off_tokens: tuple[int, int] = (300, 1500)
    max_tokens: tuple[int, int] = (16, 32)

    def __post_init__(self) -> None:
        for name in ("conversations", "one_off"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.turns < 1 or self.system_prompts < 1:
            raise ValueError("turns and system_prompts must be >= 1")
        if self.conversations + self.one_off == 0:
            raise ValueError("the workload is empty: give conversations or one-off requests")


@dataclass(frozen=True, slots=True)
class Turn:
    user: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    cid: int
    system: int  # index into Workload.system_prompts
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class OneOff:
    oid: int
    prompt: tuple[int, ...]
    max_tokens: int


Stream = Conversation | OneOff


@dataclass(frozen=True, slots=True)
class Workload:
    system_prompts: tuple[tuple[int, ...], ...]
    streams: tuple[Stream, ...]  # chats and one-offs, in the (shuffled) order they start

    @property
    def requests(self) -> int:
        return sum(len(s.turns) if isinstance(s, Conversation) else 1 for s in self.streams)


def make_workload(spec: WorkloadSpec) -> Workload:
    """The same spec (seed included) always gives the same workload."""
    rng = random.Random(spec.seed)

    def tokens(bounds: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*bounds)))

    systems = tuple(tokens(spec.system_tokens) for _ in range(spec.system_prompts))
    streams: list[Stream] = [
        Conversation(
            cid=c,
            system=rng.randrange(spec.system_prompts),
            turns=tuple(Turn(tokens(spec.user_tokens), rng.randint(*spec.max_tokens))
                        for _ in range(spec.turns)),
        )
        for c in range(spec.conversations)
    ]
    streams += [OneOff(o, tokens(spec.one_off_tokens), rng.randint(*spec.max_tokens))
                for o in range(spec.one_off)]
    rng.shuffle(streams)  # interleave chats and one-offs, as independent users would
    return Workload(systems, tuple(streams))


@dataclass(frozen=True, slots=True)
class Request:
    label: str  # "conv 03 turn 2/4" or "one-off 05"
    prompt: tuple[int, ...]
    max_tokens: int
    session_id: str  # the chat's id, as a chat front end would send; "" for one-offs


@dataclass(frozen=True, slots=True)
class Result:
    request: Request
    worker_id: str
    prompt_tokens: int  # from the final usage
    cached_tokens: int  # from the final usage
    ttft_ms: float  # measured at the client
    reply: tuple[int, ...]


Send = Callable[[Request], Awaitable[Result]]


async def drive(workload: Workload, send: Send, concurrency: int,
                on_result: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """Send every request, at most ``concurrency`` at once, each chat's turns in order.

    A chat waits for its reply before queueing its next turn behind the requests already
    waiting, so chats interleave like independent users. Results are in completion order.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    # asyncio.Semaphore wakes waiters first-come first-served, so streams start in
    # workload order and a finished turn's successor queues at the back.
    slots = asyncio.Semaphore(concurrency)
    results: list[Result] = []

    async def one(req: Request) -> Result:
        async with slots:
            res = await send(req)
        results.append(res)
        on_result(res)
        return res

    async def chat(conv: Conversation) -> None:
        prompt = workload.system_prompts[conv.system]
        n = len(conv.turns)
        for k, turn in enumerate(conv.turns):
            prompt = prompt + turn.user
            res = await one(Request(f"conv {conv.cid:02d} turn {k + 1}/{n}", prompt,
                                    turn.max_tokens, f"conv-{conv.cid}"))
            prompt = prompt + res.reply

    async def stream(s: Stream) -> None:
        if isinstance(s, Conversation):
            await chat(s)
        else:
            await one(Request(f"one-off {s.oid:02d}", s.prompt, s.max_tokens, ""))

    tasks = [asyncio.create_task(stream(s)) for s in workload.streams]
    try:
        await asyncio.gather(*tasks)
    finally:
        # One failed request fails the run: do not leave the others sending.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int
    ttft_mean_ms: float
    ttft_p99_ms: float
    per_worker: dict[str, int]

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def reusable_ratio(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def reusable_tokens(results: Sequence[Result], block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The hit ceiling: prompt tokens one unbounded cache shared by all workers would serve.

    Per result (in completion order), the full blocks of its prompt's longest prefix already
    seen in an earlier prompt + reply, capped like the engines so one token is computed.
    No policy can beat it: new user messages and one-off prompts are never cached.
    """
    hasher = BlockHasher(block_size)  # the chain seed does not matter for comparisons
    seen: set[int] = set()
    total = 0
    for r in results:
        prompt = r.request.prompt
        cap = (len(prompt) - 1) // block_size
        hit = 0
        for key in hasher.iter_keys(prompt[: cap * block_size]):
            if key not in seen:
                break
            hit += 1
        total += hit * block_size
        seen.update(hasher.iter_keys(prompt + r.reply))
    return total


def summarize(results: Sequence[Result]) -> Summary:
    ttfts = [r.ttft_ms for r in results]
    return Summary(
        requests=len(results),
        prompt_tokens=sum(r.prompt_tokens for r in results),
        cached_tokens=sum(r.cached_tokens for r in results),
        reusable_tokens=reusable_tokens(results),
        ttft_mean_ms=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p99_ms=percentile(ttfts, 99),
        per_worker=dict(sorted(Counter(r.worker_id for r in results).items())),
    )
