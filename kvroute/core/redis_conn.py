"""Opening Redis connections from a URL, with timeouts suited to a router's hot loop."""

from __future__ import annotations

import redis.asyncio as aioredis

# Errors that mean "Redis is unreachable or misbehaving", as opposed to programming errors.
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    aioredis.ConnectionError,
    aioredis.TimeoutError,
    aioredis.ResponseError,
    OSError,
)


def connect(url: str, *, block_timeout_s: float = 0.0) -> aioredis.Redis:
    """A client for ``url`` (redis:// or unix://). Commands fail fast rather than hang.

    ``block_timeout_s`` leaves room for blocking reads (XREAD BLOCK) under the socket timeout.
    """
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=2.0,
        socket_timeout=5.0 + block_timeout_s,
        health_check_interval=0,
        retry_on_timeout=False,
    )
