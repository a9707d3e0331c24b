"""The block-key contract (docs/block-keys.md): these vectors are the scheme's definition."""

from __future__ import annotations

import struct

import pytest
import xxhash

from kvroute.core.blocks import BlockHasher, adapter_salt, chain_seed, split_adapter_salt

# Published test vectors. Changing any of these breaks every deployed agent/router pair.
VECTORS = [
    # (block_size, model, salt, tokens, keys)
    (16, "default", "", list(range(48)),
     [0x962361D09E4C654B, 0xD942DC7DF559ECDF, 0xED9331836A12C2B6]),
    (4, "llama", "salt", [1, 2, 3, 4, 5, 6, 7, 8, 9],
     [0x1F49CE079EF15378, 0x32520A43DFEC58EF]),
]


@pytest.mark.parametrize(("bs", "model", "salt", "tokens", "keys"), VECTORS)
def test_published_vectors(bs: int, model: str, salt: str, tokens: list[int],
                           keys: list[int]) -> None:
    assert BlockHasher(bs, model, salt).keys(tokens) == keys


def test_seed_vectors() -> None:
    assert chain_seed("default") == 0xE75D8AF6547988D0
    assert chain_seed("m", "lora-a") == 0xB03BAD3988EFCBC9
    # A LoRA adapter: its own salt input, never a caller salt's seed or the base model's.
    assert adapter_salt("lora-a") == "\x00lora\x00lora-a\x00"
    assert chain_seed("m", adapter_salt("lora-a")) == 0xE88B9CAE19318D5C
    assert chain_seed("m", adapter_salt("lora-a", "s")) == 0x6FD045F134733F39
    assert BlockHasher(4, "llama", adapter_salt("lora-a")).keys(list(range(1, 10))) == [
        0x7CED828A2F432FD6, 0xF889EA07571510AA]
    assert split_adapter_salt(adapter_salt("lora-a", "s")) == ("lora-a", "s")
    assert split_adapter_salt("lora-a") == ("", "lora-a")


def test_scheme_matches_its_written_definition() -> None:
    """Recompute from the docstring's formula with nothing but xxhash and struct."""
    tokens = [7, 50000, 3, 2**32 - 1] * 5
    prev = xxhash.xxh3_64_intdigest(b"kvroute/v1\x00" + b"m" + b"\x00" + b"s")
    expected = []
    for i in range(len(tokens) // 4):
        blk = struct.pack("<4I", *tokens[i * 4:(i + 1) * 4])
        prev = xxhash.xxh3_64_intdigest(struct.pack("<Q", prev) + blk)
        expected.append(prev)
    assert BlockHasher(4, "m", "s").keys(tokens) == expected


def test_only_full_blocks_are_keyed() -> None:
    h = BlockHasher(16)
    assert h.keys(list(range(15))) == []
    assert len(h.keys(list(range(47)))) == 2
    assert h.keys(list(range(47))) == h.keys(list(range(32)))


def test_key_names_the_whole_prefix() -> None:
    h = BlockHasher(4)
    a = h.keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.keys([9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    assert a[1] != b[1]


def test_model_and_salt_separate_chains() -> None:
    toks = list(range(32))
    assert BlockHasher(16, "a").keys(toks) != BlockHasher(16, "b").keys(toks)
    assert BlockHasher(16, "a", "x").keys(toks) != BlockHasher(16, "a", "y").keys(toks)


def test_parent_continues_a_chain() -> None:
    h = BlockHasher(4)
    toks = list(range(12))
    full = h.keys(toks)
    assert h.keys(toks[4:], parent=full[0]) == full[1:]


def test_iter_keys_is_lazy() -> None:
    h = BlockHasher(4)
    it = h.iter_keys(list(range(400)))
    assert next(it) == h.keys(list(range(4)))[0]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)
    with pytest.raises(OverflowError):
        BlockHasher(4).keys([-1, 0, 0, 0])


@pytest.mark.parametrize("native", [False, True])
def test_both_paths_give_the_published_keys(native: bool) -> None:
    from kvroute.core.blocks import NATIVE_AVAILABLE

    if native and not NATIVE_AVAILABLE:
        pytest.fail("the C chain (kvroute.core._chainhash) was not built; see setup.py")
    for bs, model, salt, tokens, keys in VECTORS:
        h = BlockHasher(bs, model, salt, native=native)
        assert h.keys(tokens) == keys
        assert list(h.iter_keys(tokens)) == keys


def test_native_and_python_agree_on_random_prompts() -> None:
    import random

    rng = random.Random(5)
    for _ in range(50):
        bs = rng.choice([1, 4, 16, 32])
        toks = [rng.randrange(2**32) for _ in range(rng.randrange(0, 300))]
        parent = rng.choice([None, rng.getrandbits(64)])
        py = BlockHasher(bs, "m", "s", native=False)
        c = BlockHasher(bs, "m", "s")
        assert c.keys(toks, parent) == py.keys(toks, parent)


@pytest.mark.parametrize("native", [False, True])
def test_bad_tokens_raise_on_both_paths(native: bool) -> None:
    h = BlockHasher(2, native=native)
    with pytest.raises(OverflowError):
        h.keys([1, 2**32])
    with pytest.raises((OverflowError, TypeError)):
        h.keys([-1, 0])


@pytest.mark.parametrize("native", [False, True])
def test_a_uint32_buffer_hashes_like_its_list(native: bool) -> None:
    # The router hands the hasher an array('I') decoded off the wire (core/wire.py);
    # the C path reads it in place, and any other buffer as a sequence of ints.
    import random
    from array import array

    rng = random.Random(9)
    toks = [rng.randrange(2**32) for _ in range(100)]
    h = BlockHasher(8, "m", "s", native=native)
    want = h.keys(toks)
    assert h.keys(array("I", toks)) == want
    assert h.keys(memoryview(array("I", toks))) == want
    strided = memoryview(array("I", [x for t in toks for x in (t, 0)]))[::2]
    assert h.keys(strided) == want  # not contiguous: read as a sequence
    assert h.keys(array("Q", toks)) == want  # 8-byte items: read as ints
