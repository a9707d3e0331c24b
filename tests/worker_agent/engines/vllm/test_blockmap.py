"""vLLM block hashes -> kvroute keys: chaining, salts, residency, removals, clears."""

from __future__ import annotations

import array

from kvroute.core.blocks import BlockHasher, adapter_salt
from kvroute.core.cache_events import CacheEvent
from kvroute.core.redis_schema import Op
from kvroute.worker_agent.engines.served.blockmap import BlockMap
from kvroute.worker_agent.engines.served.wire import Cleared, Removed, Stored

B = 4
TOKS = list(range(1, 17))  # 4 blocks of 4
KEYS = BlockHasher(B, "m").keys(TOKS)


def stored(hashes: list, parent=None, tokens=None, **kw) -> Stored:
    toks = tokens if tokens is not None else TOKS[: len(hashes) * B]
    return Stored(hashes, parent, array.array("I", toks), kw.pop("block_size", B), **kw)


def run(m: BlockMap, *events) -> list[CacheEvent]:
    out: list[CacheEvent] = []
    for e in events:
        m.apply(e, out)
    return out


def test_chains_continue_from_the_parents_key_for_int_and_bytes_hashes() -> None:
    m = BlockMap(B, "m")
    out = run(m, stored([b"h0", b"h1"]), stored([7, 8], parent=b"h1", tokens=TOKS[8:16]))
    assert out == [CacheEvent(Op.STORE, tuple(KEYS[:2])), CacheEvent(Op.STORE, tuple(KEYS[2:]))]
    assert sorted(m.cached_keys()) == sorted(KEYS)
    assert m.longest_prefix(KEYS) == 4
    out = run(m, Removed([8]), Removed([b"h0"]))
    assert out == [CacheEvent(Op.EVICT, (KEYS[3],)), CacheEvent(Op.EVICT, (KEYS[0],))]


def test_cache_salt_from_extra_keys_seeds_the_chain() -> None:
    m = BlockMap(B, "m")
    run(m, stored([1, 2], extra_keys=[["user-7"], None]))
    assert m.cached_keys() == BlockHasher(B, "m", "user-7").keys(TOKS[:8])
    # The served model may itself be a LoRA adapter: its name precedes the salt.
    m = BlockMap(B, "m", served_model="adapter")
    run(m, stored([1, 2], lora_name="adapter", lora_id=3,
                  extra_keys=[["adapter", "user-7"], ["adapter"]]))
    assert m.cached_keys() == BlockHasher(B, "m", "user-7").keys(TOKS[:8])


def test_another_adapters_blocks_are_keyed_with_its_adapter_salt() -> None:
    # vLLM serving base + LoRA adapters: an adapter's blocks get the keys a router's
    # --lora NAME=BASE computes for its requests (core/blocks.py adapter_salt), which never
    # equal the base model's.
    m = BlockMap(B, "m", served_model="base")
    out = run(m, stored([1, 2], lora_name="other", lora_id=1, extra_keys=[["other"], ["other"]]),
              stored([3], parent=2, tokens=TOKS[8:12], lora_name="other", lora_id=1),
              stored([4], lora_name="other", lora_id=1, extra_keys=[["other", "user-7"]]))
    lora = BlockHasher(B, "m", adapter_salt("other")).keys(TOKS[:12])
    salted = BlockHasher(B, "m", adapter_salt("other", "user-7")).keys(TOKS[:4])
    assert out == [CacheEvent(Op.STORE, tuple(lora[:2])), CacheEvent(Op.STORE, (lora[2],)),
                   CacheEvent(Op.STORE, tuple(salted))]
    assert not set(lora + salted) & set(KEYS)
    assert m.stats.opaque_blocks == 0


def test_blocks_no_kvroute_request_can_hit_are_tracked_but_never_published() -> None:
    m = BlockMap(B, "m", served_model="base")
    out = run(m,
              stored([4, 5], extra_keys=[None, [["img-hash", 0]]]),  # multimodal from block 1
              stored([6], lora_id=9))  # old layout: an adapter we cannot name
    assert out == [CacheEvent(Op.STORE, (KEYS[0],))]  # only block 0 of the multimodal event
    assert m.stats.opaque_blocks == 2 and m.stats.unknown_parent == 0
    assert run(m, Removed([5, 6])) == []
    assert m.stats.unknown_removals == 0 and m.engine_hashes == 1


def test_residency_per_group_and_medium_and_idempotent_restores() -> None:
    m = BlockMap(B, "m")
    out = run(m, stored([1], group_idx=0), stored([1], group_idx=1),
              stored([1], medium="CPU"), stored([1], group_idx=0))
    assert out == [CacheEvent(Op.STORE, (KEYS[0],))]
    assert m.stats.duplicate_stores == 1
    assert run(m, Removed([1], group_idx=1)) == []  # group 0 still holds it in GPU memory
    # The last GPU residency goes, the CPU copy stays: the key moves to the lower tier.
    assert run(m, Removed([1], medium="GPU")) == [CacheEvent(Op.LOWER, (KEYS[0],))]
    assert m.cached_keys() == [KEYS[0]] and m.lower_keys() == [KEYS[0]]
    assert run(m, Removed([1], medium="CPU")) == [CacheEvent(Op.EVICT, (KEYS[0],))]
    assert m.cached_keys() == [] and m.engine_hashes == 0


