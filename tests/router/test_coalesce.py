from __future__ import annotations

import pytest

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
    inflight.add(first, "w", predicted, 64)  # as the router does: only predicted blocks
    assert inflight.producer(index, "w", [1, 2, 3, 4, 9], 4) is first
    assert inflight.producer(index, "w", [1, 2, 3, 4, 9], 2) is None  # block 2 is stored
    assert inflight.producer(index, "w", [1, 2, 3], 0) is None
    assert inflight.producer(index, "x", [1, 2, 3, 4], 4) is None  # another worker
    # A later request over the same blocks becomes their producer; dropping it leaves the
    # earlier one only where it alone is named.
    inflight.add(second, "w", index.predict("w", [1, 2, 3], deadline=11.0), 48)
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
    inflight.add(r, "w", index.predict("w", [5, 6, 5], deadline=1.0), 48)
    assert inflight.producer(index, "w", [5, 6], 2) is r
    inflight.drop(r)
    assert inflight.producer(index, "w", [5, 6], 2) is None and not inflight._by_key


def test_a_request_waits_only_for_a_prefill_it_gets_most_of() -> None:
    """``worth_waiting``: the blocks matched only by prediction against ``share`` of the
    tokens the producer prefills (block size 16 here)."""
    index = PrefixIndex()
    index.add("w", [1, 2])  # a system prompt the worker really holds
    fork, agent = Req(), Req()
    inflight: InflightPrefixes[Req] = InflightPrefixes(share=0.8)
    # A fork's first branch prefills a 10-block context (and its own 1-block branch): a
    # sibling matching the context gets 160 of its 176 tokens.
    inflight.add(fork, "w", index.predict("w", [1, 2, *range(10, 21)], 20.0), 176)
    assert inflight.producer(index, "w", [1, 2, *range(10, 20), 99], 12) is fork
    assert inflight.worth_waiting(fork, index, "w", [1, 2, *range(10, 20), 99], 12, 16)
    # A sibling matching only 2 of those blocks would wait out 144 tokens it does not need.
    assert not inflight.worth_waiting(fork, index, "w", [1, 2, 10, 11, 98], 4, 16)
    # An agent call shares 2 new blocks with its producer, which adds 20 of its own.
    inflight.add(agent, "x", index.predict("x", range(30, 52), 20.0), 22 * 16)
    assert not inflight.worth_waiting(agent, index, "x", [30, 31, 77], 2, 16)
    # share 0 waits for any producer (the behaviour before the gate); a dropped producer's
    # prefix is stored, so nobody waits for it.
    always: InflightPrefixes[Req] = InflightPrefixes(share=0.0)
    always.add(agent, "x", (30, 31), 22 * 16)
    assert always.worth_waiting(agent, index, "x", [30, 31, 77], 2, 16)
    always.drop(agent)
    assert not always.worth_waiting(agent, index, "x", [30, 31, 77], 2, 16)


def test_the_share_is_a_fraction() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="fraction"):
            InflightPrefixes(share=bad)
