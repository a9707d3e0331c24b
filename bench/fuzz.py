"""Hostile input: generated requests over gRPC and HTTP, and garbage in Redis, against a real
cluster; what the router and agents answer, and whether they survive.

One redis-server, ``--agents`` sim agents (``--tokenizer byte``: constrained programs compile)
and one router with ``--http-port`` and ``--model fuzz=DIR`` (the byte-vocabulary model of
kvroute/demo/openai_model.py), each a subprocess. ``--requests`` inputs, ``--concurrency`` at
a time, each with a deadline of ``--deadline-s``, drawn from seeded generators:

* gRPC ``Router/Generate`` and ``Route``, and agents' ``WorkerAgent/Generate`` straight (a
  quarter of them, as a client bypassing the router): random bytes as the message, valid
  messages with bytes flipped or cut, wrong wire types, invalid UTF-8 in string fields, huge
  and negative numbers (varints of 10 bytes), prompts empty, at and over
  ``--max-prompt-tokens``, ids past the vocabulary, unknown models and enum values, NaN and
  infinite floats, programs with huge fan-out (``n`` up to 2^32-1, nested forks), deep
  nesting, many steps, catastrophic and giant regexes, deep and looping JSON schemas,
  20,000-way ``choices``, garbage Lark, placements naming any address;
* HTTP ``/v1/chat/completions`` and ``/v1/completions``: random bytes, invalid UTF-8 and
  deeply nested JSON as the body, fields of the wrong type, huge and negative numbers, giant
  strings, ``n`` and ``max_tokens`` out of range, hostile ``response_format`` schemas and
  regexes, unknown paths and methods;
* Redis, all along: garbage feed entries (in real and made-up workers' names), heartbeats
  (not JSON, huge numbers, NaN, an hour-long TTL, a fake worker at 127.0.0.1:1), snapshots
  and metas of the wrong type or size, members that are not names.

Prints (each an invariant the smoke test asserts): processes that died (must be 0), statuses
by code for each API (no INTERNAL or UNKNOWN on gRPC, no 500 on HTTP: ``bad``), requests not
answered by their deadline (``hung``, 0), a valid request through each API after the run
(must succeed), and router / agent RSS growth from after warm-up to the end.

    python bench/fuzz.py [--requests 10000] [--seed 1] [--concurrency 16] [--agents 2]
                         [--deadline-s 15] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import redis.asyncio as aioredis

from kvroute.core.redis_schema import Heartbeat, RedisKeys, pack_keys
from kvroute.core.wire import varint
from kvroute.demo.openai_model import write_byte_model
from kvroute.demo.procs import Children, scratch_redis
from kvroute.v1 import common_pb2, program_pb2, router_pb2

MODEL = "fuzz"
MAX_PROMPT = 2048
VOCAB = 258
BAD_GRPC = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS"})
_GENERATE = "/kvroute.v1.Router/Generate"
_AGENT_GENERATE = "/kvroute.v1.WorkerAgent/Generate"
_ROUTE = "/kvroute.v1.Router/Route"


# -- gRPC inputs --------------------------------------------------------------------------

def field(num: int, wire_type: int, payload: bytes | int) -> bytes:
    """One protobuf record, written by hand (so anything can be written)."""
    tag = varint((num << 3) | wire_type)
    if wire_type == 0:
        assert isinstance(payload, int)
        return tag + varint(payload & ((1 << 64) - 1))
    assert isinstance(payload, bytes)
    if wire_type == 2:
        return tag + varint(len(payload)) + payload
    return tag + payload


def gen(n: int, **kw: Any) -> program_pb2.Step:
    return program_pb2.Step(gen=program_pb2.Gen(max_tokens=n, **kw))


def fork(subs: list[list[program_pb2.Step]], n: int = 0, select: int = 0) -> program_pb2.Step:
    return program_pb2.Step(fork=program_pb2.Fork(
        branches=[program_pb2.ControllerProgram(steps=s) for s in subs], n=n, select=select))


def deep_schema(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth


def hostile_constraint(rng: random.Random) -> program_pb2.Constraint:
    pick = rng.randrange(10)
    if pick == 0:
        return program_pb2.Constraint(regex="(a+)+$" * rng.randint(1, 50))  # catastrophic
    if pick == 1:
        return program_pb2.Constraint(regex="[a-z]" * rng.choice([100, 20000, 70000]))
    if pick == 2:
        return program_pb2.Constraint(json_schema=deep_schema(rng.choice([10, 70, 900, 1500])))
    if pick == 3:
        return program_pb2.Constraint(json_schema=json.dumps(
            {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                            "b": {"$ref": "#/$defs/a"}}}))
    if pick == 4:
        return program_pb2.Constraint(choices=program_pb2.Choices(
            options=[f"o{i}" for i in range(rng.choice([0, 3, 1100, 20000]))]))
    if pick == 5:
        return program_pb2.Constraint(lark=rng.choice(["start: (((", "start: x\nx: x x",
                                                       "%import nope", "start: /(a|a)*b/"]))
    if pick == 6:
        return program_pb2.Constraint(json_schema=rng.choice(
            ["{nope", "[]", "1e999", '{"type": "nope"}', "[" * 5000 + "]" * 5000, "null"]))
    if pick == 7:
        return program_pb2.Constraint(regex=rng.choice(["((", "[z-a]", "\\", "(?P<x>", "a{99999}"]))
    if pick == 8:
        return program_pb2.Constraint(choices=program_pb2.Choices(options=["", "x"]))
    return program_pb2.Constraint()  # none set


def hostile_program(rng: random.Random) -> program_pb2.ControllerProgram:
    pick = rng.randrange(12)
    if pick == 0:
        steps = [fork([[gen(1)]], n=rng.choice([10 ** 6, 4 * 10 ** 9, (1 << 32) - 1]))]
    elif pick == 1:
        steps = [gen(1)]
        for _ in range(rng.randint(2, 24)):  # deeper: past protobuf's own limit
            steps = [fork([steps], n=rng.randint(2, 10))]
    elif pick == 2:
        steps = [gen(1)] * rng.choice([300, 5000, 20000])
    elif pick == 3:
        steps = [gen(rng.randint(1, 8), constraint=hostile_constraint(rng))]
    elif pick == 4:
        steps = [fork([[gen(1)]], n=2), program_pb2.Step(select=program_pb2.Select(
            mode=rng.choice([3, 77, -1, 1 << 30])))]
    elif pick == 5:
        steps = [fork([[gen(1)], [gen(1)]], select=rng.choice([4, 99, -5]))]
    elif pick == 6:
        steps = [program_pb2.Step(backtrack=program_pb2.Backtrack(tokens=rng.choice([0, 1 << 31]))),
                 gen(rng.choice([0, (1 << 32) - 1, 1 << 30, 4]))]
    elif pick == 7:
        steps = [program_pb2.Step(fast_forward=program_pb2.FastForward(tokens=program_pb2.TokenIds(
            ids=[rng.choice([0, 257, 258, (1 << 32) - 1]) for _ in range(rng.randint(0, 9))])))]
    elif pick == 8:
        steps = [program_pb2.Step(fast_forward=program_pb2.FastForward(
            text="x" * rng.choice([0, 10, 70000]))), gen(2, stop=["", "a"])]
    elif pick == 9:
        steps = [gen(2, temperature=rng.choice([float("nan"), float("inf"), -1.0, 0.5]),
                     capture="c" * rng.choice([3, 100]))]
    elif pick == 10:
        steps = [program_pb2.Step()]  # empty step
    else:  # a valid one, so the happy path runs under fire too
        steps = [gen(2), fork([[gen(2)]], n=rng.randint(2, 4),
                              select=program_pb2.SELECT_MODE_BEST_LOGPROB)]
    return program_pb2.ControllerProgram(steps=steps)


def valid_request(rng: random.Random) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        token_ids=[rng.randrange(256) for _ in range(rng.randint(1, 64))],
        sampling=common_pb2.SamplingParams(max_tokens=rng.randint(1, 4)))


def grpc_input(rng: random.Random) -> tuple[str, bytes]:
    """(kind, serialized request): the kind names the generator, for the report."""
    pick = rng.randrange(14)
    if pick == 0:
        return "random_bytes", rng.randbytes(rng.randint(0, 512))
    if pick == 1:
        wire = bytearray(valid_request(rng).SerializeToString())
        for _ in range(rng.randint(1, 4)):
            if wire:
                wire[rng.randrange(len(wire))] = rng.randrange(256)
        return "flipped_bytes", bytes(wire[:rng.randint(0, len(wire))])
    if pick == 2:  # wrong wire types for known fields
        num = rng.choice([1, 2, 3, 4, 5, 7, 9])
        wt = rng.choice([0, 1, 2, 5])
        payload: bytes | int = rng.randrange(1 << 64) if wt == 0 else rng.randbytes(
            {1: 8, 2: rng.randint(0, 30), 5: 4}[wt])
        return "wrong_wire_type", field(num, wt, payload)
    if pick == 3:  # invalid UTF-8 in string fields
        bad = rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80"])
        return "invalid_utf8", field(rng.choice([2, 3, 6, 7, 8]), 2, bad) + field(
            4, 2, field(1, 0, 2))
    if pick == 4:  # ids as 10-byte varints: negative or past uint32
        ids = b"".join(varint(rng.choice([(1 << 64) - 1, 1 << 40, 1 << 32, 258, 5]))
                       for _ in range(rng.randint(1, 20)))
        return "huge_ids", field(1, 2, ids) + field(4, 2, field(1, 0, 4))
    if pick == 5:  # sampling numbers
        samp = (field(1, 0, rng.choice([0, -1, 1 << 31, (1 << 64) - 1, 3]))
                + field(2, 5, struct.pack("<f", rng.choice([float("nan"), float("inf"), -2.0])))
                + field(3, 5, struct.pack("<f", rng.choice([float("nan"), 7.0, -0.5])))
                + field(5, 2, varint(rng.choice([1 << 31, 300, 0]))))
        return "sampling_numbers", field(1, 2, varint(5)) + field(4, 2, samp)
    if pick == 6:
        n = rng.choice([0, MAX_PROMPT, MAX_PROMPT + 1, 10 * MAX_PROMPT])
        req = common_pb2.GenerateRequest(token_ids=[rng.randrange(256) for _ in range(n)],
                                         sampling=common_pb2.SamplingParams(max_tokens=1))
        return f"prompt_{'at' if n == MAX_PROMPT else 'over' if n else 'empty'}", \
            req.SerializeToString()
    if pick == 7:
        req = valid_request(rng)
        req.text = rng.choice(["", "x" * (MAX_PROMPT + 1), "héllo ✓", "\x00" * 10])
        if req.text:
            del req.token_ids[:]
        return "text", req.SerializeToString()
    if pick == 8:
        req = valid_request(rng)
        setattr(req, rng.choice(["model", "cache_salt", "request_id", "session_id"]),
                rng.choice(["nope", "x" * 300, "y" * 100000]))
        return "names", req.SerializeToString()
    if pick in (9, 10):
        req = valid_request(rng)
        req.sampling.max_tokens = 0
        req.program.CopyFrom(hostile_program(rng))
        return "program", req.SerializeToString()
    if pick == 11:
        req = valid_request(rng)
        req.program.CopyFrom(program_pb2.ControllerProgram(
            steps=[fork([[gen(1)]] * 4)]))
        req.placement.fork_step = rng.choice([0, 5])
        req.placement.overflow.add(worker_id=rng.choice(["evil", "a0", ""]),
                                   address=rng.choice(["127.0.0.1:1", "nowhere", ""]),
                                   children=[rng.choice([1, 9])])
        return "placement", req.SerializeToString()
    if pick == 12:  # deep message nesting: past protobuf's recursion limit
        inner = b""
        for _ in range(rng.choice([50, 120])):
            inner = field(1, 2, field(4, 2, field(1, 2, inner)))  # steps.fork.branches...
        return "deep_message", field(1, 2, varint(5)) + field(5, 2, inner)
    return "valid", valid_request(rng).SerializeToString()


# -- HTTP inputs --------------------------------------------------------------------------

def http_input(rng: random.Random) -> tuple[str, str, str, bytes, dict[str, str]]:
    """(kind, method, path, body, headers)."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    js = {"Content-Type": "application/json"}
    pick = rng.randrange(12)
    if pick == 0:
        return "random_bytes", "POST", rng.choice([chat, comp]), rng.randbytes(
            rng.randint(0, 400)), js
    if pick == 1:
        body = b'{"messages":[{"role":"user","content":"\xff\xfe"}]}'
        return "invalid_utf8", "POST", chat, body, js
    if pick == 2:
        d = rng.choice([100, 5000, 100000])
        return "deep_json", "POST", comp, ("[" * d + "]" * d).encode(), js
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    is_chat = rng.random() < 0.5
    if is_chat:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hello"
    if pick == 3:
        key = rng.choice(["max_tokens", "n", "temperature", "top_p", "seed", "logprobs",
                          "top_logprobs", "stream", "stop", "messages", "prompt", "model"])
        base[key] = rng.choice([None, "x", [], {}, -1, 0, 1 << 70, 1e308, -1e308, True,
                                [1, 2], [[[]]], "x" * 10000])
        kind = f"wrong_{key}"
    elif pick == 4:
        base["max_tokens"] = rng.choice([0, -5, 1 << 31, 1 << 64, 10 ** 30])
        kind = "max_tokens_range"
    elif pick == 5:
        base["n"] = rng.choice([0, 17, 1000, 10 ** 9, 1 << 40])
        kind = "n_range"
    elif pick == 6:
        schema: Any = rng.choice([json.loads(deep_schema(60)), {"$ref": "#"},
                                  {"type": "nope"}, "x", [], {"$ref": "#/$defs/a",
                                                              "$defs": {"a": {"$ref": "#"}}}])
        base["response_format"] = rng.choice([
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            {"type": "json_object"}, {"type": "nope"}, "x",
            {"type": "json_schema", "json_schema": "x"}])
        kind = "response_format"
    elif pick == 7:
        base["structured_outputs"] = rng.choice([
            {"regex": "(a+)+$" * 30}, {"regex": "[a-z]" * 30000}, {"choice": ["a"] * 20000},
            {"grammar": "start: ((("}, {"json": deep_schema(2000)}, {"regex": 5}])
        kind = "structured_outputs"
    elif pick == 8:
        text = "x" * rng.choice([MAX_PROMPT - 20, MAX_PROMPT + 1, 100000])
        if is_chat:
            base["messages"] = [{"role": "user", "content": text}]
        else:
            base["prompt"] = text
        kind = "long_prompt"
    elif pick == 9:
        if is_chat:
            base["messages"] = rng.choice([[], [{"role": "nope", "content": "x"}], [{}],
                                           [{"role": "user", "content": [{"type": "x"}]}],
                                           "x", [{"role": "user", "content": 5}]])
        else:
            base["prompt"] = rng.choice([[], [1 << 40], [-1], [[1, 2], [300]], 5, None])
        kind = "messages_prompt"
    elif pick == 10:
        return "bad_route", rng.choice(["GET", "PUT", "DELETE", "POST"]), rng.choice(
            [chat, comp, "/v1/nope", "/../../etc", "/v1/models/x"]), b"{}", js
    else:
        kind = "valid"
    return kind, "POST", chat if is_chat else comp, json.dumps(base).encode(), js


