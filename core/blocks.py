"""The block-key scheme: token ids -> chained 64-bit keys. One source of truth.

Contract (version 1), shared by every agent and router:

* Only full blocks are keyed. ``block_size`` (default 16) must equal the engine's block size.
* The chain is seeded from the model name and the cache salt (any caller-chosen salt)::

      seed = xxh3_64(b"kvroute/v1\\x00" + utf8(model) + b"\\x00" + utf8(salt))

  A LoRA adapter's requests are keyed under the base model with the salt
  :func:`adapter_salt` gives (``"\\x00lora\\x00" + adapter + "\\x00" + salt``): callers' salts
  hold no NUL (routers refuse them), so an adapter's blocks never match the base model's,
  another adapter's or any caller's salt.
* Block ``i`` covers tokens ``[i*B, (i+1)*B)``; each token is a little-endian uint32::

      key_i = xxh3_64(le64(key_{i-1}) + le32(t_0) + ... + le32(t_{B-1})),  key_{-1} = seed

  so a key names a block *and its whole prefix*: equal keys mean equal prefixes.
* Keys are unsigned 64-bit integers; on the wire (Redis) they are 8 bytes big-endian
  (see :func:`kvroute.core.redis_schema.pack_keys`).

Test vectors are in ``tests/core/test_blocks.py`` and ``docs/block-keys.md``.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

try:  # the optional C build of the same chain (setup.py); absent, the Python path runs
    from kvroute.core._chainhash import chain_keys as _native_chain
except ImportError:  # pragma: no cover - depends on the build
    _native_chain = None

NATIVE_AVAILABLE = _native_chain is not None
DEFAULT_BLOCK_SIZE = 16
_SEED_DOMAIN = b"kvroute/v1\x00"
_h64 = xxhash.xxh3_64_intdigest


ADAPTER_SALT_PREFIX = "\x00lora\x00"


def adapter_salt(adapter: str, salt: str = "") -> str:
    """The cache salt of LoRA adapter ``adapter``'s requests with caller salt ``salt``."""
    return ADAPTER_SALT_PREFIX + adapter + "\x00" + salt


def split_adapter_salt(salt: str) -> tuple[str, str]:
    """``(adapter, caller salt)`` of a salt :func:`adapter_salt` made; ``("", salt)`` for any
    other."""
    if not salt.startswith(ADAPTER_SALT_PREFIX):
        return "", salt
    adapter, _, rest = salt[len(ADAPTER_SALT_PREFIX):].partition("\x00")
    return adapter, rest


def chain_seed(model: str, salt: str = "") -> int:
    """The key that precedes block 0 for this model and cache salt."""
    return _h64(_SEED_DOMAIN + model.encode() + b"\x00" + salt.encode())


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes. Raises OverflowError for ids outside uint32."""
    arr = array.array("I", token_ids)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes chained block keys for one (model, salt) with a fixed block size."""

    block_size: int = DEFAULT_BLOCK_SIZE
    model: str = ""
    salt: str = ""
    native: bool = True  # use the C chain when it is built (same keys, ~10x faster)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")

    @property
    def seed(self) -> int:
        return chain_seed(self.model, self.salt)

    def iter_keys(self, token_ids: Sequence[int], parent: int | None = None) -> Iterator[int]:
        """Yield the key of every full block. The Python path is lazy (a caller that stops
        early hashes no more); the C path hashes every block at once, which costs less than
        the Python path's first few blocks.

        ``parent`` continues a chain (the key of the block before ``token_ids[0]``).
        """
        if self.native and _native_chain is not None:
            yield from _native_chain(token_ids, self.block_size,
                                     self.seed if parent is None else parent)
            return
        data = tokens_to_bytes(token_ids)
        step = self.block_size * 4
        prev = self.seed if parent is None else parent
        h = _h64
        for off in range(0, len(data) - step + 1, step):
            prev = h(prev.to_bytes(8, "little") + data[off : off + step])
            yield prev

    def keys(self, token_ids: Sequence[int], parent: int | None = None) -> list[int]:
        """The keys of every full block of ``token_ids``."""
        if self.native and _native_chain is not None:
            return _native_chain(token_ids, self.block_size,
                                 self.seed if parent is None else parent)
        return list(self.iter_keys(token_ids, parent))

    def full_blocks(self, n_tokens: int) -> int:
        return n_tokens // self.block_size
