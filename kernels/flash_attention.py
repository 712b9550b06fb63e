"""Flash attention, forward and backward, in Pallas with the Triton lowering.

Layout is BTNH: ``q [batch, q_len, heads, head_dim]``, ``k``/``v [batch, kv_len, kv_heads, head_dim]``
with ``heads`` a multiple of ``kv_heads``. The kernels never materialise the ``q_len x kv_len``
logits: the forward pass keeps an online softmax per block of queries and saves the row
log-sum-exp; the backward pass recomputes the probabilities from it in two kernels, one over key
blocks (dk, dv; for GQA it loops over the query heads of its kv head, so K/V are never repeated)
and one over query blocks (dq).

Masks are described statically by `MaskSpec` (causal and sliding window as a band of allowed
``key - query`` offsets, bottom-right aligned) plus optional segment ids (0 marks padding). Key
blocks entirely outside the band are skipped through the loop bounds; blocks entirely inside it
run without any mask arithmetic; only the band's edges (and the padded tails) are masked.
A query that sees no key returns zeros. Logits are scaled into the base-2 domain (``exp2``) and all
statistics and accumulators are float32. Dropout draws its mask from a counter-based hash of
(seed, row, key) in every kernel, so no ``q_len x kv_len`` mask is stored either.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mtjax.kernels.common import (
    LOG2E,
    MAX_ELEMENTS,
    Launchers,
    dropout_keep,
    pallas_call,
    vary_together,
    with_ptx,
)
from mtjax.kernels.common import pallas_triton as pltriton

HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MIN_BLOCK = 16  # the smallest tile tl.dot accepts


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Which keys a query sees, besides segment ids.

    Query ``i`` may see key ``j`` when ``lo <= j - (i + kv_len - q_len) <= hi`` and ``j < kv_len``.

    Attributes:
      q_len: the true query length (the arrays may be padded beyond it).
      kv_len: the true key length.
      lo: the smallest allowed offset (``-left`` of a sliding window), ``None`` for unbounded.
      hi: the largest allowed offset (0 when causal, ``right`` of a window), ``None`` for unbounded.
      segments: segment ids are given: keys must share the query's non-zero id.
    """

    q_len: int
    kv_len: int
    lo: int | None = None
    hi: int | None = None
    segments: bool = False

    @classmethod
    def build(cls, q_len: int, kv_len: int, *, causal: bool, window_size: tuple[int, int] | None,
              segments: bool) -> MaskSpec:
        lo = hi = None
        if window_size is not None:
            left, right = window_size
            lo = -left if left >= 0 else None
            hi = right if right >= 0 else None
        if causal:
            hi = 0 if hi is None else min(hi, 0)
        return cls(q_len=q_len, kv_len=kv_len, lo=lo, hi=hi, segments=segments)

    @property
    def offset(self) -> int:
        return self.kv_len - self.q_len

    def keep(self, q_pos, k_pos, q_seg, kv_seg, *, edge: bool):
        """Bool mask of visible pairs, or ``None`` when everything is visible.

        ``q_pos``/``q_seg`` and ``k_pos``/``kv_seg`` are 2-d and broadcast against each other (a
        column and a row, either way round), so the backward pass gets its transposed tile directly.
        ``edge`` says the block may straddle the band or the key tail; blocks inside need only the
        segment test.
        """
        keep = None

        def conj(a, b):
            return b if a is None else a & b

        if edge:
            delta = k_pos - q_pos - self.offset
            if self.lo is not None:
                keep = conj(keep, delta >= self.lo)
            if self.hi is not None:
                keep = conj(keep, delta <= self.hi)
            keep = conj(keep, k_pos < self.kv_len)
        if self.segments:
            keep = conj(keep, (q_seg == kv_seg) & (q_seg != 0) & (kv_seg != 0))
        return keep

    def kv_blocks(self, q0, block_q: int, block_k: int):
        """For queries ``[q0, q0 + block_q)``: key blocks ``lo <= full_lo <= full_hi <= hi``;
        ``[lo, hi)`` may hold visible keys and ``[full_lo, full_hi)`` is visible to every row."""
        first_q, last_q = q0 + self.offset, q0 + block_q - 1 + self.offset  # as key positions
        # Some row sees key j when first_q + lo <= j <= last_q + hi.
        lo = 0 if self.lo is None else lax.div(jnp.maximum(first_q + self.lo, 0), block_k)
        end = self.kv_len if self.hi is None else jnp.clip(last_q + self.hi + 1, 0, self.kv_len)
        hi = jnp.maximum(_cdiv(end, block_k), lo)
        # Every row sees the block [k0, k0 + block_k) when last_q + lo <= k0 and k0 + block_k - 1 <= first_q + hi.
        full_lo = lo
        if self.lo is not None:
            full_lo = jnp.clip(_cdiv(jnp.maximum(last_q + self.lo, 0), block_k), lo, hi)
        full_end = self.kv_len if self.hi is None else jnp.clip(first_q + self.hi + 1, 0, self.kv_len)
        full_hi = jnp.clip(lax.div(full_end, block_k), full_lo, hi)
        return _int32(lo, full_lo, full_hi, hi)

    def q_blocks(self, k0, block_k: int, block_q: int):
        """For keys ``[k0, k0 + block_k)``: query blocks ``lo <= full_lo <= full_hi <= hi`` (as
        `kv_blocks`). Padded query rows need no mask: their output gradient is zero."""
        first_k, last_k = k0 - self.offset, k0 + block_k - 1 - self.offset  # as query positions
        # Some key is seen by row i when first_k - hi <= i <= last_k - lo.
        lo = 0 if self.hi is None else lax.div(jnp.maximum(first_k - self.hi, 0), block_q)
        end = self.q_len if self.lo is None else jnp.clip(last_k - self.lo + 1, 0, self.q_len)
        hi = jnp.maximum(_cdiv(end, block_q), lo)
        # Row block [q0, q0 + block_q) sees every key when last_k - hi <= q0 and q0 + block_q - 1 <= first_k - lo.
        full_lo = lo
        if self.hi is not None:
            full_lo = jnp.clip(_cdiv(jnp.maximum(last_k - self.hi, 0), block_q), lo, hi)
        full_hi = hi
        if self.lo is not None:
            full_hi = jnp.clip(lax.div(jnp.maximum(first_k - self.lo + 1, 0), block_q), full_lo, hi)
        lo, full_lo, full_hi, hi = _int32(lo, full_lo, full_hi, hi)
        # A key block reaching into the padded key tail is masked throughout.
        full_hi = jnp.where(k0 + block_k > self.kv_len, full_lo, full_hi)
        return lo, full_lo, full_hi, hi


