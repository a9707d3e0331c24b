"""vLLM block hashes -> kvroute block keys, and which keys the engine holds right now.

vLLM's own block hash (SHA-256 of a pickle, or a seeded 64-bit hash) is never reproduced:
each ``BlockStored`` carries the token ids of its blocks, and the key of block ``i`` is
``xxh3_64(key_{i-1} || tokens_i)`` (docs/block-keys.md), continuing from the kvroute key the
parent block's engine hash maps to. The map is kept for removals and for children.

Residency is counted per ``(engine hash, group_idx, medium)``: hybrid models emit one event per
KV-cache group with the *same* hashes, and offloading tiers (medium CPU, ...) hold copies, so a
removal from one group or tier must not drop a block another still holds. A kvroute key is
published when its first residency appears and withdrawn (``Op.EVICT``) when the last one goes;
re-stores (vLLM re-reports reused blocks) are idempotent. Its tier (core/cache_events.py) is the
best medium holding it: ``Op.STORE`` when a GPU residency appears (medium ``GPU`` or none),
``Op.LOWER`` when it is first held, or left held, only in another medium (vLLM's ``CPU``,
SGLang's ``CPU_PINNED``, any disk or external tier: one lower tier, its cost the engine's).
SGLang's HiCache describes its host copies in full (token ids, parent); vLLM's offloading
connector names them by hash alone (no token ids, no parent; ``block_size`` 0, or its own
block of ``k`` of ours, named by the last of them), so those are mapped through the hashes the
GPU's events taught: each entry keeps its parent's hash for that walk.

Cache salt (what seeds the chain at a root block, ``parent_block_hash is None``):

* ``lora_name`` None, or equal to the served model name (the agent serves one vLLM model, which
  may itself be a LoRA adapter): salt = the ``cache_salt`` string vLLM lists in the first
  block's ``extra_keys`` (``""`` if none), i.e. exactly what the router computes from
  ``GenerateRequest.cache_salt``.
* another LoRA adapter (``lora_name``; a router's ``--lora NAME=BASE`` sends its requests
  here with ``adapter_salt(NAME, salt)``, and vLLM runs them as model NAME): salt =
  ``adapter_salt(lora_name, that cache_salt)``, the salt the router keys the adapter's
  requests with (core/blocks.py).
* multimodal identifiers or prompt-embedding digests in a block's ``extra_keys``: the block
  (and every block chained after it) is **opaque**: it is tracked, so removals and children
  resolve, but never published, because no kvroute request (token ids only) can hit it.
  Releases before ``lora_name`` existed mark any ``lora_id`` opaque (the adapter is unknown).
* SGLang names the salt in the event (``cache_salt``): salt = that string (or its
  ``adapter_salt`` for another LoRA adapter, as above).
* releases before ``extra_keys`` existed (0.10.2, the oldest supported, among them) carry no
  cache salt: salted blocks get the unsalted key (the router may over-predict a hit for an
  unsalted prompt; the engine still isolates).

A block whose parent hash is unknown (learned after a gap that replay could not heal) gets the
marker UNKNOWN: tracked, not published, upgraded when vLLM stores it again from a known parent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kvroute.core.blocks import BlockHasher, adapter_salt
from kvroute.core.cache_events import CacheEvent
from kvroute.core.redis_schema import Op
from kvroute.worker_agent.engines.served.wire import Cleared, EngineHash, Event, Removed, Stored

log = logging.getLogger("kvroute.agent.vllm")

OPAQUE = -1  # no kvroute request can hit it (other LoRA, multimodal, prompt embeds)
UNKNOWN = -2  # its parent chain is unknown (learned after an unhealed gap)
_GPU = "GPU"  # the medium of the GPU cache (and of events that name none)
_U64 = (1 << 64) - 1


@dataclass
class BlockMapStats:
    stored_blocks: int = 0  # residencies added
    removed_blocks: int = 0  # residencies dropped
    duplicate_stores: int = 0  # residency already held (vLLM re-reporting reused blocks)
    unknown_parent: int = 0  # blocks stored under a parent we never saw (UNKNOWN)
    unknown_removals: int = 0  # removal of a residency we never saw
    opaque_blocks: int = 0  # blocks stored that no kvroute request can hit
    block_size_mismatch: int = 0  # blocks of an event whose block_size is not ours (skipped)
    key_conflicts: int = 0  # one engine hash, two different computed keys (kept the first)
    unknown_copies: int = 0  # a lower tier's copies of blocks we never saw (skipped)
    clears: int = 0


class _Entry:
    """One engine hash: its kvroute key (or OPAQUE/UNKNOWN), how many residencies, how many
    of them in GPU memory, and its parent's engine hash (None at a root)."""

    __slots__ = ("gpu", "key", "parent", "refs")

    def __init__(self, key: int, parent: EngineHash | None) -> None:
        self.key = key
        self.parent = parent
        self.refs = 0
        self.gpu = 0


