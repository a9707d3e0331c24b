"""Benchmark: how far one model's cache state scales over a real Redis Cluster.

Real parts only: a 3-master Redis Cluster (redis-server processes joined by ``redis-cli
--cluster create``); W simulated workers, each a real ``CachePublisher`` (the agent's code path
and Redis schema) fed a synthetic store/evict stream, hundreds per *host* process (this script
run with ``--host``, driven over its stdin/stdout); R real ``kvroute router`` processes, whose
mirrors are read through their metrics port: ``/metrics`` (feed propagation histogram, events
applied, decision latency) and ``/debug/mirror`` (per-worker epoch, seq, blocks and keys).

For each (W, R) of the grid it prints:

* the feed entries/s one router applied under the offered load, and the most it applies:
  router 0 is paused (SIGSTOP) under load, then resumed; the rate it drains its backlog at is
  the rate at which it falls behind;
* propagation p50/p99: each entry's XADD (its id's time) -> applied in a router's mirror, from
  the routers' ``kvroute_router_feed_propagation_seconds`` histograms;
* divergence: the share of (block, worker) entries on which a router differs from the workers'
  truth (and routers from each other), under load and after quiescence;
* Redis memory and CPU per worker.

Then, once: a router started late against W_boot workers x B blocks (default 1,000 x 10k):
its bootstrap time, its memory per (block, worker) entry, and the routing decision p99 of an
8k-token prompt there (the router's own ``kvroute_router_decision_seconds``).

    python bench/scale.py [--quick] [--workers 16,128,1000] [--routers 1,2,8]

All processes share this machine's cores: the rates measured are what it can do with every
process competing; the output says how many cores that was.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvroute.core.blocks import BlockHasher
from kvroute.core.cache_events import CacheEvent
from kvroute.core.load import EngineLoad
from kvroute.core.ports import PortPool
from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import Heartbeat, Op, RedisKeys
from kvroute.core.settings import AT_LEAST_ONE
from kvroute.demo.procs import find_redis_server

BLOCK = 16
KEYS_PER_STORE = 4  # blocks one synthetic store event adds (one 64-token step)
PER_HOST = 500  # publishers one host process runs
PROMPT_TOKENS = 8192
_PORTS = PortPool()
COUNTS = AT_LEAST_ONE.list_parser(int)  # --workers 16,128


# -- Redis Cluster -----------------------------------------------------------------------------


@contextlib.contextmanager
def redis_cluster(masters: int = 3, replicas: int = 0, extra: Sequence[str] = ()) -> object:
    """``masters`` cluster-enabled redis-servers, each with ``replicas`` replicas (synced
    before this yields), joined into one cluster; yields every node's port. ``extra``: more
    redis-server arguments (``--cluster-node-timeout``). Stopped by PID on exit."""
    cli = shutil.which("redis-cli") or str(Path(find_redis_server()).with_name("redis-cli"))
    with tempfile.TemporaryDirectory() as tmp:
        ports = [_PORTS.take_cluster() for _ in range(masters * (1 + replicas))]
        procs = [subprocess.Popen(
            [find_redis_server(), "--port", str(p), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{p}.conf", "--dir", tmp,
             "--repl-diskless-sync-delay", "0", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
        try:
            for p in ports:
                _wait_ping(p)
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                            "--cluster-replicas", str(replicas), "--cluster-yes"], check=True,
                           capture_output=True, timeout=60)
            wait_cluster_ok(ports[0])
            _wait_replicas_synced(ports)
            yield ports
        finally:
            for proc in procs:
                _stop(proc)


def wait_cluster_ok(port: int, timeout_s: float = 30.0) -> None:
    """Until the node at ``port`` says the cluster's state is ok (every slot served)."""
    rc = redis.Redis(port=port)
    deadline = time.monotonic() + timeout_s
    try:
        while rc.cluster("INFO").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("the redis cluster never reached state ok")
            time.sleep(0.05)
    finally:
        rc.close()


