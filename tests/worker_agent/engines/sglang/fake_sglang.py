"""A stand-in SGLang server speaking SGLang's real wire protocols, run as a subprocess by tests.

It plays one release (``--sglang-version``, with that release's files from its wheel in
``--sglang-src``), as that release's code says:

* **KV events:** the release's own ``ZmqEventPublisher`` (executed from its wheel, see
  :mod:`sglang_wire`) publishes batches of its own ``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared`` structs with the fields that release has (0.5.1: no ``medium``, no
  ``cache_salt``), block hashes as signed 64-bit ints, the salt on every block of a salted
  request, as SGLang's radix cache records them.
* **Prefix cache:** :class:`~tests.worker_agent.engines.vllm.fake_vllm.FakeVllm`'s paged
  cache (pages of ``--block-size`` tokens, the last prompt token always computed, LRU
  eviction); the salt isolates only on releases whose ``GenerateReqInput`` has
  ``cache_salt``.
* **HTTP:** ``POST /generate`` with ``stream: true`` (``data:`` objects of ``output_ids`` and
  ``meta_info`` with ``completion_tokens``, ``cached_tokens``, ``finish_reason``; the ids so far,
  or with ``--incremental`` only the new ones, as ``--stream-output`` /
  ``--incremental-streaming-output`` make SGLang do). A ``sampling_params`` name the release's
  ``SamplingParams`` does not take is a 400 (SGLang's constructor raises); request fields its
  ``GenerateReqInput`` lacks are ignored and listed in ``/control/state``. ``GET
  /server_info`` (0.5.12 and later) and ``/get_server_info``; ``GET /metrics`` (SGLang's
  names, ``max_total_num_tokens`` only from 0.5.12); ``POST /flush_cache``; and the test-only
  ``/control/*`` routes of the fake vLLM (``?rank=R`` for a rank's).
* **Data parallelism** (``--dp-size N``): N caches and publishers, rank R's on the ports plus
  R; ``/generate`` runs on the rank the release's rank field names (``data_parallel_rank``, or
  ``routed_dp_rank`` from 0.5.10), else round robin; ``/metrics`` labels samples ``dp_rank``.
* **Grammars:** recorded, not enforced; answered as the fake vLLM answers them (``regex`` of
  literal alternatives with the first, a ``json_schema`` with ``examples`` with the first).

Run: ``python -m tests.worker_agent.engines.sglang.fake_sglang --http-port P --events-port E
...``; it prints one line ``READY {json}`` when serving and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.worker_agent.engines.sglang.sglang_wire import load_kv_events, request_fields
from tests.worker_agent.engines.vllm.fake_vllm import (
    FakeVllm,
    _Req,
    _respond,
    common_args,
    control,
    fake_logprob,
    read_request,
    serve,
    stream_sse,
)
from tests.worker_agent.engines.vllm.vllm_wire import FrameForwarder


@dataclass(frozen=True)
class _NoVllm:
    """What FakeVllm asks of a vLLM release: nothing applies to SGLang."""

    version: str
    reports_reused: bool = False
    constraint_fields: frozenset[str] = frozenset()

    def fields(self, cls: str) -> frozenset[str]:
        return frozenset()


def _parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:3])


class FakeSglang(FakeVllm):
    def __init__(self, args: argparse.Namespace, kv: Any, fwd: FrameForwarder) -> None:
        super().__init__(args, kv, fwd, _NoVllm(args.sglang_version))  # type: ignore[arg-type]
        self.version = _parse_version(args.sglang_version)
        self.io_fields, self.sampling_fields = request_fields(Path(args.sglang_src))

    def ext(self, h: bytes) -> int:
        return int.from_bytes(h[:8], "big", signed=True)

    def lora_fields(self, r: _Req) -> dict[str, Any]:
        """As SGLang's recorder fills them: no ``lora_id``; the adapter's name (releases with
        ``lora_name``); the salt on every block."""
        return {"lora_id": None, "lora_name": r.lora or None, "cache_salt": r.salt or None}

    def server_info(self) -> dict[str, Any]:
        return {"version": self.a.sglang_version, "page_size": self.a.page_size or self.bs,
                "max_running_requests": 48, "chunked_prefill_size": 2048,
                "max_prefill_tokens": 16384,
                "max_total_num_tokens": self.a.capacity * self.bs,
                "enable_metrics": not self.a.no_metrics,
                "kv_events_config": json.dumps({"publisher": "zmq"}),
                "served_model_name": self.a.model, "dp_size": self.a.dp_size}

    def refusal(self, body: dict[str, Any]) -> str | None:
        ids = body.get("input_ids")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            return "input_ids must be a non-empty list of token ids"
        sp = body.get("sampling_params") or {}
        need = len(ids) + int(sp.get("max_new_tokens") or 128)
        if self.a.context_len and need > self.a.context_len:
            return (f"The input ({len(ids)} tokens) plus max_new_tokens is longer than the "
                    f"model's context length ({self.a.context_len} tokens).")
        unknown = sorted(set(sp) - self.sampling_fields)
        if unknown:
            return f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}"
        return None

    async def generate_native(self, body: dict[str, Any], write: Any) -> None:
        self.ignored |= body.keys() - self.io_fields
        self.received.append(body)
        sp = body.get("sampling_params") or {}
        salted = "cache_salt" in self.io_fields
        r = _Req(rid=str(body.get("rid") or f"rid-{self.next_rid}"), prompt=list(body["input_ids"]),
                 max_tokens=int(sp.get("max_new_tokens") or 128),
                 salt=(body.get("cache_salt") or "") if salted else "", report_full=False,
                 seed=int(sp.get("sampling_seed") or 0),
                 stop=frozenset(sp.get("stop_token_ids") or ()),
                 lora=body.get("lora_path") if body.get("lora_path") in self.loras else "")
        self.next_rid += 1
        forced = self.forced(_as_structured(sp))
        want_lp = bool(body.get("return_logprob"))
        incremental = self.a.incremental

        async def token(t: int, tok: int, finish: str | None) -> None:
            meta: dict[str, Any] = {
                "id": r.rid, "prompt_tokens": len(r.prompt), "completion_tokens": len(r.out),
                "cached_tokens": r.cached_tokens,
                "finish_reason": None if finish is None else
                {"type": finish, **({"matched": tok} if finish == "stop" else
                                    {"length": len(r.out)})}}
            if want_lp:
                lps = [[fake_logprob(x), x, None] for x in r.out]
                meta["output_token_logprobs"] = lps[-1:] if incremental else lps
            await write({"text": f" t{tok}", "output_ids": r.out[-1:] if incremental
                         else list(r.out), "meta_info": meta})

        await self.run(r, forced, token)

    def metric_rows(self) -> list[tuple[str, float]]:
        usage = (self.used() - len(self.free_lru)) / self.a.capacity
        rows = [("num_running_reqs", self.running), ("num_queue_reqs", self.waiting),
                ("token_usage", usage), ("num_used_tokens", self.used() * self.bs)]
        if self.version >= (0, 5, 12):
            rows.append(("max_total_num_tokens", self.a.capacity * self.bs))
        return rows


def metrics(fakes: list[FakeSglang]) -> str:
    """SGLang's scheduler gauges, one sample per data-parallel rank (labelled ``dp_rank``
    when there are several)."""
    a = fakes[0].a
    out: list[str] = []
    for i, (name, _) in enumerate(fakes[0].metric_rows()):
        out += [f"# HELP sglang:{name} {name}.", f"# TYPE sglang:{name} gauge"]
        for rank, fake in enumerate(fakes):
            labels = f'model_name="{a.model}",engine_type="unified",tp_rank="0",pp_rank="0"'
            if len(fakes) > 1:
                labels += f',dp_rank="{rank}"'
            out.append(f"sglang:{name}{{{labels}}} {float(fake.metric_rows()[i][1])}")
    return "\n".join(out) + "\n"


def _as_structured(sp: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's grammar fields as the fake vLLM's ``structured_outputs``."""
    if isinstance(sp.get("json_schema"), str):
        return {"json": json.loads(sp["json_schema"])}
    if isinstance(sp.get("regex"), str):
        return {"regex": sp["regex"]}
    if isinstance(sp.get("ebnf"), str):
        return {"grammar": sp["ebnf"]}
    return None


