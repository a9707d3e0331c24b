"""What the mirror counts, and the one way it refuses a record (:class:`Rejects`).

Whatever anyone wrote into Redis, one record never takes the mirror down: a heartbeat, feed
entry, snapshot or heartbeat key (member) that breaks the schema is rejected, counted in
:attr:`MirrorStats.rejected` by kind and reason, and logged at most once per
:data:`REJECT_LOG_S` per kind and worker.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("kvroute.router.mirror")

# Bounds of the propagation histogram (seconds); entry ids carry milliseconds.
PROPAGATION_BOUNDS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# Least seconds between two log lines about rejected records of one kind and worker.
REJECT_LOG_S = 30.0
# Most (kind, worker) pairs whose last log time is kept: garbage under many names stays bounded.
_REJECT_LOG_KEPT = 10_000


@dataclass
class MirrorStats:
    events_applied: int = 0
    snapshot_loads: int = 0
    snapshot_smembers: int = 0  # of them read by SMEMBERS: DUMP's payload another encoding
    gaps: int = 0
    # Caches held apart from their heartbeat, healed: by feed "chain", "epoch" or "seq".
    heartbeat_mismatches: Counter[str] = field(default_factory=Counter)
    malformed: int = 0
    bootstraps: int = 0
    # Records refused, by (kind, reason): redis_schema's RECORD_KINDS and REJECT_REASONS.
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)
    lag_s: float = 0.0
    last_event_at: float = field(default=0.0)
    # Feed propagation: each applied entry's age (Redis's XADD time, in its id, to now),
    # counted per bound of PROPAGATION_BOUNDS_S (the last count: beyond every bound).
    propagation: list[int] = field(default_factory=lambda: [0] * (len(PROPAGATION_BOUNDS_S) + 1))
    propagation_sum_s: float = 0.0


class Rejects:
    """Counts refused records in ``stats`` and logs them, rate-limited per kind and worker."""

    def __init__(self, stats: MirrorStats) -> None:
        self._stats = stats
        self._logged: dict[tuple[str, str], float] = {}  # (kind, worker) -> when

    def __call__(self, kind: str, reason: str, worker: str, error: object) -> None:
        self._stats.rejected[kind, reason] += 1
        self._stats.malformed += 1
        now = time.monotonic()
        if now - self._logged.get((kind, worker), -REJECT_LOG_S) < REJECT_LOG_S:
            return
        if len(self._logged) > _REJECT_LOG_KEPT:
            self._logged.clear()
        self._logged[kind, worker] = now
        log.warning(f"rejected a malformed {kind} record",
                    extra={"kv": {"worker": worker, "reason": reason, "error": f"{error}"[:300]}})
