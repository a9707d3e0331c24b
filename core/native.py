"""Which of the optional C builds of the routing hot path are present (setup.py builds them
when a compiler is there; each has a pure-Python fallback with the same results)."""

from __future__ import annotations

from kvroute.core import blocks, holders, wire
from kvroute.core.policies import columns


def native_builds() -> dict[str, bool]:
    """``{"chainhash": ..., "holders": ..., "wire": ..., "costs": ...}``: key hashing, the
    index's holder map, token ids off the wire, the policy's sums over load columns."""
    return {"chainhash": blocks.NATIVE_AVAILABLE, "holders": holders.NATIVE_AVAILABLE,
            "wire": wire.NATIVE_AVAILABLE, "costs": columns.NATIVE}
