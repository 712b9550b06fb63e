"""Paged attention for decoding in native Triton: the kernel of `mtjax.kernels.paged_attention`.

The Pallas module prepares the launch (query rows of a KV head ``t * groups + g``, the context split,
the padded block table) and merges the splits; this kernel is its native port: one program per
(sequence, KV head and row block, context split), gathering ``block_k // page_size`` pages per loop
step through the block table, an online softmax in base 2 with float32 statistics, FP8 pages widened
in registers with their per-KV-head scales folded into the logit scale and the output.
"""

import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mtjax.kernels import paged_attention as pallas_paged
from mtjax.kernels.common import Launchers
from mtjax.kernels.triton.language import tanh
from mtjax.kernels.triton.runtime import launch

LOG2E = math.log2(math.e)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, k_scales_ptr, v_scales_ptr, o_ptr, lse_ptr,
                   KV_HEADS: tl.constexpr, NUM_PAGES: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PADDED_PAGES: tl.constexpr,
                   NUM_ROW_BLOCKS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                   PAGES_PER_BLOCK: tl.constexpr, PAGES_PER_SPLIT: tl.constexpr, Q_LEN: tl.constexpr,
                   GROUPS: tl.constexpr, ROWS: tl.constexpr, SCALE2: tl.constexpr, SOFT_CAP: tl.constexpr,
                   CAP2: tl.constexpr, HAS_WINDOW: tl.constexpr, WINDOW_LEFT: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0)
    kv_h = tl.program_id(1) // NUM_ROW_BLOCKS
    row_block = tl.program_id(1) % NUM_ROW_BLOCKS
    split = tl.program_id(2)
    length = tl.load(lengths_ptr + b)
    rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    q_pos = length - Q_LEN + tl.minimum(rows, ROWS - 1) // GROUPS  # rows past ROWS (masked) repeat the last one
    # Keys the block's rows may see: [first_key, last_key].
    last_key = tl.max(q_pos, axis=0)
    if HAS_WINDOW:
        first_key = tl.maximum(tl.min(q_pos, axis=0) - WINDOW_LEFT, 0)
    else:
        first_key = last_key * 0
    split_start = split * PAGES_PER_SPLIT
    start_page = tl.maximum(split_start, first_key // PAGE_SIZE)
    end_page = tl.minimum(split_start + PAGES_PER_SPLIT, (last_key + PAGE_SIZE) // PAGE_SIZE)
    start_block = (start_page - split_start) // PAGES_PER_BLOCK
    end_block = tl.maximum((tl.maximum(end_page - split_start, 0) + PAGES_PER_BLOCK - 1) // PAGES_PER_BLOCK,
                           start_block)

    dims = tl.arange(0, HEAD_DIM)
    real = rows < ROWS  # the last row block may reach past the KV head's rows: masked, not padded
    q_offsets = ((b * KV_HEADS + kv_h) * ROWS + rows[:, None]) * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=real[:, None], other=0.0)
    if FP8:
        k_scale = tl.load(k_scales_ptr + kv_h)
        v_scale = tl.load(v_scales_ptr + kv_h)
    else:
        k_scale = 1.0
        v_scale = 1.0
    logit_scale2 = SCALE2 * k_scale  # the logit scale times log2 e
    keys = tl.arange(0, BLOCK_K)
    page_base = (kv_h * NUM_PAGES).to(tl.int64)

    acc = tl.zeros((BLOCK_ROWS, HEAD_DIM), tl.float32)
    m = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_ROWS,), tl.float32)
    for j in tl.range(start_block, end_block):
        page0 = split_start + j * PAGES_PER_BLOCK
        pages = tl.load(tables_ptr + b * PADDED_PAGES + page0 + keys // PAGE_SIZE)
        kv_offsets = ((page_base + pages) * PAGE_SIZE + keys % PAGE_SIZE)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + kv_offsets).to(q.dtype)
        v = tl.load(v_ptr + kv_offsets).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee" if q.dtype == tl.float32 else "tf32")
        if SOFT_CAP:  # CAP2 = cap * log2 e
            s = CAP2 * tanh(s * (logit_scale2 / CAP2))
        else:
            s = s * logit_scale2
        k_pos = page0 * PAGE_SIZE + keys
        keep = k_pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            keep = keep & (k_pos[None, :] >= q_pos[:, None] - WINDOW_LEFT)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee" if v.dtype == tl.float32
                                            else "tf32")
        m = m_new
    empty = denom == 0.0
    split_offset = split * tl.num_programs(0) + b
    out_rows = (split_offset * KV_HEADS + kv_h) * ROWS + rows
    out = acc * (v_scale / tl.where(empty, 1.0, denom))[:, None]
    tl.store(o_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], out, mask=real[:, None])
    # Log-sum-exp in base 2; -inf where this split saw nothing (the merge then gives it no weight).
    tl.store(lse_ptr + out_rows, tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, denom))),
             mask=real)


def _decode(qr, k_pages, v_pages, tables, lens, k_scales, v_scales, *, st, num_row_blocks: int, num_splits: int,
            blocks, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """`mtjax.kernels.paged_attention._decode` (same arguments and results) on the native Triton kernel."""
    del interpret  # the runtime decides (config.pallas_interpret)
    batch, kv_heads, rows, head_dim = qr.shape
    out, lse = launch(
        _decode_kernel, qr, k_pages, v_pages, tables, lens.reshape(batch), k_scales.reshape(kv_heads),
        v_scales.reshape(kv_heads),
        out_shape=[jax.ShapeDtypeStruct((num_splits, batch, kv_heads, rows, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, batch, kv_heads, rows), jnp.float32)],
        grid=(batch, kv_heads * num_row_blocks, num_splits), name="mtjax_triton_paged_attention",
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        KV_HEADS=kv_heads, NUM_PAGES=k_pages.shape[1], PAGE_SIZE=k_pages.shape[2], HEAD_DIM=head_dim,
        PADDED_PAGES=tables.shape[1], NUM_ROW_BLOCKS=num_row_blocks,
        BLOCK_ROWS=st.block_rows, BLOCK_K=st.pages_per_block * k_pages.shape[2], PAGES_PER_BLOCK=st.pages_per_block,
        PAGES_PER_SPLIT=st.pages_per_split, Q_LEN=st.q_len, GROUPS=st.groups, ROWS=st.rows,
        SCALE2=st.scale * LOG2E, SOFT_CAP=st.soft_cap is not None,
        CAP2=(st.soft_cap or 1.0) * LOG2E, HAS_WINDOW=st.window_left is not None,
        WINDOW_LEFT=st.window_left or 0, FP8=st.fp8,
    )
    return out, lse


NATIVE = Launchers(forward=_decode)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scale=None, v_scale=None, **options) -> jax.Array:
    """`mtjax.kernels.paged_attention.paged_attention` (same arguments but ``interpret``) on the native
    Triton kernel."""
    return pallas_paged.paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scale, v_scale,
                                        launchers=NATIVE, **options)

