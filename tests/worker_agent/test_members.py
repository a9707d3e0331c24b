"""Agents keep the workers set to live workers (against a real redis-server)."""

from __future__ import annotations

from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import RedisKeys
from kvroute.worker_agent.members import prune_dead_members

KEYS = RedisKeys("default")


async def test_only_members_with_neither_heartbeat_nor_meta_are_pruned(redis_server) -> None:
    """A live worker (heartbeat), one whose engine cannot serve (meta, no heartbeat: its state
    has not expired yet) and one that just beat (heartbeat, no state yet) stay; a dead one
    (both expired) and a member that is no worker name go."""
    c = redis_server.client()
    c.set(KEYS.heartbeat("live"), "{}", px=5000)
    c.hset(KEYS.meta("live"), mapping={"epoch": "e", "seq": 1})
    c.hset(KEYS.meta("stalled"), mapping={"epoch": "e", "seq": 1})
    c.set(KEYS.heartbeat("new"), "{}", px=5000)
    c.sadd(KEYS.workers, "live", "stalled", "new", "dead", b"\xff", "bad name*")
    r = connect(redis_server.url)
    try:
        pruned = await prune_dead_members(r, KEYS)
        assert pruned.members == 6
        assert sorted(pruned.removed) == sorted(["dead", repr(b"\xff"), repr(b"bad name*")])
        assert c.smembers(KEYS.workers) == {b"live", b"stalled", b"new"}
        again = await prune_dead_members(r, KEYS)
        assert again.removed == () and again.members == 3
    finally:
        await r.aclose()