# -- Redis garbage ------------------------------------------------------------------------

async def redis_garbage(url: str, rng: random.Random, stop: asyncio.Event,
                        workers: list[str], counts: Counter[str]) -> None:
    keys = RedisKeys(MODEL)
    r = aioredis.Redis.from_url(url)
    try:
        while not stop.is_set():
            pick = rng.randrange(8)
            name = rng.choice(["ghost", "evil", "x" * 199, "a" * 300, "bad name", *workers])
            fake = rng.choice(["ghost", "evil"])
            try:
                if pick == 0:
                    await r.xadd(keys.feed, {"w": name, "e": rng.choice(["e", ""]),
                                             "s": rng.choice(["1", "-1", "x", str(1 << 70)]),
                                             "op": rng.choice(["store", "evict", "nope"]),
                                             "k": rng.randbytes(rng.choice([0, 7, 8, 80]))})
                elif pick == 1:
                    await r.set(keys.heartbeat(fake), rng.choice(
                        [b"{nope", b"[]", b"\xff", b"[" * 3000,
                         json.dumps({"worker_id": fake, "address": "127.0.0.1:1",
                                     "epoch": "e", "running": 2e70}).encode(),
                         json.dumps({"worker_id": fake, "address": "127.0.0.1:1",
                                     "epoch": "e", "ttl_s": 1e300}).encode()]), px=2000)
                elif pick == 2:  # a fake worker at a dead address, well-formed
                    hb = Heartbeat("evil", "127.0.0.1:1", "e", ttl_s=3600.0,
                                   block_size=16, vocab_size=VOCAB)
                    await r.set(keys.heartbeat("evil"), hb.to_json(), px=3000)
                elif pick == 3:
                    await r.sadd(keys.snapshot(fake), rng.randbytes(rng.choice([1, 8, 9])),
                                 pack_keys([rng.randrange(1 << 64)]))
                elif pick == 4:
                    await r.hset(keys.meta(fake), mapping={"epoch": rng.choice(["e", ""]),
                                                           "seq": rng.choice(["x", "-3", "1"])})
                elif pick == 5:
                    await r.delete(keys.snapshot(fake))
                    await r.set(keys.snapshot(fake), b"not a set")
                elif pick == 6:
                    # A heartbeat key naming no worker (the registry is these keys).
                    bad = rng.choice(["bad name", "x" * 300, "\u00e9t\u00e9"])
                    await r.set(keys.heartbeat(bad), b"{}", px=2000)
                else:
                    await r.delete(keys.heartbeat(fake))
                counts[["feed", "heartbeat", "fake_worker", "snapshot", "meta", "wrong_type",
                        "member", "delete"][pick]] += 1
            except aioredis.ResponseError:
                counts["redis_refused"] += 1
            await asyncio.sleep(0.01)
    finally:
        await r.aclose()


