"""A stand-in vLLM server speaking vLLM's real wire protocols, run as a subprocess by tests.

It plays one release (``--vllm-version``, with that release's files from its wheel in
``--vllm-src``), and behaves as that release's code says (:mod:`vllm_release`):

* **KV events:** the release's own ``ZmqEventPublisher`` (executed from its wheel, see
  :mod:`vllm_wire`) publishes ``KVEventBatch`` es of its own ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared`` structs (with the fields that release has: 0.10.2
  has no ``lora_name`` / ``extra_keys`` / ``group_idx``, so no cache salt either), and serves
  its ROUTER replay socket (0.10.2's replies have no topic frame). Its PUB socket connects to
  a :class:`~vllm_wire.FrameForwarder` in this process, which the agent subscribes to and
  tests use to drop or inject frames.
* **Prefix cache:** paged, modelled on vLLM v1's ``BlockPool``: block hashes chained over the
  parent's hash (SHA-256 of a pickle, bytes; or the low 64 bits as int, like
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), cache salt in the first block's extra keys,
  reference counts, an LRU of free cached blocks, eviction events, cache hits capped to keep
  one prompt token computed, reused blocks re-reported with ``kv_cache_report_mode=full``
  (only by releases whose ``vllm/v1/request.py`` reads it: not 0.10.2).
* **HTTP:** ``POST /v1/completions`` with ``stream: true`` (SSE chunks shaped like
  ``CompletionStreamResponse``, final usage chunk with
  ``prompt_tokens_details.cached_tokens``); request fields the release's
  ``CompletionRequest`` does not declare are ignored, as vLLM does, and listed in
  ``/control/state``'s ``ignored_fields``. ``GET /version`` (``{"version": ...}``),
  ``GET /metrics`` (vLLM's metric names), ``POST /reset_prefix_cache``; and, for tests only,
  ``/control/*``: ``state`` (the cached blocks as kvroute keys, computed independently of the
  agent), ``drop``, ``inject``, ``evict``, ``requests`` (every completion request body
  received, in order).
* **Structured outputs:** the constraint is read from the fields the release declares
  (``structured_outputs``, or before 0.11 ``guided_json|regex|choice|grammar``; the others
  are ignored, as vLLM does) and recorded, but this fake does
  NOT enforce grammars (real vLLM does, with its guidance backend). Only so that programs
  can be tested, it answers a ``choice`` with the first option, and a ``regex`` that is a
  plain literal or an alternation of literals (``a|b\\.c``, JSON's optional whitespace
  ``[ \\t\\n\\r]*`` read as none) with the first alternative, as
  ``--tokenizer`` token ids, ending with finish_reason "stop" (as vLLM does when the grammar
  is complete), and a ``json`` schema that has ``examples`` with its first example (compact);
  other ``json`` and ``grammar`` are ignored (the usual made-up tokens).

Run: ``python -m tests.worker_agent.engines.vllm.fake_vllm --http-port P --events-port E ...``; it
prints one line ``READY {json}`` when serving and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import pickle
import re
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.core import tokenizer as tokenizers
from kvroute.core.blocks import BlockHasher, adapter_salt
from tests.worker_agent.engines.vllm.vllm_release import Release, read_release
from tests.worker_agent.engines.vllm.vllm_wire import FrameForwarder, load_kv_events, struct

NONE_HASH = hashlib.sha256(b"vllm-none-hash").digest()
MASK64 = (1 << 64) - 1


def fake_logprob(token: int) -> float:
    """The log-probability the fake reports for a sampled token (deterministic, varied)."""
    return -0.125 - (token % 37) / 8


@dataclass
class _Block:
    hash: bytes
    key: int  # kvroute key: the test oracle, never sent to the agent
    refs: int = 0


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    salt: str
    report_full: bool
    seed: int
    stop: frozenset[int]
    lora: str = ""  # the LoRA adapter it runs (its body's model, one of --lora-modules)
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks so far
    keys: list[int] = field(default_factory=list)
    pinned: list[bytes] = field(default_factory=list)  # cached blocks this request holds
    uncached: int = 0  # allocated blocks not (yet) in the cache
    cached_tokens: int = 0
    out: list[int] = field(default_factory=list)


class FakeVllm:
    def __init__(self, args: argparse.Namespace, kv: Any, fwd: FrameForwarder,
                 release: Release) -> None:
        self.a = args
        self.kv = kv
        self.vllm = release
        self.request_fields = release.fields("CompletionRequest")
        self.ignored: set[str] = set()  # request fields this release would ignore
        self.fwd = fwd
        self.bs = args.block_size
        # The rank positionally: vLLM names it data_parallel_rank, SGLang attn_dp_rank.
        self.publisher = kv.ZmqEventPublisher(
            0, endpoint=f"tcp://127.0.0.1:{args.upstream_port}",
            replay_endpoint=f"tcp://127.0.0.1:{args.replay_port}",
            buffer_steps=args.buffer_steps, topic=args.topic)
        self.cached: dict[bytes, _Block] = {}
        self.free_lru: OrderedDict[bytes, None] = OrderedDict()  # refs == 0, oldest first
        # --offload-blocks: the OffloadingConnector's CPU tier, hash -> kvroute key, LRU first
        self.cpu: OrderedDict[bytes, int] = OrderedDict()
        self.uncached = 0
        self.running = 0
        self.waiting = 0
        self.published = 0
        self.pending: list[Any] = []  # events of the current step
        self.next_rid = 0
        self.received: list[dict[str, Any]] = []  # completion request bodies, in order
        self.tokenizer = tokenizers.ByteTokenizer() if args.tokenizer == "byte" \
            else tokenizers.GPT2Tokenizer()
        self.received_tokenize: list[dict[str, Any]] = []  # /tokenize bodies, in order
        self.loras = [m for m in args.lora_modules.split(",") if m]
        self.chat_model: Any = None  # transformers' tokenizer of --chat-model
        if args.chat_model:
            import transformers

            self.chat_model = transformers.AutoTokenizer.from_pretrained(args.chat_model)

    # -- cache -------------------------------------------------------------------------------

    def ext(self, h: bytes) -> bytes | int:
        return int.from_bytes(h, "big") & MASK64 if self.a.int_hashes else h

    def block_hash(self, parent: bytes | None, tokens: list[int], salt: str, first: bool,
                   lora: str = "") -> bytes:
        extra = ((("lora", lora),) if lora else ()) + \
            ((("cache_salt", salt),) if (first and salt) else ())
        extra = extra or None
        return hashlib.sha256(pickle.dumps((parent or NONE_HASH, tuple(tokens), extra),
                                           protocol=5)).digest()

    def flush(self) -> None:
        """Publish this step's events as one batch, as vLLM's scheduler does per step."""
        if self.pending:
            self.publisher.publish(self.kv.KVEventBatch(ts=time.time(), events=self.pending))
            self.pending = []
            self.published += 1

    def used(self) -> int:
        return len(self.cached) + self.uncached

    def evict_one(self) -> bool:
        if not self.free_lru:
            return False
        h, _ = self.free_lru.popitem(last=False)
        del self.cached[h]
        self.pending.append(struct(self.kv.BlockRemoved, block_hashes=[self.ext(h)],
                                       medium="GPU", group_idx=0))
        return True

    def oracle(self, r: _Req) -> BlockHasher:
        """The kvroute keys of ``r``'s blocks: an adapter's with its adapter salt."""
        salt = adapter_salt(r.lora, r.salt) if r.lora else r.salt
        return BlockHasher(self.bs, self.a.kvroute_model, salt)

    def extra_keys(self, r: _Req, lo: int, hi: int) -> list[Any] | None:
        """vLLM's per-block extra keys: the adapter's name on each block, the cache salt
        after it on the first."""
        extra = [([r.lora] if r.lora else []) + ([r.salt] if (i == 0 and r.salt) else [])
                 for i in range(lo, hi)]
        return [e or None for e in extra] if any(extra) else None

    def lora_fields(self, r: _Req) -> dict[str, Any]:
        if not r.lora:
            return {"lora_id": None, "lora_name": None}
        return {"lora_id": self.loras.index(r.lora) + 1, "lora_name": r.lora}

    def admit(self, r: _Req) -> bool:
        n, bs = len(r.prompt), self.bs
        hasher = self.oracle(r)
        r.keys = hasher.keys(r.prompt)
        r.hashes = []
        parent = None
        for i in range(n // bs):
            parent = self.block_hash(parent, r.prompt[i * bs:(i + 1) * bs], r.salt, i == 0,
                                     r.lora)
            r.hashes.append(parent)
        hit = 0
        for h in r.hashes[: (n - 1) // bs]:
            if h not in self.cached:
                break
            hit += 1
        loaded = 0  # the connector's hits after the GPU's: loaded, not computed
        for h in r.hashes[hit: (n - 1) // bs] if self.a.offload_blocks else ():
            if h not in self.cpu:
                break
            self.cpu.move_to_end(h)
            loaded += 1
        # Pin the hits before allocating (vLLM's touch()), so eviction cannot take them.
        for h in r.hashes[:hit]:
            b = self.cached[h]
            if b.refs == 0:
                self.free_lru.pop(h, None)
            b.refs += 1
            r.pinned.append(h)
        need = -(-(n + r.max_tokens - 1) // bs) - hit
        while self.used() + need > self.a.capacity:
            if not self.evict_one():
                self.release(r)
                self.flush()
                return False
        r.uncached = need
        self.uncached += need
        r.cached_tokens = (hit + loaded) * bs
        if hit and r.report_full:
            self.pending.append(self._stored(r, 0, hit, None))
        return True

    def _stored(self, r: _Req, lo: int, hi: int, parent: bytes | None,
                tokens: list[int] | None = None) -> Any:
        """A ``BlockStored`` of ``r``'s blocks ``lo..hi`` (their tokens from ``tokens``,
        default the prompt), with the fields the release's struct has."""
        bs = self.bs
        return struct(
            self.kv.BlockStored,
            block_hashes=[self.ext(h) for h in r.hashes[lo:hi]],
            parent_block_hash=self.ext(parent) if parent is not None else None,
            token_ids=(r.prompt if tokens is None else tokens)[lo * bs:hi * bs],
            block_size=bs, medium="GPU",
            extra_keys=self.extra_keys(r, lo, hi), group_idx=0, **self.lora_fields(r))

    def commit(self, r: _Req, tokens: list[int], computed: int) -> None:
        """Cache every block fully covered by computed KV (vLLM's cache_full_blocks)."""
        bs = self.bs
        full = computed // bs
        have = len(r.pinned)
        if full <= have:
            return
        while len(r.hashes) < full:
            i = len(r.hashes)
            parent = r.hashes[-1] if r.hashes else None
            r.hashes.append(self.block_hash(parent, tokens[i * bs:(i + 1) * bs], r.salt, i == 0,
                                            r.lora))
        if len(r.keys) < full:
            r.keys = self.oracle(r).keys(tokens[: full * bs])
        new_lo = None
        for i in range(have, full):
            h = r.hashes[i]
            b = self.cached.get(h)
            if b is None:
                self.cached[h] = _Block(h, r.keys[i], refs=1)
                self.uncached -= 1
                r.uncached -= 1
                if new_lo is None:
                    new_lo = i
            else:  # committed meanwhile by another request: share it
                if b.refs == 0:
                    self.free_lru.pop(h, None)
                b.refs += 1
            r.pinned.append(h)
        if new_lo is not None:
            parent = r.hashes[new_lo - 1] if new_lo else None
            self.pending.append(self._stored(r, new_lo, full, parent, tokens))
        if self.a.offload_blocks:
            self.offload(r, have, full)

    def offload(self, r: _Req, lo: int, hi: int) -> None:
        """The OffloadingConnector's write-through of blocks ``lo..hi``, as it reports it: by
        the whole digest alone (no token ids, no parent, its block size), medium CPU; its LRU
        evictions as BlockRemoved of medium CPU."""
        new = []
        for i in range(lo, hi):
            h = r.hashes[i]
            if h in self.cpu:
                self.cpu.move_to_end(h)
            else:
                self.cpu[h] = r.keys[i]
                new.append(h)
        if new:
            self.pending.append(struct(
                self.kv.BlockStored, block_hashes=new, parent_block_hash=None, token_ids=[],
                block_size=self.bs, lora_id=None, medium="CPU", lora_name=None))
        gone = []
        while len(self.cpu) > self.a.offload_blocks:
            gone.append(self.cpu.popitem(last=False)[0])
        if gone:
            self.pending.append(struct(self.kv.BlockRemoved, block_hashes=gone, medium="CPU"))

    def release(self, r: _Req) -> None:
        for h in reversed(r.pinned):  # vLLM frees tail blocks first: they are evicted first
            b = self.cached[h]
            b.refs -= 1
            if b.refs == 0:
                self.free_lru[h] = None
        r.pinned = []
        self.uncached -= r.uncached
        r.uncached = 0

    def reset_prefix_cache(self) -> bool:
        if any(b.refs for b in self.cached.values()):
            return False
        self.cached.clear()
        self.free_lru.clear()
        self.pending.append(self.kv.AllBlocksCleared())
        self.flush()
        return True

    def truth(self) -> list[int]:
        return [b.key for b in self.cached.values()]

    def lower_truth(self) -> list[int]:
        """The keys only the CPU tier holds."""
        return [key for h, key in self.cpu.items() if h not in self.cached]

    # -- generation --------------------------------------------------------------------------

    def constraint(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The constraint, from the fields this release reads, as ``structured_outputs``."""
        fields = self.vllm.constraint_fields
        if "structured_outputs" in fields and body.get("structured_outputs") is not None:
            return body["structured_outputs"]
        for kind in ("json", "regex", "choice", "grammar"):
            if f"guided_{kind}" in fields and body.get(f"guided_{kind}") is not None:
                return {kind: body[f"guided_{kind}"]}
        return None

    def forced(self, so: Any) -> list[int] | None:
        """Tokens answering a ``choice``, a literal-alternation ``regex`` or a ``json`` schema
        with ``examples`` (NOT grammar enforcement: see the module doc); None for anything
        else."""
        if not isinstance(so, dict):
            return None
        text = None
        if isinstance(so.get("choice"), list) and so["choice"]:
            text = str(so["choice"][0])
        elif isinstance(so.get("json"), dict) and so["json"].get("examples"):
            text = json.dumps(so["json"]["examples"][0], separators=(",", ":"),
                              ensure_ascii=False)
        elif isinstance(so.get("regex"), str):
            # (JSON's optional whitespace, as a continued schema's rest has it: none)
            literal = so["regex"].replace("[ \\t\\n\\r]*", "")
            first = re.sub(r"\\(.)", r"\1", literal.split("|")[0])
            if re.fullmatch(so["regex"], first):
                text = first
        return list(self.tokenizer.encode(text)) if text else None

    async def generate(self, body: dict[str, Any], write: Any) -> None:
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise ValueError("prompt must be a non-empty list of token ids")
        self.ignored |= body.keys() - self.request_fields
        xargs = body.get("vllm_xargs") or {}
        r = _Req(rid=f"cmpl-{self.next_rid}", prompt=list(prompt),
                 max_tokens=int(body.get("max_tokens") or 16), salt=body.get("cache_salt") or "",
                 report_full=xargs.get("kv_cache_report_mode") == "full"
                 and self.vllm.reports_reused,
                 seed=int(body.get("seed") or 0),
                 stop=frozenset(body.get("stop_token_ids") or ()),
                 lora=body.get("model") if body.get("model") in self.loras else "")
        self.next_rid += 1
        self.received.append(body)
        forced = self.forced(self.constraint(body))
        token_ids = bool(body.get("return_token_ids")) and not self.a.no_return_token_ids \
            and "return_token_ids" in self.request_fields
        as_ids = body.get("logprobs") is not None and body.get("return_tokens_as_token_ids")
        want_lp = body.get("logprobs") is not None
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        created = int(time.time())

        async def token(t: int, tok: int, finish: str | None) -> None:
            choice: dict[str, Any] = {"index": 0, "text": f" t{tok}", "logprobs": None,
                                      "finish_reason": finish, "stop_reason":
                                      tok if tok in r.stop else None}
            if token_ids:
                choice["prompt_token_ids"] = r.prompt if t == 0 else None
                choice["token_ids"] = [tok]
            if want_lp:
                choice["logprobs"] = {"text_offset": [0], "token_logprobs": [fake_logprob(tok)],
                                      "tokens": [f"token_id:{tok}" if as_ids else f" t{tok}"],
                                      "top_logprobs": [None]}
            await write({"id": r.rid, "object": "text_completion", "created": created,
                         "model": body.get("model"), "choices": [choice]})
            if finish and usage:
                u: dict[str, Any] = {"prompt_tokens": len(r.prompt),
                                     "total_tokens": len(r.prompt) + len(r.out),
                                     "completion_tokens": len(r.out)}
                if self.a.prompt_tokens_details:
                    u["prompt_tokens_details"] = {"cached_tokens": r.cached_tokens}
                await write({"id": r.rid, "object": "text_completion", "created": created,
                             "model": body.get("model"), "choices": [], "usage": u})

        await self.run(r, forced, token)

    async def run(self, r: _Req, forced: list[int] | None, token: Any) -> None:
        """Admit ``r`` (waiting for room), then make its tokens one step at a time: each is
        cached as vLLM does and handed to ``await token(step, id, finish reason or None)``;
        ``forced``: the tokens to make instead (a constraint's answer)."""
        self.waiting += 1
        try:
            while not self.admit(r):
                await asyncio.sleep(self.a.step_s or 0.001)
        finally:
            self.waiting -= 1
        self.running += 1
        out = r.out
        try:
            base = (sum(r.prompt) * 31 + r.seed) % self.a.vocab
            for t in range(r.max_tokens):
                await asyncio.sleep(self.a.step_s)
                tok = (base + 7919 * t) % self.a.vocab if forced is None else forced[t]
                out.append(tok)
                self.commit(r, r.prompt + out, len(r.prompt) + len(out) - 1)
                self.flush()
                finish = None
                if tok in r.stop or (forced is not None and len(out) == len(forced)):
                    finish = "stop"
                elif len(out) == r.max_tokens:
                    finish = "length"
                await token(t, tok, finish)
                if finish:
                    break
        finally:
            self.running -= 1
            self.release(r)
            self.flush()

    def tokenize(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """vLLM's ``POST /tokenize`` of a chat (TokenizeChatRequest: ``model``, ``messages``,
        ``add_generation_prompt``, ``tools``; special tokens not added, as vLLM's default for chat):
        ``{"tokens", "count", "max_model_len"}``, rendered by transformers'
        ``apply_chat_template`` on ``--chat-model`` (404 without one, as a server whose
        model has no chat template answers an error)."""
        self.received_tokenize.append(body)
        if body.get("model") != self.a.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not "
                                   "exist.", "type": "NotFoundError", "code": 404}}
        if self.chat_model is None or not isinstance(body.get("messages"), list):
            return 400, {"error": {"message": "messages and a chat template are needed",
                                   "type": "BadRequestError", "code": 400}}
        ids = self.chat_model.apply_chat_template(
            body["messages"], tools=body.get("tools"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            tokenize=True, return_dict=False)
        return 200, {"tokens": list(ids), "count": len(ids), "max_model_len": 4096}

    def metrics(self) -> str:
        m = f'engine="0",model_name="{self.a.model}"'
        # As vLLM: cached blocks nobody uses are free (evictable), so not "used".
        usage = (self.used() - len(self.free_lru)) / self.a.capacity
        usage_name = "vllm:gpu_cache_usage_perc" if self.a.old_metrics else \
            "vllm:kv_cache_usage_perc"
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{m}}} {float(self.running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{m}}} {float(self.waiting)}\n"
            f"# HELP {usage_name} KV-cache usage. 1 means 100 percent usage.\n"
            f"# TYPE {usage_name} gauge\n"
            f"{usage_name}{{{m}}} {usage}\n"
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.bs}",enable_prefix_caching="True",'
            f'engine="0",num_gpu_blocks="{self.a.capacity}"}} 1.0\n'
        )


