"""vLLM's own code, for tests: fetched from each supported release's wheel, run without vLLM.

``vllm/distributed/kv_events.py`` (the structs *and* ``ZmqEventPublisher``) is executed
unmodified from the wheel of each end of
:data:`kvroute.worker_agent.engines.vllm.versions.SUPPORTED`. Importing it needs four small
parts of vLLM that pull in torch and CUDA; only those are stubbed, with what the file uses of
them:

* ``vllm.config.utils.config`` -> ``dataclasses.dataclass`` (``vllm/config/kv_events.py``
  itself is loaded from the wheel too)
* ``vllm.logger.init_logger`` -> ``logging.getLogger``
* ``vllm.utils.network_utils`` -> the four helpers ``ZmqEventPublisher._bind`` calls for
  ``tcp://*:0`` (never used here: tests bind explicit loopback ports; 0.10.2 has no such
  import)
* ``vllm.v1.core.kv_cache_utils.ExternalBlockHash`` -> ``bytes | int``, its definition

Besides those, the OpenAI server's request/response models (every
``vllm/entrypoints/**/protocol.py``), ``vllm/sampling_params.py`` and ``vllm/v1/request.py``
are kept, to be read (never executed) by :mod:`vllm_release`.

A wheel (~250-450 MB) is downloaded once per release with ``pip download --no-deps
vllm==VERSION``; only those files are kept, under ``.cache/vllm-VERSION/`` (gitignored).
``KVROUTE_VLLM_SOURCES`` may name another directory holding such ``vllm-VERSION/`` trees
(e.g. unpacked wheels), to run offline.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import logging
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import types
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[4]
KV_FILES = ("vllm/distributed/kv_events.py", "vllm/config/kv_events.py")
_KEEP = re.compile(r"vllm/(distributed/kv_events|config/kv_events|sampling_params|v1/request"
                   r"|entrypoints/.*protocol)\.py")
_COMPLETE = ".kvroute-complete"  # written last: a tree without it is fetched again


def vllm_sources(version: str, cache_dir: Path | None = None) -> Path:
    """A directory holding vLLM ``version``'s files (see the module doc); downloads the
    wheel the first time."""
    env = os.environ.get("KVROUTE_VLLM_SOURCES")
    if env:
        root = Path(env) / f"vllm-{version}"
        if not all((root / f).is_file() for f in KV_FILES):
            raise RuntimeError(f"KVROUTE_VLLM_SOURCES={env} lacks vllm-{version}/"
                               f"{{{', '.join(KV_FILES)}}}")
        return root
    root = (cache_dir or REPO / ".cache") / f"vllm-{version}"
    if (root / _COMPLETE).is_file():
        return root
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", f"vllm=={version}", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(
                f"cannot download the vLLM {version} wheel for its kv_events.py "
                f"({' '.join(cmd)}): {res.stderr.strip()[-500:]}; set KVROUTE_VLLM_SOURCES to "
                "a directory of unpacked vllm-VERSION trees to run these tests offline")
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if _KEEP.fullmatch(name):
                    dest = root / name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(zf.read(name))
    missing = [f for f in KV_FILES if not (root / f).is_file()]
    if missing:
        raise RuntimeError(f"the vLLM {version} wheel lacks {', '.join(missing)}")
    (root / _COMPLETE).write_text(version)
    return root


def struct(cls: type, **fields: object) -> object:
    """An instance of one of a release's msgspec structs, given only the fields it has: e.g.
    0.10.2's ``BlockStored`` lacks ``lora_name``, ``extra_keys`` and ``group_idx``, whose
    values are then dropped (a release that cannot carry them loses them on the wire too)."""
    have = cls.__struct_fields__  # type: ignore[attr-defined]
    return cls(**{k: v for k, v in fields.items() if k in have})


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
