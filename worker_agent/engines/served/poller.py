"""A server's Prometheus ``/metrics``, polled in the background (never per request), read
into :class:`ServerMetrics` by the server's own parser."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvroute.agent.metrics_poll")

_SAMPLE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*[{ ]")


def families(text: str, names: Collection[str]) -> Iterator[Metric]:
    """The metric families ``names`` of ``text`` (Prometheus exposition), parsed from their
    sample lines only. A server exposes hundreds of lines (vLLM ~650, 57 KB, on a CPU
    build) that the pure-Python parser takes ~10 ms to read whole, on the agent's event
    loop at every poll; the few read here take well under 1 ms. ValueError for a named
    metric's malformed line."""
    heads = tuple(name + end for name in names for end in ("{", " "))
    lines = text.splitlines()
    kept = [line for line in lines if line.startswith(heads)]
    if not kept:
        # Still say so when the text is no exposition at all (a wrong URL's HTML page).
        first = next((line for line in lines if line.strip()), "")
        if first and not (first.startswith("#") or _SAMPLE.match(first)):
            raise ValueError(f"not Prometheus exposition text: {first[:80]!r}")
        return iter(())
    return text_string_to_metric_families("\n".join(kept) + "\n")


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    """What a server's ``/metrics`` says of its load: its engine's ``load()`` reads it (with
    its own counts) into the one load record, ``core.load.EngineLoad``."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    """KV-cache usage in [0, 1]."""
    num_gpu_blocks: int | None = None
    """KV-cache capacity in blocks of the agent's size."""


@dataclass
class MetricsStats:
    polls: int = 0
    errors: int = 0
    up: bool = False
    last_ok: float = 0.0


class MetricsPoller:
    """Keeps :attr:`latest` fresh by polling ``{base_url}/metrics`` every ``interval_s``."""

    def __init__(self, base_url: str, interval_s: float = 0.5, timeout_s: float = 2.0,
                 on_poll: Callable[[], None] | None = None,
                 parse: Callable[[str], ServerMetrics] | None = None) -> None:
        """``on_poll``: called after every poll, failed or not (the engine's liveness);
        ``parse``: the exposition text -> :class:`ServerMetrics` (ValueError if not
        Prometheus text); default: nothing read."""
        self._parse = parse or (lambda text: ServerMetrics())
        self._url = base_url.rstrip("/") + "/metrics"
        self._on_poll = on_poll
        self._interval = interval_s
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self.latest = ServerMetrics()
        self.stats = MetricsStats()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="metrics-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._http.aclose()

    async def poll_once(self) -> None:
        st = self.stats
        st.polls += 1
        try:
            resp = await self._http.get(self._url)
            resp.raise_for_status()
            self.latest = self._parse(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            st.errors += 1
            if st.up or st.polls == 1:
                log.warning("cannot read the server's metrics; keeping the last load",
                            extra={"kv": {"url": self._url, "error": repr(exc)[:200]}})
            st.up = False
            return
        if not st.up:
            log.info("reading the server's metrics", extra={"kv": {"url": self._url}})
        st.up = True
        st.last_ok = time.monotonic()

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            if self._on_poll is not None:
                self._on_poll()
            await asyncio.sleep(self._interval)
