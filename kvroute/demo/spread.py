"""The run-to-run spread of a ratio between two policies, and whether it is more than noise.

Repeat ``r`` runs both policies on fresh processes with the same requests and gives one ratio
``x_r = a_r / b_r`` (a repeat where ``b_r == 0`` gives none). Over the ``R`` ratios, with
median ``m`` and range ``[lo, hi]``::

    within noise  iff  lo <= 1 <= hi          (the repeats disagree on the direction)
                   or  |m - 1| < hi - lo      (the difference is smaller than the spread)

Otherwise the ratio is a real difference: lower (``hi < 1``) or higher (``lo > 1``). One
ratio gives no estimate of the noise, hence no verdict either way; none (every ``b_r`` 0)
gives no ratio at all.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    LOWER = "lower, beyond noise"
    HIGHER = "higher, beyond noise"
    NOISE = "within noise"
    UNKNOWN = "noise unknown (one ratio)"
    UNDEFINED = "no ratio (divides by 0)"


@dataclass(frozen=True, slots=True)
class RatioSpread:
    ratios: tuple[float, ...]  # one per repeat that has a defined ratio

    @classmethod
    def of(cls, pairs: Sequence[tuple[float, float]]) -> RatioSpread:
        """From ``(a_r, b_r)`` per repeat; ratios with ``b_r == 0`` are left out."""
        return cls(tuple(a / b for a, b in pairs if b))

    @property
    def median(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    @property
    def lo(self) -> float:
        return min(self.ratios, default=float("nan"))

    @property
    def hi(self) -> float:
        return max(self.ratios, default=float("nan"))

    @property
    def verdict(self) -> Verdict:
        if not self.ratios:
            return Verdict.UNDEFINED
        if len(self.ratios) == 1:
            return Verdict.UNKNOWN
        if self.lo <= 1.0 <= self.hi or abs(self.median - 1.0) < self.hi - self.lo:
            return Verdict.NOISE
        return Verdict.LOWER if self.hi < 1.0 else Verdict.HIGHER

    def cell(self) -> str:
        """``0.77x (0.70-0.85)``; one repeat shows the ratio alone, none shows ``-``."""
        if not self.ratios:
            return "-"
        if len(self.ratios) == 1:
            return f"{self.median:.2f}x"
        return f"{self.median:.2f}x ({self.lo:.2f}-{self.hi:.2f})"
