from __future__ import annotations

from kvroute.core.index import PrefixIndex
from kvroute.router.coalesce import InflightPrefixes


class Req:
    """A stand-in request: identity only (requests need not be hashable)."""

    __hash__ = None  # type: ignore[assignment]


def test_producer_is_the_request_whose_prefill_stores_the_predicted_block() -> None:
    index = PrefixIndex()
    inflight: InflightPrefixes[Req] = InflightPrefixes()
    first, second = Req(), Req()
    index.add("w", [1, 2])  # really stored
    index.predict("w", [1, 2, 3, 4], deadline=10.0)
    inflight.add(first, "w", [1, 2, 3, 4])
    assert inflight.producer(index, "w", [1, 2, 3, 4, 9], 4) is first
    assert inflight.producer(index, "w", [1, 2, 3, 4, 9], 2) is None  # block 2 is stored
    assert inflight.producer(index, "w", [1, 2, 3], 0) is None
    assert inflight.producer(index, "x", [1, 2, 3, 4], 4) is None  # another worker
    # A later request over the same blocks becomes their producer; dropping it leaves the
    # earlier one only where it alone is named.
    inflight.add(second, "w", [1, 2, 3])
    assert inflight.producer(index, "w", [1, 2, 3], 3) is second
    inflight.drop(second)
    assert inflight.producer(index, "w", [1, 2, 3], 3) is None
    assert inflight.producer(index, "w", [1, 2, 3, 4], 4) is first
    inflight.drop(first)
    inflight.drop(first)  # idempotent
    assert len(inflight) == 0 and inflight.producer(index, "w", [1, 2, 3, 4], 4) is None