# -- running ------------------------------------------------------------------------------

def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def wait_ready(grpc_port: int, http_port: int, children: Children,
                     workers: int) -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as http:
        while True:
            for c in children.started:
                if c.exited() is not None:
                    raise SystemExit(f"{c.name} exited at start:\n{c.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(f"http://127.0.0.1:{http_port}/health") as resp:
                    body = await resp.json(content_type=None)
                    if resp.status == 200 and body.get("workers", 0) >= workers:
                        return
            if time.monotonic() > deadline:
                raise SystemExit("the cluster did not become ready in 60 s")
            await asyncio.sleep(0.2)


async def one_grpc(ch: grpc.aio.Channel, wire: bytes, target: str,
                   deadline_s: float) -> str:
    """``target``: route (Router/Route), generate (Router/Generate) or agent (an agent's
    WorkerAgent/Generate, as a client bypassing the router would call it)."""
    try:
        if target == "route":
            call = ch.unary_unary(_ROUTE, request_serializer=None,
                                  response_deserializer=router_pb2.RouteResponse.FromString)
            await call(wire, timeout=deadline_s)
        else:
            stream = ch.unary_stream(
                _GENERATE if target == "generate" else _AGENT_GENERATE,
                request_serializer=None,
                response_deserializer=common_pb2.GenerateResponse.FromString)
            async for _ in stream(wire, timeout=deadline_s):
                pass
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


async def one_http(http: aiohttp.ClientSession, base: str, method: str, path: str,
                   body: bytes, headers: dict[str, str], deadline_s: float) -> str:
    try:
        async with http.request(method, base + path, data=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=deadline_s)) as resp:
            await resp.read()
            return str(resp.status)
    except TimeoutError:
        return "TIMEOUT"
    except aiohttp.ClientError as exc:
        return f"client_error:{type(exc).__name__}"