class Ranks:
    """The server's data-parallel ranks, each its own cache and publisher."""

    def __init__(self, fakes: list[FakeSglang]) -> None:
        self.fakes = fakes
        self.next = 0

    def pick(self, body: dict[str, Any]) -> FakeSglang:
        """The rank a request names in the field its release reads, else round robin."""
        io = self.fakes[0].io_fields
        field = "routed_dp_rank" if "routed_dp_rank" in io else "data_parallel_rank"
        rank = body.get(field)
        if not isinstance(rank, int):
            rank, self.next = self.next % len(self.fakes), self.next + 1
        return self.fakes[rank]


async def handle(ranks: Ranks, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        req = await read_request(r)
        if req is None:
            return
        method, path, body = req
        path, _, query = path.partition("?")
        fake = ranks.fakes[int(query.removeprefix("rank=") or 0)]
        new_info = fake.version >= (0, 5, 12)
        if method == "GET" and (path == "/get_server_info"
                                or (path == "/server_info" and new_info)):
            await _respond(w, 200, json.dumps(fake.server_info()).encode())
        elif method == "GET" and path == "/metrics" and not fake.a.no_metrics:
            await _respond(w, 200, metrics(ranks.fakes).encode(), "text/plain; version=0.0.4")
        elif method == "POST" and path == "/generate":
            refusal = fake.refusal(body)
            if refusal is not None or not body.get("stream"):
                msg = refusal or "this fake only streams"
                await _respond(w, 400, json.dumps({"error": {"message": msg}}).encode())
            else:
                rank = ranks.pick(body)
                await stream_sse(w, lambda write: rank.generate_native(body, write))
        elif method in ("GET", "POST") and path == "/flush_cache":
            ok = all([f.reset_prefix_cache() for f in ranks.fakes])
            await _respond(w, 200 if ok else 400, b"{}")
        elif not await control(fake, method, path, body, w):
            await _respond(w, 404, b'{"detail": "Not Found"}')
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            w.close()


async def main(args: argparse.Namespace) -> None:
    kv = load_kv_events(Path(args.sglang_src))
    fakes: list[FakeSglang] = []
    for rank in range(args.dp_size):
        # Each rank publishes on the configured ports plus its rank, as SGLang's does.
        a = argparse.Namespace(**{**vars(args), **{
            k: getattr(args, k) + rank for k in ("upstream_port", "replay_port", "events_port")}})
        fwd = FrameForwarder(f"tcp://127.0.0.1:{a.upstream_port}",
                             f"tcp://127.0.0.1:{a.events_port}")
        fakes.append(FakeSglang(a, kv, fwd))
    ranks = Ranks(fakes)
    await serve(args, lambda r, w: handle(ranks, r, w),
                [c for f in fakes for c in (f.publisher.shutdown, f.fwd.close)])


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = common_args("SGLang", topic="kv-events")
    ap.add_argument("--page-size", type=int, default=0,
                    help="what /server_info reports (default: --block-size)")
    ap.add_argument("--tokenizer", choices=("byte", "gpt2"), default="byte",
                    help="encodes the answers to literal-regex and example-schema grammars")
    ap.add_argument("--incremental", action="store_true",
                    help="stream only the new output ids")
    ap.add_argument("--no-metrics", action="store_true", help="as without --enable-metrics")
    ap.add_argument("--dp-size", type=int, default=1,
                    help="data-parallel ranks, each its own cache and publisher (ports + rank)")
    ap.add_argument("--context-len", type=int, default=0,
                    help="refuse (400) a prompt plus max_new_tokens past it (0: no limit)")
    ap.add_argument("--sglang-src", required=True, help="sglang_wire.sglang_sources(version)")
    ap.add_argument("--sglang-version", required=True, help="the release it plays")
    args = ap.parse_args(argv)
    args.int_hashes = True
    args.chat_model = ""
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args(sys.argv[1:])))
