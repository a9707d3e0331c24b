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
    predicted = index.predict("w", [1, 2, 3, 4], deadline=10.0)
    assert predicted == (3, 4)
    inflight.add(first, "w", predicted)  # as the router does: only predicted blocks
    assert inflight.producer(index, "w", [1, 2, 3, 4, 9], 4) is first
    assert inflight.producer(index, "w", [1, 2, 3, 4, 9], 2) is None  # block 2 is stored
    assert inflight.producer(index, "w", [1, 2, 3], 0) is None
    assert inflight.producer(index, "x", [1, 2, 3, 4], 4) is None  # another worker
    # A later request over the same blocks becomes their producer; dropping it leaves the
    # earlier one only where it alone is named.
    inflight.add(second, "w", index.predict("w", [1, 2, 3], deadline=11.0))
    assert inflight.producer(index, "w", [1, 2, 3], 3) is second
    inflight.drop(second)
    assert inflight.producer(index, "w", [1, 2, 3], 3) is None
    assert inflight.producer(index, "w", [1, 2, 3, 4], 4) is first
    inflight.drop(first)
    inflight.drop(first)  # idempotent
    assert len(inflight) == 0 and inflight.producer(index, "w", [1, 2, 3, 4], 4) is None
    assert not inflight._by_key  # no worker's map is left behind, empty or not


def test_a_prompt_naming_a_key_twice_adds_and_drops_cleanly() -> None:
    inflight: InflightPrefixes[Req] = InflightPrefixes()
    index = PrefixIndex()
    r = Req()
    inflight.add(r, "w", index.predict("w", [5, 6, 5], deadline=1.0))
    assert inflight.producer(index, "w", [5, 6], 2) is r
    inflight.drop(r)
    assert inflight.producer(index, "w", [5, 6], 2) is None and not inflight._by_key