# -- a minimal HTTP/1.1 server (Connection: close; SSE as chunked transfer) -------------------


async def _respond(w: asyncio.StreamWriter, status: int, body: bytes,
                   ctype: str = "application/json") -> None:
    w.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode() + body)
    await w.drain()


async def read_request(r: asyncio.StreamReader) -> tuple[str, str, dict[str, Any]] | None:
    """(method, path, JSON body) of one HTTP/1.1 request; None at end of stream."""
    line = await r.readline()
    if not line:
        return None
    method, path, _ = line.decode().split(" ", 2)
    headers: dict[str, str] = {}
    while (h := await r.readline()) not in (b"\r\n", b"\n", b""):
        k, _, v = h.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    raw = await r.readexactly(int(headers.get("content-length", "0")))
    return method, path, json.loads(raw) if raw else {}


async def control(fake: FakeVllm, method: str, path: str, body: dict[str, Any],
                  w: asyncio.StreamWriter) -> bool:
    """The test-only ``/control/*`` routes; False for any other path."""
    if method == "GET" and path == "/control/state":
        await _respond(w, 200, json.dumps({
            "keys": fake.truth(), "lower": fake.lower_truth(), "published": fake.published,
            "forwarded": fake.fwd.forwarded, "dropped": fake.fwd.dropped,
            "ignored_fields": sorted(fake.ignored)}).encode())
    elif method == "GET" and path == "/control/requests":
        await _respond(w, 200, json.dumps(fake.received).encode())
    elif method == "GET" and path == "/control/tokenize":
        await _respond(w, 200, json.dumps(fake.received_tokenize).encode())
    elif method == "POST" and path == "/control/drop":
        fake.fwd.drop(body.get("seqs", ()), int(body.get("next", 0)))
        await _respond(w, 200, b"{}")
    elif method == "POST" and path == "/control/inject":
        fake.fwd.inject([bytes.fromhex(x) for x in body["frames"]])
        await _respond(w, 200, b"{}")
    elif method == "POST" and path == "/control/evict":
        n = 0
        while n < int(body.get("n", 1)) and fake.evict_one():
            n += 1
        fake.flush()
        await _respond(w, 200, json.dumps({"evicted": n}).encode())
    else:
        return False
    return True


