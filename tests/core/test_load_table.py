"""The router's loads with their columns: a dict whose rows follow it."""

from __future__ import annotations

import pytest

from kvroute.core.load import WorkerLoad
from kvroute.core.load_table import Column, LoadTable


def test_a_load_table_is_a_dict_with_its_columns_in_step() -> None:
    table = LoadTable()
    for i in range(40):  # past the first allocation of rows
        table[f"w{i}"] = WorkerLoad(pending_prefill_tokens=i, running=1, inflight=i % 3)
    del table["w0"]
    assert table.pop("w5").pending_prefill_tokens == 5
    assert table.pop("nobody", None) is None
    with pytest.raises(KeyError):
        table.pop("nobody")
    table["w5"] = WorkerLoad(pending_prefill_tokens=500)
    names, rows, d = table.columns()
    assert list(names) == list(table)
    assert [rows[w] for w in names] == list(range(len(names)))
    assert d[Column.PENDING].tolist() == [ld.pending_prefill_tokens
                                             for ld in table.values()]
    assert d[Column.BUSY].tolist() == [ld.busy for ld in table.values()]
    table.clear()
    assert len(table.columns()[0]) == table.columns()[2].shape[1] == 0
