"""The kvroute policy's sums over load columns (core/policies/columns.py): the C kernel
gives numpy's floats, bit for bit, and refuses arrays it cannot read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.load import WorkerLoad
from kvroute.core.load_table import LoadTable
from kvroute.core.policies import columns
from kvroute.core.policies.base import RouteQuery
from kvroute.core.policies.columns import (
    cached_columns,
    kth_smallest,
    queued_waits,
    worker_costs,
)
from tests.core.test_policy_kvroute import loads_st

pytestmark = pytest.mark.skipif(not columns.NATIVE, reason="the C kernel was not built "
                                "(no compiler at install): numpy alone ranks")


@settings(max_examples=300, deadline=None)
@given(loads=st.lists(loads_st, min_size=1, max_size=70),
       cached=st.lists(st.integers(0, 12_000), min_size=70, max_size=70),
       prompt=st.integers(1, 12_000), attn=st.sampled_from([0.0, 1e-5, 3e-4]),
       decode=st.floats(0, 50), k=st.floats(0, 5), reuse=st.sampled_from([0.0, 0.5, 1.0]))
def test_the_kernel_gives_numpys_floats(loads: list[WorkerLoad], cached: list[int],
                                        prompt: int, attn: float, decode: float, k: float,
                                        reuse: float) -> None:
    table = LoadTable()
    for i, ld in enumerate(loads):
        table[f"w{i}"] = ld
    _, _, d = table.columns()
    waits = queued_waits(d, attn, native=True)
    assert waits.tobytes() == queued_waits(d, attn, native=False).tobytes()
    c = np.minimum(np.array(cached[:len(loads)], dtype=float), prompt)
    args = dict(p=prompt, bs=16, attn=attn, decode=decode, k=k,
                wait_avg=float(waits.sum() / len(loads)), reuse=reuse, top=float(c.max()))
    assert worker_costs(waits, d, c, native=True, **args).tobytes() == \
        worker_costs(waits, d, c, native=False, **args).tobytes()


def test_arrays_it_cannot_read_are_refused() -> None:
    from kvroute.core import _costs

    ok, out = np.ones(4), np.empty(4)
    with pytest.raises(TypeError, match="float64"):
        _costs.queued(ok, np.ones(4, dtype=np.float32), ok, 0.0, out)
    with pytest.raises(ValueError, match="one length"):
        _costs.queued(ok, np.ones(5), ok, 0.0, out)
    with pytest.raises(ValueError):  # read-only: not written
        _costs.queued(ok, ok, ok, 0.0, np.frombuffer(bytes(32)))
    with pytest.raises(ValueError):  # not contiguous
        _costs.queued(ok, ok, np.ones(8)[::2], 0.0, out)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from([f"w{i}" for i in range(12)]),
                       st.integers(1, 40), max_size=12),
       st.integers(1, 9), st.integers(1, 600))
def test_cached_columns_are_each_rows_cached_tokens(matched: dict[str, int], rows_kept: int,
                                                    prompt: int) -> None:
    """By row, each worker's ``cached_tokens`` (capped at the prompt); a match of a worker
    with no row (not a candidate) is left out, wherever it stands in the match."""
    rows = {f"w{i}": rows_kept - 1 - i for i in range(rows_kept)}  # rows out of name order
    query = RouteQuery(prompt, 16, matched, {})
    want = np.zeros(rows_kept)
    for w, i in rows.items():
        want[i] = query.cached_tokens(w)
    for native in (True, False):
        assert cached_columns(query, rows, rows_kept, native).tolist() == want.tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, 2.5, 7.0, 1e9, float("inf")]) | st.floats(0, 1e6),
                min_size=1, max_size=200), st.integers(0, 63))
def test_the_kth_smallest_is_numpys(values: list[float], k: int) -> None:
    """Ties, infinities and every k the ranking's head uses: as ``np.partition``."""
    arr = np.array(values)
    k = k % len(values)
    assert kth_smallest(arr, k, native=True) == kth_smallest(arr, k, native=False)


def test_bad_kernel_arguments_are_refused() -> None:
    from kvroute.core import _costs

    with pytest.raises(ValueError, match="out of range"):
        _costs.kth(np.ones(4), 4)
    with pytest.raises(ValueError, match="out of range"):
        _costs.kth(np.ones(100), 64)
    with pytest.raises(TypeError):
        _costs.cached([("w0", 1)], {"w0": 0}, np.zeros(1), 16.0, 9.0)
    with pytest.raises(IndexError, match="row 5 of 2"):
        _costs.cached({"w0": 1}, {"w0": 5}, np.zeros(2), 16.0, 9.0)
    with pytest.raises(TypeError):
        _costs.cached({"w0": "x"}, {"w0": 0}, np.zeros(2), 16.0, 9.0)