async def final_checks(grpc_port: int, http_port: int) -> dict[str, bool]:
    ok: dict[str, bool] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        wire = common_pb2.GenerateRequest(
            token_ids=list(b"still serving?"),
            sampling=common_pb2.SamplingParams(max_tokens=3)).SerializeToString()
        # The fake worker at 127.0.0.1:1 may cost a request its first attempt: two tries.
        ok["grpc"] = "OK" in [await one_grpc(ch, wire, "generate", 15) for _ in range(2)]
    async with aiohttp.ClientSession() as http:
        body = json.dumps({"model": MODEL, "max_tokens": 3,
                           "messages": [{"role": "user", "content": "still serving?"}]})
        codes = [await one_http(http, f"http://127.0.0.1:{http_port}", "POST",
                                "/v1/chat/completions", body.encode(),
                                {"Content-Type": "application/json"}, 15) for _ in range(2)]
        ok["http"] = "200" in codes
    return ok


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-fuzz-"))
    model_dir = write_byte_model(tmp / "model")
    children = Children(tmp)
    py = [sys.executable, "-m", "kvroute"]
    limits = ["--max-prompt-tokens", str(MAX_PROMPT), "--vocab-size", str(VOCAB)]
    try:
        async with scratch_redis() as url:
            workers = [f"a{i}" for i in range(args.agents)]
            aports = [children.free_port() for _ in workers]
            agents = [children.spawn(w, [*py, "agent", "--redis", url, "--model", MODEL,
                                         "--port", str(port), "--worker-id", w,
                                         "--engine", "sim", "--model-source", str(model_dir),
                                         "--time-scale", "0", "--capacity-blocks", "256",
                                         *limits])
                      for w, port in zip(workers, aports, strict=True)]
            gport, hport = children.free_port(), children.free_port()
            router = children.spawn("router", [*py, "router", "--redis", url,
                                               "--model", f"{MODEL}={model_dir}",
                                               "--port", str(gport), "--http-port", str(hport),
                                               "--poll-interval-s", "0.2", *limits])
            await wait_ready(gport, hport, children, args.agents)
            return await fuzz(args, rng, url, gport, hport, router, agents, workers, aports)
    finally:
        children.stop_all()


