"""Flash attention, forward and backward, in native Triton: the algorithm of `mtjax.kernels.flash_attention`.

The Pallas module owns what does not depend on the kernel language: the padding to whole tiles,
`MaskSpec` (causal and sliding windows as a band of ``key - query`` offsets, bottom-right aligned),
`BlockSizes` and its per-head_dim defaults, the custom_vjp glue and the checks. This module supplies
its three kernels as `Launchers` (`mtjax.kernels.common`):

- forward, one program per (query block, batch, head), query blocks last-first: an online softmax
  in base 2 with float32 statistics over the key blocks the band lets it see, the band's masked
  blocks first and the unmasked ones last (`_for_blocks`), saving the row log-sum-exp;
- dk/dv, one program per (key block, batch, kv head), looping over the kv head's query heads (GQA
  without repeating K/V);
- dq, one program per (query block, batch, head);
- on Hopper, the forward for 16-bit inputs of head_dim 128 without segments, soft-capping or
  dropout as `_fwd_tma_kernel`: TMA descriptors built on the device and Triton's warp
  specialization (a producer partition loading, consumer partitions computing) over one loop.

Loops over key (or query) blocks are ``tl.range`` loops that Triton software-pipelines over
``num_stages`` stages (cp.async on Ampere and Hopper, where ``tl.dot`` becomes wgmma). Dropout redraws
the counter-based mask of `mtjax.kernels.common.dropout_keep` in every kernel, as the Pallas kernels do.
``tl.exp2`` of ``s * c - m`` compiles to one ``fma`` and one ``ex2.approx.ftz`` on NVIDIA GPUs, the
instruction pair the Pallas kernels write as inline PTX.
"""

import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mtjax import backend
from mtjax.kernels import flash_attention as fa
from mtjax.kernels.common import Launchers, interpret
from mtjax.kernels.triton.language import cdiv, clip, dropout_keep, dropout_threshold, tanh
from mtjax.kernels.triton.runtime import compute_capability, launch, seed_input, stand_in

LOG2E = math.log2(math.e)


# --------------------------------------------------------------------------------------------------
# Device functions: block bounds, logits, masks
# --------------------------------------------------------------------------------------------------