def _cdiv(a, b: int):
    return lax.div(a + b - 1, b)


def _int32(*bounds):
    # Bounds that are Python constants must become int32 values: Triton's select takes no mixed types.
    return tuple(jnp.asarray(b, jnp.int32) for b in bounds)


def _row(x):
    return None if x is None else x[None, :]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles and Triton launch parameters of the three kernels (the field defaults: head_dim 128).

    Attributes:
      block_q, block_k, num_warps, num_stages: the forward kernel.
      dkdv_block_q, dkdv_block_k, dkdv_num_warps, dkdv_num_stages: the dk/dv kernel.
      dq_block_q, dq_block_k, dq_num_warps, dq_num_stages: the dq kernel.
    """

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    dkdv_block_q: int = 64
    dkdv_block_k: int = 64
    dkdv_num_warps: int = 4
    dkdv_num_stages: int = 2
    dq_block_q: int = 128
    dq_block_k: int = 64
    dq_num_warps: int = 8
    dq_num_stages: int = 3

    @classmethod
    def default(cls, head_dim: int) -> BlockSizes:
        """The fastest tiles for ``head_dim`` on Hopper GPUs (`mtjax bench attention --sweep` and A/B
        runs; docs/kernels.md has the design notes, docs/performance.md the numbers).

        Four warps and two stages let two programs share an SM, so one's softmax runs under the
        other's GEMMs: the forward on 128x64 tiles and dk/dv on 64x64 (and dq on 64x64 at head_dim
        64, whose forward keeps 3 stages). 128x128 forward tiles on 8 warps were faster only on
        unmasked rows of 16384 keys, and asked for more shared memory than a Hopper SM has once a
        masked key tail joined the loop. head_dim 256 uses 64-row forward tiles, 32x64 dk/dv and 64x32 dq.
        """
        if head_dim <= 64:
            return cls(num_stages=3, dq_block_q=64, dq_num_warps=4, dq_num_stages=2)
        if head_dim <= 128:
            return cls()
        return cls(block_q=64, block_k=64, num_warps=8, num_stages=2,
                   dkdv_block_q=32, dkdv_block_k=64, dkdv_num_warps=8, dkdv_num_stages=1,
                   dq_block_q=64, dq_block_k=32, dq_num_warps=8, dq_num_stages=1)

    def clamp(self, q_len: int, kv_len: int) -> BlockSizes:
        """Shrink tiles that exceed the (power-of-two rounded) sequence lengths."""
        def fit(block, length):
            return max(_MIN_BLOCK, min(block, pl.next_power_of_2(length)))

        return dataclasses.replace(
            self,
            block_q=fit(self.block_q, q_len), block_k=fit(self.block_k, kv_len),
            dkdv_block_q=fit(self.dkdv_block_q, q_len), dkdv_block_k=fit(self.dkdv_block_k, kv_len),
            dq_block_q=fit(self.dq_block_q, q_len), dq_block_k=fit(self.dq_block_k, kv_len),
        )

    @property
    def q_multiple(self) -> int:
        return max(self.block_q, self.dkdv_block_q, self.dq_block_q)

    @property
    def kv_multiple(self) -> int:
        return max(self.block_k, self.dkdv_block_k, self.dq_block_k)


@dataclasses.dataclass(frozen=True)
class _Static:
    mask: MaskSpec
    scale: float
    soft_cap: float | None
    blocks: BlockSizes
    interpret: bool
    dropout_rate: float = 0.0
    ptx_exp2: bool = False
    launchers: Launchers | None = None  # None: the Pallas kernels here

    @property
    def kernels(self) -> Launchers:
        return self.launchers or PALLAS


def _logits2(q, k, st: _Static):
    """``(s, c)``: float32 ``s [rows, cols]`` with ``s * c`` the logits in the base-2 domain (scaled,
    soft-capped). Without a soft-cap ``s`` is the raw ``q k^T`` and ``c`` the scale, so that the scale
    folds into the exponent's subtraction (`_exp2_shifted`: one FMA per element, not a multiply and a
    subtraction); the elementwise work, not the GEMMs, is what bounds these kernels on Hopper."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if st.soft_cap is None:
        return s, st.scale * LOG2E
    return (st.soft_cap * LOG2E) * jnp.tanh(s * (st.scale / st.soft_cap)), 1.0


