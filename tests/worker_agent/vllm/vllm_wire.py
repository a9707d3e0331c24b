"""vLLM's own KV-event code, for tests: fetched from the vLLM wheel and loaded without vLLM.

``vllm/distributed/kv_events.py`` (the structs *and* ``ZmqEventPublisher``) is executed
unmodified from the wheel. Importing it needs four small parts of vLLM that pull in torch and
CUDA; only those are stubbed, with what the file uses of them:

* ``vllm.config.utils.config`` -> ``dataclasses.dataclass`` (``vllm/config/kv_events.py``
  itself is loaded from the wheel too)
* ``vllm.logger.init_logger`` -> ``logging.getLogger``
* ``vllm.utils.network_utils`` -> the four helpers ``ZmqEventPublisher._bind`` calls for
  ``tcp://*:0`` (never used here: tests bind explicit loopback ports)
* ``vllm.v1.core.kv_cache_utils.ExternalBlockHash`` -> ``bytes | int``, its definition

The wheel (~330 MB) is downloaded once with ``pip download --no-deps vllm==VERSION``; only
those two files are kept, under ``.cache/vllm-VERSION/`` (gitignored).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import types
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import zmq

VLLM_VERSION = os.environ.get("KVROUTE_VLLM_VERSION", "0.33.0")
REPO = Path(__file__).resolve().parents[3]
FILES = ("vllm/distributed/kv_events.py", "vllm/config/kv_events.py")


def vllm_sources(cache_dir: Path | None = None) -> Path:
    """A directory holding vLLM's KV-event sources; downloads the wheel the first time.

    ``KVROUTE_VLLM_SRC`` may point at an existing tree (e.g. an unpacked wheel)."""
    env = os.environ.get("KVROUTE_VLLM_SRC")
    if env:
        root = Path(env)
        if not all((root / f).is_file() for f in FILES):
            raise RuntimeError(f"KVROUTE_VLLM_SRC={env} lacks {', '.join(FILES)}")
        return root
    root = (cache_dir or REPO / ".cache") / f"vllm-{VLLM_VERSION}"
    if all((root / f).is_file() for f in FILES):
        return root
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", f"vllm=={VLLM_VERSION}", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(
                f"cannot download the vLLM {VLLM_VERSION} wheel for its kv_events.py "
                f"({' '.join(cmd)}): {res.stderr.strip()[-500:]}; set KVROUTE_VLLM_SRC to an "
                "unpacked vLLM tree to run these tests offline")
        with zipfile.ZipFile(wheels[0]) as zf:
            for f in FILES:
                dest = root / f
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(zf.read(f))
    return root


def _stub(name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so submodules resolve
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def _exec(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port


def _is_ipv6(addr: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(addr), ipaddress.IPv6Address)
    except ValueError:
        return False


def load_kv_events(src: Path) -> types.ModuleType:
    """Execute vLLM's ``kv_events.py`` from ``src`` with the stubs above; sys.modules is
    restored afterwards (the returned module keeps what it imported)."""
    stubs = {
        "vllm": _stub("vllm"),
        "vllm.config": _stub("vllm.config"),
        "vllm.config.utils": _stub("vllm.config.utils", config=dataclasses.dataclass),
        "vllm.logger": _stub("vllm.logger", init_logger=logging.getLogger),
        "vllm.utils": _stub("vllm.utils"),
        "vllm.utils.network_utils": _stub(
            "vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
            get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
            is_valid_ipv6_address=_is_ipv6, split_zmq_path=_split_zmq_path),
        "vllm.v1": _stub("vllm.v1"),
        "vllm.v1.core": _stub("vllm.v1.core"),
        "vllm.v1.core.kv_cache_utils": _stub("vllm.v1.core.kv_cache_utils",
                                             ExternalBlockHash=bytes | int),
        "vllm.distributed": _stub("vllm.distributed"),
    }
    names = [*stubs, "vllm.config.kv_events", "vllm.distributed.kv_events"]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        sys.modules.update(stubs)
        _exec("vllm.config.kv_events", src / "vllm/config/kv_events.py")
        return _exec("vllm.distributed.kv_events", src / "vllm/distributed/kv_events.py")
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


class FrameForwarder:
    """Sits on the wire between vLLM's PUB socket and the agent, like a lossy network.

    vLLM's publisher *connects* to ``upstream`` (its connect mode for non-wildcard
    endpoints); the agent subscribes to ``downstream``. Frames pass unchanged unless asked
    to drop some (by seq, or the next n) or to inject raw frames."""

    def __init__(self, upstream: str, downstream: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.bind(upstream)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind(downstream)
        self._lock = threading.Lock()
        self._drop_seqs: set[int] = set()
        self._drop_next = 0
        self._inject: queue.Queue[list[bytes]] = queue.Queue()
        self.forwarded = 0
        self.dropped: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="frame-forwarder", daemon=True)
        self._thread.start()

    def drop(self, seqs: Iterable[int] = (), next_n: int = 0) -> None:
        with self._lock:
            self._drop_seqs.update(seqs)
            self._drop_next += next_n

    def inject(self, frames: Sequence[bytes]) -> None:
        self._inject.put(list(frames))

    def _should_drop(self, frames: list[bytes]) -> bool:
        seq = int.from_bytes(frames[1], "big") if len(frames) == 3 else -1
        with self._lock:
            if seq in self._drop_seqs:
                self._drop_seqs.discard(seq)
            elif self._drop_next > 0:
                self._drop_next -= 1
            else:
                return False
        self.dropped.append(seq)
        return True

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            while True:
                try:
                    self._pub.send_multipart(self._inject.get_nowait())
                except queue.Empty:
                    break
            if not poller.poll(10):
                continue
            frames = self._sub.recv_multipart()
            if not self._should_drop(frames):
                self._pub.send_multipart(frames)
                self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()
