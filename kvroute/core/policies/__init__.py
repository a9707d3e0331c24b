"""Routing policies and their registry. Each policy documents its formula where it is defined."""

from __future__ import annotations

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

DEFAULT_POLICY = "kvroute"

REGISTRY: dict[str, Callable[[], Policy]] = {
    "kvroute": KvrouteCost,
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


def make_policy(name: str) -> Policy:
    """A fresh policy object by registry name; ValueError names the choices."""
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose one of: {', '.join(sorted(REGISTRY))}"
        ) from None


__all__ = [
    "DEFAULT_POLICY",
    "REGISTRY",
    "ConsistentHashBoundedLoads",
    "DynamoKvRouter",
    "KvrouteCost",
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
    "rank_by_cost",
    "tie_break",
]
