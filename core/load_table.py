"""The router's loads by worker with their columns: what a policy reads over many workers
as arrays (``kvroute.core.policies.kvroute``). Apart from :mod:`kvroute.core.load` so that
an agent, which sends loads but ranks nothing, does not import numpy."""

from __future__ import annotations

import numpy as np

from kvroute.core.load import WorkerLoad


class Column:
    """The columns of :class:`LoadTable`: a :class:`WorkerLoad` field (or derived value) each,
    as float64. The three a ranking averages are adjacent, to be summed as one block."""

    PENDING, CONTEXT, BUDGET, BUSY, CAPACITY, CACHED, ARRIVAL_RATE, PREFILL_RATE, WAITING = \
        range(9)
    COUNT = 9


class LoadTable(dict[str, WorkerLoad]):
    """Loads by worker, as a dict, with the fields a policy reads for every worker kept
    beside it in columns (:class:`Column`), so a ranking over many workers reads arrays
    instead of thousands of attributes.

    Invariant: position ``i`` of :meth:`columns` is the ``i``-th key's load, in the dict's order
    (insertion order: a key set again keeps its row, a key removed and added again goes
    last). Only ``[]=``, ``del``, ``pop`` and ``clear`` change it (the registry uses no other
    mutation)."""

    __slots__ = ("_data", "_ids", "_names", "_rows")

    def __init__(self) -> None:
        super().__init__()
        # One row per column, one column per worker: each field's values contiguous.
        self._data = np.zeros((Column.COUNT, 16))
        self._names: list[str] = []
        self._rows: dict[str, int] = {}
        self._ids: np.ndarray | None = None  # _names as an array, made when first read

    def __setitem__(self, worker: str, load: WorkerLoad) -> None:
        i = self._rows.get(worker)
        if i is None:
            i = self._rows[worker] = len(self._names)
            self._names.append(worker)
            self._ids = None
            if i == self._data.shape[1]:
                self._data = np.concatenate([self._data, np.zeros_like(self._data)], axis=1)
        self._data[:, i] = (load.pending_prefill_tokens, load.pending_prefill_context,
                         load.max_batched_tokens, load.busy, load.capacity_blocks,
                         load.cached_blocks, load.arrival_rate, load.prefill_rate, load.waiting)
        super().__setitem__(worker, load)

    def __delitem__(self, worker: str) -> None:
        super().__delitem__(worker)
        i = self._rows.pop(worker)
        n = len(self._names)
        self._data[:, i:n - 1] = self._data[:, i + 1:n]
        del self._names[i]
        self._ids = None
        for w in self._names[i:]:
            self._rows[w] -= 1

    _MISSING = object()

    def pop(self, worker: str, default: object = _MISSING) -> WorkerLoad:  # type: ignore[override]
        if worker in self:
            load = self[worker]
            del self[worker]
            return load
        if default is LoadTable._MISSING:
            raise KeyError(worker)
        return default  # type: ignore[return-value]

    def clear(self) -> None:
        super().clear()
        self._names.clear()
        self._rows.clear()
        self._ids = None

    def columns(self) -> tuple[np.ndarray, dict[str, int], np.ndarray]:
        """The workers in the dict's order (an array of their names), each one's position,
        and the columns: ``columns[Column.X][i]`` is the ``i``-th worker's X (views: read
        them, do not keep or change them)."""
        if self._ids is None:
            self._ids = np.array(self._names, dtype=object)
        return self._ids, self._rows, self._data[:, :len(self._names)]