def _wait_replicas_synced(ports: list[int], timeout_s: float = 20.0) -> None:
    """Until every replica has finished its first sync: one that has not refuses to fail
    over (its data counts as infinitely old)."""
    deadline = time.monotonic() + timeout_s
    for p in ports:
        rc = redis.Redis(port=p)
        while True:
            info = rc.info("replication")
            if info.get("role") != "slave" or info.get("master_link_status") == "up":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {p} never finished its first sync")
            time.sleep(0.05)
        rc.close()


def _wait_ping(port: int) -> None:
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {port} did not start") from None
            time.sleep(0.02)
    client.close()


def _stop(proc: subprocess.Popen[bytes] | asyncio.subprocess.Process) -> None:
    """SIGTERM by PID, then SIGKILL after 5 s."""
    if proc.returncode is None and (not isinstance(proc, subprocess.Popen)
                                    or proc.poll() is None):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a paused router must be able to exit
            proc.send_signal(signal.SIGTERM)
        if isinstance(proc, subprocess.Popen):
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def redis_stats(ports: Sequence[int]) -> tuple[int, float]:
    """(used memory in bytes, CPU seconds used) summed over the cluster's nodes."""
    mem, cpu = 0, 0.0
    for p in ports:
        c = redis.Redis(port=p)
        m, u = c.info("memory"), c.info("cpu")
        mem += int(m["used_memory"])
        cpu += float(u["used_cpu_user"]) + float(u["used_cpu_sys"])
        c.close()
    return mem, cpu


# -- a host process: many publishers -----------------------------------------------------------


@dataclass
class SimWorker:
    """One worker's truth: its cache as an insertion-ordered dict (oldest evicted first)."""

    name: str
    capacity: int
    keys: dict[int, None] = field(default_factory=dict)
    publisher: object = None

    def snapshot(self) -> list[int]:
        return list(self.keys)


def _truth_row(w: SimWorker, with_keys: bool) -> dict[str, object]:
    pub = w.publisher
    row: dict[str, object] = {"epoch": pub.epoch, "seq": pub.seq, "blocks": len(w.keys),
                              "sum": sum(w.keys) % (1 << 64), "pending": pub.stats.pending,
                              "dead": [repr(t.exception())[:300] for t in pub._tasks
                                       if t.done() and not t.cancelled()]}
    if with_keys:
        row["keys_b64"] = base64.b64encode(b"".join(
            k.to_bytes(8, "big") for k in sorted(w.keys))).decode()
    return row


async def host_main(args: argparse.Namespace) -> None:
    """``--host``: run publishers for workers [first, first + count) until told to exit.

    Commands on stdin, one a line: ``go RATE`` (store events/s over all these workers),
    ``quiet`` (stop generating), ``dump`` / ``dumpkeys`` (the truth, one JSON line out),
    ``exit``. ``ready`` is written once every publisher declared its epoch."""
    from kvroute.worker_agent.publisher import CachePublisher

    logging.basicConfig(level=logging.ERROR)
    os.nice(args.nice)
    rng = random.Random(args.seed)
    client = connect(args.redis)
    keys = RedisKeys(args.model)
    pool = [rng.getrandbits(63) for _ in range(args.pool)] if args.pool else []
    workers = []
    for i in range(args.first, args.first + args.count):
        w = SimWorker(f"w{i:05d}", args.capacity)
        if args.preload:  # the bootstrap phase: a full cache, drawn from a shared pool
            w.keys = dict.fromkeys(rng.sample(pool, args.preload) if pool else
                                   (rng.getrandbits(63) for _ in range(args.preload)))
        for chain in args.chains_of(i):
            w.keys.update(dict.fromkeys(chain))

        def beat(name: str = w.name) -> Heartbeat:
            return Heartbeat(worker_id=name, address="127.0.0.1:9", epoch="e", block_size=BLOCK,
                             ttl_s=args.ttl, load=EngineLoad(
                                 capacity_blocks=args.capacity, free_blocks=args.capacity // 2,
                                 max_running=64, max_batched_tokens=8192))

        w.publisher = CachePublisher(client, keys, w.name, w.snapshot, beat,
                                     heartbeat_s=args.heartbeat_s, heartbeat_ttl_s=args.ttl)
        workers.append(w)
    for w in workers:
        await w.publisher.start()
        await asyncio.sleep(0)
    while any(w.publisher.stats.resyncs == 0 for w in workers):
        await asyncio.sleep(0.05)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    gen: asyncio.Task[None] | None = None
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        cmd = line[0]
        if cmd == "go":
            gen = asyncio.create_task(_generate(workers, float(line[1]), rng))
        elif cmd == "quiet" and gen is not None:
            gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
            gen = None
        elif cmd in ("dump", "dumpkeys"):
            rows = {w.name: _truth_row(w, cmd == "dumpkeys") for w in workers}
            out.write(json.dumps(rows) + "\n")
            out.flush()
        elif cmd == "exit":
            break
    os._exit(0)  # the publishers' loops need no clean stop: the bench is over


