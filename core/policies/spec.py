"""Policy specs: a registry name with parameter overrides, ``kvroute:hold=2:batch_weight=1``.

The same string selects a policy everywhere (``kvroute router --policy``, ``kvroute replay
--policies``, the Helm chart's ``router.policy``), so a variant that wins a replay of a user's
own traffic is deployed by pasting its name. Parameters are the policy dataclass's public
fields (``kvroute policies`` lists them with their defaults); every value is checked against
the field's type and must be a finite number >= 0 (policies check their own ranges further in
``__post_init__``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TypeVar

P = TypeVar("P")

SEPARATOR = ":"


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name:k=v:k2=v2"`` -> ``("name", {"k": "v", "k2": "v2"})``; ValueError on a
    malformed override or a parameter given twice."""
    name, *items = (part.strip() for part in spec.strip().split(SEPARATOR))
    params: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"policy {spec!r}: expected {name}{SEPARATOR}PARAM=VALUE, got "
                             f"{item!r}")
        if key in params:
            raise ValueError(f"policy {spec!r}: {key} given twice")
        params[key] = value
    return name, params


def parameters(policy: object) -> dict[str, object]:
    """A policy's tunable parameters and their current values (public dataclass fields
    other than its name); empty for a policy that is not a dataclass."""
    if not dataclasses.is_dataclass(policy):
        return {}
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)
            if f.init and f.name != "name" and not f.name.startswith("_")}


def _convert(spec: str, key: str, text: str, current: object) -> int | float:
    kind = type(current)
    value: int | float | None = None
    if kind in (int, float):
        with contextlib.suppress(ValueError):
            value = kind(text)
    if value is None:
        what = {int: "a whole number", float: "a number"}.get(kind, kind.__name__)
        raise ValueError(f"policy {spec!r}: {key} takes {what}, got {text!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"policy {spec!r}: {key} must be a finite number >= 0, got {text!r}")
    return value


def with_params(policy: P, params: dict[str, str], spec: str) -> P:
    """A copy of ``policy`` with ``params`` (strings, as parsed) set, named ``spec`` so that
    reports tell variants apart; ValueError names an unknown parameter and the known ones."""
    if not params:
        return policy
    known = parameters(policy)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"policy {spec!r}: no parameter {', '.join(unknown)}; "
                         f"{parse_spec(spec)[0]} takes: {', '.join(known) or 'none'}")
    typed = {k: _convert(spec, k, v, known[k]) for k, v in params.items()}
    name = SEPARATOR.join([parse_spec(spec)[0], *(f"{k}={v}" for k, v in params.items())])
    try:
        return dataclasses.replace(policy, **typed, name=name)  # type: ignore[type-var]
    except ValueError as exc:  # the policy's own range checks
        raise ValueError(f"policy {spec!r}: {exc}") from None
