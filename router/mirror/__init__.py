"""The router's mirror of the cluster's cache state in Redis (:class:`IndexMirror`)."""

from kvroute.router.mirror.mirror import IndexMirror
from kvroute.router.mirror.stats import PROPAGATION_BOUNDS_S, MirrorStats

__all__ = ["PROPAGATION_BOUNDS_S", "IndexMirror", "MirrorStats"]
