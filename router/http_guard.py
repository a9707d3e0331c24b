"""Connection limits in front of the HTTP server's protocol: a header-read timeout and a cap
on each client address's open connections.

aiohttp reads a request's headers for as long as the client takes and keeps every connection
it is given, so 500 clients sending one header byte a minute hold 500 connections until the
file-descriptor limit. :class:`ConnectionGuard` wraps the server's protocol factory:

* a connection whose first request's headers (up to the blank line) have not arrived
  ``header_timeout_s`` after it opened is closed;
* a connection from an address that already holds ``max_per_client`` is closed as it opens.

Both are counted (:class:`GuardStats`). Idle keep-alive connections are aiohttp's own
(``keepalive_timeout``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_END_OF_HEADERS = b"\r\n\r\n"


@dataclass
class GuardStats:
    open: Counter[str] = field(default_factory=Counter)  # client address -> connections
    refused: int = 0  # connections closed at once: their address was at its cap
    timed_out: int = 0  # connections closed: headers not in within the timeout


@dataclass
class ConnectionGuard:
    """A protocol factory: ``inner``'s protocols, each behind a :class:`_Guarded`."""

    inner: Callable[[], asyncio.BaseProtocol]
    header_timeout_s: float
    max_per_client: int
    stats: GuardStats = field(default_factory=GuardStats)

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self, self.inner())


class _Guarded(asyncio.Protocol):
    def __init__(self, guard: ConnectionGuard, inner: Any) -> None:
        self._guard = guard
        self._inner = inner
        self._client: str | None = None  # counted against its cap while set
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, for a blank line split across reads
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self._guard
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if g.stats.open[client] >= g.max_per_client:
            g.stats.refused += 1
            transport.abort()
            return
        g.stats.open[client] += 1
        self._client = client
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(g.header_timeout_s, self._expire)
        self._inner.connection_made(transport)

    def _expire(self) -> None:
        self._timer = None
        self._guard.stats.timed_out += 1
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if _END_OF_HEADERS in seen:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()  # type: ignore[no-any-return]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client is None:
            return  # refused: the inner protocol never saw it
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        open_ = self._guard.stats.open
        open_[self._client] -= 1
        if open_[self._client] <= 0:
            del open_[self._client]
        self._client = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GuardCollector(Collector):
    """``kvroute_router_http_connections_closed_total{reason}`` and the open connections."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard

    def collect(self) -> Iterator[Any]:
        st = self._guard.stats
        closed = CounterMetricFamily(
            "kvroute_router_http_connections_closed",
            "HTTP connections the front closed: client_cap = the client address already held "
            "--http-max-connections-per-client, header_timeout = its request headers were "
            "not in within --http-header-timeout-s", labels=["reason"])
        closed.add_metric(["client_cap"], st.refused)
        closed.add_metric(["header_timeout"], st.timed_out)
        yield closed
        yield GaugeMetricFamily("kvroute_router_http_connections",
                                "HTTP connections open on the front",
                                value=sum(st.open.values()))