def _exp2_shifted(s, c: float, shift, ptx: bool):
    """``exp2(s * c - shift)`` (``shift`` broadcast against ``s``).

    With ``ptx`` each element is one PTX ``fma`` and one ``ex2.approx.ftz``: jnp.exp2 lowers to
    libdevice's ``__nv_exp2f``, whose denormal handling adds a compare and two multiplies around the
    MUFU instruction. Results below 2^-126 flush to zero, which no bf16 or f32 softmax weight notices.
    """
    if not ptx:
        return jnp.exp2((s if c == 1.0 else s * c) - shift)
    c_bits = struct.unpack("<I", struct.pack("<f", c))[0]
    [p] = pltriton.elementwise_inline_asm(
        f"{{ .reg .f32 t; fma.rn.ftz.f32 t, $1, 0f{c_bits:08X}, $2; ex2.approx.ftz.f32 $0, t; }}",
        args=[s, jnp.broadcast_to(-shift, s.shape)], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.float32)])
    return p


def _soft_cap_grad(ds, s2, st: _Static):
    """Chain ``ds`` (w.r.t. the capped logits) through ``cap * tanh(x / cap)``; ``s2`` = capped * log2 e."""
    if st.soft_cap is None:
        return ds
    t = s2 * (1.0 / (st.soft_cap * LOG2E))
    return ds * (1.0 - t * t)


def _for_blocks(bounds, body, carry):
    """Run ``body(edge, block, carry)`` over ``[full_hi, hi)`` and ``[lo, full_lo)`` with masks, then
    over ``[full_lo, full_hi)`` without. The masked edges go first, so a program ends in its long
    unmasked loop, which the attention benchmark found faster (docs/kernels.md)."""
    lo, full_lo, full_hi, hi = bounds
    carry = lax.fori_loop(full_hi, hi, functools.partial(body, True), carry)
    carry = lax.fori_loop(lo, full_lo, functools.partial(body, True), carry)
    return lax.fori_loop(full_lo, full_hi, functools.partial(body, False), carry)


def _optional_inputs(st: _Static, q_seg, kv_seg, seed, q_seg_spec, kv_seg_spec):
    """BlockSpecs and arrays of the inputs a call may lack: segment ids, the dropout seed."""
    specs, args = [], []
    if st.mask.segments:
        specs += [q_seg_spec, kv_seg_spec]
        args += [q_seg, kv_seg]
    if st.dropout_rate > 0.0:
        specs.append(pl.BlockSpec((1,), lambda *_: (0,)))
        args.append(seed.reshape(1))
    return specs, args


