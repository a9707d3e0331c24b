"""PortPool never hands out one port twice, and each port it hands out can be bound; a port
that cannot be bound is refused saying which and why."""

from __future__ import annotations

import socket

import pytest

from kvroute.core.grpc_util import bind, new_server
from kvroute.core.ports import PortPool, address, why_unbindable


def test_ports_are_distinct_and_free() -> None:
    pool = PortPool()
    ports = [pool.take() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_the_os_offers_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # The OS readily offers a just-closed port again; the pool must not repeat it.
    offered = iter([41000, 41000, 41000, 41001])

    class FakeSocket:
        def __init__(self, *_: object) -> None:
            self.port = next(offered)

        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def bind(self, _addr: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(socket, "socket", FakeSocket)
    pool = PortPool()
    assert [pool.take(), pool.take()] == [41000, 41001]


async def test_a_served_port_is_refused_naming_its_flag_and_a_free_one_is_picked() -> None:
    # Two servers made by new_server (async: a grpc.aio server wants a running loop): the
    # second cannot share the first's port (gRPC's default SO_REUSEPORT would let it); port
    # 0 still picks a free one for each.
    first, second = new_server(), new_server()
    port = bind(first, "127.0.0.1", 0)
    other = bind(second, "127.0.0.1", 0)
    assert port > 0 and other > 0 and other != port
    with pytest.raises(SystemExit) as refused:
        bind(new_server(), "127.0.0.1", port)
    assert str(refused.value) == (f"--port {port} (KVROUTE_PORT): address "
                                  f"127.0.0.1:{port} is already in use")
    with pytest.raises(SystemExit) as refused:
        bind(new_server(), "127.0.0.1", other, setting="metrics_port")
    assert str(refused.value).startswith(f"--metrics-port {other} (KVROUTE_METRICS_PORT)")


def test_why_a_port_cannot_be_bound_is_said() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert why_unbindable("127.0.0.1", port) == "is already in use"
    # TEST-NET-1 (RFC 5737) is no address of this host.
    assert why_unbindable("192.0.2.1", port) == "is not an address of this host"
    assert why_unbindable("no-such-host.invalid", port).startswith("cannot be resolved")
    assert address("::1", 5) == "[::1]:5" and address("127.0.0.1", 5) == "127.0.0.1:5"


def test_a_span_is_free_and_never_handed_out_again() -> None:
    pool = PortPool()
    first = pool.take_span(4)
    span = set(range(first, first + 4))
    for port in span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    later = {pool.take() for _ in range(300)} | {pool.take_span(4) for _ in range(20)}
    assert not later & span
