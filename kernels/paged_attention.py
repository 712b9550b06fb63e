"""Paged attention for decoding (and short chunked-prefill queries), in Pallas with the Triton lowering.

Layout as `mtjax.ops.paged_attention`: ``q [batch, q_len, heads, head_dim]``, pages
``[kv_heads, num_pages, page_size, head_dim]``, ``block_tables [batch, pages_per_seq]``, ``lengths [batch]``.

One program per (sequence, KV head, context split): it serves all the query heads of its KV head
(GQA) and all ``q_len`` queries at once, as the rows ``t * groups + g`` of one ``[rows, head_dim]``
tile, so each key/value page is read from memory once per KV head and not once per query head.
It walks its part of the sequence's pages through the block table, ``block_k // page_size`` pages at
a time (gathered into one ``[block_k, head_dim]`` tile), with an online softmax in the base-2 domain
and float32 statistics. Long contexts are split over ``num_splits`` programs per (sequence, KV head)
(flash-decoding), so that a small batch still fills the GPU: each writes its normalised partial
output and log-sum-exp, and a small XLA reduction merges them. A program stops at the last page its
queries can see (the sequence length, and causality for ``q_len > 1``), so the grid is sized for the
longest sequence while short ones cost only what they read; an empty slot reads nothing and returns
zeros.

FP8 pages (``float8_e4m3fn``/``float8_e5m2``) are read as FP8 (half the bytes) and widened to the
query dtype in registers; the per-KV-head scale of K folds into the logit scale and that of V into
the output. Forward only (inference): no VJP.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mtjax.kernels.common import KERNEL_FP8_DTYPES, MAX_ELEMENTS, Launchers, pallas_call
from mtjax.kernels.common import pallas_triton as pltriton

LOG2E = math.log2(math.e)
HEAD_DIMS = (16, 32, 64, 128, 256)
Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
PAGE_DTYPES = Q_DTYPES + tuple(jnp.dtype(d) for d in KERNEL_FP8_DTYPES)
_MIN_TILE = 16  # the smallest tile tl.dot accepts
# Programs to aim for when choosing the context split: a few per SM of an H100/H200 (132 SMs).
TARGET_PROGRAMS = 528
# Fewest keys one split gets: below this a program's fixed costs (its query tile, the partial result
# written and merged) outweigh its share of the reads.
MIN_KEYS_PER_SPLIT = 256


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """Tiles and Triton launch parameters of the decode kernel.

    Attributes:
      block_k: keys per loop step (a multiple of ``page_size``: that many pages are gathered per step).
      block_rows: the most query rows (``q_len * groups``) one program holds; more rows take several
        programs per KV head.
      num_splits: context splits per (sequence, KV head); ``None``: enough for `TARGET_PROGRAMS`
        programs, with at least `MIN_KEYS_PER_SPLIT` keys each.
      num_warps, num_stages: Triton launch parameters.
    """

    block_k: int = 64
    block_rows: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def default(cls, head_dim: int, page_size: int) -> DecodeBlocks:
        block_k = max(64 if head_dim <= 128 else 32, page_size, _MIN_TILE)
        return cls(block_k=block_k, block_rows=64 if head_dim <= 128 else 32)


@dataclasses.dataclass(frozen=True)
class _Static:
    q_len: int
    groups: int
    rows: int  # q_len * groups, the real rows of a KV head
    block_rows: int
    pages_per_block: int
    pages_per_split: int
    scale: float
    soft_cap: float | None
    window_left: int | None
    fp8: bool


def _decode_kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, ks_ref, vs_ref, o_ref, lse_ref, *, st: _Static,
                   num_row_blocks: int):
    # Grid coordinates are read here: interpret mode cannot read them inside loops.
    row_block = pl.program_id(1) % num_row_blocks
    split = pl.program_id(2)
    page_size = k_ref.shape[1]
    head_dim = q_ref.shape[-1]
    block_k = st.pages_per_block * page_size
    length = len_ref[0]

    rows = row_block * st.block_rows + jnp.arange(st.block_rows, dtype=jnp.int32)
    q_pos = length - st.q_len + lax.div(jnp.minimum(rows, st.rows - 1), st.groups)  # padding rows repeat the last one
    # Keys the block's rows may see: [first_key, last_key].
    last_key = jnp.max(q_pos)
    first_key = jnp.maximum(jnp.min(q_pos) - st.window_left, 0) if st.window_left is not None else 0
    split_start = split * st.pages_per_split
    start_page = jnp.maximum(split_start, lax.div(first_key, page_size))
    end_page = jnp.minimum(split_start + st.pages_per_split, lax.div(last_key + page_size, page_size))
    start_block = lax.div(start_page - split_start, st.pages_per_block)
    end_block = lax.div(jnp.maximum(end_page - split_start, 0) + st.pages_per_block - 1, st.pages_per_block)
    end_block = jnp.maximum(end_block, start_block)

    q = q_ref[...]
    k_scale = ks_ref[0] if st.fp8 else 1.0
    v_scale = vs_ref[0] if st.fp8 else 1.0
    logit_scale = st.scale * k_scale

    def body(j, carry):
        acc, m, denom = carry
        page0 = split_start + j * st.pages_per_block
        pages = bt_ref[pl.ds(page0, st.pages_per_block)]
        k = k_ref[pages].reshape(block_k, head_dim)
        v = v_ref[pages].reshape(block_k, head_dim)
        if k.dtype != q.dtype:
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if st.soft_cap is None:
            s = s * (logit_scale * LOG2E)
        else:
            s = (st.soft_cap * LOG2E) * jnp.tanh(s * (logit_scale / st.soft_cap))
        k_pos = page0 * page_size + jnp.arange(block_k, dtype=jnp.int32)
        keep = k_pos[None, :] <= q_pos[:, None]
        if st.window_left is not None:
            keep &= k_pos[None, :] >= q_pos[:, None] - st.window_left
        s = jnp.where(keep, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing visible yet
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        denom = denom * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, denom

    carry = (jnp.zeros((st.block_rows, head_dim), jnp.float32),
             jnp.full((st.block_rows,), -jnp.inf, jnp.float32), jnp.zeros((st.block_rows,), jnp.float32))
    acc, m, denom = lax.fori_loop(start_block, end_block, body, carry)
    empty = denom == 0.0
    o_ref[...] = acc * (v_scale / jnp.where(empty, 1.0, denom))[:, None]
    # Log-sum-exp in base 2; -inf where this split saw nothing (the merge then gives it no weight).
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, denom)))


def _decode(qr, k_pages, v_pages, tables, lens, k_scales, v_scales, *, st: _Static, num_row_blocks: int,
            num_splits: int, blocks: DecodeBlocks, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Launch the decode kernel on the prepared arrays (`paged_attention`; ``qr [batch, kv_heads, rows,
    head_dim]``): ``(out [splits, batch, kv_heads, rows, head_dim], lse [splits, batch, kv_heads, rows])``
    float32, normalised per split. The rows are padded to whole row blocks around the kernel."""
    batch, kv_heads, rows, head_dim = qr.shape
    nrb = num_row_blocks
    block_rows = st.block_rows
    padded_rows = nrb * block_rows
    if padded_rows > rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    grid = (batch, kv_heads * nrb, num_splits)
    q_spec = pl.BlockSpec((None, None, block_rows, head_dim), lambda b, h, s: (b, h // nrb, h % nrb, 0))
    page_spec = pl.BlockSpec((None,) + tuple(k_pages.shape[1:]), lambda b, h, s: (h // nrb, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, 1), lambda b, h, s: (h // nrb, 0))
    out, lse = pallas_call(
        functools.partial(_decode_kernel, st=st, num_row_blocks=nrb),
        grid=grid,
        in_specs=[q_spec, page_spec, page_spec, pl.BlockSpec((None, tables.shape[1]), lambda b, h, s: (b, 0)),
                  pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)), scale_spec, scale_spec],
        out_specs=[pl.BlockSpec((None, None, None, block_rows, head_dim), lambda b, h, s: (s, b, h // nrb, h % nrb, 0)),
                   pl.BlockSpec((None, None, None, block_rows), lambda b, h, s: (s, b, h // nrb, h % nrb))],
        out_shape=[jax.ShapeDtypeStruct((num_splits, batch, kv_heads, padded_rows, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, batch, kv_heads, padded_rows), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="mtjax_paged_attention",
    )(qr, k_pages, v_pages, tables, lens, k_scales, v_scales)
    return out[..., :rows, :], lse[..., :rows]


# forward(qr, k_pages, v_pages, tables, lens, k_scales, v_scales, *, st, num_row_blocks, num_splits, blocks,
# interpret) -> (out, lse), as `_decode`.
PALLAS = Launchers(forward=_decode)


def merge_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Combine normalised partial results ``out [splits, ..., d]`` with their base-2 log-sum-exp
    ``lse [splits, ...]`` into the softmax over all splits (zeros where no split saw a key)."""
    top = jnp.max(lse, axis=0)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp2(lse - top[None])  # 0 for empty splits
    total = jnp.sum(w, axis=0)
    merged = jnp.sum(out * w[..., None], axis=0)
    return merged / jnp.where(total == 0.0, 1.0, total)[..., None]


def unsupported(q_shape, page_shape, q_dtype, page_dtype, blocks: DecodeBlocks | None = None) -> str | None:
    """Why `paged_attention` cannot take these shapes/dtypes, or ``None`` if it can."""
    head_dim = q_shape[-1]
    page_size = page_shape[2]
    if jnp.dtype(q_dtype) not in Q_DTYPES:
        return f"q dtype {jnp.dtype(q_dtype)} (supported: {', '.join(map(str, Q_DTYPES))})"
    if jnp.dtype(page_dtype) not in PAGE_DTYPES:
        return f"page dtype {jnp.dtype(page_dtype)} (supported: {', '.join(map(str, PAGE_DTYPES))})"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (supported: {HEAD_DIMS})"
    if page_size & (page_size - 1) or page_size > 256:
        return f"page_size {page_size} (a power of two up to 256)"
    blocks = blocks or DecodeBlocks.default(head_dim, page_size)
    if blocks.block_k % page_size or blocks.block_k & (blocks.block_k - 1) or blocks.block_k < _MIN_TILE:
        return f"block_k {blocks.block_k} (a power of two >= {_MIN_TILE}, a multiple of page_size {page_size})"
    if math.prod(page_shape) > MAX_ELEMENTS:
        return f"pages of more than {MAX_ELEMENTS} elements (the kernel indexes with int32)"
    return None


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    scale: float,
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    blocks: DecodeBlocks | None = None,
    interpret: bool = False,
    launchers: Launchers = PALLAS,
) -> jax.Array:
    """Paged attention of the last ``q_len`` tokens of each sequence (module docstring).

    Args:
      q: ``[batch, q_len, heads, head_dim]``, ``head_dim`` in `HEAD_DIMS`.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``; ``page_size`` a power of two.
      block_tables: int32 ``[batch, pages_per_seq]``; lengths: int32 ``[batch]`` (new tokens included).
      k_scale, v_scale: float32 ``[kv_heads]`` dequantization scales of FP8 pages (else ``None``).
      scale: multiplies ``q k^T``.
      logits_soft_cap: ``cap * tanh(logits / cap)`` after scaling.
      window_left: a query at position ``i`` sees keys ``i - window_left .. i`` (``None``: unbounded).
      blocks: tiles, launch parameters and the context split; default `DecodeBlocks.default`.
      interpret: run in Pallas interpret mode (any backend, e.g. CPU tests).
      launchers: the kernel: `PALLAS`, or `mtjax.kernels.triton.paged_attention.NATIVE`.
    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``; queries that see no key are zeros.
    """
    batch, q_len, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    reason = unsupported(q.shape, k_pages.shape, q.dtype, k_pages.dtype, blocks)
    if reason is not None:
        raise ValueError(f"paged_attention kernel: unsupported {reason}")
    fp8 = jnp.dtype(k_pages.dtype) in [jnp.dtype(d) for d in KERNEL_FP8_DTYPES]
    if fp8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("paged_attention kernel: k_scale and v_scale go with FP8 pages, and only with them")
    groups = heads // kv_heads
    blocks = blocks or DecodeBlocks.default(head_dim, page_size)
    rows = q_len * groups
    block_rows = max(_MIN_TILE, min(blocks.block_rows, pl.next_power_of_2(rows)))
    num_row_blocks = pl.cdiv(rows, block_rows)
    pages_per_block = blocks.block_k // page_size
    pages_per_seq = block_tables.shape[1]
    num_blocks = pl.cdiv(pages_per_seq, pages_per_block)
    if blocks.num_splits is None:
        wanted = pl.cdiv(TARGET_PROGRAMS, batch * kv_heads * num_row_blocks)
        num_splits = max(1, min(wanted, pages_per_seq * page_size // MIN_KEYS_PER_SPLIT, num_blocks))
    else:
        num_splits = max(1, min(blocks.num_splits, num_blocks))
    pages_per_split = pl.cdiv(num_blocks, num_splits) * pages_per_block
    num_splits = pl.cdiv(pages_per_seq, pages_per_split)
    padded_pages = num_splits * pages_per_split
    st = _Static(q_len=q_len, groups=groups, rows=rows, block_rows=block_rows, pages_per_block=pages_per_block,
                 pages_per_split=pages_per_split, scale=float(scale),
                 soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                 window_left=window_left, fp8=fp8)

    compute_dtype = q.dtype if fp8 else jnp.promote_types(q.dtype, k_pages.dtype)
    # [batch, kv_heads, q_len * groups, head_dim]: the rows of one KV head, t-major.
    qr = q.astype(compute_dtype).reshape(batch, q_len, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    qr = qr.reshape(batch, kv_heads, rows, head_dim)
    tables = block_tables.astype(jnp.int32)
    if padded_pages > pages_per_seq:
        tables = jnp.pad(tables, ((0, 0), (0, padded_pages - pages_per_seq)))
    lens = lengths.astype(jnp.int32).reshape(batch, 1)
    if fp8:
        scales = (k_scale.astype(jnp.float32).reshape(kv_heads, 1), v_scale.astype(jnp.float32).reshape(kv_heads, 1))
    else:  # unused placeholders, so the kernel has one signature
        scales = (jnp.ones((kv_heads, 1), jnp.float32),) * 2

    out, lse = launchers.forward(qr, k_pages, v_pages, tables, lens, *scales, st=st, num_row_blocks=num_row_blocks,
                                 num_splits=num_splits, blocks=blocks, interpret=interpret)
    merged = out[0] if num_splits == 1 else merge_splits(out, lse)
    merged = merged.reshape(batch, kv_heads, q_len, groups, head_dim).transpose(0, 2, 1, 3, 4)
    return merged.reshape(batch, q_len, heads, head_dim).astype(q.dtype)
