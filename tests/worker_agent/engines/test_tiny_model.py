"""TinyModel: the exactness invariant, and that it computes real causal attention.

Exactness is tested with ``np.array_equal`` (bit for bit), not ``allclose``: the model is built so
that a position's result cannot depend on batch, chunking or cache state (see the
``tiny_model`` module doc), so any difference at all is a bug. Correctness of the maths is
tested separately against a plain float64 implementation with a tolerance.
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
import pytest

from kvroute.worker_agent.engines.tiny_model import (
    ForwardItem,
    TinyModel,
    TinyModelConfig,
    matmul,
)

B = 16


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel(TinyModelConfig(), max_positions=1024)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def garbage_cache(model: TinyModel, blocks: int, seed: int = 9):
    """A cache whose slots all hold finite junk: unused slots must not leak into results."""
    kv = model.new_cache(blocks, B)
    kv.data[:] = np.random.default_rng(seed).standard_normal(kv.data.shape, dtype=np.float32)
    return kv


def test_weights_are_seeded_float32() -> None:
    a = TinyModel(TinyModelConfig(seed=1), 64)
    b = TinyModel(TinyModelConfig(seed=1), 64)
    c = TinyModel(TinyModelConfig(seed=2), 64)
    assert a.embed.dtype == np.float32 and a.layers[0].wqkv.dtype == np.float32
    assert np.array_equal(a.embed, b.embed) and np.array_equal(a.unembed, b.unembed)
    assert not np.array_equal(a.embed, c.embed)


def test_chunked_prefill_and_decode_equal_one_prefill_bit_for_bit(model: TinyModel) -> None:
    toks = tokens(150, 1)
    ref = model.reference_logits(toks, B)
    kv = garbage_cache(model, 40)
    table = np.random.default_rng(3).permutation(40)[:10].tolist()  # scattered blocks
    got = []
    # Chunk boundaries off and on block edges, then token-by-token decode.
    bounds = [0, 7, 40, 48, 49, 120]
    for lo, hi in itertools.pairwise(bounds):
        got.append(model.forward(kv, [ForwardItem(toks[lo:hi], lo, table)], all_logits=True)[0])
    for p in range(120, 150):
        got.append(model.forward(kv, [ForwardItem(toks[p : p + 1], p, table)])[0][None])
    assert np.array_equal(np.concatenate(got), ref)


def test_cached_blocks_are_read_not_recomputed(model: TinyModel) -> None:
    shared = tokens(48, 2)  # 3 full blocks
    a, b = shared + tokens(20, 3), shared + tokens(37, 4)
    kv = garbage_cache(model, 20)
    table_a = [5, 9, 2, 14, 0]
    model.forward(kv, [ForwardItem(a, 0, table_a)])
    before = kv.data[table_a[:3]].copy()
    # b reuses a's first 3 blocks and computes only its own 37 tokens.
    table_b = [*table_a[:3], 7, 11, 19]
    got = model.forward(kv, [ForwardItem(b[48:], 48, table_b)], all_logits=True)[0]
    assert np.array_equal(got, model.reference_logits(b, B)[48:])
    assert np.array_equal(kv.data[table_a[:3]], before)  # shared blocks untouched


def test_batch_composition_does_not_change_results(model: TinyModel) -> None:
    seqs = [tokens(n, 10 + n) for n in (1, 5, 33, 70)]
    kv = garbage_cache(model, 40)
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(len(seqs))]
    # Step 1: all four prefill in one pass. Step 2: three decode + one more prefill chunk.
    first = model.forward(kv, [*(ForwardItem(seqs[i][: max(1, len(seqs[i]) - 1)], 0, tables[i])
                                 for i in range(3)),
                               ForwardItem(seqs[3][:40], 0, tables[3])])
    second = model.forward(kv, [*(ForwardItem(seqs[i][-1:], len(seqs[i]) - 1, tables[i])
                                  for i in (1, 2)),
                                ForwardItem(seqs[3][40:], 40, tables[3])])
    for i, s in enumerate(seqs[:3]):
        ref = model.reference_logits(s, B)
        assert np.array_equal(first[i], ref[max(1, len(s) - 1) - 1])
    assert np.array_equal(second[0], model.reference_logits(seqs[1], B)[-1])
    assert np.array_equal(second[1], model.reference_logits(seqs[2], B)[-1])
    assert np.array_equal(second[2], model.reference_logits(seqs[3], B)[-1])


def plain_float64_logits(m: TinyModel, toks: list[int]) -> npt.NDArray[np.float64]:
    """The same transformer written the obvious way (float64, BLAS, full causal mask)."""
    c = m.config
    n, h, dh = len(toks), c.heads, c.head_dim

    def norm(x: npt.NDArray[np.float64], g: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.norm_eps) * g

    inv = c.rope_base ** (-np.arange(0, dh, 2) / dh)
    ang = np.arange(n)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    x = m.embed[toks].astype(np.float64)
    causal = np.tril(np.ones((n, n), bool))
    for layer in m.layers:
        q, k, v = np.split(norm(x, layer.g_attn) @ layer.wqkv, 3, axis=-1)
        q, k = rope(q.reshape(n, h, dh)), rope(k.reshape(n, h, dh))
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v.reshape(n, h, dh)).reshape(n, -1)
        x = x + o @ layer.wo
        u = norm(x, layer.g_mlp) @ layer.w1
        x = x + (u / (1 + np.exp(-u))) @ layer.w2
    return norm(x, m.g_out) @ m.unembed


def test_paged_model_computes_real_causal_attention(model: TinyModel) -> None:
    toks = tokens(90, 5)
    got = model.reference_logits(toks, B)
    want = plain_float64_logits(model, toks)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # Causality: changing a later token leaves earlier logits untouched.
    other = [*toks[:60], (toks[60] + 1) % 256, *toks[61:]]
    assert np.array_equal(model.reference_logits(other, B)[:60], got[:60])
    assert not np.array_equal(model.reference_logits(other, B)[60:], got[60:])


@pytest.mark.parametrize("shape", [(1, 64, 192), (3, 256, 64), (600, 64, 300), (2, 64, 5000)])
def test_matmul_sums_in_index_order_whatever_the_batch(shape: tuple[int, int, int]) -> None:
    t, k, n = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((t, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    got = matmul(x, w)
    want = x[:, 0, None] * w[0]
    for i in range(1, k):
        want = want + x[:, i, None] * w[i]
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(matmul(x[-1:], w), got[-1:])  # one row alone: same bits


def test_numpy_exp_is_position_independent() -> None:
    """Invariant 4 of the module doc, which the exactness relies on."""
    x = np.random.default_rng(1).standard_normal(10_007, dtype=np.float32) * 10
    full = np.exp(x)
    for start in (0, 1, 5, 13):
        for n in (1, 3, 8, 17, 64, 100):
            assert np.array_equal(np.exp(x[start : start + n]), full[start : start + n])


def test_forward_rejects_bad_items(model: TinyModel) -> None:
    kv = model.new_cache(4, B)
    with pytest.raises(ValueError, match="out of range"):
        model.forward(kv, [ForwardItem([300], 0, [0])])
    with pytest.raises(ValueError, match="block table"):
        model.forward(kv, [ForwardItem(tokens(17, 1), 0, [0])])
    with pytest.raises(ValueError, match="bad forward item"):
        model.forward(kv, [ForwardItem([], 0, [0])])
    with pytest.raises(ValueError, match="even size"):
        TinyModelConfig(dim=12, heads=4)