async def handle(fake: FakeVllm, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        req = await read_request(r)
        if req is None:
            return
        method, path, body = req
        path = path.partition("?")[0]  # (a fake SGLang's ?rank=R; one rank here)
        if method == "GET" and path == "/version":
            if fake.a.report_version == "none":
                await _respond(w, 404, b'{"detail": "Not Found"}')
            else:
                await _respond(w, 200, json.dumps(
                    {"version": fake.a.report_version or fake.vllm.version}).encode())
        elif method == "GET" and path == "/metrics":
            await _respond(w, 200, fake.metrics().encode(), "text/plain; version=0.0.4")
        elif method == "POST" and path == "/v1/completions":
            await _completions(fake, body, w)
        elif method == "POST" and path == "/tokenize":
            status, answer = fake.tokenize(body)
            await _respond(w, status, json.dumps(answer).encode())
        elif method == "POST" and path == "/reset_prefix_cache":
            ok = fake.reset_prefix_cache()
            await _respond(w, 200 if ok else 400, b"{}")
        elif not await control(fake, method, path, body, w):
            await _respond(w, 404, b'{"error": "not found"}')
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            w.close()


async def _completions(fake: FakeVllm, body: dict[str, Any], w: asyncio.StreamWriter) -> None:
    if not isinstance(body.get("prompt"), list) or not body["prompt"]:
        await _respond(w, 400, json.dumps({"error": {"message": "prompt must be token ids",
                                                     "type": "BadRequestError"}}).encode())
        return
    if body.get("stream"):
        await stream_sse(w, lambda write: fake.generate(body, write))
        return
    chunks: list[dict[str, Any]] = []

    async def keep(obj: dict[str, Any]) -> None:
        chunks.append(obj)

    await fake.generate(body, keep)  # one answer of the stream's chunks, as vLLM's
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    await _respond(w, 200, json.dumps({
        "id": chunks[0]["id"], "object": "text_completion", "model": body.get("model"),
        "choices": [{"index": 0, "text": "".join(c["text"] for c in choices),
                     "finish_reason": choices[-1]["finish_reason"]}]}).encode())


async def stream_sse(w: asyncio.StreamWriter, produce: Any) -> None:
    """A 200 event stream: ``produce(write)`` writes its ``data:`` objects, then ``[DONE]``."""
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")

    async def send(text: str) -> None:
        data = text.encode()
        w.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await w.drain()

    async def write(obj: dict[str, Any]) -> None:
        await send(f"data: {json.dumps(obj)}\n\n")

    await produce(write)
    await send("data: [DONE]\n\n")
    w.write(b"0\r\n\r\n")
    await w.drain()


async def serve(args: argparse.Namespace, handler: Any, closers: list[Any]) -> None:
    """Serve HTTP on ``--http-port`` with ``handler(reader, writer)``, print ``READY`` and
    run until SIGTERM; then call each of ``closers``."""
    server = await asyncio.start_server(handler, "127.0.0.1", args.http_port)
    await asyncio.sleep(0.2)  # let the PUBs finish connecting to the forwarders
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("READY " + json.dumps({"pid": os.getpid()}), flush=True)
    await stop.wait()
    server.close()
    for close in closers:
        close()


async def main(args: argparse.Namespace) -> None:
    src = Path(args.vllm_src)
    kv = load_kv_events(src)
    release = read_release(args.vllm_version, src)
    fwd = FrameForwarder(f"tcp://127.0.0.1:{args.upstream_port}",
                         f"tcp://127.0.0.1:{args.events_port}")
    fake = FakeVllm(args, kv, fwd, release)
    await serve(args, lambda r, w: handle(fake, r, w), [fake.publisher.shutdown, fwd.close])


def common_args(product: str, topic: str = "") -> argparse.ArgumentParser:
    """The fakes' shared arguments (ports, model, cache, tokens)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--events-port", type=int, required=True, help="the agent subscribes here")
    ap.add_argument("--upstream-port", type=int, required=True, help=f"{product} PUB -> forwarder")
    ap.add_argument("--replay-port", type=int, required=True)
    ap.add_argument("--topic", default=topic)
    ap.add_argument("--model", default="fake-model", help="served model name")
    ap.add_argument("--kvroute-model", default="default", help="for the kvroute-key oracle")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=256, help="KV blocks")
    ap.add_argument("--offload-blocks", type=int, default=0,
                    help="a CPU tier of this many blocks, as vLLM's OffloadingConnector")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--step-s", type=float, default=0.001)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--lora-modules", default="",
                    help="comma-separated LoRA adapters served beside --model")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = common_args("vLLM")
    ap.add_argument("--tokenizer", choices=("byte", "gpt2"), default="byte",
                    help="encodes the answers to choice / literal-regex structured outputs")
    ap.add_argument("--int-hashes", action="store_true")
    ap.add_argument("--no-return-token-ids", action="store_true", help="act as vLLM < 0.10.2")
    ap.add_argument("--old-metrics", action="store_true", help="vllm:gpu_cache_usage_perc")
    ap.add_argument("--no-prompt-tokens-details", dest="prompt_tokens_details",
                    action="store_false")
    ap.add_argument("--vllm-src", required=True, help="vllm_wire.vllm_sources(version)")
    ap.add_argument("--vllm-version", required=True, help="the release it plays")
    ap.add_argument("--chat-model", default="",
                    help="a HF model directory whose chat template /tokenize renders with")
    ap.add_argument("--report-version", default="",
                    help="what GET /version answers instead (none: 404)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args(sys.argv[1:])))