async def fuzz(args: argparse.Namespace, rng: random.Random, url: str, gport: int,
               hport: int, router: Any, agents: list[Any], workers: list[str],
               aports: list[int]) -> dict[str, Any]:
    inputs: list[tuple[str, Callable[[], Any]]] = []
    grpc_codes: Counter[str] = Counter()
    http_codes: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    hung: Counter[str] = Counter()
    garbage: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    big = [("grpc.max_send_message_length", 64 << 20)]
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{gport}", options=big)
    agent_chs = [grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=big) for p in aports]
    http = aiohttp.ClientSession()
    base = f"http://127.0.0.1:{hport}"
    for _ in range(args.requests):
        if rng.random() < 0.6:
            kind, wire = grpc_input(rng)
            target = rng.choices(["route", "generate", "agent"], [0.2, 0.55, 0.25])[0]
            on = rng.choice(agent_chs) if target == "agent" else ch

            async def g(kind: str = kind, wire: bytes = wire, target: str = target,
                        on: grpc.aio.Channel = on) -> None:
                code = await one_grpc(on, wire, target, args.deadline_s)
                grpc_codes[code] += 1
                by_kind.setdefault(f"grpc {target} {kind}", Counter())[code] += 1
                if code in BAD_GRPC:
                    bad[f"grpc {target} {kind} {code}"] += 1
                if code == "DEADLINE_EXCEEDED":
                    hung[f"grpc {target} {kind}"] += 1
            inputs.append((kind, g))
        else:
            kind, method, path, body, headers = http_input(rng)

            async def h(kind: str = kind, method: str = method, path: str = path,
                        body: bytes = body, headers: dict[str, str] = headers) -> None:
                code = await one_http(http, base, method, path, body, headers, args.deadline_s)
                http_codes[code] += 1
                by_kind.setdefault(f"http {kind}", Counter())[code] += 1
                if code.startswith("5") and code != "503":
                    bad[f"http {kind} {code}"] += 1
                if code == "TIMEOUT":
                    hung[f"http {kind}"] += 1
            inputs.append((kind, h))
    # Warm-up (channels, tokenizer, first grammar compile) before RSS is first read.
    for _kind, task in inputs[:50]:
        await task()
    rss0 = {"router": rss_kb(router.pid), **{a.name: rss_kb(a.pid) for a in agents}}
    stop = asyncio.Event()
    noise = asyncio.create_task(redis_garbage(url, random.Random(args.seed + 1), stop,
                                              workers, garbage))
    queue = iter(inputs[50:])
    t0 = time.monotonic()

    async def worker() -> None:
        for _kind, task in queue:
            await task()

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.monotonic() - t0
    stop.set()
    await noise
    await ch.close()
    for c in agent_chs:
        await c.close()
    await http.close()
    final = await final_checks(gport, hport)
    rss1 = {"router": rss_kb(router.pid), **{a.name: rss_kb(a.pid) for a in agents}}
    died = [c.name for c in [router, *agents] if c.exited() is not None]
    for c in [router, *agents]:
        if c.exited() is not None:
            print(f"--- {c.name} exited {c.exited()}:\n{c.log_tail(40)}", file=sys.stderr)
    return {"requests": args.requests, "seed": args.seed, "elapsed_s": round(elapsed, 1),
            "died": died, "grpc": dict(grpc_codes), "http": dict(http_codes),
            "bad": dict(bad), "hung": dict(hung), "final": final,
            "rss_kb_start": rss0, "rss_kb_end": rss1, "redis_garbage": dict(garbage),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}}


