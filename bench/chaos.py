"""Faults under load: a real cluster keeps serving while its parts are killed, stopped and
restarted, and heals to the agents' truth afterwards.

One redis-server, 4 sim agents and 2 routers, each a subprocess. ``--clients`` concurrent
gRPC clients send ``Router/Generate`` for ``--duration`` seconds (prompts sharing a few hot
prefixes, so routing is cache-aware), each request to the next router in turn; a client
whose router is down, or refuses with nothing sent, sends it to the other one
(``failovers``, see below). Meanwhile, at scheduled times:

* Redis is SIGKILLed and, ``--redis-down-s`` later, started again on the same port (empty);
* an agent is SIGKILLed mid-stream and started again 2 s later (same id and port);
* an agent is SIGSTOPped for 5 s (hung, not dead; its heartbeat lives 3 s), then SIGCONTed;
* a router is SIGTERMed and started again on the same port;
* Redis is FLUSHALLed (everything lost while it answers: the agents must notice and rewrite
  their state, the routers must keep every live worker);
* a second agent is started under a live worker's id (it must refuse to start, exit 1);
* one agent's snapshot key is deleted (as ``maxmemory`` eviction or a failover that lost
  writes would lose it): the agent must notice and rewrite it, the routers reload it;
* one agent's credential is misused: with its own ACL user (every agent and router logs in
  as the least user docs/security.md gives it), every command it has is tried against the
  other workers' keys and the feed (each must be refused), then what it may do is done:
  the feed trimmed to nothing and, in each other worker's name, a new epoch and blocks it
  does not hold. Every worker must stay routable on every router throughout, and every
  router must undo the forged epochs (its ``/debug/mirror`` then holds none).

Not done: dropping 1% of feed events. No real way exists without a hook in the agent's
publisher (test-only logic in production code): routers read the feed as it is written, so
deleting entries from Redis races them. A seq gap's healing is tested on its own
(tests/router/mirror/test_mirror.py::test_a_gap_reloads_the_snapshot); here the Redis loss (the
agents rewrite their snapshots under new epochs) and the router restart (a bootstrap)
exercise the mirror's healing paths.

Figures (each an invariant; the exit code is 1 if one fails):

* requests accepted, succeeded, failed by status; a failure is *allowed* only for a stream
  already past its first token on the killed agent, failed UNAVAILABLE with the
  ``kvroute-output-sent`` trailer; any other failure is ``unallowed`` (must be 0);
* hung past deadline (DEADLINE_EXCEEDED at the client, ``--deadline-s``): 0;
* per fault, seconds from its healing (Redis up again, agent restarted or continued, router
  started) until every router answers ``Route`` cache-aware again (not ``degraded``, the
  probe's hot prefix found in some candidate's cache); the fault's aim beside it;
* the hung agent: the longest any request waited for a first token during the stop (must
  stay under the stop's length), and requests *left to the hang* (sent over a connect
  timeout before the SIGCONT, their first token from the stopped agent after it: must be 0;
  they are moved instead);
* divergence of each router's index (``kvroute_router_worker_cached_blocks``) from each
  agent's snapshot in Redis (SCARD) after the load stops and the cluster heals: 0.

    python bench/chaos.py [--duration 60] [--clients 12] [--seed 1] [--quick] [--json OUT]
                          [--router-flags '--connect-timeout-s 20']  # (that one fails)

A client retries on the other router only an UNAVAILABLE or a CANCELLED it did not cause,
with nothing sent (no response, no ``kvroute-output-sent`` trailer): the router down
(``router down``), a call caught in a router's stop (``router stopping``, see
docs/failure.md), or a router that refused it because every worker it tried failed first
(``refused: ...``, listed: each is a request the cluster could not place on its own). Every
other failure is final.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError
from scale import redis_cluster

from kvroute.core.config import WorkerSettings
from kvroute.core.redis_conn import RedisClient, connect
from kvroute.core.redis_schema import FeedEvent, Op, RedisKeys, acl_rules
from kvroute.demo.procs import Child, Children, find_redis_server, wait_redis
from kvroute.router.refusal import OUTPUT_SENT
from kvroute.v1 import common_pb2, router_pb2_grpc

AGENTS = 4
ROUTERS = 2
MODEL = "default"
PREFIX = 256  # tokens of each hot prefix (16 blocks)
# Within this long a router leaves a hung worker (--connect-timeout-s's default): a request
# sent to it later than this before it wakes may be served by it.
CONNECT_TIMEOUT_S = WorkerSettings().connect_timeout_s
DOCS = 12
# Failures a client may retry when nothing was sent. This client never cancels a call, so a
# CANCELLED is the server's: a call that reached the router in the instant its server
# stopped, before any handler took it (gRPC core grpc/grpc#41785; UNAVAILABLE once fixed).
SAFE_TO_RETRY = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# gRPC's own words when the router itself is gone (its messages start otherwise).
ROUTER_DOWN = re.compile(r"^(failed to connect|socket closed|broken pipe|connection reset|"
                         r"goaway|.*server shutdown)", re.I)


@dataclass
class Outcome:
    start: float
    end: float
    router: int
    code: str = "OK"
    worker: str = ""
    first_token: float | None = None
    output_sent: int = 0
    failovers: list[str] = field(default_factory=list)  # why each earlier attempt failed
    details: str = ""


@dataclass
class Fault:
    name: str
    at: float  # seconds into the load
    heal_at: float  # when it is undone (restart, SIGCONT)
    aim_s: float
    done_at: float = 0.0  # wall times, filled in as it happens (relative to t0)
    healed_at: float = 0.0
    resume_s: float | None = None
    not_aware_s: float = 0.0
    note: str = ""


@dataclass
class Cluster:
    children: Children
    redis_port: int
    redis: Child
    agent_ports: list[int]
    agents: list[Child]
    router_ports: list[int]
    metrics_ports: list[int]
    routers: list[Child]
    args: argparse.Namespace
    up: list[bool] = field(default_factory=lambda: [True] * ROUTERS)
    duplicate_refused: bool = False
    misuse_contained: bool = False
    # --redis-cluster: every node's port, and the one the model's slot master is on (the
    # failover's victim); redis_port is then another master's, the one clients start from.
    cluster_ports: list[int] = field(default_factory=list)
    victim_port: int = 0

    def _url(self, auth: str) -> str:
        if self.cluster_ports:
            return f"redis+cluster://{auth}127.0.0.1:{self.redis_port}"
        return f"redis://{auth}127.0.0.1:{self.redis_port}/0"

    @property
    def url(self) -> str:
        """The bench's own access (the default user: flushes, deletes, SCARDs)."""
        return self._url("")

    def user_url(self, user: str) -> str:
        return self._url(f"{user}:pw-{user}@")

    def client(self, url: str = "") -> RedisClient:
        return connect(url or self.url)

    async def start_redis(self) -> None:
        """Redis started (empty; on a cluster, its nodes already are) and given the least
        ACL users agents and routers log in as (docs/security.md), on every node; until
        then they are refused, and retry."""
        if not self.cluster_ports:
            await wait_redis(self.url, self.spawn_redis(), 10.0)
        users = [(f"kvr-agent-a{i}", acl_rules("agent", MODEL, f"a{i}")) for i in range(AGENTS)]
        users.append(("kvr-router", acl_rules("router", MODEL)))
        for port in self.cluster_ports or [self.redis_port]:
            admin = aioredis.Redis(port=port)
            try:
                for user, rules in users:
                    await admin.execute_command("ACL", "SETUSER", user, "reset", "on",
                                                f">pw-{user}", *rules)
            finally:
                await admin.aclose()

    def spawn_redis(self) -> Child:
        self.redis = self.children.spawn("redis", [
            find_redis_server(), "--port", str(self.redis_port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--protected-mode", "no"], stop_last=True)
        return self.redis

    def spawn_agent(self, i: int, duplicate: bool = False) -> Child:
        """Agent a{i}; ``duplicate``: a second one under that id, on a port of its own."""
        port = self.children.free_port() if duplicate else self.agent_ports[i]
        child = self.children.spawn(f"agent-a{i}{'-duplicate' if duplicate else ''}", [
            sys.executable, "-m", "kvroute", "agent", "--redis", self.user_url(f"kvr-agent-a{i}"),
            "--port", str(port), "--worker-id", f"a{i}", "--engine", "sim",
            "--time-scale", str(self.args.time_scale), "--capacity-blocks", "512",
            "--heartbeat-s", "0.5", "--heartbeat-ttl-s", "3"])
        if duplicate:
            return child
        if i < len(self.agents):
            self.agents[i] = child
        else:
            self.agents.append(child)
        return child

    def spawn_router(self, i: int) -> Child:
        child = self.children.spawn(f"router-{i}", [
            sys.executable, "-m", "kvroute", "router", "--redis", self.user_url("kvr-router"),
            "--port", str(self.router_ports[i]), "--metrics-port", str(self.metrics_ports[i]),
            "--poll-interval-s", "0.2", "--redis-retry-s", "0.5",
            *self.args.router_flags.split()])
        if i < len(self.routers):
            self.routers[i] = child
        else:
            self.routers.append(child)
        return child


def prompt(rng: random.Random, doc: int) -> list[int]:
    base = random.Random(doc)
    head = [base.randrange(1, 50000) for _ in range(PREFIX)]
    return head + [rng.randrange(1, 50000) for _ in range(rng.randint(8, 64))]


def request(tokens: list[int], max_tokens: int) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        token_ids=tokens, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def one_request(stubs: list[Any], start_router: int, req: common_pb2.GenerateRequest,
                      deadline_s: float, t0: float, into: list[Outcome] | None = None
                      ) -> Outcome:
    """Send ``req``; its Outcome is appended to ``into`` at once (``end`` 0 while it runs,
    so the fault schedule can see which streams are live where)."""
    out = Outcome(start=time.monotonic() - t0, end=0.0, router=start_router)
    if into is not None:
        into.append(out)
    r = start_router
    deadline = time.monotonic() + deadline_s
    for attempt in range(ROUTERS):
        got = False
        call = stubs[r].Generate(req, timeout=max(0.1, deadline - time.monotonic()))
        try:
            async for resp in call:
                got = True
                if out.first_token is None and resp.token_ids:
                    out.first_token = time.monotonic() - t0
                out.worker = resp.worker_id or out.worker
            out.code = "OK"
        except grpc.aio.AioRpcError as exc:
            out.code, out.details = exc.code().name, exc.details() or ""
            trailer = dict(exc.trailing_metadata() or ())
            with contextlib.suppress(ValueError):
                out.output_sent = int(trailer.get(OUTPUT_SENT, 0))
            # Nothing sent (no response, no output-sent trailer) is safe to retry, the
            # trailer's point: the router down, or one refusing it (every worker it tried
            # failed first), or a call caught in the router's stop. Each is retried once on
            # the other router, and told apart in the report.
            if (exc.code() in SAFE_TO_RETRY and not got
                    and OUTPUT_SENT not in trailer and attempt + 1 < ROUTERS):
                out.failovers.append(
                    "router down" if ROUTER_DOWN.match(out.details)
                    else "router stopping" if exc.code() == grpc.StatusCode.CANCELLED
                    else f"refused: {out.details[:70]}")
                r = (r + 1) % ROUTERS
                continue
        break
    out.router = r
    out.end = time.monotonic() - t0
    return out


async def client(i: int, stubs: list[Any], args: argparse.Namespace, stop: asyncio.Event,
                 outcomes: list[Outcome], counter: list[int], t0: float) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while not stop.is_set():
        counter[0] += 1
        # One in 8 streams is long, so that a kill finds streams past their first token.
        n = rng.randint(128, 256) if rng.random() < 0.125 else rng.randint(8, 32)
        req = request(prompt(rng, rng.randrange(DOCS)), n)
        await one_request(stubs, counter[0] % ROUTERS, req, args.deadline_s, t0, outcomes)


async def probe(stubs: list[Any], stop: asyncio.Event, samples: list[tuple[float, int, bool]],
                t0: float) -> None:
    """Every 0.1 s, ask each router to Route a prompt of hot prefix 0: True when it answers
    cache-aware (not degraded, the prefix found in some worker's cache)."""
    rng = random.Random(7)
    while not stop.is_set():
        req = request(prompt(rng, 0), 1)
        for i, stub in enumerate(stubs):
            try:
                resp = await stub.Route(req, timeout=1.0)
                ok = (not resp.degraded
                      and max((c.cached_tokens for c in resp.candidates), default=0) > 0)
            except grpc.aio.AioRpcError:
                ok = False
            samples.append((time.monotonic() - t0, i, ok))
        await asyncio.sleep(0.1)


def not_aware_s(samples: list[tuple[float, int, bool]], since: float, until: float) -> float:
    """From the first to the last answer in [since, until] that was not cache-aware (0 when
    every one was): how long the fault cost cache-aware routing on some router."""
    bad = [t for t, _i, ok in samples if since <= t <= until and not ok]
    return bad[-1] - bad[0] + 0.1 if bad else 0.0


def resumed_after(samples: list[tuple[float, int, bool]], since: float) -> float | None:
    """Seconds from ``since`` until every router has answered cache-aware (None: never)."""
    last: dict[int, float] = {}
    for t, i, ok in samples:
        if t >= since and ok and i not in last:
            last[i] = t
    if len(last) < ROUTERS:
        return None
    return max(0.0, max(last.values()) - since)


async def wait_ready(cl: Cluster, stubs: list[Any], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for c in cl.children.started:
            if c.exited() is not None and c is not cl.redis:
                raise SystemExit(f"{c.name} exited at start:\n{c.log_tail()}")
        ready = 0
        for stub in stubs:
            with contextlib.suppress(grpc.aio.AioRpcError):
                resp = await stub.Route(request([1, 2, 3], 1), timeout=1.0)
                ready += len(resp.candidates) >= AGENTS
        if ready == ROUTERS:
            return
        if time.monotonic() > deadline:
            raise SystemExit("the cluster did not become ready in 60 s")
        await asyncio.sleep(0.2)


async def wait_router(cl: Cluster, i: int, timeout_s: float = 30.0) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cl.router_ports[i]}") as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Route(request([1, 2, 3], 1), timeout=1.0)
                return
            await asyncio.sleep(0.05)


def schedule(args: argparse.Namespace) -> list[Fault]:
    d = args.duration
    down = args.redis_down_s
    restart = max(0.78 * d, 0.5 * d + 7)
    first = "slot master killed" if args.redis_cluster else "redis killed"
    return [Fault(first, 0.08 * d, 0.08 * d + down, 5.0),
            Fault("agent killed mid-stream", 0.38 * d, 0.38 * d + 2.0, 2.0),
            Fault("agent stopped 5 s", 0.5 * d, 0.5 * d + 5.0, 2.0),
            # 2 s after the SIGCONT at least: each fault's recovery measured on its own.
            Fault("router restarted", restart, restart, 2.0),
            # After the restart has healed (its stop and start take ~3 s).
            Fault("redis flushed", restart + 5, restart + 5, 5.0),
            Fault("duplicate worker id", restart + 6, restart + 6, 2.0),
            # After the duplicate has been refused (~1 s): a snapshot the agent wrote, lost.
            Fault("snapshot key lost", restart + 8, restart + 8, 5.0),
            # After the snapshot is back (~1 s).
            Fault("agent credential misused", restart + 10, restart + 10, 2.0)]


async def sleep_until(t0: float, t: float) -> None:
    await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))


async def faults(cl: Cluster, plan: list[Fault], t0: float, outcomes: list[Outcome]) -> None:
    rel = lambda: time.monotonic() - t0  # noqa: E731
    redis_f, kill_f, stop_f, router_f, flush_f, dup_f, snap_f, misuse_f = plan
    await sleep_until(t0, redis_f.at)
    if cl.cluster_ports:
        redis_f.note = await fail_over(cl, redis_f, rel)
    else:
        cl.redis.proc.send_signal(signal.SIGKILL)
        cl.redis.proc.wait()
        redis_f.done_at = rel()
        await sleep_until(t0, redis_f.heal_at)
        await cl.start_redis()
        redis_f.healed_at = rel()

    await sleep_until(t0, kill_f.at)
    # Mid-stream: wait (up to 3 s) for a live stream past its first token on the victim.
    until = time.monotonic() + 3.0
    while time.monotonic() < until and not any(
            o.end == 0 and o.worker == "a1" and o.first_token is not None
            for o in outcomes[-4 * cl.args.clients:]):
        await asyncio.sleep(0.005)
    victim = cl.agents[1]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    kill_f.done_at = rel()
    await asyncio.sleep(kill_f.heal_at - kill_f.at)
    cl.spawn_agent(1)
    kill_f.healed_at = rel()

    await sleep_until(t0, stop_f.at)
    hung = cl.agents[2]
    hung.proc.send_signal(signal.SIGSTOP)
    stop_f.done_at = rel()
    await sleep_until(t0, stop_f.heal_at)
    hung.proc.send_signal(signal.SIGCONT)
    stop_f.healed_at = rel()

    await sleep_until(t0, router_f.at)
    r = cl.routers[1]
    router_f.done_at = rel()
    r.proc.send_signal(signal.SIGTERM)
    await asyncio.get_running_loop().run_in_executor(None, r.proc.wait)
    cl.spawn_router(1)
    await wait_router(cl, 1)
    router_f.healed_at = rel()
    router_f.note = f"down {router_f.healed_at - router_f.done_at:.1f} s (stop + start)"

    await sleep_until(t0, flush_f.at)
    client = cl.client()
    try:
        if isinstance(client, aioredis.RedisCluster):
            await client.flushall(target_nodes=aioredis.RedisCluster.PRIMARIES)
        else:
            await client.flushall()
    finally:
        await client.aclose()
    flush_f.done_at = flush_f.healed_at = rel()

    await sleep_until(t0, dup_f.at)
    dup = cl.spawn_agent(0, duplicate=True)
    dup_f.done_at = rel()
    code = await asyncio.get_running_loop().run_in_executor(None, dup.proc.wait)
    dup_f.healed_at = rel()
    cl.duplicate_refused = code == 1 and "belongs to a live agent" in dup.log_tail(5)
    dup_f.note = (f"{'refused' if cl.duplicate_refused else 'NOT refused'}: exit {code} after "
                  f"{dup_f.healed_at - dup_f.done_at:.1f} s")

    await sleep_until(t0, snap_f.at)
    snap_f.note = await lose_snapshot(cl, "a3", snap_f, rel)

    await sleep_until(t0, misuse_f.at)
    misuse_f.note = await misuse_credential(cl, misuse_f, rel)


async def router_metrics(http: aiohttp.ClientSession, port: int) -> str:
    try:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            return await resp.text()
    except aiohttp.ClientError:
        return ""


async def mirror_view(http: aiohttp.ClientSession, port: int) -> dict[str, Any]:
    """A router's ``/debug/mirror``: its counters and per-worker feed positions."""
    try:
        async with http.get(f"http://127.0.0.1:{port}/debug/mirror") as resp:
            return dict(await resp.json())
    except (aiohttp.ClientError, ValueError):
        return {}


def healings(view: dict[str, Any]) -> int:
    """Snapshot reloads a router made to heal: gaps and unannounced epochs in the feed, and
    caches held apart from their heartbeat (another epoch or feed chain)."""
    return int(view.get("gaps", 0)) + sum(view.get("heartbeat_mismatches", {}).values())


async def misuse_credential(cl: Cluster, f: Fault, rel: Any, wait_s: float = 10.0) -> str:
    """Agent a0's credential used against the others (see the module's docstring); sets
    ``cl.misuse_contained``. The note: commands refused, forged epochs undone, and whether
    any worker left any router's registry meanwhile."""
    keys = RedisKeys(MODEL)
    others = [f"a{i}" for i in range(1, AGENTS)]
    c = cl.client(cl.user_url("kvr-agent-a0"))
    refused = tried = 0
    async with aiohttp.ClientSession() as http:
        before = [healings(await mirror_view(http, p)) for p in cl.metrics_ports]
        try:
            attempts = [call for w in others for key in (
                keys.heartbeat(w), keys.snapshot(w), keys.lower(w), keys.meta(w))
                for call in (lambda k=key: c.delete(k), lambda k=key: c.set(k, "{}"),
                             lambda k=key: c.pexpire(k, 1), lambda k=key: c.sadd(k, b"x"),
                             lambda k=key: c.hset(k, "seq", 1))]
            attempts += [lambda: c.delete(keys.feed), lambda: c.set(keys.feed, "x"),
                         lambda: c.pexpire(keys.feed, 1)]
            for call in attempts:
                tried += 1
                try:
                    await call()
                except NoPermissionError:
                    refused += 1
                except ResponseError:
                    pass  # past the ACL (a wrong type): not refused
            f.done_at = rel()
            # What it may do: trim the feed to nothing, then in each other's name a new
            # epoch and 64 blocks it does not hold.
            rng = random.Random(7)
            for n, w in enumerate(others):
                forged = f"forged-{n}"
                await c.xadd(keys.feed, FeedEvent(w, forged, 1, Op.CLEAR).to_fields(),
                             maxlen=0 if n == 0 else None)
                claim = tuple(rng.getrandbits(63) for _ in range(64))
                await c.xadd(keys.feed, FeedEvent(w, forged, 2, Op.STORE, claim).to_fields())
        finally:
            await c.aclose()
        # Until no router holds a forged epoch, and for 3 s at least: every worker in every
        # router's registry at every look.
        deadline, watch = time.monotonic() + wait_s, time.monotonic() + 3.0
        looks = missing = forged_seen = 0
        undone = False
        while time.monotonic() < deadline and not (undone and time.monotonic() >= watch):
            views = [await mirror_view(http, p) for p in cl.metrics_ports]
            texts = [await router_metrics(http, p) for p in cl.metrics_ports]
            looks += 1
            missing += sum(len({f"a{i}" for i in range(AGENTS)} - parse_blocks(t).keys())
                           for t in texts)
            forged_now = sum(str(row.get("epoch", "")).startswith("forged-")
                             for v in views for row in v.get("workers", {}).values())
            forged_seen += forged_now
            if not undone and all(views) and forged_now == 0:
                undone, f.healed_at = True, rel()
            await asyncio.sleep(0.05)
        after = [healings(await mirror_view(http, p)) for p in cl.metrics_ports]
    if not undone:
        f.healed_at = rel()
    cl.misuse_contained = refused == tried and undone and missing == 0
    healed = [a - b for a, b in zip(after, before, strict=True)]
    return (f"{refused}/{tried} commands refused; forged epochs "
            f"{f'undone after {f.healed_at - f.done_at:.1f} s' if undone else 'NOT undone'} "
            f"({forged_seen} seen held, snapshot reloads per router {healed}); "
            f"{missing} workers missing from a router in {looks} looks")


async def fail_over(cl: Cluster, f: Fault, rel: Any, wait_s: float = 60.0) -> str:
    """SIGKILL the node that is the model's slot master (by the PID it reports) and wait
    until the cluster serves every slot again without it: its replica promoted."""
    node = aioredis.Redis(port=cl.victim_port)
    try:
        pid = int((await node.info("server"))["process_id"])
    finally:
        await node.aclose()
    os.kill(pid, signal.SIGKILL)
    f.done_at = rel()
    seed = aioredis.Redis(port=cl.redis_port)
    deadline = time.monotonic() + wait_s
    promoted = False
    try:
        while not promoted and time.monotonic() < deadline:
            nodes = await seed.execute_command("CLUSTER", "NODES")
            text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
            failed = any(f"127.0.0.1:{cl.victim_port}@" in line and "fail" in line.split()[2]
                         for line in text.splitlines() if line.strip())
            promoted = failed and (await seed.cluster("INFO"))["cluster_state"] == "ok"
            await asyncio.sleep(0.05)
    finally:
        await seed.aclose()
    f.healed_at = rel()
    return (f"replica promoted after {f.healed_at - f.done_at:.1f} s" if promoted
            else f"NOT promoted within {wait_s:g} s")


async def lose_snapshot(cl: Cluster, worker: str, f: Fault, rel: Any, wait_s: float = 15.0
                        ) -> str:
    """Delete ``worker``'s snapshot key and wait for its agent to write it again; the
    fault's note says after how long (its meta and the routers' view are the divergence
    check's, at the end)."""
    key = RedisKeys(MODEL).snapshot(worker)
    client = cl.client()
    try:
        await client.delete(key)
        f.done_at = rel()
        deadline = time.monotonic() + wait_s
        while not await client.exists(key) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        back = bool(await client.exists(key))
    finally:
        await client.aclose()
    f.healed_at = rel()
    return (f"rewritten after {f.healed_at - f.done_at:.1f} s" if back
            else f"NOT rewritten within {wait_s:g} s")


def parse_blocks(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in re.finditer(r'^kvroute_router_worker_cached_blocks\{worker="([^"]+)"\} (\S+)$',
                         text, re.M):
        out[m.group(1)] = int(float(m.group(2)))
    return out


async def divergence(cl: Cluster, timeout_s: float) -> tuple[dict[str, int], float, int]:
    """Per router, the sum over agents of |its index's blocks - the agent's snapshot| (an
    agent missing from its index counts its snapshot + 1), polled until all are 0 or
    ``timeout_s``; the seconds that took; the blocks of all snapshots."""
    keys = RedisKeys(MODEL)
    r = cl.client()
    t = time.monotonic()
    diff: dict[str, int] = {}
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                truth = {f"a{i}": int(await r.scard(keys.snapshot(f"a{i}")))
                         for i in range(AGENTS)}
                for i, port in enumerate(cl.metrics_ports):
                    seen = parse_blocks(await router_metrics(http, port))
                    diff[f"router-{i}"] = sum(abs(seen.get(w, -1) - n) if w in seen else n + 1
                                              for w, n in truth.items())
                if not any(diff.values()) or time.monotonic() - t > timeout_s:
                    return diff, time.monotonic() - t, sum(truth.values())
                await asyncio.sleep(0.2)
    finally:
        await r.aclose()


def judge(outs: list[Outcome], plan: list[Fault]) -> tuple[Counter[str], Counter[str]]:
    """(allowed, unallowed) failures by a short reason."""
    allowed: Counter[str] = Counter()
    unallowed: Counter[str] = Counter()
    kill = plan[1]
    for o in outs:
        if o.code == "OK":
            continue
        on_killed = (o.worker == "a1" and o.start <= kill.done_at + 0.05
                     and o.end >= kill.done_at - 0.05)
        if (o.code == "UNAVAILABLE" and o.first_token is not None and o.output_sent > 0
                and on_killed):
            allowed["UNAVAILABLE past first token on the killed agent"] += 1
        else:
            unallowed[f"{o.code} on {o.worker or '?'} at {o.end:.1f} s: {o.details[:80]}"] += 1
    return allowed, unallowed


def hang_wait(outs: list[Outcome], f: Fault, hung: str, grace_s: float
              ) -> tuple[float, int, int]:
    """The longest wait for a first token (or an answer) of a request waiting during the
    stop, from the later of its start and the SIGSTOP; how many waited; and how many were
    left to the hang: sent over ``grace_s`` (the router's connect timeout, within which it
    leaves a hung worker) before the SIGCONT, their first token from the stopped agent after
    it (nothing moved them; they waited for it to wake)."""
    worst, n, left = 0.0, 0, 0
    for o in outs:
        got = o.first_token if o.first_token is not None else o.end
        if o.start < f.healed_at and got > f.done_at:
            n += 1
            worst = max(worst, got - max(o.start, f.done_at))
            left += (o.worker == hung and got >= f.healed_at
                     and o.start < f.healed_at - grace_s)
    return worst, n, left


async def slot_master(ports: list[int]) -> tuple[int, int]:
    """The port of the model's slot master, and of another master (clients start there: a
    client started after the failover must not start from the dead node)."""
    rc = redis.RedisCluster(host="127.0.0.1", port=ports[0])
    try:
        victim = rc.get_node_from_key(RedisKeys(MODEL).feed).port
        other = next(n.port for n in rc.get_primaries() if n.port != victim)
    finally:
        rc.close()
    return int(victim), int(other)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if not args.redis_cluster:
        return await run_on(args, [])
    with redis_cluster(3, 1, ["--cluster-node-timeout", str(args.node_timeout_ms)]) as ports:
        return await run_on(args, list(ports))


async def run_on(args: argparse.Namespace, cluster_ports: list[int]) -> dict[str, Any]:
    """The run, on one Redis of its own, or (``cluster_ports``) on that Redis Cluster."""
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-chaos-"))
    children = Children(tmp)
    cl = Cluster(children, children.free_port(), None,  # type: ignore[arg-type]
                 [children.free_port() for _ in range(AGENTS)], [],
                 [children.free_port() for _ in range(ROUTERS)],
                 [children.free_port() for _ in range(ROUTERS)], [], args)
    if cluster_ports:
        cl.cluster_ports = cluster_ports
        cl.victim_port, cl.redis_port = await slot_master(cluster_ports)
    try:
        await cl.start_redis()
        for i in range(AGENTS):
            cl.spawn_agent(i)
        for i in range(ROUTERS):
            cl.spawn_router(i)
        chans = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in cl.router_ports]
        stubs = [router_pb2_grpc.RouterStub(c) for c in chans]
        try:
            await wait_ready(cl, stubs)
            return await load(cl, stubs, args, tmp)
        finally:
            for c in chans:
                await c.close()
    finally:
        for a in cl.agents:  # a stopped agent cannot act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                if a.exited() is None:
                    a.proc.send_signal(signal.SIGCONT)
        children.stop_all()


async def load(cl: Cluster, stubs: list[Any], args: argparse.Namespace,
               tmp: Path) -> dict[str, Any]:
    # Warm the hot prefixes into some caches before the clock starts.
    for d in range(DOCS):
        await one_request(stubs, d % ROUTERS, request(prompt(random.Random(d), d), 1),
                          args.deadline_s, time.monotonic())
    plan = schedule(args)
    outcomes: list[Outcome] = []
    samples: list[tuple[float, int, bool]] = []
    stop, probe_stop = asyncio.Event(), asyncio.Event()
    counter = [0]
    t0 = time.monotonic()
    prober = asyncio.create_task(probe(stubs, probe_stop, samples, t0))
    clients = [asyncio.create_task(client(i, stubs, args, stop, outcomes, counter, t0))
               for i in range(args.clients)]
    chaos = asyncio.create_task(faults(cl, plan, t0, outcomes))
    await sleep_until(t0, args.duration)
    await chaos  # the last fault may end just past the duration
    stop.set()
    await asyncio.gather(*clients)
    elapsed = time.monotonic() - t0
    diff, heal_s, truth = await divergence(cl, 20.0)
    await asyncio.sleep(0.3)
    probe_stop.set()
    await prober
    for f in plan:
        f.resume_s = resumed_after(samples, f.healed_at)
        if f.resume_s is not None:
            f.not_aware_s = round(not_aware_s(samples, f.done_at,
                                              f.healed_at + f.resume_s), 1)
    allowed, unallowed = judge(outcomes, plan)
    worst, waited, left = hang_wait(outcomes, plan[2], "a2", CONNECT_TIMEOUT_S)
    plan[2].note = (f"{waited} requests waited during the stop, longest {worst:.2f} s; "
                    f"{left} left to the hang")
    kill = plan[1]
    past_first = sum(1 for o in outcomes if o.worker == "a1" and o.first_token is not None
                     and o.first_token < kill.done_at < o.end)
    kill.note = f"{past_first} streams were past their first token on it"
    died = [c.name for c in cl.children.started
            if c.exited() not in (None, 0) and c.exited() != -signal.SIGKILL
            and c.exited() != -signal.SIGTERM
            and not (c.name.endswith("-duplicate") and c.exited() == 1)]  # refused: its job
    for c in cl.children.started:
        if c.name in died:
            print(f"--- {c.name} exited {c.exited()}:\n{c.log_tail(40)}", file=sys.stderr)
    codes = Counter(o.code for o in outcomes)
    return {"duration_s": args.duration, "elapsed_s": round(elapsed, 1),
            "clients": args.clients, "seed": args.seed, "accepted": len(outcomes),
            "succeeded": codes.get("OK", 0), "codes": dict(codes),
            "failovers": sum(len(o.failovers) for o in outcomes),
            "failover_reasons": dict(Counter(r for o in outcomes for r in o.failovers)),
            "allowed": dict(allowed), "unallowed": dict(unallowed),
            "hung": codes.get("DEADLINE_EXCEEDED", 0), "hang_wait_s": round(worst, 2),
            "left_to_hang": left,
            "stop_s": round(plan[2].healed_at - plan[2].done_at, 1),
            "faults": [asdict(f) for f in plan], "divergence": diff, "truth": truth,
            "heal_s": round(heal_s, 1), "died": died,
            "duplicate_refused": cl.duplicate_refused,
            "misuse_contained": cl.misuse_contained, "logs": str(tmp),
            "redis": (f"a Redis Cluster of 3+3 (node timeout {args.node_timeout_ms} ms)"
                      if cl.cluster_ports else "one Redis")}


def ok(res: dict[str, Any]) -> bool:
    # truth > 0: a divergence of 0 between empty indexes and empty snapshots proves nothing.
    return (not res["unallowed"] and res["hung"] == 0 and not any(res["divergence"].values())
            and res["truth"] > 0
            and all(f["resume_s"] is not None for f in res["faults"])
            and res["hang_wait_s"] < res["stop_s"] and res["left_to_hang"] == 0
            and not res["died"] and res["duplicate_refused"] and res["misuse_contained"])


def report(res: dict[str, Any]) -> None:
    print(f"chaos: {res['duration_s']:g} s of load ({res['elapsed_s']} s with the last fault), "
          f"{res['clients']} clients, 4 agents, 2 routers, {res['redis']}, seed {res['seed']}")
    print(f"requests accepted:      {res['accepted']}")
    print(f"succeeded:              {res['succeeded']}")
    print("failed by status:       " + (", ".join(
        f"{k} {v}" for k, v in sorted(res["codes"].items()) if k != "OK") or "none"))
    print(f"  allowed:              {sum(res['allowed'].values())} {res['allowed'] or ''}")
    print(f"  unallowed:            {sum(res['unallowed'].values())} "
          f"{res['unallowed'] or ''}")
    print(f"failovers to the other router: {res['failovers']} "
          f"{res['failover_reasons'] or ''}")
    print(f"hung past deadline:     {res['hung']}")
    print("fault                     at s   healed s  cache-aware again  aim   not aware  note")
    for f in res["faults"]:
        resume = "never" if f["resume_s"] is None else f"{f['resume_s']:.1f} s"
        print(f"  {f['name']:24s} {f['done_at']:5.1f}  {f['healed_at']:7.1f}  "
              f"{resume:>17s}  {f['aim_s']:.0f} s  {f['not_aware_s']:7.1f} s  {f['note']}")
    print(f"hung agent: longest wait {res['hang_wait_s']:.2f} s of a {res['stop_s']:.1f} s "
          f"stop, {res['left_to_hang']} requests left to the hang")
    print("mirror divergence after healing: " + ", ".join(
        f"{k} {v}" for k, v in res["divergence"].items())
        + f" blocks ({res['heal_s']} s to heal; agents' snapshots hold {res['truth']} blocks)")
    print(f"processes died:         {len(res['died'])} {res['died'] or ''}")
    print(f"duplicate worker id:    {'refused' if res['duplicate_refused'] else 'NOT refused'}")
    print(f"agent credential:       "
          f"{'contained' if res['misuse_contained'] else 'NOT contained'}")
    print(f"invariants: {'ok' if ok(res) else 'FAILED'} (logs: {res['logs']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadline-s", type=float, default=15.0)
    ap.add_argument("--redis-down-s", type=float, default=10.0)
    ap.add_argument("--time-scale", type=float, default=0.3,
                    help="the sim engine's speed (streams must last for a kill mid-stream)")
    ap.add_argument("--router-flags", default="",
                    help="more flags for both routers, e.g. '--connect-timeout-s 20' to see "
                    "the hung-agent invariant fail")
    ap.add_argument("--quick", action="store_true",
                    help="the suite's bounded run: 18 s, 6 clients, Redis down 3 s (the last "
                    "faults end ~12 s later)")
    ap.add_argument("--redis-cluster", action="store_true",
                    help="run on a Redis Cluster of 3 masters and 3 replicas: the first fault "
                    "SIGKILLs the model's slot master (its replica takes over) instead of "
                    "killing the one Redis")
    ap.add_argument("--node-timeout-ms", type=int, default=15000,
                    help="the cluster's cluster-node-timeout (Redis's default 15000: the "
                    "failover then outlasts every heartbeat's TTL)")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.clients, args.redis_down_s = 18.0, 6, 3.0
        args.node_timeout_ms = 2000 if args.redis_cluster else args.node_timeout_ms
    if args.redis_cluster:  # the failover's length, as the schedule spaces the faults
        args.redis_down_s = args.node_timeout_ms / 1000 + 2.0
    if args.duration < 15 or args.clients < 1 or args.redis_down_s <= 0:
        ap.error("--duration must be at least 15 s, --clients and --redis-down-s positive")
    if args.redis_down_s > 0.3 * args.duration:
        ap.error("Redis's fault must end before the next fault (30% of --duration later): "
                 "a longer --duration, or a shorter --redis-down-s or --node-timeout-ms")
    res = asyncio.run(run(args))
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    sys.exit(0 if ok(res) else 1)


if __name__ == "__main__":
    main()
