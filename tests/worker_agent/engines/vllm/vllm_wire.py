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
import ipaddress
import logging
import queue
import re
import threading
import types
from collections.abc import Iterable, Sequence
from pathlib import Path

import zmq

from tests.worker_agent.engines.wheels import load_with_stubs, stub, wheel_files

KV_FILES = ("vllm/distributed/kv_events.py", "vllm/config/kv_events.py")
_KEEP = re.compile(r"vllm/(distributed/kv_events|config/kv_events|sampling_params|v1/request"
                   r"|entrypoints/.*protocol)\.py")


def vllm_sources(version: str, cache_dir: Path | None = None) -> Path:
    """A directory holding vLLM ``version``'s files (see the module doc); downloads the
    wheel the first time."""
    return wheel_files("vllm", version, _KEEP, KV_FILES, "KVROUTE_VLLM_SOURCES", cache_dir)


def struct(cls: type, **fields: object) -> object:
    """An instance of one of a release's msgspec structs, given only the fields it has: e.g.
    0.10.2's ``BlockStored`` lacks ``lora_name``, ``extra_keys`` and ``group_idx``, whose
    values are then dropped (a release that cannot carry them loses them on the wire too)."""
    have = cls.__struct_fields__  # type: ignore[attr-defined]
    return cls(**{k: v for k, v in fields.items() if k in have})


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
        "vllm": stub("vllm"),
        "vllm.config": stub("vllm.config"),
        "vllm.config.utils": stub("vllm.config.utils", config=dataclasses.dataclass),
        "vllm.logger": stub("vllm.logger", init_logger=logging.getLogger),
        "vllm.utils": stub("vllm.utils"),
        "vllm.utils.network_utils": stub(
            "vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
            get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
            is_valid_ipv6_address=_is_ipv6, split_zmq_path=_split_zmq_path),
        "vllm.v1": stub("vllm.v1"),
        "vllm.v1.core": stub("vllm.v1.core"),
        "vllm.v1.core.kv_cache_utils": stub("vllm.v1.core.kv_cache_utils",
                                             ExternalBlockHash=bytes | int),
        "vllm.distributed": stub("vllm.distributed"),
    }
    return load_with_stubs(stubs, [
        ("vllm.config.kv_events", src / "vllm/config/kv_events.py"),
        ("vllm.distributed.kv_events", src / "vllm/distributed/kv_events.py")])


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