class BlockMap:
    """Applies decoded vLLM events; emits kvroute :class:`CacheEvent` s for the changes."""

    def __init__(self, block_size: int, model: str, served_model: str = "") -> None:
        self.block_size = block_size
        self.model = model
        self.served_model = served_model or model
        self.stats = BlockMapStats()
        self._entries: dict[EngineHash, _Entry] = {}
        self._resident: set[tuple[EngineHash, int, str]] = set()
        self._key_refs: dict[int, int] = {}  # published key -> residencies mapping to it
        self._gpu_refs: dict[int, int] = {}  # of those, the ones in GPU memory (if any)
        # A lower tier's block covering k > 1 of ours -> the hashes of those (last first).
        self._chunks: dict[tuple[EngineHash, int, str], list[EngineHash]] = {}
        self._hashers: dict[str, BlockHasher] = {}
        self._warned_sizes: set[tuple[int, int]] = set()

    # -- queries -----------------------------------------------------------------------------

    def cached_keys(self) -> list[int]:
        """Every published key, whatever its tier."""
        return list(self._key_refs)

    def lower_keys(self) -> list[int]:
        """The published keys held only in a lower tier."""
        gpu = self._gpu_refs
        return [k for k in self._key_refs if k not in gpu]

    def __contains__(self, key: int) -> bool:
        return key in self._key_refs

    def longest_prefix(self, keys: Iterable[int]) -> int:
        """How many leading keys are cached (the engine would hit that many blocks)."""
        n = 0
        for k in keys:
            if k not in self._key_refs:
                break
            n += 1
        return n

    @property
    def cached_count(self) -> int:
        return len(self._key_refs)

    @property
    def lower_count(self) -> int:
        """Published keys held only in a lower tier."""
        return len(self._key_refs) - len(self._gpu_refs)

    @property
    def engine_hashes(self) -> int:
        return len(self._entries)

    def hasher(self, salt: str = "") -> BlockHasher:
        h = self._hashers.get(salt)
        if h is None:
            if len(self._hashers) > 1024:  # salts can be per-user: keep the cache bounded
                self._hashers.clear()
            h = self._hashers[salt] = BlockHasher(self.block_size, self.model, salt)
        return h

    # -- updates -----------------------------------------------------------------------------

    def apply(self, ev: Event, out: list[CacheEvent]) -> None:
        if isinstance(ev, Stored):
            self._store(ev, out)
        elif isinstance(ev, Removed):
            self._remove(ev, out)
        elif isinstance(ev, Cleared):
            self.clear(out)

    def clear(self, out: list[CacheEvent]) -> None:
        self._entries.clear()
        self._resident.clear()
        self._key_refs.clear()
        self._gpu_refs.clear()
        self._chunks.clear()
        self.stats.clears += 1
        out.append(CacheEvent(Op.CLEAR))

    def _store(self, ev: Stored, out: list[CacheEvent]) -> None:
        st = self.stats
        n = len(ev.block_hashes)
        if not ev.token_ids and n and (ev.medium or _GPU) != _GPU:
            self._store_copies(ev, out)
            return
        if ev.block_size != self.block_size:
            st.block_size_mismatch += n
            self._warn_size(ev.group_idx or 0, ev.block_size)
            return
        keys = self._keys_for(ev)
        group = ev.group_idx or 0
        medium = ev.medium or _GPU
        entries = self._entries
        new_gpu: list[int] = []
        new_lower: list[int] = []
        parent = ev.parent
        for h, key in zip(ev.block_hashes, keys, strict=True):
            ent = entries.get(h)
            if ent is None:
                ent = entries[h] = _Entry(key, parent)
            elif ent.key != key and key >= 0:
                if ent.key < 0:
                    # Upgrade UNKNOWN/OPAQUE -> a real key: every residency now counts.
                    ent.key = key
                    ent.parent = parent
                    if ent.refs:
                        self._count(key, ent.refs, ent.gpu, new_gpu, new_lower)
                else:
                    st.key_conflicts += 1
            self._hold(h, ent, group, medium, new_gpu, new_lower)
            parent = h
        self._emit_new(new_gpu, new_lower, out)

    def _store_copies(self, ev: Stored, out: list[CacheEvent]) -> None:
        """A lower tier's copies of blocks the GPU stored, named by hash alone (vLLM's
        offloading connector sends no token ids and no parent): each hash is a block we
        know, or, when the tier's block is ``k`` of ours (its ``block_size``; 0: ours), the
        last of ``k`` chained blocks. Unknown hashes are counted and skipped."""
        st = self.stats
        k = self._blocks_per(ev.block_size, ev.group_idx)
        if not k:
            st.block_size_mismatch += len(ev.block_hashes)
            return
        group, medium = ev.group_idx or 0, ev.medium or _GPU
        new_gpu: list[int] = []
        new_lower: list[int] = []
        for raw in ev.block_hashes:
            h = self._known(raw)
            covered = None if h is None else self._chain(h, k)
            if covered is None:
                st.unknown_copies += 1
                continue
            if k > 1:
                self._chunks[(h, group, medium)] = covered
            for c in covered:
                self._hold(c, self._entries[c], group, medium, new_gpu, new_lower)
        self._emit_new(new_gpu, new_lower, out)

    def _blocks_per(self, block_size: int, group: int | None) -> int:
        """How many of our blocks one of ``block_size`` tokens is (0 and ours: 1); 0 (and
        a warning, once) if it is not a whole number of them."""
        if block_size in (0, self.block_size):
            return 1
        if block_size > 0 and block_size % self.block_size == 0:
            return block_size // self.block_size
        self._warn_size(group or 0, block_size)
        return 0

    def _known(self, h: EngineHash) -> EngineHash | None:
        """``h`` as the GPU's events named it, or None: a lower tier's event may carry the
        whole digest where the GPU's carry its low 64 bits (vLLM converts the hashes of its
        own events, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, not its connectors')."""
        if h in self._entries:
            return h
        if isinstance(h, bytes):
            low = int.from_bytes(h, "big") & _U64
            if low in self._entries:
                return low
        return None

    def _chain(self, h: EngineHash, k: int) -> list[EngineHash] | None:
        """``h`` and its ``k - 1`` nearest ancestors (all known), else None."""
        entries = self._entries
        out: list[EngineHash] = []
        cur: EngineHash | None = h
        while len(out) < k:
            if cur is None or cur not in entries:
                return None
            out.append(cur)
            cur = entries[cur].parent
        return out

    def _hold(self, h: EngineHash, ent: _Entry, group: int, medium: str,
              new_gpu: list[int], new_lower: list[int]) -> None:
        """Add the residency ``(h, group, medium)`` unless held (idempotent re-stores)."""
        st = self.stats
        r = (h, group, medium)
        if r in self._resident:
            st.duplicate_stores += 1
            return
        self._resident.add(r)
        on_gpu = medium == _GPU
        ent.refs += 1
        ent.gpu += on_gpu
        st.stored_blocks += 1
        if ent.key >= 0:
            self._count(ent.key, 1, int(on_gpu), new_gpu, new_lower)
        elif ent.key == OPAQUE:
            st.opaque_blocks += 1

    @staticmethod
    def _emit_new(new_gpu: list[int], new_lower: list[int], out: list[CacheEvent]) -> None:
        if new_gpu:
            out.append(CacheEvent(Op.STORE, tuple(new_gpu)))
        if new_lower:
            out.append(CacheEvent(Op.LOWER, tuple(new_lower)))

    def _warn_size(self, group: int, block_size: int) -> None:
        if (group, block_size) in self._warned_sizes:
            return
        self._warned_sizes.add((group, block_size))
        # Hybrid models publish other groups at other granularities: expected there. If no
        # group matches, nothing is ever published: say so loudly.
        level = logging.WARNING if self.stats.stored_blocks else logging.ERROR
        log.log(level, "skipping engine blocks of another block size; if no group matches, "
                "set the agent's --block-size to the engine's", extra={"kv": {
                    "group_idx": group, "event_block_size": block_size,
                    "agent_block_size": self.block_size}})

    def _count(self, key: int, refs: int, gpu: int, new_gpu: list[int],
               new_lower: list[int]) -> None:
        """Add ``refs`` residencies of ``key`` (``gpu`` of them in GPU memory); note the key
        in ``new_gpu`` if it now reaches GPU memory, in ``new_lower`` if it is new and
        held only below it."""
        key_refs, gpu_refs = self._key_refs, self._gpu_refs
        c = key_refs.get(key, 0)
        key_refs[key] = c + refs
        if gpu:
            g = gpu_refs.get(key, 0)
            gpu_refs[key] = g + gpu
            if g == 0:
                new_gpu.append(key)
        elif c == 0:
            new_lower.append(key)

    def _remove(self, ev: Removed, out: list[CacheEvent]) -> None:
        st = self.stats
        group = ev.group_idx or 0
        medium = ev.medium or _GPU
        on_gpu = medium == _GPU
        entries, resident = self._entries, self._resident
        key_refs, gpu_refs = self._key_refs, self._gpu_refs
        gone: list[int] = []
        lowered: list[int] = []
        hashes: Iterable[EngineHash] = ev.block_hashes
        if not on_gpu:  # a lower tier's: its hashes as ours, its blocks of several of ours
            known = [self._known(h) or h for h in hashes]
            hashes = [c for h in known for c in self._chunks.pop((h, group, medium), (h,))]
        for h in hashes:
            r = (h, group, medium)
            if r not in resident:
                st.unknown_removals += 1
                continue
            resident.discard(r)
            st.removed_blocks += 1
            ent = entries[h]
            ent.refs -= 1
            ent.gpu -= on_gpu
            key = ent.key
            if key >= 0:
                c = _release(key_refs, key)
                if on_gpu and not _release(gpu_refs, key) and c:
                    lowered.append(key)  # a lower tier still holds it
                if not c:
                    gone.append(key)
            if ent.refs == 0:
                del entries[h]
        if lowered:
            out.append(CacheEvent(Op.LOWER, tuple(lowered)))
        if gone:
            out.append(CacheEvent(Op.EVICT, tuple(gone)))

    # -- key computation ---------------------------------------------------------------------

    def _keys_for(self, ev: Stored) -> list[int]:
        """One kvroute key (or OPAQUE/UNKNOWN) per block of a BlockStored event."""
        n = len(ev.block_hashes)
        if ev.parent is None:
            salt = self._root_salt(ev)
            if salt is None:
                return [OPAQUE] * n
            hasher, parent = self.hasher(salt), None
        else:
            ent = self._entries.get(ev.parent)
            if ent is None or ent.key == UNKNOWN:
                self.stats.unknown_parent += n
                return [UNKNOWN] * n
            if ent.key == OPAQUE:
                return [OPAQUE] * n
            if not self._lora_ok(ev):
                return [OPAQUE] * n
            hasher, parent = self.hasher(), ent.key
        # Blocks carrying multimodal / prompt-embedding keys break the chain from there on.
        cut = n
        if ev.extra_keys is not None:
            for i, ek in enumerate(ev.extra_keys):
                if not self._plain_extra(ek, ev.lora_name, first=(i == 0 and ev.parent is None)):
                    cut = i
                    break
        if cut == 0:
            return [OPAQUE] * n
        tokens = ev.token_ids if cut == n else ev.token_ids[: cut * self.block_size]
        keys = hasher.keys(tokens, parent)
        return keys + [OPAQUE] * (n - cut)

    def _lora_ok(self, ev: Stored) -> bool:
        """Whether the block's adapter is known: none, or named (releases with lora_name)."""
        return ev.lora_name is not None or ev.lora_id is None

    def _root_salt(self, ev: Stored) -> str | None:
        """The cache salt seeding a root block's chain; None if the block is opaque."""
        if not self._lora_ok(ev):
            return None
        if ev.cache_salt is not None:  # SGLang's, named in the event
            return self._adapter_salt(ev, ev.cache_salt)
        if not ev.extra_keys or not ev.extra_keys[0]:
            return self._adapter_salt(ev, "")
        salt = ""
        skip_lora = ev.lora_name is not None
        for item in ev.extra_keys[0]:
            if isinstance(item, str):
                if skip_lora and item == ev.lora_name:
                    skip_lora = False  # the LoRA name precedes the cache salt
                    continue
                salt = item
                break
        return self._adapter_salt(ev, salt)

    def _adapter_salt(self, ev: Stored, salt: str) -> str:
        """``salt`` as the router keys it: an adapter other than the served model's own
        seeds ``adapter_salt`` (core/blocks.py)."""
        if ev.lora_name is not None and ev.lora_name != self.served_model:
            return adapter_salt(ev.lora_name, salt)
        return salt

    @staticmethod
    def _plain_extra(ek: object, lora_name: str | None, *, first: bool) -> bool:
        """True if a block's extra keys hold only what kvroute's key models: the served
        LoRA's name and, on the first block, the cache salt (both strings)."""
        if ek is None:
            return True
        if not isinstance(ek, list | tuple):
            return False
        strings = 0
        for item in ek:
            if not isinstance(item, str):
                return False  # (mm_identifier, offset) pairs, prompt-embedding digests
            if item != lora_name:
                strings += 1
        return strings <= (1 if first else 0)


def _release(refs: dict[int, int], key: int) -> int:
    """One reference of ``key`` fewer (deleted at none); returns how many are left."""
    c = refs[key] - 1
    if c:
        refs[key] = c
    else:
        del refs[key]
    return c
