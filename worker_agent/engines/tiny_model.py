"""A small decoder-only transformer in numpy over a paged KV cache, exact by construction.

Architecture (pre-norm, Llama-like; float32 throughout; weights from a seeded normal)::

    h = E[token]                                        E: vocab x D
    per layer:
      a       = rmsnorm(h) * g1                         rmsnorm(x) = x / sqrt(mean(x^2) + eps)
      q, k, v = a Wq, a Wk, a Wv                        H heads of Dh = D / H
      q, k    = rope(q, pos) / sqrt(Dh), rope(k, pos)   rotate-half RoPE, base 10000
      K/V of the new tokens -> their slots in the paged cache
      o_t     = sum_{s <= t} softmax_s(q_t . k_s) v_s   causal, over cached + new K/V
      h      += o Wo
      h      += silu((rmsnorm(h) * g2) W1) W2           silu(x) = x / (1 + exp(-x)), W1: D x 4D
    logits = (rmsnorm(h) * g3) U                        U: D x vocab

Paged KV cache: :class:`PagedKV` holds ``data[capacity_blocks, layers, 2, block_size, heads,
head_dim]`` (2 = K, V). A sequence's block table maps position ``p`` to the slot
``(table[p // B], p % B)``; blocks shared between sequences are read, never rewritten (a
sequence only writes positions past its cached prefix, which live in its own fresh blocks).

**Exactness invariant.** The K/V and the logits of position ``t`` are a function of
``tokens[0..t]`` alone, bit for bit: they do not depend on which other tokens share the forward
pass (batch, prefill chunk, decode step), on how many positions came from the cache, nor on
what the unused slots of a block hold. So a request whose prefix comes from the cache gets
exactly the logits of an uncached run (tests use ``np.array_equal``). Why it holds:

1. No BLAS. A BLAS matmul picks kernels and summation order by matrix shape (gemv for one row,
   blocked gemm otherwise), so one row's result changes with the batch it is in. :func:`matmul`
   adds the K products of each output one at a time in index order, with float32 ufuncs whose
   every operation is correctly rounded: row t depends on row t only.
2. Fixed-length reductions (rmsnorm over D) run the same code for every row; q . k over Dh is
   an explicit loop in index order.
3. Sums over the context (softmax numerator and denominator) have an order fixed by absolute
   key positions: one at a time within each tile of 32 keys (a reduction along a
   non-innermost axis, where numpy adds in index order), then tile by tile. Masked positions
   contribute exact zeros (exp(-inf) = 0, 0 * v = 0, x + 0 = x), so neither padding nor the
   context length a query is computed with changes its result.
4. Elementwise functions (exp) give each element the same result wherever it sits in an array
   (numpy's SIMD kernels treat tails like the body; a test checks it).

The price is speed: several times slower than BLAS, still a 1k-token prefill in a fraction of
a second at dim 64, 2 layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

_Q_CHUNK = 64
"""Prefill queries per :func:`attend` call: their scores ``[H, ctx, 64]`` stay cache-sized."""
_DECODE_BUDGET = 1 << 20
"""Most score floats (``sequences * H * ctx``) of one batched decode :func:`attend` call."""
_KEY_TILE = 32
"""Keys per partial sum in :func:`attend` (fewer numpy calls than one key at a time)."""
_MM_PRODUCT_MAX = 1 << 20
"""``matmul`` forms the whole ``[T, K, N]`` product and reduces it when it has at most this many
floats (few numpy calls: decode); above, it loops over K. Both add in the same order."""
_MM_ACC_MAX = 1 << 18
"""Largest accumulator (floats) of the K loop; wider outputs go in column chunks (cache)."""


@dataclass(frozen=True, slots=True)
class TinyModelConfig:
    """Shape and seed of the transformer. ``head_dim = dim / heads`` must be even (RoPE)."""

    vocab_size: int = 258
    dim: int = 64
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    seed: int = 0
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "layers", "heads", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TinyModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.heads} heads of even size")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class PagedKV:
    """K/V storage by physical block: ``data[block, layer, 0 = K | 1 = V, slot, head, dim]``.

    Zero-initialised, so every slot always holds finite values (invariant 3 of the module doc
    needs ``0 * v == 0`` for the masked slots).
    """

    __slots__ = ("block_size", "data")

    def __init__(self, capacity_blocks: int, config: TinyModelConfig, block_size: int) -> None:
        self.block_size = block_size
        self.data: F32 = np.zeros(
            (capacity_blocks, config.layers, 2, block_size, config.heads, config.head_dim),
            np.float32)

    @property
    def capacity_blocks(self) -> int:
        return int(self.data.shape[0])


@dataclass(frozen=True, slots=True)
class ForwardItem:
    """One sequence's share of a forward pass: ``tokens`` at positions ``start, start + 1, ...``.

    Positions ``[0, start)`` must already be in the cache under ``blocks`` (the block table),
    which must cover ``start + len(tokens)`` positions.
    """

    tokens: Sequence[int]
    start: int
    blocks: Sequence[int]


@dataclass(frozen=True, slots=True)
class _Layer:
    g_attn: F32
    wqkv: F32  # D x 3D: q | k | v
    wo: F32
    g_mlp: F32
    w1: F32
    w2: F32


def matmul(x: F32, w: F32) -> F32:
    """``x [T, K] @ w [K, N]`` with each output summed in index order ``k = 0 .. K-1``::

        out[t, n] = (((x[t,0] w[0,n] + x[t,1] w[1,n]) + x[t,2] w[2,n]) + ...)

    so row ``t`` of the result depends on row ``t`` of ``x`` alone (invariant 1).
    """
    t, k = x.shape
    n = w.shape[1]
    if t * k * n <= _MM_PRODUCT_MAX:
        # Reduction along a non-innermost axis (N >= 2 follows): numpy adds in index order.
        return np.add.reduce(x[:, :, None] * w[None], axis=1)
    cols = max(256, _MM_ACC_MAX // t)
    if cols < n:
        out = np.empty((t, n), np.float32)
        for c0 in range(0, n, cols):
            out[:, c0 : c0 + cols] = matmul(x, w[:, c0 : c0 + cols])
        return out
    acc = x[:, 0, None] * w[0]
    for i in range(1, k):
        acc += x[:, i, None] * w[i]
    return acc


def rmsnorm(x: F32, gain: F32, eps: float) -> F32:
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return x / np.sqrt(ms + np.float32(eps)) * gain


def silu(x: F32) -> F32:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives x / inf = -0: right
        return x / (np.float32(1) + np.exp(-x))


def rope(x: F32, cos: F32, sin: F32) -> F32:
    """Rotate-half RoPE: ``x [T, H, Dh]``, ``cos``/``sin`` ``[T, 1, Dh/2]`` of each position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attend(q: F32, qpos: I64, kt: F32, vt: F32) -> F32:
    """Causal attention of query groups over their own contexts.

    ``q [G, nq, H, Dh]`` (already scaled) at positions ``qpos [G, nq]``; ``kt [Dh, G, H, ctx]``
    (K, transposed) and ``vt [G, H, ctx, Dh + 1]`` (V with a trailing channel of ones) hold
    positions ``0 .. ctx - 1``; key ``j`` is visible to a query at ``p`` iff ``j <= p``.
    Returns ``[G, nq, H, Dh]``::

        out = (sum_j e_j v_j) / (sum_j e_j),   e_j = exp(q . k_j - max_j' q . k_j')

    Both sums come from one accumulation (the ones channel gives the denominator) in a fixed
    order: within each tile of ``_KEY_TILE`` keys at absolute positions ``[32 i, 32 i + 32)``
    one at a time, then tile by tile. Masked keys give e_j = 0 and keys past every query are
    skipped, which changes no sum (invariant 3).
    """
    g, nq, h, dh = q.shape
    last = int(qpos.max()) + 1  # keys from here on are masked for every query
    qt = np.ascontiguousarray(q.transpose(3, 0, 2, 1))  # [Dh, G, H, nq]
    kt = kt[..., :last]
    # Scores [G, H, ctx, nq]: the queries innermost, so the ufuncs stream long contiguous rows.
    s = kt[0][..., :, None] * qt[0][..., None, :]
    for d in range(1, dh):
        s += kt[d][..., :, None] * qt[d][..., None, :]
    visible = np.arange(last)[None, :, None] <= qpos[:, None, :]  # [G, ctx, nq]
    s = np.where(visible[:, None], s, np.float32(-np.inf))
    s -= s.max(axis=2, keepdims=True)
    np.exp(s, out=s)
    acc = np.zeros((g, h, dh + 1, nq), np.float32)
    for j0 in range(0, last, _KEY_TILE):
        j1 = min(last, j0 + _KEY_TILE)
        # Reduction along a non-innermost axis: numpy adds the tile's keys in index order.
        acc += np.add.reduce(vt[:, :, j0:j1, :, None] * s[:, :, j0:j1, None, :], axis=2)
    return (acc[:, :, :dh] / acc[:, :, dh:]).transpose(0, 3, 1, 2)


