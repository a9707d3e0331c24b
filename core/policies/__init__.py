"""Routing policies and their registry. Each policy documents its formula where it is defined."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvroute.core.policies.base import (
    Policy,
    Ranking,
    RouteQuery,
    Scored,
    rank_by_cost,
    tie_break,
)
from kvroute.core.policies.kvroute_cost import KvrouteCost
from kvroute.core.policies.kvroute_v2 import KvrouteV2
from kvroute.core.policies.peers import (
    ConsistentHashBoundedLoads,
    DynamoKvRouter,
    LlmdPrecisePrefix,
    MooncakeConductor,
    PrebleE2,
    RandomChoice,
    SglangCacheAware,
)
from kvroute.core.policies.simple import LeastLoaded, RoundRobin
from kvroute.core.policies.spec import parameters, parse_spec, with_params

DEFAULT_POLICY = "kvroute"

REGISTRY: dict[str, Callable[[], Policy]] = {
    "kvroute": KvrouteCost,
    # The derived policy (docs/policy.md), beside the default until it is shown as good.
    "kvroute_v2": KvrouteV2,
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "random": RandomChoice,
    "chwbl": ConsistentHashBoundedLoads,
    "sglang": SglangCacheAware,
    "llmd": LlmdPrecisePrefix,
    "dynamo": DynamoKvRouter,
    "preble": PrebleE2,
    "mooncake": MooncakeConductor,
    # Same-capability comparisons: with and without KV transfer between workers.
    "kvroute_fetch": lambda: KvrouteCost(transfer_cost=MooncakeConductor().transfer_cost,
                                         name="kvroute_fetch"),
    "mooncake_local": lambda: MooncakeConductor(transfer_cost=1.0, name="mooncake_local"),
}


def make_policy(spec: str, seed: int | None = None) -> Policy:
    """A fresh policy from a spec: a registry name, optionally with parameter overrides
    (``kvroute:hold=2``, see :mod:`~kvroute.core.policies.spec`). ``seed`` seeds a randomised
    policy (those with a ``seed`` parameter) unless the spec sets it. ValueError names the
    choices, or what is wrong with an override."""
    name, params = parse_spec(spec)
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of: {', '.join(sorted(REGISTRY))}"
        ) from None
    policy = factory()
    if seed is not None and "seed" in parameters(policy):
        policy = dataclasses.replace(policy, seed=seed)  # type: ignore[type-var]
    return with_params(policy, params, spec)


__all__ = [
    "DEFAULT_POLICY",
    "REGISTRY",
    "ConsistentHashBoundedLoads",
    "DynamoKvRouter",
    "KvrouteCost",
    "KvrouteV2",
    "LeastLoaded",
    "LlmdPrecisePrefix",
    "MooncakeConductor",
    "Policy",
    "PrebleE2",
    "RandomChoice",
    "Ranking",
    "RoundRobin",
    "RouteQuery",
    "Scored",
    "SglangCacheAware",
    "make_policy",
    "parameters",
    "rank_by_cost",
    "tie_break",
]
