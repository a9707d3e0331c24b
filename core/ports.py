"""Ports: free loopback ones for the processes one run starts (the demo, the tests), and the
clear error a server's port it cannot listen on ends it with."""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.core.settings import ENV_PREFIX, flag

_WHY = {
    errno.EADDRINUSE: "is already in use",
    errno.EACCES: "is not permitted (a port below 1024 needs privileges)",
    errno.EADDRNOTAVAIL: "is not an address of this host",
}


def address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def why_unbindable(host: str, port: int) -> str:
    """Why a listener on ``host:port`` fails, in words ("is already in use"), found by binding
    it as gRPC and the metrics server do (SO_REUSEADDR on, so a closed connection's TIME_WAIT
    does not count, SO_REUSEPORT off). For a bind that failed without saying why (gRPC)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot be resolved ({exc.strerror})"
    for family, kind, proto, _name, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
        except OSError as exc:
            return describe(exc)
    return "could not be bound"  # free again now, or refused for a reason a bind cannot see


def describe(exc: OSError) -> str:
    """A failed bind's reason, in words."""
    return _WHY.get(exc.errno or 0, f"could not be bound ({exc.strerror or exc})")


def refuse_port(setting: str, host: str, port: int, why: str) -> SystemExit:
    """The error a server ends with when config field ``setting``'s port cannot be listened
    on: ``--port 50061 (KVROUTE_PORT): address 127.0.0.1:50061 is already in use``."""
    return SystemExit(f"{flag(setting)} {port} ({ENV_PREFIX}{setting.upper()}): address "
                      f"{address(host, port)} {why}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class PortPool:
    """Hands out free 127.0.0.1 ports, never the same one twice.

    A port is only reserved once its server binds it, so two ports picked before either
    binds can be the same number (the OS reuses a just-closed one), and the second of two
    servers given it would fail to start. Remembering every port handed out rules that out.
    """

    _taken: set[int] = field(default_factory=set)

    def take(self) -> int:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in self._taken:
                self._taken.add(port)
                return port

    def take_cluster(self) -> int:
        """A free port whose Redis Cluster bus port (port + 10000) is valid and free too."""
        return self._take_with((10000,), "no free port pair for a cluster node")

    def take_span(self, n: int) -> int:
        """A free port p with p+1 .. p+n-1 free too, all remembered as handed out: for a
        server that offsets its ports (SGLang's data-parallel ranks: port + rank)."""
        return self._take_with(range(1, n), f"no {n} free ports in a row")

    def _take_with(self, offsets: Sequence[int], fail: str) -> int:
        """A port from :meth:`take` whose ports at ``offsets`` are valid, not handed out and
        bindable now; those are remembered as handed out too."""
        for _ in range(1000):
            p = self.take()
            others = [p + k for k in offsets]
            if all(q <= 65535 and q not in self._taken and _bindable(q) for q in others):
                self._taken.update(others)
                return p
        raise RuntimeError(fail)