def report(res: dict[str, Any]) -> None:
    print(f"fuzz: {res['requests']} inputs, seed {res['seed']}, {res['elapsed_s']} s "
          f"(after 50 warm-up)")
    print(f"processes died:            {len(res['died'])} {res['died'] or ''}")
    print("gRPC statuses:             " + ", ".join(
        f"{k} {v}" for k, v in sorted(res["grpc"].items(), key=lambda kv: -kv[1])))
    print("HTTP statuses:             " + ", ".join(
        f"{k} {v}" for k, v in sorted(res["http"].items(), key=lambda kv: -kv[1])))
    print(f"bad (INTERNAL/UNKNOWN/5xx): {sum(res['bad'].values())} {res['bad'] or ''}")
    print(f"hung past deadline:        {sum(res['hung'].values())} {res['hung'] or ''}")
    print(f"valid request afterwards:  grpc {'ok' if res['final']['grpc'] else 'FAILED'}, "
          f"http {'ok' if res['final']['http'] else 'FAILED'}")
    for name, start in res["rss_kb_start"].items():
        end = res["rss_kb_end"][name]
        print(f"RSS {name:7s}                {start / 1024:7.1f} MB -> {end / 1024:7.1f} MB "
              f"({(end - start) / 1024:+.1f} MB)")
    print("Redis garbage written:     " + ", ".join(
        f"{k} {v}" for k, v in sorted(res["redis_garbage"].items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=15.0)
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    if args.requests < 60:
        ap.error("--requests must be at least 60 (50 are the warm-up)")
    res = asyncio.run(run(args))
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    ok = (not res["died"] and not res["bad"] and not res["hung"] and all(res["final"].values()))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
