"""The HTTP front's connection guard (router/http_guard.py) against raw sockets on a real
router: a header-read timeout and a cap per client address."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp

from tests.support import free_port


async def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """True if the router closes ``sock`` within ``within_s``."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        data = await asyncio.wait_for(loop.sock_recv(sock, 1024), within_s)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return data == b""


async def test_slow_headers_time_out_and_a_clients_connections_are_capped(cluster) -> None:
    r = await cluster.router(http_port=free_port(), tokenizer="byte", vocab_size=258,
                             http_header_timeout_s=0.5, http_max_connections_per_client=4)
    port = r.http_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    slow = idle[0]
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
    t0 = time.monotonic()
    fifth = socket.create_connection(("127.0.0.1", port))
    assert await closed_by_peer(fifth, 0.3), "the 5th connection of one client is closed"
    for s in idle:
        assert await closed_by_peer(s, 2.0)
    assert 0.4 <= time.monotonic() - t0 <= 2.0
    guard = r.http.guard
    assert guard is not None
    assert (guard.stats.refused, guard.stats.timed_out) == (1, 4)
    assert not guard.stats.open
    # Whole requests are untouched, and keep-alive connections outlive the header timeout.
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                assert resp.status == 200
            await asyncio.sleep(0.3)
    for s in (*idle, fifth):
        s.close()