async def _generate(workers: list[SimWorker], rate: float, rng: random.Random) -> None:
    """Store events at ``rate`` per second over ``workers`` (each a new 4-block step), with the
    oldest blocks evicted once a worker's cache is full; 100 ticks a second."""
    tick = 0.01
    owed = 0.0
    nxt = time.monotonic()
    while True:
        owed += rate * tick
        while owed >= 1:
            owed -= 1
            w = rng.choice(workers)
            new = tuple(rng.getrandbits(63) for _ in range(KEYS_PER_STORE))
            w.keys.update(dict.fromkeys(new))
            w.publisher.on_event(CacheEvent(Op.STORE, new))
            if len(w.keys) > w.capacity:
                old = tuple(list(w.keys)[: len(w.keys) - w.capacity])
                for k in old:
                    del w.keys[k]
                w.publisher.on_event(CacheEvent(Op.EVICT, old))
        nxt += tick
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))


@dataclass
class Host:
    proc: asyncio.subprocess.Process

    async def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def dump(self, keys: bool = False) -> dict[str, dict[str, object]]:
        await self.send("dumpkeys" if keys else "dump")
        return json.loads(await self.proc.stdout.readline())


@contextlib.asynccontextmanager
async def hosts(url: str, model: str, workers: int, capacity: int, *, preload: int = 0,
                pool: int = 0, chains: int = 0, seed: int = 1, heartbeat_s: float = 1.0,
                nice: int = 0) -> AsyncIterator[list[Host]]:
    """Host processes for ``workers`` publishers, each ready (epoch declared), at ``nice``
    (the niceness they add)."""
    out = []
    try:
        for first in range(0, workers, PER_HOST):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--host", "--redis", url, "--model", model,
                "--first", str(first), "--count", str(min(PER_HOST, workers - first)),
                "--capacity", str(capacity), "--preload", str(preload), "--pool", str(pool),
                "--chains", str(chains), "--seed", str(seed + first),
                "--heartbeat-s", str(heartbeat_s), "--nice", str(nice),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                limit=1 << 30)
            out.append(Host(proc))
        for h in out:
            line = await asyncio.wait_for(h.proc.stdout.readline(), 600)
            if line.strip() != b"ready":
                raise RuntimeError("a host process failed to start its publishers")
        yield out
    finally:
        for h in out:
            with contextlib.suppress(Exception):
                await h.send("exit")
            try:
                await asyncio.wait_for(h.proc.wait(), 5)
            except TimeoutError:
                h.proc.kill()
                await h.proc.wait()