@triton.jit
def _kv_blocks(q0, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, OFFSET: tl.constexpr, KV_LEN: tl.constexpr,
               HAS_LO: tl.constexpr, LO: tl.constexpr, HAS_HI: tl.constexpr, HI: tl.constexpr):
    """`fa.MaskSpec.kv_blocks`: key blocks ``lo <= full_lo <= full_hi <= hi`` of queries ``q0..``."""
    first_q = q0 + OFFSET
    last_q = q0 + BLOCK_Q - 1 + OFFSET
    zero = q0 * 0
    if HAS_LO:
        lo = tl.maximum(first_q + LO, 0) // BLOCK_K
    else:
        lo = zero
    if HAS_HI:
        end = clip(last_q + HI + 1, 0, KV_LEN)
    else:
        end = zero + KV_LEN
    hi = tl.maximum(cdiv(end, BLOCK_K), lo)
    if HAS_LO:
        full_lo = clip(cdiv(tl.maximum(last_q + LO, 0), BLOCK_K), lo, hi)
    else:
        full_lo = lo
    if HAS_HI:
        full_end = clip(first_q + HI + 1, 0, KV_LEN)
    else:
        full_end = zero + KV_LEN
    full_hi = clip(full_end // BLOCK_K, full_lo, hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _q_blocks(k0, BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr, OFFSET: tl.constexpr, Q_LEN: tl.constexpr,
              KV_LEN: tl.constexpr, HAS_LO: tl.constexpr, LO: tl.constexpr, HAS_HI: tl.constexpr, HI: tl.constexpr):
    """`fa.MaskSpec.q_blocks`: query blocks ``lo <= full_lo <= full_hi <= hi`` of keys ``k0..``."""
    first_k = k0 - OFFSET
    last_k = k0 + BLOCK_K - 1 - OFFSET
    zero = k0 * 0
    if HAS_HI:
        lo = tl.maximum(first_k - HI, 0) // BLOCK_Q
    else:
        lo = zero
    if HAS_LO:
        end = clip(last_k - LO + 1, 0, Q_LEN)
    else:
        end = zero + Q_LEN
    hi = tl.maximum(cdiv(end, BLOCK_Q), lo)
    if HAS_HI:
        full_lo = clip(cdiv(tl.maximum(last_k - HI, 0), BLOCK_Q), lo, hi)
    else:
        full_lo = lo
    if HAS_LO:
        full_hi = clip(tl.maximum(first_k - LO + 1, 0) // BLOCK_Q, full_lo, hi)
    else:
        full_hi = hi
    # A key block reaching into the padded key tail is masked throughout.
    full_hi = tl.where(k0 + BLOCK_K > KV_LEN, full_lo, full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _logits(a, b, SOFT_CAP: tl.constexpr, CAP2: tl.constexpr, CAP_SCALE: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b^T`` in float32, soft-capped (``CAP2 * tanh(s * CAP_SCALE)``, the cap times log2 e) if asked:
    with the exponent factor `_exp_factor`, the logits in the base-2 domain."""
    s = tl.dot(a, tl.trans(b), input_precision=PRECISION)
    if SOFT_CAP:
        s = CAP2 * tanh(s * CAP_SCALE)
    return s


@triton.jit
def _soft_cap_grad(ds, s, SOFT_CAP: tl.constexpr, CAP2: tl.constexpr):
    """``ds`` through the soft-cap: ``s`` = the capped logits times log2 e (as `_logits` returns them)."""
    if SOFT_CAP:
        t = s * (1.0 / CAP2)
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _keep(q_pos, k_pos, q_seg, kv_seg, EDGE: tl.constexpr, OFFSET: tl.constexpr, KV_LEN: tl.constexpr,
          HAS_LO: tl.constexpr, LO: tl.constexpr, HAS_HI: tl.constexpr, HI: tl.constexpr, SEGMENTS: tl.constexpr):
    """`fa.MaskSpec.keep`: the visible pairs of a tile (positions and segment ids broadcast to 2-D, a
    column against a row either way round). ``EDGE``: the tile may straddle the band or the key tail;
    tiles inside need only the segment test."""
    if EDGE:
        delta = k_pos - q_pos - OFFSET
        keep = (k_pos < KV_LEN) & (delta == delta)
        if HAS_LO:
            keep = keep & (delta >= LO)
        if HAS_HI:
            keep = keep & (delta <= HI)
        if SEGMENTS:
            keep = keep & (q_seg == kv_seg) & (q_seg != 0) & (kv_seg != 0)
    else:
        keep = (q_seg == kv_seg) & (q_seg != 0) & (kv_seg != 0)
    return keep


@triton.jit
def _dropped(x, seed, row_ids, cols, DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr, KEEP_SCALE: tl.constexpr):
    if DROPOUT:
        x = tl.where(dropout_keep(seed, row_ids, cols, THRESHOLD), x * KEEP_SCALE, 0.0)
    return x


@triton.jit
def _query_block(q_seg_ptr, seed_ptr, k_ptr, v_ptr, kv_seg_ptr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, Q_LEN: tl.constexpr,
                 KV_LEN: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LO: tl.constexpr,
                 LO: tl.constexpr, HAS_HI: tl.constexpr, HI: tl.constexpr, SEGMENTS: tl.constexpr):
    """What a program over a query block (grid: query block, batch, head) starts from: its batch and
    head, rows, the offsets of its ``[BLOCK_Q, HEAD_DIM]`` tile, segment ids, dropout row counters
    and seed, the bases of its kv head's K, V and segment ids, and the bounds of its key blocks."""
    # The grid runs query blocks last-first: under a causal mask they carry the most work.
    q0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_Q
    b = tl.program_id(1)
    h = tl.program_id(2)
    kv_h = h // (HEADS // KV_HEADS)
    rows = q0 + tl.arange(0, BLOCK_Q)
    q_offsets = ((b * Q_PAD + rows[:, None]) * HEADS + h) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    q_seg = tl.load(q_seg_ptr + b * Q_PAD + rows) if SEGMENTS else rows
    row_ids = ((b * HEADS + h) * Q_LEN + rows).to(tl.uint32, bitcast=True)
    seed = tl.load(seed_ptr).to(tl.uint32, bitcast=True)
    kv_base = (b * KV_PAD * KV_HEADS + kv_h) * HEAD_DIM
    lo, full_lo, full_hi, hi = _kv_blocks(q0, BLOCK_Q, BLOCK_K, KV_LEN - Q_LEN, KV_LEN, HAS_LO, LO, HAS_HI, HI)
    return (b, h, rows, q_offsets, q_seg, row_ids, seed, k_ptr + kv_base, v_ptr + kv_base, kv_seg_ptr + b * KV_PAD,
            lo, full_lo, full_hi, hi)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _softmax_step(m, l, s, C: tl.constexpr):
    """One key block of the online softmax: from the running max ``m`` and normaliser ``l`` and the
    block's logits ``s`` (masked ones -inf), ``(m_new, alpha, p, l_new)``: the rescale factor of what
    was accumulated and the block's weights, in base 2 (``C``: the scale times log2 e)."""
    m_new = tl.maximum(m, tl.max(s, axis=1) * C)  # C > 0: the max of the scaled row
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s * C - m_safe[:, None])
    return m_new, alpha, p, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _store_forward(o_ptr, lse_ptr, acc, m, l, o_offsets, lse_offsets):
    """The normalised output and the row log-sum-exp (base 2) of a query block."""
    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty))
    # +inf for rows that saw nothing: the backward pass then recomputes p = exp2(s - lse) = 0.
    tl.store(lse_ptr + lse_offsets, tl.where(empty, float("inf"), m + tl.log2(tl.where(empty, 1.0, l))))