def _optional_refs(refs, st: _Static):
    """Split a kernel's trailing refs into ``(q_seg_ref, kv_seg_ref, seed_ref, output_refs)`` as laid
    out by `_optional_inputs` (absent ones are ``None``)."""
    refs = list(refs)
    q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if st.mask.segments else (None, None)
    seed_ref = refs.pop(0) if st.dropout_rate > 0.0 else None
    return q_seg_ref, kv_seg_ref, seed_ref, refs


def _dropout_rows(batch_index, head, num_heads: int, rows, st: _Static):
    """The dropout hash's row counters of query positions ``rows``: ``(b * heads + h) * q_len + i``
    (`mtjax.ops.attention.dropout_rows`), in uint32; ``None`` without dropout."""
    if st.dropout_rate == 0.0:
        return None
    base = (batch_index * num_heads + head).astype(jnp.uint32) * jnp.uint32(st.mask.q_len)
    return base + rows.astype(jnp.uint32)


def _dropout(x, seed_ref, row_ids, cols, st: _Static):
    """``x`` with the dropout mask applied (kept entries scaled by ``1 / (1 - rate)``)."""
    if seed_ref is None:
        return x
    keep = dropout_keep(seed_ref[0], row_ids, cols, st.dropout_rate)
    return jnp.where(keep, x * (1.0 / (1.0 - st.dropout_rate)), 0.0)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, st: _Static, num_q_blocks: int):
    q_seg_ref, kv_seg_ref, seed_ref, (o_ref, lse_ref) = _optional_refs(refs, st)
    block_q, block_k = st.blocks.block_q, st.blocks.block_k
    # The grid runs query blocks last-first: under a causal mask they carry the most work.
    q0 = (num_q_blocks - 1 - pl.program_id(0)) * block_q
    q = q_ref[...]
    rows = (q0 + jnp.arange(block_q))[:, None]
    q_seg = q_seg_ref[...][:, None] if st.mask.segments else None
    row_ids = _dropout_rows(pl.program_id(1), pl.program_id(2), pl.num_programs(2), rows, st)

    def body(edge, j, carry):
        acc, m, l = carry
        k0 = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(k0, block_k), :]
        s, c = _logits2(q, k, st)
        kv_seg = kv_seg_ref[pl.ds(k0, block_k)] if st.mask.segments else None
        keep = st.mask.keep(rows, (k0 + jnp.arange(block_k))[None, :], q_seg, _row(kv_seg), edge=edge)
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)  # c > 0: the max of the scaled row
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing visible yet
        alpha = jnp.exp2(m - m_safe)
        p = _exp2_shifted(s, c, m_safe[:, None], st.ptx_exp2)
        l = l * alpha + jnp.sum(p, axis=1)  # the normaliser counts dropped entries too
        p = _dropout(p, seed_ref, row_ids, (k0 + jnp.arange(block_k))[None, :], st)
        v = v_ref[pl.ds(k0, block_k), :]
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, l

    head_dim = q_ref.shape[-1]
    carry = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    acc, m, l = _for_blocks(st.mask.kv_blocks(q0, block_q, block_k), body, carry)
    empty = l == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    # +inf for rows that saw nothing: the backward pass then recomputes p = exp2(s - lse) = 0.
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _forward(q, k, v, q_seg, kv_seg, seed, st: _Static):
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    b = st.blocks
    nq = q_pad // b.block_q
    grid = (nq, batch, heads)

    def q_index(i, n, h):
        return n, nq - 1 - i, h, 0

    in_specs = [
        pl.BlockSpec((None, b.block_q, None, head_dim), q_index),
        pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, n, h: (n, 0, h // groups, 0)),
        pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, n, h: (n, 0, h // groups, 0)),
    ]
    specs, args = _optional_inputs(st, q_seg, kv_seg, seed,
                                   pl.BlockSpec((None, b.block_q), lambda i, n, h: (n, nq - 1 - i)),
                                   pl.BlockSpec((None, kv_pad), lambda i, n, h: (n, 0)))
    return pallas_call(
        functools.partial(_fwd_kernel, st=st, num_q_blocks=nq),
        grid=grid,
        in_specs=in_specs + specs,
        out_specs=[pl.BlockSpec((None, b.block_q, None, head_dim), q_index),
                   pl.BlockSpec((None, None, b.block_q), lambda i, n, h: (n, h, nq - 1 - i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
        interpret=st.interpret,
        name="mtjax_flash_attention_fwd",
    )(q, k, v, *args)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static, groups: int):
    q_seg_ref, kv_seg_ref, seed_ref, (dk_ref, dv_ref) = _optional_refs(refs, st)
    block_q, block_k = st.blocks.dkdv_block_q, st.blocks.dkdv_block_k
    k0 = pl.program_id(0) * block_k
    k = k_ref[...]
    v = v_ref[...]
    cols = (k0 + jnp.arange(block_k))[:, None]
    kv_seg = kv_seg_ref[...][:, None] if st.mask.segments else None
    bounds = st.mask.q_blocks(k0, block_k, block_q)
    # Grid coordinates are read here: interpret mode cannot read them inside loops.
    batch_index, first_head, num_heads = pl.program_id(1), pl.program_id(2) * groups, pl.num_programs(2) * groups

    def head(g, carry):
        def body(edge, i, carry):
            dk, dv = carry
            q0 = pl.multiple_of(i * block_q, block_q)
            q = q_ref[pl.ds(q0, block_q), g, :]
            do = do_ref[pl.ds(q0, block_q), g, :]
            lse = lse_ref[g, pl.ds(q0, block_q)]
            delta = delta_ref[g, pl.ds(q0, block_q)]
            s_t, c = _logits2(k, q, st)  # [keys, queries]
            q_seg = q_seg_ref[pl.ds(q0, block_q)][None, :] if st.mask.segments else None
            keep_t = st.mask.keep((q0 + jnp.arange(block_q))[None, :], cols, q_seg, kv_seg, edge=edge)
            p_t = _exp2_shifted(s_t, c, lse[None, :], st.ptx_exp2)
            if keep_t is not None:
                p_t = jnp.where(keep_t, p_t, 0.0)
            row_ids = _dropout_rows(batch_index, first_head + g, num_heads, (q0 + jnp.arange(block_q))[None, :], st)
            dv = dv + jnp.dot(_dropout(p_t, seed_ref, row_ids, cols, st).astype(do.dtype), do,
                              preferred_element_type=jnp.float32)
            dp_t = lax.dot_general(v, do, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            dp_t = _dropout(dp_t, seed_ref, row_ids, cols, st)
            ds_t = _soft_cap_grad(p_t * (dp_t - delta[None, :]), s_t, st)
            dk = dk + jnp.dot(ds_t.astype(q.dtype), q, preferred_element_type=jnp.float32)
            return dk, dv

        return _for_blocks(bounds, body, carry)

    head_dim = k_ref.shape[-1]
    zeros = jnp.zeros((block_k, head_dim), jnp.float32)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static, num_q_blocks: int):
    q_seg_ref, kv_seg_ref, seed_ref, (dq_ref,) = _optional_refs(refs, st)
    block_q, block_k = st.blocks.dq_block_q, st.blocks.dq_block_k
    q0 = (num_q_blocks - 1 - pl.program_id(0)) * block_q
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    rows = (q0 + jnp.arange(block_q))[:, None]
    q_seg = q_seg_ref[...][:, None] if st.mask.segments else None
    row_ids = _dropout_rows(pl.program_id(1), pl.program_id(2), pl.num_programs(2), rows, st)

    def body(edge, j, dq):
        k0 = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(k0, block_k), :]
        v = v_ref[pl.ds(k0, block_k), :]
        s, c = _logits2(q, k, st)
        kv_seg = kv_seg_ref[pl.ds(k0, block_k)] if st.mask.segments else None
        keep = st.mask.keep(rows, (k0 + jnp.arange(block_k))[None, :], q_seg, _row(kv_seg), edge=edge)
        p = _exp2_shifted(s, c, lse[:, None], st.ptx_exp2)
        if keep is not None:
            p = jnp.where(keep, p, 0.0)
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dp = _dropout(dp, seed_ref, row_ids, (k0 + jnp.arange(block_k))[None, :], st)
        ds = _soft_cap_grad(p * (dp - delta[:, None]), s, st)
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    dq = _for_blocks(st.mask.kv_blocks(q0, block_q, block_k), body,
                     jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _backward(q, k, v, q_seg, kv_seg, seed, out, lse, do, st: _Static):
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    b = st.blocks
    # delta_i = sum_d dO_id O_id, the softmax-backward row term; a cheap fused XLA reduction.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), out.astype(jnp.float32))
    do = do.astype(q.dtype)

    # dk, dv: one program per key block and kv head, looping over the kv head's query heads.
    nk = kv_pad // b.dkdv_block_k
    kv_block = pl.BlockSpec((None, b.dkdv_block_k, None, head_dim), lambda j, n, h: (n, j, h, 0))
    q_group = pl.BlockSpec((None, q_pad, groups, head_dim), lambda j, n, h: (n, 0, h, 0))
    row_group = pl.BlockSpec((None, groups, q_pad), lambda j, n, h: (n, h, 0))
    specs, args = _optional_inputs(st, q_seg, kv_seg, seed, pl.BlockSpec((None, q_pad), lambda j, n, h: (n, 0)),
                                   pl.BlockSpec((None, b.dkdv_block_k), lambda j, n, h: (n, j)))
    dk, dv = pallas_call(
        functools.partial(_dkdv_kernel, st=st, groups=groups),
        grid=(nk, batch, kv_heads),
        in_specs=[q_group, kv_block, kv_block, q_group, row_group, row_group] + specs,
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=pltriton.CompilerParams(num_warps=b.dkdv_num_warps, num_stages=b.dkdv_num_stages),
        interpret=st.interpret,
        name="mtjax_flash_attention_dkdv",
    )(q, k, v, do, lse, delta, *args)

    # dq: one program per query block and head.
    nq = q_pad // b.dq_block_q

    def q_index(i, n, h):
        return n, nq - 1 - i, h, 0

    q_block = pl.BlockSpec((None, b.dq_block_q, None, head_dim), q_index)
    kv_full = pl.BlockSpec((None, kv_pad, None, head_dim), lambda i, n, h: (n, 0, h // groups, 0))
    row_block = pl.BlockSpec((None, None, b.dq_block_q), lambda i, n, h: (n, h, nq - 1 - i))
    specs, args = _optional_inputs(st, q_seg, kv_seg, seed,
                                   pl.BlockSpec((None, b.dq_block_q), lambda i, n, h: (n, nq - 1 - i)),
                                   pl.BlockSpec((None, kv_pad), lambda i, n, h: (n, 0)))
    dq = pallas_call(
        functools.partial(_dq_kernel, st=st, num_q_blocks=nq),
        grid=(nq, batch, heads),
        in_specs=[q_block, kv_full, kv_full, q_block, row_block, row_block] + specs,
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=b.dq_num_warps, num_stages=b.dq_num_stages),
        interpret=st.interpret,
        name="mtjax_flash_attention_dq",
    )(q, k, v, do, lse, delta, *args)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# custom_vjp glue and the entry point
# --------------------------------------------------------------------------------------------------


# forward(q, k, v, q_seg, kv_seg, seed, st) -> (out, lse) on padded arrays, lse [batch, heads, q_pad]
# float32 in base 2 (+inf for rows that see no key); backward(q, k, v, q_seg, kv_seg, seed, out, lse,
# do, st) -> (dq, dk, dv).
PALLAS = Launchers(forward=_forward, backward=_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, q_seg, kv_seg, seed, st: _Static):
    return st.kernels.forward(q, k, v, q_seg, kv_seg, seed, st)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, seed, st: _Static):
    out, lse = st.kernels.forward(q, k, v, q_seg, kv_seg, seed, st)
    return out, (q, k, v, q_seg, kv_seg, seed, out, lse)


def _flash_bwd(st: _Static, residuals, do):
    q, k, v, q_seg, kv_seg, seed, out, lse = residuals
    dq, dk, dv = st.kernels.backward(q, k, v, q_seg, kv_seg, seed, out, lse, do, st)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def unsupported(q_shape, kv_shape, dtype) -> str | None:
    """Why `flash_attention` cannot take these shapes/dtype, or ``None`` if it can."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        return f"dtype {jnp.dtype(dtype)} (supported: bfloat16, float16, float32)"
    if q_shape[-1] not in HEAD_DIMS:
        return f"head_dim {q_shape[-1]} (supported: {HEAD_DIMS})"
    if q_shape[1] == 0 or kv_shape[1] == 0:
        return "empty sequence"
    if max(math.prod(q_shape), math.prod(kv_shape)) > MAX_ELEMENTS:
        return f"arrays of more than {MAX_ELEMENTS} elements (the kernels index with int32)"
    return None


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    scale: float,
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: jax.Array | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    ptx_exp2: bool | None = None,
    launchers: Launchers = PALLAS,
) -> jax.Array:
    """Flash attention over BTNH arrays; differentiable in ``q``, ``k``, ``v``.

    Args:
      q: ``[batch, q_len, heads, head_dim]``; ``head_dim`` in `HEAD_DIMS`.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``, same dtype as ``q``; ``heads % kv_heads == 0``.
      q_segment_ids, kv_segment_ids: int ``[batch, q_len]`` / ``[batch, kv_len]`` or both ``None``;
        a query sees keys of its own segment, id 0 is padding.
      scale: multiplies ``q k^T``.
      causal: bottom-right aligned causal mask (query ``i`` sees key ``j <= i + kv_len - q_len``).
      window_size: ``(left, right)``, ``-1`` unbounded: query ``i`` sees keys ``i - left .. i + right``
        (in the same bottom-right alignment).
      logits_soft_cap: ``cap * tanh(logits / cap)`` after scaling.
      dropout_rate: probability of dropping an attention weight (kept ones scale by ``1 / (1 - rate)``).
      dropout_seed: uint32 scalar; the mask is ``common.dropout_keep(seed, (b * heads + h) * q_len + i, j)``,
        recomputed by every kernel, never stored.
      block_sizes: tiles and launch parameters; default `BlockSizes.default`.
      interpret: run the kernels in Pallas interpret mode (any backend, e.g. CPU tests).
      ptx_exp2: compute the softmax probabilities' exponentials with PTX ``fma`` + ``ex2.approx.ftz``
        inline assembly (NVIDIA only); ``None``: wherever the lowering platform is ``cuda`` (through
        `jax.lax.platform_dependent`), never in interpret mode.
      launchers: the kernels: `PALLAS`, or `mtjax.kernels.triton.flash_attention.NATIVE`.
    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``; rows that see no key are zeros.
    """
    _check_blockwise("flash_attention", q, k, v, q_segment_ids, kv_segment_ids, ptx_exp2, interpret)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"flash_attention: dropout_rate={dropout_rate}; expected 0 <= dropout_rate < 1")
    if dropout_rate > 0.0 and dropout_seed is None:
        raise ValueError("flash_attention: dropout_rate > 0 needs dropout_seed")
    q_len = q.shape[1]
    st, args = _prepare(q, k, v, q_segment_ids, kv_segment_ids, scale=scale, causal=causal, window_size=window_size,
                        logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate, block_sizes=block_sizes,
                        interpret=interpret, launchers=launchers)
    seed = None if dropout_rate == 0.0 else jnp.asarray(dropout_seed, jnp.uint32)

    def run(ptx, *args):
        return _flash(*args, dataclasses.replace(st, ptx_exp2=ptx))

    out = _per_platform(ptx_exp2, interpret, run, *vary_together(*args, seed))
    return out[:, :q_len]


def _prepare(q, k, v, q_segment_ids, kv_segment_ids, *, scale, causal, window_size, logits_soft_cap, dropout_rate,
             block_sizes, interpret, launchers):
    """The static configuration and the inputs padded to whole blocks (the kernels mask the key
    tail; padded queries are dropped): ``(st, (q, k, v, q_seg, kv_seg))``."""
    q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    segments = q_segment_ids is not None
    blocks = (block_sizes or BlockSizes.default(head_dim)).clamp(q_len, kv_len)
    st = _Static(
        mask=MaskSpec.build(q_len, kv_len, causal=causal, window_size=window_size, segments=segments),
        scale=float(scale), soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        blocks=blocks, interpret=interpret, dropout_rate=float(dropout_rate), launchers=launchers,
    )
    q_pad = -q_len % blocks.q_multiple
    kv_pad = -kv_len % blocks.kv_multiple
    if q_pad:
        q = jnp.pad(q, ((0, 0), (0, q_pad), (0, 0), (0, 0)))
    if kv_pad:
        k, v = (jnp.pad(t, ((0, 0), (0, kv_pad), (0, 0), (0, 0))) for t in (k, v))
    if segments:
        q_segment_ids = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, q_pad)))
        kv_segment_ids = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, kv_pad)))
    return st, (q, k, v, q_segment_ids, kv_segment_ids)


def _check_blockwise(name, q, k, v, q_segment_ids, kv_segment_ids, ptx_exp2, interpret):
    reason = unsupported(q.shape, k.shape, q.dtype)
    if reason is not None:
        raise ValueError(f"{name}: unsupported {reason}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{name}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"{name}: k {k.shape} / v {v.shape} do not match q {q.shape}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{name}: pass q_segment_ids and kv_segment_ids together")
    if ptx_exp2 and interpret:
        raise ValueError(f"{name}: ptx_exp2=True is PTX inline assembly; interpret mode cannot run it")


def _per_platform(ptx_exp2, interpret, run, *args):
    """``run(ptx, *args)``; ``ptx_exp2=None`` decides per lowering platform (`with_ptx`): a rocm or
    plugin lowering (a Triton that takes no PTX) gets the libdevice form."""
    if ptx_exp2 is None and not interpret:
        return with_ptx(run, *args, interpreted=False)
    return run(bool(ptx_exp2), *args)


def flash_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    scale: float,
    causal: bool = False,
    logits_soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    ptx_exp2: bool | None = None,
    launchers: Launchers = PALLAS,
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel alone: ``(out, lse)``, for attention over key blocks merged outside
    (ring / context-parallel attention merges partial results by their log-sum-exp).

    Arguments as `flash_attention` (no dropout or window). ``lse [batch, heads, q_len]`` float32 is
    the natural-log ``logsumexp`` of each row's scaled (soft-capped) visible logits, ``-inf`` for a
    row that sees no key (its ``out`` row is zeros). Not differentiable: `flash_attention_backward`
    is its transpose given the *final* ``out`` and ``lse``.
    """
    _check_blockwise("flash_attention_forward", q, k, v, q_segment_ids, kv_segment_ids, ptx_exp2, interpret)
    q_len = q.shape[1]
    st, args = _prepare(q, k, v, q_segment_ids, kv_segment_ids, scale=scale, causal=causal, window_size=None,
                        logits_soft_cap=logits_soft_cap, dropout_rate=0.0, block_sizes=block_sizes,
                        interpret=interpret, launchers=launchers)

    def run(ptx, *args):
        return tuple(st.kernels.forward(*args, None, dataclasses.replace(st, ptx_exp2=ptx)))

    out, lse2 = _per_platform(ptx_exp2, interpret, run, *args)
    lse = jnp.where(jnp.isinf(lse2), -jnp.inf, lse2 * (1.0 / LOG2E))  # base 2 -> e; empty rows +inf -> -inf
    return out[:, :q_len], lse[:, :, :q_len]


def flash_attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    scale: float,
    causal: bool = False,
    logits_soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    ptx_exp2: bool | None = None,
    launchers: Launchers = PALLAS,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward kernels alone: ``(dq, dk, dv)`` of this block of keys, given the attention's
    final ``out [batch, q_len, heads, head_dim]``, ``lse [batch, heads, q_len]`` (natural log,
    ``-inf`` for rows that see nothing, as `flash_attention_forward` returns) and ``d_out``.

    When the keys are split into blocks whose partial results were merged by their log-sum-exp,
    the gradients of the whole attention are the sums of these per-block gradients computed with
    the merged ``out`` and ``lse``. Results are in the dtypes of ``q``, ``k``, ``v``.
    """
    _check_blockwise("flash_attention_backward", q, k, v, q_segment_ids, kv_segment_ids, ptx_exp2, interpret)
    q_len, kv_len = q.shape[1], k.shape[1]
    rows = (q.shape[0], q.shape[2], q_len)
    if out.shape != q.shape[:3] + (v.shape[3],) or d_out.shape != out.shape or lse.shape != rows:
        raise ValueError(f"flash_attention_backward: out {out.shape} / d_out {d_out.shape} / lse {lse.shape} do not "
                         f"match q {q.shape}")
    st, (q, k, v, q_seg, kv_seg) = _prepare(
        q, k, v, q_segment_ids, kv_segment_ids, scale=scale, causal=causal, window_size=None,
        logits_soft_cap=logits_soft_cap, dropout_rate=0.0, block_sizes=block_sizes, interpret=interpret,
        launchers=launchers)
    q_pad = q.shape[1] - q_len
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)  # the kernels' convention: base 2, +inf empty
    rows = ((0, 0), (0, q_pad), (0, 0), (0, 0))
    out, d_out = jnp.pad(out, rows), jnp.pad(d_out, rows)
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, q_pad)), constant_values=jnp.inf)

    def run(ptx, q, k, v, q_seg, kv_seg, out, lse2, d_out):
        return st.kernels.backward(q, k, v, q_seg, kv_seg, None, out, lse2, d_out,
                                   dataclasses.replace(st, ptx_exp2=ptx))

    dq, dk, dv = _per_platform(ptx_exp2, interpret, run, q, k, v, q_seg, kv_seg, out, lse2, d_out)
    return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]