def probe_chains(n: int, seed: int = 7) -> list[list[int]]:
    """Token ids of ``n`` 8k-token prompts (the routing-decision probes)."""
    rng = random.Random(seed)
    return [[rng.randrange(50257) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


# -- routers -----------------------------------------------------------------------------------


@dataclass
class Router:
    proc: asyncio.subprocess.Process
    port: int
    metrics_port: int
    log: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.metrics_port}{path}"

    async def get(self, path: str, timeout: float = 60.0) -> bytes:
        def fetch() -> bytes:
            with urllib.request.urlopen(self.url(path), timeout=timeout) as resp:
                return resp.read()
        return await asyncio.to_thread(fetch)

    async def counters(self) -> dict[str, float]:
        """The mirror's counters alone (``/debug/mirror?workers=0``: cheap to poll)."""
        return json.loads(await self.get("/debug/mirror?workers=0"))

    async def view(self, keys: bool = False) -> dict[str, object]:
        return json.loads(await self.get("/debug/mirror?keys=1" if keys else "/debug/mirror"))

    async def metrics(self) -> dict[str, float]:
        """Unlabelled samples and histogram buckets of the router's /metrics."""
        out: dict[str, float] = {}
        for line in (await self.get("/metrics")).decode().splitlines():
            if line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            if "{" in name and "_bucket{" not in name:
                continue
            out[name] = float(value)
        return out

    def rss(self) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


def compile_kvroute() -> None:
    """Byte-compile kvroute's modules, as installing its wheel does. Where bytecode is
    never written (PYTHONDONTWRITEBYTECODE, set on these machines, and an editable
    install), every router compiled its sources at each start: 0.3-0.45 s of it."""
    import compileall

    import kvroute

    for name in ("", ".core", ".router", ".worker_agent", ".simulations"):
        pkg = importlib.import_module(f"kvroute{name}") if name else kvroute
        compileall.compile_dir(os.path.dirname(pkg.__file__), quiet=1)


async def start_router(url: str, model: str, poll_s: float = 0.5) -> Router:
    port, mport = _PORTS.take(), _PORTS.take()
    fd, path = tempfile.mkstemp(prefix="scale-router-", suffix=".log")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute", "router", "--redis", url, "--model", model,
        "--port", str(port), "--metrics-port", str(mport), "--block-size", str(BLOCK),
        "--poll-interval-s", str(poll_s), "--log-level", "warning",
        stdout=fd, stderr=fd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(fd)
    return Router(proc, port, mport, Path(path))


async def stop_routers(routers: Sequence[Router]) -> None:
    for r in routers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.proc.pid, signal.SIGCONT)
            r.proc.send_signal(signal.SIGTERM)
    for r in routers:
        try:
            await asyncio.wait_for(r.proc.wait(), 10)
        except TimeoutError:
            r.proc.kill()
            await r.proc.wait()
        with contextlib.suppress(OSError):
            r.log.unlink()


async def wait_views(routers: Sequence[Router], workers: int, timeout: float,
                     entries: int | None = None) -> float:
    """Seconds until every router's mirror is up and holds ``workers`` workers (and
    ``entries`` (block, worker) entries, if given)."""
    t0 = time.monotonic()
    while True:
        ok = True
        for r in routers:
            if r.proc.returncode is not None:
                raise RuntimeError(f"a router exited: {r.log.read_text()[-2000:]}")
            try:
                v = await r.view()
            except OSError:
                ok = False
                break
            rows = v["workers"]
            if not v["available"] or len(rows) < workers or (
                    entries is not None and sum(x["blocks"] for x in rows.values()) < entries):
                ok = False
                break
        if ok:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"routers did not see {workers} workers in {timeout:.0f} s")
        await asyncio.sleep(0.1)


async def wait_bootstrapped(router: Router, timeout: float) -> float:
    """Seconds from now until ``router``'s mirror has bootstrapped (its counters say so:
    polled every 50 ms, ``/metrics`` would take ~210 ms of the router's GIL a render at 1,000
    workers and slow the bootstrap it measures)."""
    t0 = time.monotonic()
    while True:
        if router.proc.returncode is not None:
            raise RuntimeError(f"a router exited: {router.log.read_text()[-2000:]}")
        with contextlib.suppress(OSError):
            m = await router.counters()
            if m.get("bootstraps", 0) >= 1:
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the late router did not bootstrap in {timeout:.0f} s")
        await asyncio.sleep(0.05)


# -- comparing views ---------------------------------------------------------------------------


def _keyset(row: dict[str, object]) -> set[int]:
    blob = base64.b64decode(row.get("keys_b64", ""))
    return {int.from_bytes(blob[i:i + 8], "big") for i in range(0, len(blob), 8)}