@triton.jit
def _fwd_blocks(acc, m, l, q, q_seg, rows, row_ids, seed, k_base, v_base, kv_seg_base, start, end,
                EDGE: tl.constexpr, KV_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                C: tl.constexpr, OFFSET: tl.constexpr, KV_LEN: tl.constexpr, HAS_LO: tl.constexpr, LO: tl.constexpr,
                HAS_HI: tl.constexpr, HI: tl.constexpr, SEGMENTS: tl.constexpr, SOFT_CAP: tl.constexpr,
                CAP2: tl.constexpr, CAP_SCALE: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
                THRESHOLD: tl.constexpr, KEEP_SCALE: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    for j in tl.range(start, end):
        cols = j * BLOCK_K + tl.arange(0, BLOCK_K)
        k = tl.load(k_base + cols[:, None] * KV_STRIDE + dims[None, :])
        s = _logits(q, k, SOFT_CAP, CAP2, CAP_SCALE, PRECISION)
        if EDGE or SEGMENTS:
            kv_seg = tl.load(kv_seg_base + cols) if SEGMENTS else cols
            keep = _keep(rows[:, None], cols[None, :], q_seg[:, None], kv_seg[None, :], EDGE, OFFSET, KV_LEN,
                         HAS_LO, LO, HAS_HI, HI, SEGMENTS)
            s = tl.where(keep, s, float("-inf"))
        m_new, alpha, p, l = _softmax_step(m, l, s, C)  # the normaliser counts dropped entries too
        p = _dropped(p, seed, row_ids[:, None], cols[None, :], DROPOUT, THRESHOLD, KEEP_SCALE)
        v = tl.load(v_base + cols[:, None] * KV_STRIDE + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, q_seg_ptr, kv_seg_ptr, seed_ptr, o_ptr, lse_ptr,
                Q_PAD: tl.constexpr, KV_PAD: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, Q_LEN: tl.constexpr, KV_LEN: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_K: tl.constexpr, HAS_LO: tl.constexpr, LO: tl.constexpr, HAS_HI: tl.constexpr,
                HI: tl.constexpr, SEGMENTS: tl.constexpr, C: tl.constexpr, SOFT_CAP: tl.constexpr,
                CAP2: tl.constexpr, CAP_SCALE: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
                THRESHOLD: tl.constexpr, KEEP_SCALE: tl.constexpr):
    KV_STRIDE: tl.constexpr = KV_HEADS * HEAD_DIM
    OFFSET: tl.constexpr = KV_LEN - Q_LEN
    (b, h, rows, q_offsets, q_seg, row_ids, seed, k_base, v_base, kv_seg_base, lo, full_lo, full_hi,
     hi) = _query_block(q_seg_ptr, seed_ptr, k_ptr, v_ptr, kv_seg_ptr, Q_PAD, KV_PAD, HEADS, KV_HEADS, HEAD_DIM, Q_LEN,
                        KV_LEN, BLOCK_Q, BLOCK_K, HAS_LO, LO, HAS_HI, HI, SEGMENTS)
    q = tl.load(q_ptr + q_offsets)

    acc = tl.zeros((BLOCK_Q, HEAD_DIM), tl.float32)
    m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_Q,), tl.float32)
    # The band's masked edges first, so the program ends in its long unmasked loop (docs/kernels.md).
    acc, m, l = _fwd_blocks(acc, m, l, q, q_seg, rows, row_ids, seed, k_base, v_base, kv_seg_base, full_hi, hi, True,
                            KV_STRIDE, HEAD_DIM, BLOCK_K, C, OFFSET, KV_LEN, HAS_LO, LO, HAS_HI, HI, SEGMENTS,
                            SOFT_CAP, CAP2, CAP_SCALE, PRECISION, DROPOUT, THRESHOLD, KEEP_SCALE)
    acc, m, l = _fwd_blocks(acc, m, l, q, q_seg, rows, row_ids, seed, k_base, v_base, kv_seg_base, lo, full_lo, True,
                            KV_STRIDE, HEAD_DIM, BLOCK_K, C, OFFSET, KV_LEN, HAS_LO, LO, HAS_HI, HI, SEGMENTS,
                            SOFT_CAP, CAP2, CAP_SCALE, PRECISION, DROPOUT, THRESHOLD, KEEP_SCALE)
    acc, m, l = _fwd_blocks(acc, m, l, q, q_seg, rows, row_ids, seed, k_base, v_base, kv_seg_base, full_lo, full_hi,
                            False, KV_STRIDE, HEAD_DIM, BLOCK_K, C, OFFSET, KV_LEN, HAS_LO, LO, HAS_HI, HI, SEGMENTS,
                            SOFT_CAP, CAP2, CAP_SCALE, PRECISION, DROPOUT, THRESHOLD, KEEP_SCALE)
    _store_forward(o_ptr, lse_ptr, acc, m, l, q_offsets, (b * HEADS + h) * Q_PAD + rows)