def test_a_key_is_published_at_the_best_tier_holding_it() -> None:
    """GPU first, a lower tier (vLLM's CPU, SGLang's CPU_PINNED) below it: STORE when a
    GPU copy appears, LOWER when only a lower tier holds the key."""
    m = BlockMap(B, "m")
    # Offloaded and then evicted from the GPU before the router saw it: lower from the start.
    assert run(m, stored([1, 2], medium="CPU_PINNED")) == [
        CacheEvent(Op.LOWER, (KEYS[0], KEYS[1]))]
    assert sorted(m.lower_keys()) == sorted(KEYS[:2])
    # Loaded back into the GPU (a hit on the host tier): promoted, the host copy stays.
    assert run(m, stored([1])) == [CacheEvent(Op.STORE, (KEYS[0],))]
    assert m.lower_keys() == [KEYS[1]]
    # A second host residency of a GPU-held key changes nothing.
    assert run(m, stored([1], medium="CPU")) == []
    assert run(m, Removed([1], medium="CPU_PINNED"), Removed([1], medium="CPU")) == []
    assert run(m, Removed([1])) == [CacheEvent(Op.EVICT, (KEYS[0],))]
    assert run(m, Removed([2], medium="CPU_PINNED")) == [CacheEvent(Op.EVICT, (KEYS[1],))]
    assert m.cached_keys() == [] and m.lower_keys() == []


def test_unknown_parents_are_withheld_until_restored_from_a_known_chain() -> None:
    m = BlockMap(B, "m")
    assert run(m, stored([3], parent=2, tokens=TOKS[8:12])) == []
    assert m.stats.unknown_parent == 1
    # vLLM re-reports the reused prefix from block 0 (kv_cache_report_mode=full): learned.
    out = run(m, stored([1, 2, 3]))
    assert out == [CacheEvent(Op.STORE, (KEYS[0], KEYS[1], KEYS[2]))]
    assert run(m, Removed([3])) == [CacheEvent(Op.EVICT, (KEYS[2],))]


def test_other_block_sizes_are_skipped_and_clears_drop_everything() -> None:
    m = BlockMap(B, "m")
    assert run(m, stored([1], block_size=8, tokens=TOKS[:8])) == []
    assert m.stats.block_size_mismatch == 1
    run(m, stored([1, 2]))
    assert run(m, Cleared()) == [CacheEvent(Op.CLEAR)]
    assert m.cached_keys() == [] and m.engine_hashes == 0
    assert run(m, Removed([1])) == [] and m.stats.unknown_removals == 1


def test_offloaded_copies_named_by_hash_alone_map_through_the_gpu_blocks() -> None:
    """vLLM's offloading connector: BlockStored with no token ids and no parent, block_size
    0 (older) or its own block (here two of ours, named by the last), medium CPU."""
    m = BlockMap(B, "m")
    run(m, stored([1, 2, 3, 4]))
    copies = Stored(block_hashes=[1, 2], parent=None, token_ids=array.array("I"),
                    block_size=0, medium="CPU")
    assert run(m, copies) == []  # held in GPU memory too: no change of tier
    assert run(m, Removed([1, 2], medium="GPU")) == [CacheEvent(Op.LOWER, tuple(KEYS[:2]))]
    assert m.lower_keys() == list(KEYS[:2])
    pair = Stored(block_hashes=[4], parent=None, token_ids=array.array("I"), block_size=2 * B,
                  medium="CPU")  # one CPU block of two of ours: blocks 3 and 4
    assert run(m, pair) == []
    assert run(m, Removed([3, 4], medium="GPU")) == [CacheEvent(Op.LOWER, tuple(KEYS[2:4]))]
    assert run(m, Removed([4], medium="CPU")) == [CacheEvent(Op.EVICT, (KEYS[3], KEYS[2]))]
    assert sorted(m.cached_keys()) == sorted(KEYS[:2])
    unknown = Stored(block_hashes=[99], parent=None, token_ids=array.array("I"), block_size=0,
                     medium="CPU")
    odd = Stored(block_hashes=[1], parent=None, token_ids=array.array("I"), block_size=B + 1,
                 medium="CPU")
    assert run(m, unknown, odd) == []
    assert m.stats.unknown_copies == 1 and m.stats.block_size_mismatch == 1


def test_a_copy_named_by_its_whole_digest_finds_the_gpu_blocks_64_bit_hash() -> None:
    """vLLM sends its own events' hashes as the digest's low 64 bits, its connectors' as the
    whole digest: both name one block."""
    digest = bytes(range(32))
    low = int.from_bytes(digest, "big") & ((1 << 64) - 1)
    m = BlockMap(B, "m")
    run(m, stored([low]))
    copy = Stored(block_hashes=[digest], parent=None, token_ids=array.array("I"),
                  block_size=0, medium="CPU")
    assert run(m, copy, Removed([low])) == [CacheEvent(Op.LOWER, (KEYS[0],))]
    assert run(m, Removed([digest], medium="CPU")) == [CacheEvent(Op.EVICT, (KEYS[0],))]
    assert m.stats.unknown_removals == 0