def divergence(view: dict[str, dict[str, object]], before: dict[str, dict[str, object]],
               after: dict[str, dict[str, object]] | None = None) -> tuple[int, int]:
    """(entries that differ, entries in the truth). A differing entry is a (block, worker)
    a view holds and the truth does not, or the other way round.

    Under load the truth moves while the views are read, so it is read ``before`` and
    ``after`` them: only entries on which both truths agree are counted (an entry that
    changed within the reading window may be either way). Workers whose digest equals one
    of the truths' are not decoded."""
    after = after or before
    diff = total = 0
    for w, a in before.items():
        b = after.get(w, a)
        total += a["blocks"]
        v = view.get(w)
        if v is None:
            diff += min(a["blocks"], b["blocks"])
            continue
        if any(v["blocks"] == t["blocks"] and v["sum"] == t["sum"] for t in (a, b)):
            continue
        if "keys_b64" not in a:  # digests only: a lower bound
            diff += max(1, abs(v["blocks"] - a["blocks"]))
            continue
        ka, kb, kv = _keyset(a), _keyset(b), _keyset(v)
        diff += len((ka & kb) - kv) + len(kv - (ka | kb))
    diff += sum(v["blocks"] for w, v in view.items() if w not in before)
    return diff, total


async def truth_of(hs: Sequence[Host], keys: bool = False) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for part in await asyncio.gather(*(h.dump(keys) for h in hs)):
        out.update(part)
    return out


