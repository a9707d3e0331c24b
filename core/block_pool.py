"""A paged prefix cache of fixed-size KV blocks, modelled on vLLM v1's ``BlockPool``.

Plain synchronous Python (no asyncio): the sim engine drives it from its event loop and a
replay simulator drives it directly. Every operation is O(1) per block touched.

A block's life::

    free, uncached --allocate--> in use --commit(key)--> in use, cached --free--> free, cached
         ^                                                                          |
         +------------------------- evicted by allocate (Op.EVICT) <----------------+

A free cached block is still findable by :meth:`BlockPool.lookup`; pinning it again
(``allocate(..., hits=...)``) revives it without recomputation — that is the prefix cache hit.

With ``host_blocks`` the pool has a lower tier (CPU memory, as vLLM's offloading and SGLang's
HiCache keep): a key evicted from the GPU is written back there (``Op.LOWER``) and stays,
least recently used first out (``Op.EVICT`` when no tier holds it any more). A prompt's blocks
found there after its GPU hits (:meth:`BlockPool.host_prefix`) are loaded into fresh blocks
and committed again (``Op.STORE``: in GPU memory again; the host copy stays).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence

from kvroute.core.cache_events import CacheEvent
from kvroute.core.redis_schema import Op


class PoolExhaustedError(RuntimeError):
    """``allocate`` asked for more blocks than are free (check ``can_allocate`` first)."""


class BlockPool:
    """Fixed pool of ``capacity_blocks`` blocks, ids ``0 .. capacity_blocks - 1``.

    Invariants (hold between calls):

    1. ``ref_count(b) >= 0`` for every block; ``ref_count(b)`` is the number of sequences
       holding ``b``.
    2. ``b`` is in the free queue iff ``ref_count(b) == 0``; so
       ``free_blocks == len(free queue)`` and in-use blocks can never be evicted.
    3. The key map is a bijection between cached keys and cached blocks:
       ``block_key(b) == k  <=>  the map sends k to b``. A key names at most one block and a
       block holds at most one key; only full blocks are ever keyed (``commit``).
    4. Free-queue order is eviction order (head first): every free *uncached* block precedes
       every free *cached* block, and cached free blocks are ordered least recently freed
       first (LRU). Uncached blocks go to the head because reusing them loses nothing.
    5. Events are emitted synchronously, in the order the cache changed: ``Op.STORE`` when a
       key becomes findable, ``Op.EVICT`` when it stops being findable through eviction,
       ``Op.CLEAR`` when every key was dropped. The emitted key set therefore always equals
       :meth:`cached_keys`.
    6. The host tier holds at most ``host_blocks`` keys; a key's last event says its best
       tier: ``Op.STORE`` iff it is in the key map, else ``Op.LOWER`` iff it is in the host
       tier (:meth:`lower_keys`), else ``Op.EVICT``.
    """

    __slots__ = ("_block_of", "_free", "_host", "_key_of", "_ref", "capacity_blocks",
                 "host_blocks", "listener")

    def __init__(
        self, capacity_blocks: int, listener: Callable[[CacheEvent], None] | None = None,
        host_blocks: int = 0,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        if host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {host_blocks}")
        self.capacity_blocks = capacity_blocks
        self.host_blocks = host_blocks
        # The host tier's keys, least recently used first (a GPU-held key may be here too).
        self._host: OrderedDict[int, None] = OrderedDict()
        self.listener = listener
        self._ref: list[int] = [0] * capacity_blocks
        self._key_of: list[int | None] = [None] * capacity_blocks
        self._block_of: dict[int, int] = {}
        # OrderedDict as an O(1) linked list: popitem(last=False), move_to_end, del by id.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity_blocks))

    # -- queries ---------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not: what ``allocate`` can hand out."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_key(self, block: int) -> int | None:
        return self._key_of[block]

    def cached_keys(self) -> list[int]:
        """Every key currently findable (in-use and free cached blocks), and those of the
        host tier."""
        if not self._host:
            return list(self._block_of)
        return list(self._block_of.keys() | self._host.keys())

    def lower_keys(self) -> list[int]:
        """The keys held only in the host tier."""
        block_of = self._block_of
        return [k for k in self._host if k not in block_of]

    def host_prefix(self, keys: Iterable[int]) -> int:
        """How many leading ``keys`` the host tier holds (those after a prompt's GPU hits:
        what it loads instead of computing)."""
        return _leading_in(keys, self._host)

    def lookup(self, keys: Iterable[int]) -> list[int]:
        """Blocks of the longest run of leading ``keys`` that are cached. No side effects.

        Stops at the first miss, so a lazy iterator (``BlockHasher.iter_keys``) hashes no
        further than needed.
        """
        get = self._block_of.get
        out: list[int] = []
        for k in keys:
            b = get(k)
            if b is None:
                break
            out.append(b)
        return out

    def longest_cached_prefix(self, keys: Iterable[int]) -> int:
        """Number of leading ``keys`` that are cached."""
        return _leading_in(keys, self._block_of)

    def can_allocate(self, n_new: int, hits: Sequence[int] = ()) -> bool:
        """Whether ``allocate(n_new, hits)`` would succeed.

        Pinning a free hit block takes it off the free queue, so it no longer counts as
        allocatable: need ``n_new <= free_blocks - |{b in hits : ref_count(b) == 0}|``.
        """
        ref = self._ref
        free_hits = sum(1 for b in hits if ref[b] == 0)
        return n_new <= len(self._free) - free_hits

    # -- mutations -------------------------------------------------------------------------

    def touch(self, blocks: Iterable[int]) -> None:
        """Pin ``blocks`` (ref + 1); a free block leaves the free queue, so it cannot be evicted."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n_new: int, hits: Sequence[int] = ()) -> list[int]:
        """Pin the cache-hit blocks ``hits`` and take ``n_new`` fresh blocks (ref = 1).

        Returns ``[*hits, *fresh]``, i.e. the sequence's block table when ``hits`` are its
        leading blocks. Fresh blocks come from the free-queue head; any that were cached
        lose their key, reported in one ``Op.EVICT`` event. All-or-nothing: raises
        :class:`PoolExhaustedError` and changes nothing if ``can_allocate`` is false.
        """
        if n_new < 0:
            raise ValueError(f"n_new must be >= 0, got {n_new}")
        if not self.can_allocate(n_new, hits):
            raise PoolExhaustedError(
                f"need {n_new} fresh blocks (+{len(hits)} hits), {len(self._free)} free"
            )
        # Pin hits first so that eviction below cannot take them.
        self.touch(hits)
        ref, key_of, block_of, popitem = self._ref, self._key_of, self._block_of, self._free.popitem
        fresh: list[int] = []
        evicted: list[int] = []
        for _ in range(n_new):
            b = popitem(last=False)[0]
            k = key_of[b]
            if k is not None:
                del block_of[k]
                key_of[b] = None
                evicted.append(k)
            ref[b] = 1
            fresh.append(b)
        if evicted:
            if self.host_blocks:
                self._write_back(evicted)
            else:
                self._emit(Op.EVICT, tuple(evicted))
        return [*hits, *fresh] if hits else fresh

    def _write_back(self, evicted: list[int]) -> None:
        """Keys evicted from the GPU go to the host tier, whose least recently used keys
        make room: one ``Op.EVICT`` for those no tier holds now, one ``Op.LOWER`` for
        those only the host tier does."""
        host, block_of, most = self._host, self._block_of, self.host_blocks
        changed = dict.fromkeys(evicted)
        for k in evicted:
            host[k] = None
            host.move_to_end(k)
        while len(host) > most:
            victim = host.popitem(last=False)[0]
            if victim not in block_of:
                changed[victim] = None
        gone = tuple(k for k in changed if k not in host)
        lowered = tuple(k for k in changed if k in host)
        if gone:
            self._emit(Op.EVICT, gone)
        if lowered:
            self._emit(Op.LOWER, lowered)

    def load_from_host(self, keys: Sequence[int]) -> None:
        """``keys`` (host-tier keys a prompt is about to load) are used now: last out."""
        host = self._host
        for k in keys:
            if k in host:
                host.move_to_end(k)

    def commit(self, blocks: Sequence[int], keys: Sequence[int]) -> list[int]:
        """Register each now-full in-use ``blocks[i]`` under ``keys[i]``; one ``Op.STORE``.

        If a key is already cached by another block (two sequences computed the same prefix
        concurrently, or a recomputed capped block), the existing block keeps it and this
        block stays uncached, so it is reused first once freed. Re-committing a block under
        its own key is a no-op. Returns the keys that were newly stored (the event's keys).
        """
        if len(blocks) != len(keys):
            raise ValueError(f"{len(blocks)} blocks but {len(keys)} keys")
        ref, key_of, block_of = self._ref, self._key_of, self._block_of
        stored: list[int] = []
        for b, k in zip(blocks, keys, strict=True):
            if ref[b] <= 0:
                raise ValueError(f"commit of free block {b}")
            cur = key_of[b]
            if cur is not None:
                if cur == k:
                    continue
                raise ValueError(f"block {b} already holds key {cur:#x}, not {k:#x}")
            if k in block_of:
                continue
            block_of[k] = b
            key_of[b] = k
            stored.append(k)
        if stored:
            self._emit(Op.STORE, tuple(stored))
        return stored

    def free(self, blocks: Sequence[int]) -> None:
        """Unpin a sequence's ``blocks`` (given in sequence order): ref - 1.

        Blocks reaching ref 0 join the free queue in *reverse* order, so the tail of a
        sequence (least likely to be shared) is evicted before its head, as in vLLM. Cached
        ones go to the tail (most recently freed), uncached ones to the head.
        """
        ref, key_of, free = self._ref, self._key_of, self._free
        for b in reversed(blocks):
            r = ref[b] - 1
            if r < 0:
                raise ValueError(f"double free of block {b}")
            ref[b] = r
            if r == 0:
                free[b] = None
                if key_of[b] is None:
                    free.move_to_end(b, last=False)

    def clear(self) -> int:
        """Drop every key (in-use blocks stay allocated but become uncached); ``Op.CLEAR``.

        Returns how many keys were dropped. Invariant 4 holds since no free block is cached.
        """
        key_of = self._key_of
        for b in self._block_of.values():
            key_of[b] = None
        n = len(self._block_of.keys() | self._host.keys())
        self._block_of.clear()
        self._host.clear()
        self._emit(Op.CLEAR, ())
        return n

    def _emit(self, op: Op, keys: tuple[int, ...]) -> None:
        if self.listener is not None:
            self.listener(CacheEvent(op, keys))


def _leading_in(keys: Iterable[int], held: Container[int]) -> int:
    """How many leading ``keys`` are in ``held`` (consumes ``keys`` only that far)."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n
