"""Trust, but verify, what workers publish: a worker whose engine keeps reporting far fewer
cached tokens than its published blocks promised is demoted.

A worker that claims blocks it does not hold (a bug, a misconfiguration, a forged feed entry
in its name) draws traffic it then serves cold. At each request's end the router compares the
cached tokens the index promised on the worker that served it (its *confirmed* blocks at the
decision, predictions left out, capped as an engine counts: never the prompt's last token)
with the ``cached_tokens`` its engine reported. Per worker, both are smoothed (an exponential
average over about ``1/alpha`` requests); once ``min_requests`` promised something and the
shortfall ``1 - reported/promised`` is at least ``max_shortfall``, the worker is *demoted*:
for ``demote_s`` its index matches are left out of every decision (it is routed by load, as
a worker with no cache), then believed again, and demoted again if it still falls short.
Requests that promised nothing teach nothing (a cold request's 0 is no evidence either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Tally:
    promised: float = 0.0
    reported: float = 0.0
    n: int = 0


@dataclass(slots=True)
class ClaimAudit:
    min_requests: int = 8
    max_shortfall: float = 0.5
    alpha: float = 0.2
    _tallies: dict[str, _Tally] = field(default_factory=dict)

    def observe(self, worker: str, promised: int, reported: int) -> float | None:
        """Record one request's figures; the worker's smoothed shortfall when it is to be
        demoted now (its tally then starts over), else None."""
        if promised <= 0:
            return None
        t = self._tallies.setdefault(worker, _Tally())
        a = self.alpha if t.n else 1.0
        t.promised += a * (promised - t.promised)
        t.reported += a * (min(reported, promised) - t.reported)
        t.n += 1
        shortfall = 1.0 - t.reported / t.promised
        if t.n >= self.min_requests and shortfall >= self.max_shortfall:
            del self._tallies[worker]
            return shortfall
        return None

    def forget(self, worker: str) -> None:
        self._tallies.pop(worker, None)


def promised_tokens(confirmed_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """What ``confirmed_blocks`` leading blocks should save an engine: whole blocks short of
    the prompt's last token, which every engine computes."""
    return min(confirmed_blocks * block_size, (prompt_tokens - 1) // block_size * block_size)
