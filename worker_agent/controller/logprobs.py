"""Log-probabilities of a program's generated tokens, from the engine's raw logits.

:class:`LogitsTap` chains onto an engine's ``logits_observer`` (the tiny engine has one) and
hands each subscribed request's logits to its subscriber, keyed by output step; other
requests' logits pass through to whatever observer was there before. :func:`token_logprob`
is the model's log-softmax of the chosen token (temperature 1, before any mask): what a
branch's ``logprob`` sums. An engine without logits reports 0 (``logits`` None)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt


class LogitsTap:
    """Chains onto ``engine.logits_observer`` and hands each subscribed request's logits to
    its subscriber (``step -> logits``); other requests pass through untouched."""

    def __init__(self, engine: Any) -> None:
        self._prev = engine.logits_observer
        self._subs: dict[str, dict[int, npt.NDArray[np.float32]]] = {}
        engine.logits_observer = self._observe

    def _observe(self, request_id: str, step: int, logits: npt.NDArray[np.float32]) -> None:
        if self._prev is not None:
            self._prev(request_id, step, logits)
        sub = self._subs.get(request_id)
        if sub is not None:
            sub[step] = logits

    @contextlib.contextmanager
    def subscribe(self, request_id: str) -> Iterator[dict[int, npt.NDArray[np.float32]]]:
        """While open, ``request_id``'s logits land in the yielded dict by output step (the
        subscriber pops what it reads)."""
        pending: dict[int, npt.NDArray[np.float32]] = {}
        self._subs[request_id] = pending
        try:
            yield pending
        finally:
            del self._subs[request_id]


def token_logprob(logits: npt.NDArray[np.float32] | None, token: int) -> float:
    """``log softmax(logits)[token]``; 0.0 when there are no logits."""
    if logits is None:
        return 0.0
    # float32 throughout: ~4x cheaper than float64 on a 50k vocabulary, ample for ranking.
    top = logits.max()
    return float(logits[token] - top - np.log(np.exp(logits - top).sum(dtype=np.float32)))
