"""The router's routing policies and their registry: kvroute's own, and two cache-blind
baselines. The peers' policies, the replay's yardsticks, are in ``kvroute.simulations.peers``.
Each policy documents its formula where it is defined."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from kvroute.core.policies.base import (
    Policy,
    Ranking,
    RanksOnly,
    RouteQuery,
    Scored,
    rank_by_cost,
    tie_break,
)
from kvroute.core.policies.kvroute import Kvroute
from kvroute.core.policies.simple import LeastLoaded, RoundRobin
from kvroute.core.policies.spec import parameters, parse_spec, with_params

DEFAULT_POLICY = "kvroute"

PolicyFactory = Callable[[], Policy]

REGISTRY: Mapping[str, PolicyFactory] = {
    "kvroute": Kvroute,
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
}


def make_policy(spec: str, seed: int | None = None,
                registry: Mapping[str, PolicyFactory] = REGISTRY) -> Policy:
    """A fresh policy from a spec: a name in ``registry``, optionally with parameter
    overrides (``kvroute:delay=2``, see :mod:`~kvroute.core.policies.spec`). ``seed`` seeds a
    randomised policy (those with a ``seed`` parameter) unless the spec sets it. ValueError
    names the choices, or what is wrong with an override."""
    name, params = parse_spec(spec)
    try:
        factory = registry[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of: {', '.join(sorted(registry))}"
        ) from None
    policy = factory()
    if seed is not None and "seed" in parameters(policy):
        policy = dataclasses.replace(policy, seed=seed)  # type: ignore[type-var]
    return with_params(policy, params, spec)


__all__ = [
    "DEFAULT_POLICY",
    "REGISTRY",
    "Kvroute",
    "LeastLoaded",
    "Policy",
    "PolicyFactory",
    "Ranking",
    "RanksOnly",
    "RoundRobin",
    "RouteQuery",
    "Scored",
    "make_policy",
    "parameters",
    "rank_by_cost",
    "tie_break",
]
