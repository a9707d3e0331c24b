"""Opening Redis connections from a URL, with timeouts suited to a router's hot loop.

``redis://`` / ``rediss://`` / ``unix://`` open a single-node client; ``redis+cluster://`` and
``rediss+cluster://`` (any one node of the cluster) open a Redis Cluster client. Every key
of one model shares a hash tag (:mod:`kvroute.core.redis_schema`), so each transaction
kvroute runs touches one slot and works unchanged on a cluster.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ClusterError, RedisClusterException

# Errors that mean "Redis is unreachable or misbehaving", as opposed to programming errors.
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    aioredis.ConnectionError,
    aioredis.TimeoutError,
    aioredis.ResponseError,
    ClusterError,
    RedisClusterException,
    OSError,
)

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

RedisClient = aioredis.Redis | aioredis.RedisCluster


def connect(url: str, *, block_timeout_s: float = 0.0) -> RedisClient:
    """A client for ``url``. Commands fail fast rather than hang.

    ``block_timeout_s`` leaves room for blocking reads (XREAD BLOCK) under the socket timeout.
    """
    timeouts = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0 + block_timeout_s}
    scheme, sep, rest = url.partition("://")
    if sep and scheme in CLUSTER_SCHEMES:
        return aioredis.RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}",
                                              **timeouts)
    return aioredis.Redis.from_url(url, health_check_interval=0, retry_on_timeout=False,
                                   **timeouts)