def quantile(buckets: dict[float, float], q: float) -> float:
    """The q-quantile of a cumulative histogram {upper bound: count}, interpolated."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return float("nan")
    want = q * total
    lo_b, lo_c = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= want:
            if b == float("inf"):
                return lo_b
            return lo_b + (b - lo_b) * ((want - lo_c) / max(c - lo_c, 1e-9))
        lo_b, lo_c = b, c
    return bounds[-1]


def hist(m: dict[str, float], name: str) -> dict[float, float]:
    out = {}
    for k, v in m.items():
        if k.startswith(name + "_bucket{"):
            le = re.search(r'le="([^"]+)"', k).group(1)
            out[float(le)] = v
    return out


def hist_delta(a: dict[float, float], b: dict[float, float]) -> dict[float, float]:
    return {k: b[k] - a.get(k, 0.0) for k in b}


# -- one (W, R) cell ---------------------------------------------------------------------------


@dataclass
class Cell:
    workers: int
    routers: int
    offered: float = 0.0  # feed entries/s the workers wrote under load
    applied: float = 0.0  # entries/s one router applied under load
    drain: float = 0.0  # entries/s router 0 applied while catching up (its limit)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    div_load: float = 0.0  # share of entries differing, router vs truth, under load
    div_routers: float = 0.0  # share differing between routers, under load
    div_rest: float = -1.0  # after quiescence
    converge_s: float = 0.0
    window_ms: float = 0.0  # how long reading every view under load took
    redis_bytes_per_worker: float = 0.0
    redis_cpu_ms_per_worker_s: float = 0.0


async def run_cell(ports: Sequence[int], w: int, r: int, args: argparse.Namespace) -> Cell:
    url = f"redis+cluster://127.0.0.1:{ports[0]}"
    model = f"scale-w{w}-r{r}"
    cell = Cell(w, r)
    routers: list[Router] = []
    mem0, _ = redis_stats(ports)
    async with hosts(url, model, w, args.capacity, preload=args.capacity // 2,
                     heartbeat_s=args.heartbeat_s) as hs:
        try:
            routers = [await start_router(url, model) for _ in range(r)]
            await wait_views(routers, w, 120)
            t0 = time.monotonic()
            for h in hs:
                await h.send(f"go {args.rate / len(hs)}")
            await asyncio.sleep(args.seconds / 2)
            # Under load: every view and the truth read at one moment (as near as may be).
            ta = await truth_of(hs, keys=True)
            tw = time.monotonic()
            views = await asyncio.gather(*(x.view(keys=True) for x in routers))
            tb = await truth_of(hs, keys=True)
            cell.window_ms = (time.monotonic() - tw) * 1000
            shares = [divergence(v["workers"], ta, tb) for v in views]
            cell.div_load = max(d / max(t, 1) for d, t in shares)
            if r > 1:  # router 0 against the others, read in the same window
                cell.div_routers = max(
                    d / max(t, 1) for d, t in (divergence(v["workers"], views[0]["workers"])
                                               for v in views[1:]))
            # Rates and propagation from here on: reading every view with its keys stalls
            # each router's loop for a while, which is the bench's doing, not kvroute's.
            before = [await x.metrics() for x in routers]
            applied0 = (await routers[0].counters())["events_applied"]
            _, cpu0 = redis_stats(ports)
            t0 = time.monotonic()
            await asyncio.sleep(args.seconds / 2)
            cell.applied = ((await routers[0].counters())["events_applied"] - applied0) / (
                time.monotonic() - t0)
            after = [await x.metrics() for x in routers]
            elapsed = time.monotonic() - t0
            name = "kvroute_router_feed_propagation_seconds"
            merged: dict[float, float] = {}
            for a, b in zip(before, after, strict=True):
                for k, v in hist_delta(hist(a, name), hist(b, name)).items():
                    merged[k] = merged.get(k, 0.0) + v
            cell.p50_ms = quantile(merged, 0.5) * 1000
            cell.p99_ms = quantile(merged, 0.99) * 1000
            mem1, cpu1 = redis_stats(ports)
            cell.redis_bytes_per_worker = (mem1 - mem0) / w
            cell.redis_cpu_ms_per_worker_s = (cpu1 - cpu0) * 1000 / w / elapsed
            cell.offered = cell.applied  # every entry reaches every router eventually
            # The limit: router 0 paused under load, then its backlog drained.
            # Read before the pause: once resumed, the router answers only when its loop
            # gets to it, which may be after the backlog is gone.
            m0 = await routers[0].counters()
            os.kill(routers[0].proc.pid, signal.SIGSTOP)
            await asyncio.sleep(args.pause_s)
            os.kill(routers[0].proc.pid, signal.SIGCONT)
            t1 = time.monotonic()
            while True:  # drained: the last entry it applied is fresh again
                await asyncio.sleep(0.01)
                m1 = await routers[0].counters()
                # (lag_s is the last applied entry's: fresh only once it applied new ones)
                if (m1["events_applied"] > m0["events_applied"] and m1["lag_s"] < 0.05) \
                        or time.monotonic() - t1 > 60:
                    break
            cell.drain = (m1["events_applied"] - m0["events_applied"]) / max(
                time.monotonic() - t1, 1e-3)
            for h in hs:
                await h.send("quiet")
            # At rest: wait for every router to hold exactly the truth.
            t2 = time.monotonic()
            truth = await truth_of(hs)
            while True:
                views = await asyncio.gather(*(x.view() for x in routers))
                worst = max(divergence(v["workers"], truth)[0] for v in views)
                if worst == 0 or time.monotonic() - t2 > 30:
                    break
                await asyncio.sleep(0.1)
                truth = await truth_of(hs)
            cell.converge_s = time.monotonic() - t2
            if worst:  # say which workers differ, and any publisher loop that died
                v = views[0]["workers"]
                bad = [w for w, t in truth.items() if w not in v or v[w]["sum"] != t["sum"]]
                print(f"  W={w} R={r}: {len(bad)} workers differ at rest, e.g. "
                      f"{[(b, truth[b]['seq'], truth[b]['dead'], v.get(b)) for b in bad[:3]]}",
                      flush=True)
            total = sum(t["blocks"] for t in truth.values())
            cell.div_rest = worst / max(total, 1)
        finally:
            await stop_routers(routers)
    return cell


# -- the late router: bootstrap, memory, decision ----------------------------------------------


@dataclass
class Boot:
    workers: int
    blocks: int
    entries: int = 0
    write_s: float = 0.0
    bootstrap_s: float = 0.0
    bytes_per_entry: float = 0.0
    decision_p50_us: float = 0.0
    decision_p99_us: float = 0.0
    redis_bytes_per_worker: float = 0.0
    start_s: float = 0.0
    seen_entries: int = 0  # in the late router's index once bootstrapped


async def run_boot(ports: Sequence[int], args: argparse.Namespace) -> Boot:
    import grpc

    from kvroute.v1 import common_pb2, router_pb2_grpc

    url = f"redis+cluster://127.0.0.1:{ports[0]}"
    model = "scale-boot"
    w, blocks = args.boot_workers, args.boot_blocks
    b = Boot(w, blocks)
    prompts = probe_chains(8)
    t0 = time.monotonic()
    # Each block key is held by ~4 workers (drawn from a pool a quarter of the entries).
    # The publishers stand in for agents on 1,000 other machines, and heartbeating took
    # ~0.8 of this machine's 2 cores: at nice 10 they leave the routers the cores first.
    async with hosts(url, model, w, blocks + 4096, preload=blocks,
                     pool=max(blocks, w * blocks // 4), chains=len(prompts),
                     heartbeat_s=2.0, nice=10) as hs:
        b.write_s = time.monotonic() - t0
        mem, _ = redis_stats(ports)
        b.redis_bytes_per_worker = mem / w  # the cluster held nothing else
        truth = await truth_of(hs)
        b.entries = sum(t["blocks"] for t in truth.values())
        compile_kvroute()
        t0 = time.monotonic()
        empty = await start_router(url, "scale-empty")  # the same process, no state
        late: Router | None = None
        try:
            await wait_views([empty], 0, 120)
            b.start_s = time.monotonic() - t0
            late = await start_router(url, model)
            b.bootstrap_s = await wait_bootstrapped(late, 900)  # includes the process start
            got = await late.metrics()
            b.seen_entries = int(got["kvroute_router_index_entries"])
            b.bytes_per_entry = (late.rss() - empty.rss()) / max(b.seen_entries, 1)
            before = await late.metrics()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{late.port}") as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                for i in range(args.decisions):
                    req = common_pb2.GenerateRequest(
                        token_ids=prompts[i % len(prompts)],
                        sampling=common_pb2.SamplingParams(max_tokens=1))
                    await stub.Route(req)
            after = await late.metrics()
            h = hist_delta(hist(before, "kvroute_router_decision_seconds"),
                           hist(after, "kvroute_router_decision_seconds"))
            b.decision_p50_us = quantile(h, 0.5) * 1e6
            b.decision_p99_us = quantile(h, 0.99) * 1e6
        finally:
            await stop_routers([empty] + ([late] if late else []))
    return b


def chains_for(n: int, model: str) -> list[list[int]]:
    hasher = BlockHasher(BLOCK, model)
    return [hasher.keys(p) for p in probe_chains(n)]


# -- main --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a small grid (W = 16, 128; R = 1, 2) and a 200 x 2k bootstrap")
    p.add_argument("--workers", type=COUNTS, default=None, help="W values (16,128,1000)")
    p.add_argument("--routers", type=COUNTS, default=None, help="R values (1,2,8)")
    p.add_argument("--rate", type=float, default=1000.0,
                   help="store events/s offered over all workers (each may add an evict)")
    p.add_argument("--seconds", type=float, default=6.0, help="load time per cell")
    p.add_argument("--pause-s", type=float, default=5.0,
                   help="how long router 0 is paused to build the backlog it then drains")
    p.add_argument("--capacity", type=int, default=512, help="blocks per simulated worker")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--boot-workers", type=int, default=None, help="late router: W (1000)")
    p.add_argument("--boot-blocks", type=int, default=None, help="late router: blocks (10000)")
    p.add_argument("--decisions", type=int, default=300, help="Route calls, 8k-token prompts")
    p.add_argument("--no-boot", action="store_true", help="skip the late-router phase")
    p.add_argument("--boot-only", action="store_true", help="only the late-router phase")
    # --host: one process of publishers (started by this script, not by hand).
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--redis", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--preload", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pool", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--chains", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--ttl", type=float, default=10.0, help=argparse.SUPPRESS)
    return p


async def bench(args: argparse.Namespace) -> None:
    ws = args.workers or ([16, 128] if args.quick else [16, 128, 1000])
    rs = args.routers or ([1, 2] if args.quick else [1, 2, 8])
    args.boot_workers = args.boot_workers or (200 if args.quick else 1000)
    args.boot_blocks = args.boot_blocks or (2000 if args.quick else 10_000)
    print(f"machine: {os.cpu_count()} cores shared by the Redis Cluster (3 masters), the "
          f"host processes ({PER_HOST} publishers each) and every router; offered "
          f"{args.rate:g} store events/s, {args.seconds:g} s per cell", flush=True)
    with redis_cluster(3) as ports:
        cells: list[Cell] = []
        print(f"\n{'W':>5} {'R':>2} | {'applied/s':>9} {'limit/s':>8} | {'prop p50':>8} "
              f"{'p99 ms':>7} | {'div load':>9} {'r-vs-r':>8} {'at rest':>8} "
              f"{'conv s':>6} {'win ms':>6} | {'redis B/w':>9} {'cpu ms/w/s':>10}", flush=True)
        for w in [] if args.boot_only else ws:
            for r in rs:
                c = await run_cell(ports, w, r, args)
                cells.append(c)
                print(f"{c.workers:>5} {c.routers:>2} | {c.applied:>9.0f} {c.drain:>8.0f} | "
                      f"{c.p50_ms:>8.1f} {c.p99_ms:>7.1f} | {c.div_load:>9.2%} "
                      f"{c.div_routers:>8.2%} {c.div_rest:>8.2%} {c.converge_s:>6.1f} "
                      f"{c.window_ms:>6.0f} | "
                      f"{c.redis_bytes_per_worker:>9.0f} {c.redis_cpu_ms_per_worker_s:>10.3f}",
                      flush=True)
                for x in ports:  # the next cell starts from an empty cluster
                    redis.Redis(port=x).flushall()
        base = cells[0] if cells else Cell(0, 0)
        print(f"\nratios against the baseline cell (W={base.workers}, R={base.routers}):")
        for c in cells[1:]:
            print(f"  W={c.workers:<5} R={c.routers}: limit/s x{c.drain / max(base.drain, 1):.2f}"
                  f", propagation p99 x{c.p99_ms / max(base.p99_ms, 1e-3):.2f}")
        print("'applied/s' = feed entries/s one router applied under the offered load (a store "
              "and its evict are two); 'limit/s' = entries/s it drained a backlog at (where it "
              "falls behind); 'div load' = share of (block, worker) entries a router holds "
              "otherwise than the workers' truth, counting only entries that did not change "
              "while the views were read ('win ms'); 'r-vs-r' = router 0 against the others; "
              "'at rest' = after the load stopped and 'conv s' seconds passed; 'redis B/w' = "
              "Redis memory per worker, 'cpu ms/w/s' = Redis CPU ms per worker per second.")
        if not args.no_boot:
            b = await run_boot(ports, args)
            print(f"\nlate router, {b.workers} workers x {b.blocks} blocks "
                  f"({b.entries} entries, written in {b.write_s:.1f} s; "
                  f"{b.seen_entries} in its index once bootstrapped):")
            print(f"  bootstrap (process start -> mirror complete): {b.bootstrap_s:.2f} s "
                  f"(an empty router's start: {b.start_s:.2f} s)")
            print(f"  router memory per (block, worker) entry: {b.bytes_per_entry:.1f} B")
            print(f"  routing decision, 8k-token prompt: p50 {b.decision_p50_us:.0f} us, "
                  f"p99 {b.decision_p99_us:.0f} us")
            print(f"  redis memory per worker: {b.redis_bytes_per_worker / 1024:.0f} KiB")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.host:
        hasher_model = args.model
        chains = chains_for(args.chains, hasher_model) if args.chains else []
        # Prompt j's prefix, of a depth that varies by worker, on every 4th worker.
        args.chains_of = lambda i: [c[: (i * 37 + j * 11) % len(c) + 1]
                                    for j, c in enumerate(chains) if (i + j) % 4 == 0]
        asyncio.run(host_main(args))
        return 0
    asyncio.run(bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
