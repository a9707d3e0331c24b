"""PortPool never hands out one port twice, and each port it hands out can be bound."""

from __future__ import annotations

import socket

import pytest

from kvroute.core.ports import PortPool


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