@triton.jit
def _tiles_of(ptr, PAD: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A TMA descriptor of a ``[batch, PAD, HEADS, HEAD_DIM]`` array as ``[batch * PAD, HEADS * HEAD_DIM]``
    rows of tokens, in ``[BLOCK, HEAD_DIM]`` tiles (one head's columns); grid axis 1 is the batch."""
    return tl.make_tensor_descriptor(ptr, shape=[tl.num_programs(1) * PAD, HEADS * HEAD_DIM],
                                     strides=[HEADS * HEAD_DIM, 1], block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def _band_masked(s, rows, j, BLOCK_K: tl.constexpr, OFFSET: tl.constexpr, KV_LEN: tl.constexpr, TAIL: tl.constexpr,
                 HAS_LO: tl.constexpr, LO: tl.constexpr, HAS_HI: tl.constexpr, HI: tl.constexpr,
                 ROW_LIMITS: tl.constexpr):
    """The logits ``s`` of query ``rows`` and key block ``j``, -inf outside the band and the keys
    (``TAIL``: the keys end before the padded length).

    ``ROW_LIMITS``: the band and the key tail become each row's first and last visible column of the
    block (vectors), so a logit costs one comparison per edge it has; else `_keep`.
    """
    cols = tl.arange(0, BLOCK_K)
    if ROW_LIMITS:
        k0 = j * BLOCK_K
        if HAS_HI:
            last = rows + (OFFSET + HI) - k0
            if TAIL:
                last = tl.minimum(last, KV_LEN - 1 - k0)
            keep = cols[None, :] <= last[:, None]
            if HAS_LO:
                keep = keep & (cols[None, :] >= (rows + (OFFSET + LO) - k0)[:, None])
        elif HAS_LO:
            keep = cols[None, :] >= (rows + (OFFSET + LO) - k0)[:, None]
            if TAIL:
                keep = keep & (cols[None, :] <= KV_LEN - 1 - k0)
        else:  # the key tail alone
            keep = (cols <= KV_LEN - 1 - k0)[None, :]
    else:
        cols = j * BLOCK_K + cols
        keep = _keep(rows[:, None], cols[None, :], rows[:, None], cols[None, :], True, OFFSET, KV_LEN, HAS_LO, LO,
                     HAS_HI, HI, False)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _fwd_tma_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, Q_LEN: tl.constexpr,
                    KV_LEN: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LO: tl.constexpr,
                    LO: tl.constexpr, HAS_HI: tl.constexpr, HI: tl.constexpr, C: tl.constexpr,
                    ROW_LIMITS: tl.constexpr):
    """The forward of `_fwd_kernel` without segments, soft-capping or dropout, as one warp-specialized
    loop: Q, K and V tiles come through TMA descriptors built on the device, and Triton splits the
    loop into a producer partition issuing the loads and consumer partitions running the GEMMs and
    the softmax. Triton's warp specialization takes one loop per kernel, so the band's edge blocks
    run in the same loop, the mask applied to every block (a branch on the block there stops
    Triton from specializing the loop)."""
    OFFSET: tl.constexpr = KV_LEN - Q_LEN
    MASKED: tl.constexpr = HAS_LO or HAS_HI or KV_LEN < KV_PAD
    q0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_Q
    b = tl.program_id(1)
    h = tl.program_id(2)
    kv_h = h // (HEADS // KV_HEADS)
    q_desc = _tiles_of(q_ptr, Q_PAD, HEADS, HEAD_DIM, BLOCK_Q)
    k_desc = _tiles_of(k_ptr, KV_PAD, KV_HEADS, HEAD_DIM, BLOCK_K)
    v_desc = _tiles_of(v_ptr, KV_PAD, KV_HEADS, HEAD_DIM, BLOCK_K)
    rows = q0 + tl.arange(0, BLOCK_Q)
    lo, _, _, hi = _kv_blocks(q0, BLOCK_Q, BLOCK_K, OFFSET, KV_LEN, HAS_LO, LO, HAS_HI, HI)
    q = q_desc.load([b * Q_PAD + q0, h * HEAD_DIM])
    acc = tl.zeros((BLOCK_Q, HEAD_DIM), tl.float32)
    m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_Q,), tl.float32)
    for j in tl.range(lo, hi, warp_specialize=True):
        k = k_desc.load([b * KV_PAD + j * BLOCK_K, kv_h * HEAD_DIM])
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = _band_masked(s, rows, j, BLOCK_K, OFFSET, KV_LEN, KV_LEN < KV_PAD, HAS_LO, LO, HAS_HI, HI, ROW_LIMITS)
        m_new, alpha, p, l = _softmax_step(m, l, s, C)
        v = v_desc.load([b * KV_PAD + j * BLOCK_K, kv_h * HEAD_DIM])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    q_offsets = ((b * Q_PAD + rows[:, None]) * HEADS + h) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    _store_forward(o_ptr, lse_ptr, acc, m, l, q_offsets, (b * HEADS + h) * Q_PAD + rows)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_blocks(dk, dv, k, v, cols, kv_seg, h, b, seed, q_ptr, do_ptr, lse_ptr, delta_ptr, q_seg_ptr, start, end,
                 EDGE: tl.constexpr, Q_PAD: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_Q: tl.constexpr, Q_LEN: tl.constexpr, C: tl.constexpr, OFFSET: tl.constexpr,
                 KV_LEN: tl.constexpr, HAS_LO: tl.constexpr, LO: tl.constexpr, HAS_HI: tl.constexpr, HI: tl.constexpr,
                 SEGMENTS: tl.constexpr, SOFT_CAP: tl.constexpr, CAP2: tl.constexpr, CAP_SCALE: tl.constexpr,
                 PRECISION: tl.constexpr, DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr, KEEP_SCALE: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    for i in tl.range(start, end):
        q_rows = i * BLOCK_Q + tl.arange(0, BLOCK_Q)
        offsets = ((b * Q_PAD + q_rows[:, None]) * HEADS + h) * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + offsets)
        do = tl.load(do_ptr + offsets)
        lse = tl.load(lse_ptr + (b * HEADS + h) * Q_PAD + q_rows)
        delta = tl.load(delta_ptr + (b * HEADS + h) * Q_PAD + q_rows)
        s_t = _logits(k, q, SOFT_CAP, CAP2, CAP_SCALE, PRECISION)  # [keys, queries]
        p_t = tl.exp2(s_t * C - lse[None, :])
        if EDGE or SEGMENTS:
            q_seg = tl.load(q_seg_ptr + b * Q_PAD + q_rows) if SEGMENTS else q_rows
            keep_t = _keep(q_rows[None, :], cols[:, None], q_seg[None, :], kv_seg[:, None], EDGE, OFFSET, KV_LEN,
                           HAS_LO, LO, HAS_HI, HI, SEGMENTS)
            p_t = tl.where(keep_t, p_t, 0.0)
        row_ids = ((b * HEADS + h) * Q_LEN + q_rows).to(tl.uint32, bitcast=True)
        dv += tl.dot(_dropped(p_t, seed, row_ids[None, :], cols[:, None], DROPOUT, THRESHOLD, KEEP_SCALE).to(do.dtype),
                     do, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dp_t = _dropped(dp_t, seed, row_ids[None, :], cols[:, None], DROPOUT, THRESHOLD, KEEP_SCALE)
        ds_t = _soft_cap_grad(p_t * (dp_t - delta[None, :]), s_t, SOFT_CAP, CAP2)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, q_seg_ptr, kv_seg_ptr, seed_ptr, dk_ptr, dv_ptr,
                 Q_PAD: tl.constexpr, KV_PAD: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, Q_LEN: tl.constexpr, KV_LEN: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_LO: tl.constexpr, LO: tl.constexpr, HAS_HI: tl.constexpr,
                 HI: tl.constexpr, SEGMENTS: tl.constexpr, SCALE: tl.constexpr, C: tl.constexpr,
                 SOFT_CAP: tl.constexpr, CAP2: tl.constexpr, CAP_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                 DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr, KEEP_SCALE: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K
    b = tl.program_id(1)
    kv_h = tl.program_id(2)
    GROUPS: tl.constexpr = HEADS // KV_HEADS
    cols = k0 + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, HEAD_DIM)
    kv_offsets = ((b * KV_PAD + cols[:, None]) * KV_HEADS + kv_h) * HEAD_DIM + dims[None, :]
    k = tl.load(k_ptr + kv_offsets)
    v = tl.load(v_ptr + kv_offsets)
    kv_seg = tl.load(kv_seg_ptr + b * KV_PAD + cols) if SEGMENTS else cols
    seed = tl.load(seed_ptr).to(tl.uint32, bitcast=True)
    OFFSET: tl.constexpr = KV_LEN - Q_LEN
    lo, full_lo, full_hi, hi = _q_blocks(k0, BLOCK_K, BLOCK_Q, OFFSET, Q_LEN, KV_LEN, HAS_LO, LO, HAS_HI, HI)
    dk = tl.zeros((BLOCK_K, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_K, HEAD_DIM), tl.float32)
    for g in range(GROUPS):
        h = kv_h * GROUPS + g
        dk, dv = _dkdv_blocks(dk, dv, k, v, cols, kv_seg, h, b, seed, q_ptr, do_ptr, lse_ptr, delta_ptr, q_seg_ptr,
                              full_hi, hi, True, Q_PAD, HEADS, HEAD_DIM, BLOCK_Q, Q_LEN, C, OFFSET, KV_LEN,
                              HAS_LO, LO, HAS_HI, HI, SEGMENTS, SOFT_CAP, CAP2, CAP_SCALE, PRECISION, DROPOUT,
                              THRESHOLD, KEEP_SCALE)
        dk, dv = _dkdv_blocks(dk, dv, k, v, cols, kv_seg, h, b, seed, q_ptr, do_ptr, lse_ptr, delta_ptr, q_seg_ptr,
                              lo, full_lo, True, Q_PAD, HEADS, HEAD_DIM, BLOCK_Q, Q_LEN, C, OFFSET, KV_LEN,
                              HAS_LO, LO, HAS_HI, HI, SEGMENTS, SOFT_CAP, CAP2, CAP_SCALE, PRECISION, DROPOUT,
                              THRESHOLD, KEEP_SCALE)
        dk, dv = _dkdv_blocks(dk, dv, k, v, cols, kv_seg, h, b, seed, q_ptr, do_ptr, lse_ptr, delta_ptr, q_seg_ptr,
                              full_lo, full_hi, False, Q_PAD, HEADS, HEAD_DIM, BLOCK_Q, Q_LEN, C, OFFSET,
                              KV_LEN, HAS_LO, LO, HAS_HI, HI, SEGMENTS, SOFT_CAP, CAP2, CAP_SCALE, PRECISION, DROPOUT,
                              THRESHOLD, KEEP_SCALE)
    tl.store(dk_ptr + kv_offsets, (dk * SCALE).to(dk_ptr.dtype.element_ty))
    tl.store(dv_ptr + kv_offsets, dv.to(dv_ptr.dtype.element_ty))


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, q_seg, rows, row_ids, seed, k_base, v_base, kv_seg_base, start, end,
               EDGE: tl.constexpr, KV_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
               C: tl.constexpr, OFFSET: tl.constexpr, KV_LEN: tl.constexpr, HAS_LO: tl.constexpr, LO: tl.constexpr,
               HAS_HI: tl.constexpr, HI: tl.constexpr, SEGMENTS: tl.constexpr, SOFT_CAP: tl.constexpr,
               CAP2: tl.constexpr, CAP_SCALE: tl.constexpr, PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
               THRESHOLD: tl.constexpr, KEEP_SCALE: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    for j in tl.range(start, end):
        cols = j * BLOCK_K + tl.arange(0, BLOCK_K)
        k = tl.load(k_base + cols[:, None] * KV_STRIDE + dims[None, :])
        v = tl.load(v_base + cols[:, None] * KV_STRIDE + dims[None, :])
        s = _logits(q, k, SOFT_CAP, CAP2, CAP_SCALE, PRECISION)
        p = tl.exp2(s * C - lse[:, None])
        if EDGE or SEGMENTS:
            kv_seg = tl.load(kv_seg_base + cols) if SEGMENTS else cols
            keep = _keep(rows[:, None], cols[None, :], q_seg[:, None], kv_seg[None, :], EDGE, OFFSET, KV_LEN,
                         HAS_LO, LO, HAS_HI, HI, SEGMENTS)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        dp = _dropped(dp, seed, row_ids[:, None], cols[None, :], DROPOUT, THRESHOLD, KEEP_SCALE)
        ds = _soft_cap_grad(p * (dp - delta[:, None]), s, SOFT_CAP, CAP2)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, q_seg_ptr, kv_seg_ptr, seed_ptr, dq_ptr,
               Q_PAD: tl.constexpr, KV_PAD: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
               HEAD_DIM: tl.constexpr, Q_LEN: tl.constexpr, KV_LEN: tl.constexpr, BLOCK_Q: tl.constexpr,
               BLOCK_K: tl.constexpr, HAS_LO: tl.constexpr, LO: tl.constexpr, HAS_HI: tl.constexpr,
               HI: tl.constexpr, SEGMENTS: tl.constexpr, SCALE: tl.constexpr, C: tl.constexpr,
               SOFT_CAP: tl.constexpr, CAP2: tl.constexpr, CAP_SCALE: tl.constexpr, PRECISION: tl.constexpr,
               DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr, KEEP_SCALE: tl.constexpr):
    KV_STRIDE: tl.constexpr = KV_HEADS * HEAD_DIM
    OFFSET: tl.constexpr = KV_LEN - Q_LEN
    (b, h, rows, q_offsets, q_seg, row_ids, seed, k_base, v_base, kv_seg_base, lo, full_lo, full_hi,
     hi) = _query_block(q_seg_ptr, seed_ptr, k_ptr, v_ptr, kv_seg_ptr, Q_PAD, KV_PAD, HEADS, KV_HEADS, HEAD_DIM, Q_LEN,
                        KV_LEN, BLOCK_Q, BLOCK_K, HAS_LO, LO, HAS_HI, HI, SEGMENTS)
    q = tl.load(q_ptr + q_offsets)
    do = tl.load(do_ptr + q_offsets)
    lse = tl.load(lse_ptr + (b * HEADS + h) * Q_PAD + rows)
    delta = tl.load(delta_ptr + (b * HEADS + h) * Q_PAD + rows)
    dq = tl.zeros((BLOCK_Q, HEAD_DIM), tl.float32)
    dq = _dq_blocks(dq, q, do, lse, delta, q_seg, rows, row_ids, seed, k_base, v_base, kv_seg_base, full_hi, hi, True,
                    KV_STRIDE, HEAD_DIM, BLOCK_K, C, OFFSET, KV_LEN, HAS_LO, LO, HAS_HI, HI, SEGMENTS, SOFT_CAP, CAP2,
                    CAP_SCALE, PRECISION, DROPOUT, THRESHOLD, KEEP_SCALE)
    dq = _dq_blocks(dq, q, do, lse, delta, q_seg, rows, row_ids, seed, k_base, v_base, kv_seg_base, lo, full_lo, True,
                    KV_STRIDE, HEAD_DIM, BLOCK_K, C, OFFSET, KV_LEN, HAS_LO, LO, HAS_HI, HI, SEGMENTS, SOFT_CAP, CAP2,
                    CAP_SCALE, PRECISION, DROPOUT, THRESHOLD, KEEP_SCALE)
    dq = _dq_blocks(dq, q, do, lse, delta, q_seg, rows, row_ids, seed, k_base, v_base, kv_seg_base, full_lo, full_hi,
                    False, KV_STRIDE, HEAD_DIM, BLOCK_K, C, OFFSET, KV_LEN, HAS_LO, LO, HAS_HI, HI, SEGMENTS, SOFT_CAP,
                    CAP2, CAP_SCALE, PRECISION, DROPOUT, THRESHOLD, KEEP_SCALE)
    tl.store(dq_ptr + q_offsets, (dq * SCALE).to(dq_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------------
# Launchers (the interface of `fa.PALLAS`) and entry points
# --------------------------------------------------------------------------------------------------


def _constexprs(q, k, st) -> dict:
    """The constexprs every kernel takes: shapes, mask band, logit transform, dropout."""
    batch, q_pad, heads, head_dim = q.shape
    mask = st.mask
    soft_cap = st.soft_cap is not None
    return dict(
        Q_PAD=q_pad, KV_PAD=k.shape[1], HEADS=heads, KV_HEADS=k.shape[2], HEAD_DIM=head_dim, Q_LEN=mask.q_len,
        KV_LEN=mask.kv_len, HAS_LO=mask.lo is not None, LO=mask.lo or 0, HAS_HI=mask.hi is not None, HI=mask.hi or 0,
        SEGMENTS=mask.segments, C=1.0 if soft_cap else st.scale * LOG2E, SOFT_CAP=soft_cap,
        CAP2=st.soft_cap * LOG2E if soft_cap else 1.0, CAP_SCALE=st.scale / st.soft_cap if soft_cap else 1.0,
        PRECISION="ieee" if q.dtype == jnp.float32 else "tf32", DROPOUT=st.dropout_rate > 0.0,
        THRESHOLD=dropout_threshold(st.dropout_rate), KEEP_SCALE=1.0 / (1.0 - st.dropout_rate),
    )


def _optional(q_seg, kv_seg, seed):
    """The segment ids and seed, or one-element stand-ins (the kernels take every pointer; static
    flags say which they read)."""
    if q_seg is None:
        q_seg = kv_seg = stand_in()
    return q_seg, kv_seg, seed_input(seed)


# The warp-specialized TMA forward (`_fwd_tma_kernel`) runs on Hopper (and in interpret mode) for
# 16-bit inputs of these head dims without segments, soft-capping or dropout; its tiles (block_q,
# block_k, num_warps, num_stages) per head_dim. Where it lost to `_fwd_kernel` (head_dim 64, the
# backward kernels written the same way): docs/kernels.md.
TMA_FORWARD_TILES = {128: (128, 128, 4, 2)}
# Whether the TMA forward masks a block by per-row column limits (`_band_masked`) instead of `_keep`;
# read at trace time. The same mask in fewer instructions, and faster on the GPU (docs/performance.md).
TMA_ROW_LIMITS = True


def _tma_forward_tiles(q, k, q_seg, st) -> tuple[int, int, int, int] | None:
    """The TMA forward's tiles for this call (padded ``q`` and ``k``), or None where `_fwd_kernel` runs."""
    tiles = TMA_FORWARD_TILES.get(q.shape[-1])
    if tiles is None or q.dtype not in (jnp.bfloat16, jnp.float16):
        return None
    if q_seg is not None or st.soft_cap is not None or st.dropout_rate > 0.0:
        return None
    if q.shape[1] % tiles[0] or k.shape[1] % tiles[1]:
        return None
    if st.blocks != fa.BlockSizes.default(q.shape[-1]).clamp(st.mask.q_len, st.mask.kv_len):
        return None  # tiles the caller chose (`block_sizes=`) are the forward's too
    # Measured on Hopper only (sm_12x's shared memory would not hold the tiles); a CPU host lowers for
    # ``cuda`` (export) at ``config.cuda_compute_capability``.
    if not interpret() and (backend.platform() not in ("cuda", "cpu") or compute_capability() // 10 != 9):
        return None
    return tiles


def _forward(q, k, v, q_seg, kv_seg, seed, st):
    batch, q_pad, heads, _ = q.shape
    tiles = _tma_forward_tiles(q, k, q_seg, st)
    if tiles is not None:
        block_q, block_k, warps, stages = tiles
        constexprs = _constexprs(q, k, st)
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)]
        return tuple(launch(
            _fwd_tma_kernel, q, k, v, out_shape=out_shape,
            grid=(q_pad // block_q, batch, heads), name="mtjax_triton_flash_attention_fwd_tma", num_warps=warps,
            num_stages=stages, BLOCK_Q=block_q, BLOCK_K=block_k, ROW_LIMITS=TMA_ROW_LIMITS,
            **{n: constexprs[n] for n in ("Q_PAD", "KV_PAD", "HEADS", "KV_HEADS", "HEAD_DIM", "Q_LEN", "KV_LEN",
                                          "HAS_LO", "LO", "HAS_HI", "HI", "C")},
        ))
    b = st.blocks
    out, lse = launch(
        _fwd_kernel, q, k, v, *_optional(q_seg, kv_seg, seed),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)],
        grid=(q_pad // b.block_q, batch, heads), name="mtjax_triton_flash_attention_fwd",
        num_warps=b.num_warps, num_stages=b.num_stages,
        BLOCK_Q=b.block_q, BLOCK_K=b.block_k, **_constexprs(q, k, st),
    )
    return out, lse


def _backward(q, k, v, q_seg, kv_seg, seed, out, lse, do, st):
    batch, q_pad, heads, _ = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    b = st.blocks
    # delta_i = sum_d dO_id O_id, the softmax-backward row term; a cheap fused XLA reduction.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), out.astype(jnp.float32))
    do = do.astype(q.dtype)
    optional = _optional(q_seg, kv_seg, seed)
    constexprs = dict(_constexprs(q, k, st), SCALE=st.scale)
    dk, dv = launch(
        _dkdv_kernel, q, k, v, do, lse, delta, *optional,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(kv_pad // b.dkdv_block_k, batch, kv_heads), name="mtjax_triton_flash_attention_dkdv",
        num_warps=b.dkdv_num_warps, num_stages=b.dkdv_num_stages,
        BLOCK_Q=b.dkdv_block_q, BLOCK_K=b.dkdv_block_k, **constexprs,
    )
    [dq] = launch(
        _dq_kernel, q, k, v, do, lse, delta, *optional,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        grid=(q_pad // b.dq_block_q, batch, heads), name="mtjax_triton_flash_attention_dq",
        num_warps=b.dq_num_warps, num_stages=b.dq_num_stages,
        BLOCK_Q=b.dq_block_q, BLOCK_K=b.dq_block_k, **constexprs,
    )
    return dq, dk, dv


NATIVE = Launchers(forward=_forward, backward=_backward)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, **options) -> jax.Array:
    """`mtjax.kernels.flash_attention.flash_attention` (same arguments, no ``interpret``/``ptx_exp2``)
    on the native Triton kernels."""
    return fa.flash_attention(q, k, v, q_segment_ids, kv_segment_ids, ptx_exp2=False, launchers=NATIVE, **options)


def flash_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None = None,
                            kv_segment_ids: jax.Array | None = None, **options) -> tuple[jax.Array, jax.Array]:
    """`mtjax.kernels.flash_attention.flash_attention_forward` on the native Triton forward kernel."""
    return fa.flash_attention_forward(q, k, v, q_segment_ids, kv_segment_ids, ptx_exp2=False, launchers=NATIVE,
                                      **options)


def flash_attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array | None,
                             kv_segment_ids: jax.Array | None, out: jax.Array, lse: jax.Array, d_out: jax.Array,
                             **options) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`mtjax.kernels.flash_attention.flash_attention_backward` on the native Triton backward kernels."""
    return fa.flash_attention_backward(q, k, v, q_segment_ids, kv_segment_ids, out, lse, d_out, ptx_exp2=False,
                                       launchers=NATIVE, **options)
