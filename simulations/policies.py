"""The policies a replay can run: the router's (``kvroute.core.policies.REGISTRY``) and the
peers' (:mod:`kvroute.simulations.peers`), by name."""

from __future__ import annotations

from collections.abc import Mapping

from kvroute.core.policies import REGISTRY, Policy, PolicyFactory, make_policy
from kvroute.simulations.peers import (
    ConsistentHashBoundedLoads,
    DynamoKvRouter,
    LlmdPrecisePrefix,
    MooncakeConductor,
    PrebleE2,
    RandomChoice,
    SglangCacheAware,
)

PEERS: Mapping[str, PolicyFactory] = {
    "random": RandomChoice,
    "chwbl": ConsistentHashBoundedLoads,
    "sglang": SglangCacheAware,
    "llmd": LlmdPrecisePrefix,
    "dynamo": DynamoKvRouter,
    "preble": PrebleE2,
    "mooncake_local": MooncakeConductor,
}

REPLAY_REGISTRY: Mapping[str, PolicyFactory] = {**REGISTRY, **PEERS}


def make_replay_policy(spec: str, seed: int | None = None) -> Policy:
    """:func:`~kvroute.core.policies.make_policy` over :data:`REPLAY_REGISTRY`."""
    return make_policy(spec, seed, REPLAY_REGISTRY)