class TinyModel:
    """The transformer of the module doc: seeded weights, RoPE tables for ``max_positions``.

    :meth:`forward` is re-entrant for disjoint block sets but not thread-safe on one
    :class:`PagedKV`; the engine runs one forward at a time.
    """

    def __init__(self, config: TinyModelConfig, max_positions: int) -> None:
        if max_positions <= 0:
            raise ValueError(f"max_positions must be > 0, got {max_positions}")
        self.config = config
        self.max_positions = max_positions
        c = config
        d, f, v = c.dim, c.dim * c.mlp_ratio, c.vocab_size
        rng = np.random.default_rng(c.seed)

        def normal(shape: tuple[int, ...], std: float) -> F32:
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

        def ones() -> F32:
            return np.ones(d, np.float32)

        self.embed = normal((v, d), 1.0)
        self.layers = [
            _Layer(g_attn=ones(), wqkv=normal((d, 3 * d), d ** -0.5), wo=normal((d, d), d ** -0.5),
                   g_mlp=ones(), w1=normal((d, f), d ** -0.5), w2=normal((f, d), f ** -0.5))
            for _ in range(c.layers)
        ]
        self.g_out = ones()
        # Logits with std ~2: peaked enough that sampling at temperature 1 is not uniform noise.
        self.unembed = normal((d, v), 2 * d ** -0.5)
        # Tables computed once, so a position's angles never depend on the call (invariant 4).
        inv_freq = c.rope_base ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
        angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None]
        self._cos = np.cos(angles).astype(np.float32)
        self._sin = np.sin(angles).astype(np.float32)
        self._scale = np.float32(c.head_dim ** -0.5)

    def new_cache(self, capacity_blocks: int, block_size: int) -> PagedKV:
        return PagedKV(capacity_blocks, self.config, block_size)

    def forward(self, kv: PagedKV, items: Sequence[ForwardItem], *,
                all_logits: bool = False) -> list[F32]:
        """Compute and store the K/V of every item's tokens; return, per item, the logits of
        its last token ``[vocab]`` (``all_logits``: of each of its tokens, ``[n, vocab]``).

        Items must not share the blocks they write to.
        """
        if not items:
            return []
        c, bs = self.config, kv.block_size
        h_, dh, d = c.heads, c.head_dim, c.dim
        lens = [len(it.tokens) for it in items]
        tables = [np.asarray(it.blocks, np.int64) for it in items]
        for it, n, table in zip(items, lens, tables, strict=True):
            end = it.start + n
            if n == 0 or it.start < 0:
                raise ValueError(f"bad forward item: {n} tokens at position {it.start}")
            if end > self.max_positions or len(table) * bs < end:
                raise ValueError(f"positions up to {end} exceed the block table "
                                 f"({len(table)} blocks of {bs}) or {self.max_positions}")
        toks = np.concatenate([np.asarray(it.tokens, np.int64) for it in items])
        if toks.min() < 0 or toks.max() >= c.vocab_size:
            raise ValueError(f"token id out of range [0, {c.vocab_size})")
        pos = np.concatenate([np.arange(it.start, it.start + n)
                              for it, n in zip(items, lens, strict=True)])
        slot_block = np.concatenate([tb[np.arange(it.start, it.start + n) // bs]
                                     for it, n, tb in zip(items, lens, tables, strict=True)])
        slot = pos % bs
        offsets = np.concatenate([[0], np.cumsum(lens)])
        cos, sin = self._cos[pos][:, None, :], self._sin[pos][:, None, :]
        n_tok = len(toks)

        h = self.embed[toks]
        for li, layer in enumerate(self.layers):
            a = rmsnorm(h, layer.g_attn, c.norm_eps)
            qkv = matmul(a, layer.wqkv).reshape(n_tok, 3, h_, dh)
            q = rope(qkv[:, 0], cos, sin) * self._scale
            kv.data[slot_block, li, 0, slot] = rope(qkv[:, 1], cos, sin)
            kv.data[slot_block, li, 1, slot] = qkv[:, 2]
            o = self._attention(kv, li, q, pos, items, lens, tables, offsets)
            h = h + matmul(o.reshape(n_tok, d), layer.wo)
            m = rmsnorm(h, layer.g_mlp, c.norm_eps)
            h = h + matmul(silu(matmul(m, layer.w1)), layer.w2)
        if all_logits:
            logits = matmul(rmsnorm(h, self.g_out, c.norm_eps), self.unembed)
            return [logits[offsets[i]:offsets[i + 1]] for i in range(len(items))]
        last = offsets[1:] - 1
        logits = matmul(rmsnorm(h[last], self.g_out, c.norm_eps), self.unembed)
        return list(logits)

    def reference_logits(self, tokens: Sequence[int], block_size: int = 16) -> F32:
        """Logits ``[n, vocab]`` of every position of ``tokens``, prefilled at once in a private
        cache: the uncached reference for the exactness tests."""
        kv = self.new_cache(max(1, -(-len(tokens) // block_size)), block_size)
        item = ForwardItem(tokens, 0, range(kv.capacity_blocks))
        return self.forward(kv, [item], all_logits=True)[0]

    # -- attention scheduling ---------------------------------------------------------------

    def _gather(self, kv: PagedKV, layer: int, tables: I64) -> tuple[F32, F32]:
        """K as ``[Dh, G, H, nb * B]`` and ones-augmented V as ``[G, H, nb * B, Dh + 1]`` of
        the block tables ``tables [G, nb]`` (the layouts :func:`attend` takes)."""
        g, nb = tables.shape
        c = self.config
        ctx = nb * kv.block_size
        k = kv.data[tables, layer, 0].reshape(g, ctx, c.heads, c.head_dim)
        kt = np.ascontiguousarray(k.transpose(3, 0, 2, 1))
        vt = np.ones((g, c.heads, ctx, c.head_dim + 1), np.float32)
        v = kv.data[tables, layer, 1].reshape(g, ctx, c.heads, c.head_dim)
        vt[..., :-1] = v.transpose(0, 2, 1, 3)
        return kt, vt

    def _attention(self, kv: PagedKV, layer: int, q: F32, pos: I64,
                   items: Sequence[ForwardItem], lens: list[int], tables: list[I64],
                   offsets: npt.NDArray[np.intp]) -> F32:
        """Attention output ``[T, H, Dh]`` for every new token. Multi-token items (prefill)
        go one at a time in query chunks; single-token items (decode) are batched, their
        block tables padded with a valid block whose slots are masked."""
        c, bs = self.config, kv.block_size
        out = np.empty_like(q)
        decode: list[int] = []
        for i, (it, n) in enumerate(zip(items, lens, strict=True)):
            if n == 1:
                decode.append(i)
                continue
            ctx = it.start + n
            kt, vt = self._gather(kv, layer, tables[i][None, : -(-ctx // bs)])
            r0 = int(offsets[i])
            for c0 in range(0, n, _Q_CHUNK):
                rows = slice(r0 + c0, r0 + min(n, c0 + _Q_CHUNK))
                out[rows] = attend(q[None, rows], pos[None, rows], kt, vt)[0]
        while decode:
            max_ctx = max(items[i].start + 1 for i in decode)
            group_n = max(1, _DECODE_BUDGET // (max_ctx * c.heads))
            group, decode = decode[:group_n], decode[group_n:]
            nb = -(-max(items[i].start + 1 for i in group) // bs)
            padded = np.empty((len(group), nb), np.int64)
            for row, i in enumerate(group):
                used = -(-(items[i].start + 1) // bs)
                padded[row, :used] = tables[i][:used]
                padded[row, used:] = tables[i][0]
            kt, vt = self._gather(kv, layer, padded)
            rows_ = offsets[group]
            out[rows_] = attend(q[rows_][:, None], pos[rows_][:, None], kt, vt)[:, 0]
        return out
