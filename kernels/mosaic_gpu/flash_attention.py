"""Flash attention as Mosaic GPU kernels (Hopper): TMA, wgmma and warp specialisation.

The launchers plug into `mtjax.kernels.flash_attention` (a `Launchers` pair), which keeps the mask
description (`MaskSpec`: causal and sliding windows as a band of ``key - query`` offsets, bottom-right
aligned), the padding, the custom_vjp and the argument checks. Layout BTNH, ``lse`` in base 2 as the
other kernels write it, so the kernels of one family can stand in for another's in either pass.

Every kernel runs three warpgroups per CTA: two compute warpgroups of 64 rows each and one memory
warpgroup that streams the blocks the compute warpgroups loop over into a ring of ``stages``
shared-memory slots with TMA. A slot is refilled once both compute warpgroups have arrived on its
"free" barrier; they wait on its "ready" barrier (the TMA's) before reading it, for every step of the
CTA's range, so the phases of every barrier advance in step in all three warpgroups.

- Forward (one CTA per 128 queries and head): ``S = Q Kᵀ`` (wgmma from shared memory), the online
  softmax in registers (base 2, float32), ``acc += P V`` (wgmma with ``P`` in registers). Key blocks
  outside the band are never loaded; blocks inside it skip the mask arithmetic.
- dK/dV (one CTA per 128 keys and kv head, looping over the kv head's query heads and the query
  blocks of the band): ``Pᵀ = exp2(K Qᵀ · c - lse)``, ``dV += Pᵀ dO``, ``dPᵀ = V dOᵀ``,
  ``dSᵀ = Pᵀ (dPᵀ - δ)``, ``dK += dSᵀ Q``.
- dQ (one CTA per 128 queries and head): ``P``, ``dP = dO Vᵀ``, ``dS = P (dP - δ)``, ``dQ += dS K``.

What they take: bfloat16/float16, head_dim 64, 128 or 256, causal masks and sliding windows, segment
ids (their blocks ride in the same TMA ring as the keys or queries they label), GQA, logit
soft-capping and dropout (the same counter-based mask as every mtjax attention, redrawn in each
kernel); not float32 inputs (`unsupported` says so and the op runs another kernel).

At head_dim 256 the tiles are fixed (`tiles_for`): 64-row steps and two ring slots, so that each
kernel's shared memory fits an SM. The backward kernels split the head dimension between the two
compute warpgroups there: a CTA owns 64 queries (dQ) or 64 keys (dK/dV), shared by both, each
computes the step's ``S`` (``Pᵀ``) and ``dP`` over the whole head dimension and accumulates its
128-column half of the output (two float32 ``64 x 256`` dK and dV accumulators would not fit a
warpgroup's registers; Q, dO and two K and V slots of 128 queries would not fit shared memory).
Their tiles are stored as two ``[rows, 128]`` halves, so each warpgroup's GEMMs read a contiguous
half; once both are done, each writes its half of the output through shared memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtjax.kernels.common import LOG2E, Launchers, dropout_keep, interpret
from mtjax.kernels.mosaic_gpu.common import (
    BLOCK_ROWS,
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    MEMORY_REGISTERS,
    WG_ROWS,
    interpret_params,
    swizzled,
)

HEAD_DIMS = (64, 128, 256)
SPLIT_HEAD_DIM = 128  # above this, dK/dV split the head dimension between the compute warpgroups
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tiles of the Mosaic GPU kernels.

    Attributes:
      block_kv: keys per step of the forward and dQ loops (64 or 128).
      block_q: queries per step of the dK/dV loop (64 or 128).
      stages: slots of the TMA ring.
      p_in_registers: the second GEMM of each step reads its left operand (probabilities, their
        gradients) from registers, as FlashAttention-3 does; False writes it to shared memory first
        (what Mosaic GPU's interpret mode, the CPU tests, can run).
    """

    block_kv: int = 64
    block_q: int = 64
    stages: int = 2
    p_in_registers: bool = True

    def __post_init__(self) -> None:
        for name in ("block_kv", "block_q"):
            value = getattr(self, name)
            if value not in (64, 128):  # the kernels pad to multiples of 128 rows
                raise ValueError(f"AttentionConfig({name}={value!r}): expected 64 or 128")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"AttentionConfig(stages={self.stages!r}): expected an int >= 2")


DEFAULT_CONFIG = AttentionConfig()


# What `python -m mtjax.bench.attention --sweep` tries for these kernels.
# Each fits an SM's shared memory at head_dim 128 with segment ids (three stages with 128-row blocks
# would not); the tests lower every one.
SWEEP_CONFIGS = (AttentionConfig(block_kv=128), AttentionConfig(block_q=128),
                 AttentionConfig(block_kv=128, block_q=128), AttentionConfig(stages=3),
                 AttentionConfig(p_in_registers=False))


def default_config() -> AttentionConfig:
    """`DEFAULT_CONFIG`, with the probabilities through shared memory in interpret mode (which runs
    wgmma on shared-memory operands only)."""
    return dataclasses.replace(DEFAULT_CONFIG, p_in_registers=False) if interpret() else DEFAULT_CONFIG


def tiles_for(config: AttentionConfig, head_dim: int, kernel: str) -> AttentionConfig:
    """``config`` as ``kernel`` (``"forward"``, ``"dq"`` or ``"dkdv"``) runs it at ``head_dim``: at 256
    the fixed tiles whose shared memory fits an SM (see the module docstring)."""
    if head_dim <= SPLIT_HEAD_DIM:
        return config
    tiles = {"forward": dict(block_kv=64), "dq": dict(block_kv=64), "dkdv": dict(block_q=WG_ROWS)}[kernel]
    return dataclasses.replace(config, stages=2, **tiles)


def unsupported(q_shape, kv_shape, dtype) -> str | None:
    """Why the Mosaic GPU kernels cannot take this attention, or ``None``."""
    del kv_shape  # any length: the kernels pad to whole blocks
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} (wgmma here: bfloat16 or float16)"
    if q_shape[-1] not in HEAD_DIMS:
        return f"head_dim {q_shape[-1]} (supported: {HEAD_DIMS})"
    return None


def _launch(kernel, inputs, out_type, scratch: list, grid: tuple[int, ...], grid_names: tuple[str, ...]):
    """``kernel(*inputs, *outputs, *scratch)`` on three warpgroups; ``scratch`` entries that are None
    (buffers a configuration does not use) reach the kernel as None and take no shared memory."""
    def body(*refs):
        pl.run_scoped(lambda scratch_refs: kernel(*refs, *scratch_refs), scratch, collective_axes="wg")

    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=grid_names, num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret_params(),
    )(*inputs)


def _pad_rows(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _smem(shape, dtype):
    """A shared-memory buffer of 16-bit ``[..., rows, cols]`` tiles as wgmma reads them (swizzled)."""
    return plgpu.SMEM(shape, dtype, transforms=swizzled(shape[-1], dtype))


def _wg_tiles(head_dim: int, dtype):
    """One ``[64, head_dim]`` tile per compute warpgroup."""
    return _smem((COMPUTE_WGS, WG_ROWS, head_dim), dtype)


def _ring(config, rows: int, head_dim: int, dtype):
    """The TMA ring: ``stages`` slots of ``[rows, head_dim]``."""
    return _smem((config.stages, rows, head_dim), dtype)


def _staging(config, cols: int, dtype):
    """Per compute warpgroup, a ``[64, cols]`` tile for a GEMM operand computed in registers (None
    when wgmma reads those from registers)."""
    return None if config.p_in_registers else _smem((COMPUTE_WGS, WG_ROWS, cols), dtype)


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _mask_tile(mask, q0, k0, shape, transposed: bool, q_seg=None, kv_seg=None, *, edge: bool = True):
    """The `MaskSpec` of a ``[queries, keys]`` tile at ``(q0, k0)``, or of its transpose ``[keys,
    queries]`` at ``(k0, q0)``: the band and key tail where ``edge``, the segment ids' test where
    ``q_seg``/``kv_seg`` (vectors along the tile's query and key axes) are given; None if neither."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    segments = (None, None) if q_seg is None else (lax.broadcast_in_dim(q_seg, shape, [q_dim]),
                                                   lax.broadcast_in_dim(kv_seg, shape, [k_dim]))
    return mask.keep(q0 + _iota(shape, q_dim), k0 + _iota(shape, k_dim), *segments, edge=edge)


def _masked(x, keep, fill):
    return x if keep is None else jnp.where(keep, x, fill)


def _logits(s, st):
    """``(s2, c)`` with ``s2 * c`` the logits of the raw ``q kᵀ`` tile ``s`` in the base-2 domain:
    without a soft-cap ``s`` itself and the scale (folded into the exponent), with one
    ``cap · log2(e) · tanh(s · scale / cap)`` and 1 (`mtjax.kernels.flash_attention`'s convention)."""
    if st.soft_cap is None:
        return s, st.scale * LOG2E
    # tanh(x) = 1 - 2 / (exp(2x) + 1), as the native Triton kernel computes it (approx_math would make
    # jnp.tanh the hardware approximation, whose logits another kernel's lse would not match)
    tanh = 1.0 - 2.0 / (jnp.exp2(s * (2.0 * LOG2E * st.scale / st.soft_cap)) + 1.0)
    return (st.soft_cap * LOG2E) * tanh, 1.0


def _exp2(s2, c, shift):
    """``exp2(s2 · c - shift)``."""
    return jnp.exp2((s2 if c == 1.0 else s2 * c) - shift)


def _soft_cap_grad(ds, s2, st):
    """``ds`` (w.r.t. the capped logits) through ``cap · tanh(x / cap)``."""
    if st.soft_cap is None:
        return ds
    t = s2 * (1.0 / (st.soft_cap * LOG2E))
    return ds * (1.0 - t * t)


def _dropout_keep(st, seed, batch, head, num_heads: int, q0, k0, shape, transposed: bool):
    """The dropout mask of a tile as every mtjax attention draws it (`mtjax.kernels.common.dropout_keep`
    of the row counter ``(b · heads + h) · q_len + i`` and the key ``j``); None without dropout."""
    if st.dropout_rate == 0.0:
        return None
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    base = (batch * num_heads + head).astype(jnp.uint32) * jnp.uint32(st.mask.q_len)
    rows = base + (q0 + _iota(shape, q_dim)).astype(jnp.uint32)
    return dropout_keep(seed, rows, k0 + _iota(shape, k_dim), st.dropout_rate)


def _dropped(x, keep, st):
    """``x`` with the dropout mask applied (kept entries scaled by ``1 / (1 - rate)``)."""
    return x if keep is None else jnp.where(keep, x * (1.0 / (1.0 - st.dropout_rate)), 0.0)


def _rows_vector(ref):
    """A vector ``[rows]`` from shared memory, laid out to broadcast along a tile's rows."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def _cols_vector(ref):
    """A vector ``[cols]`` from shared memory, laid out to broadcast along a tile's columns."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0))


def _mma(a_smem, b_smem, shape):
    """``a @ b`` (float32 ``shape``) of two shared-memory operands, into a fresh accumulator."""
    return _mma_sum([(a_smem, b_smem)], shape)


def _mma_sum(pairs, shape):
    """``Σ a @ b`` (float32 ``shape``) over ``[(a, b), ...]`` shared-memory operands (a product over a
    contraction stored in parts), into one fresh accumulator."""
    def mma(out_ref):
        for a_smem, b_smem in pairs:
            plgpu.wgmma(out_ref, a_smem, b_smem)
        return out_ref[...]

    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def _mma_from_registers(a, staging, wg, b_smem, shape):
    """``a @ b`` (float32 ``shape``) for ``a`` computed in registers (probabilities, their gradients):
    wgmma reads it from registers, or, given a ``staging`` buffer (`_staging`), from this warpgroup's
    tile of it once written there."""
    if staging is not None:
        staging.at[wg][...] = a
        plgpu.commit_smem()
        a = staging.at[wg]
    return _mma(a, b_smem, shape)


def _drain(steps, stages: int, *free_barriers):
    """The memory warpgroup waits for the last ``stages`` steps' slots to be freed: the ring is not
    released (the CTA does not end) while a compute warpgroup may still read it."""
    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _(j):
        for barrier in free_barriers:
            plgpu.barrier_wait(barrier.at[lax.rem(j, stages)])


def _stream_kv(k_gmem, v_gmem, kv_seg_gmem, k_smem, v_smem, kv_seg_smem, k_ready, v_ready, k_free, v_free, batch,
               kv_head, lo, hi, block_kv: int, stages: int, segments: bool, parts: int = 1):
    """The memory warpgroup of the forward and dQ kernels: K and V blocks ``lo .. hi`` of one kv head
    (and their keys' segment ids, with K's barrier) into the ring, each slot refilled once both
    compute warpgroups have freed it; into ring slots ``[parts, block_kv, head_dim / parts]`` (dQ's),
    each block as ``parts`` column blocks of the head dimension."""
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    @pl.loop(lo, hi)
    def _(i):
        slot = lax.rem(i - lo, stages)
        keys = pl.ds(i * block_kv, block_kv)
        for src, dst, ready, free in ((k_gmem, k_smem, k_ready, k_free), (v_gmem, v_smem, v_ready, v_free)):
            @pl.when(i - lo >= stages)  # the slot's previous block has been read by both
            def _(free=free):
                plgpu.barrier_wait(free.at[slot])
            if len(dst.shape) == 3:  # the forward's ring: [stages, block_kv, head_dim]
                plgpu.copy_gmem_to_smem(src.at[batch, keys, kv_head], dst.at[slot], ready.at[slot])
            else:
                part_dim = src.shape[-1] // parts
                for part in range(parts):
                    plgpu.copy_gmem_to_smem(src.at[batch, keys, kv_head, pl.ds(part * part_dim, part_dim)],
                                            dst.at[slot, part], ready.at[slot])
            if segments and src is k_gmem:
                plgpu.copy_gmem_to_smem(kv_seg_gmem.at[batch, keys], kv_seg_smem.at[slot], ready.at[slot])

    _drain(hi - lo, stages, k_free, v_free)


def _cta_rows(parts: int) -> int:
    """Rows a backward CTA owns (queries in dQ, keys in dK/dV): with the head dimension split in
    ``parts`` > 1, 64 shared by both compute warpgroups; else 64 each."""
    return WG_ROWS if parts > 1 else BLOCK_ROWS


def _key_ranges(mask, q0, block_kv: int, rows: int = BLOCK_ROWS):
    """``(lo, hi, ranges)``: the key blocks the CTA's ``rows`` queries from ``q0`` may see, as the
    `_steps` ranges of the band's masked edges and its unmasked middle (which ends before a block
    holding the end of the keys)."""
    lo, full_lo, full_hi, hi = mask.kv_blocks(q0, rows, block_kv)
    return lo, hi, ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True))


def _steps(body, ranges, carry):
    """``body(step, masked, carry)`` over the consecutive ranges ``[(start, end, masked), ...]``."""
    for start, end, masked in ranges:
        carry = lax.fori_loop(start, end, lambda i, c, masked=masked: body(i, masked, c), carry)
    return carry


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


def _forward_kernel(q_gmem, k_gmem, v_gmem, q_seg_gmem, kv_seg_gmem, seed_gmem, o_gmem, lse_gmem, q_smem, k_smem,
                    v_smem, p_smem, lse_smem, q_seg_smem, kv_seg_smem, q_ready, k_ready, v_ready, k_free, v_free, *,
                    st, config: AttentionConfig, groups: int):
    mask = st.mask
    block_kv, stages = config.block_kv, config.stages
    head_dim, heads = q_gmem.shape[-1], q_gmem.shape[2]
    qi, head, batch = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q0 = qi * BLOCK_ROWS
    lo, hi, ranges = _key_ranges(mask, q0, block_kv)
    seed = seed_gmem[0] if st.dropout_rate > 0.0 else None

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        q_rows = q0 + wg * WG_ROWS
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_gmem.at[batch, pl.ds(q_rows, WG_ROWS), head], q_tile, q_ready.at[wg])
        if mask.segments:
            plgpu.copy_gmem_to_smem(q_seg_gmem.at[batch, pl.ds(q_rows, WG_ROWS)], q_seg_smem.at[wg], q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        q_seg = _rows_vector(q_seg_smem.at[wg]) if mask.segments else None
        shape = (WG_ROWS, block_kv)

        def step(i, masked, carry):
            acc, m, l = carry
            slot = lax.rem(i - lo, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            kv_seg = _cols_vector(kv_seg_smem.at[slot]) if mask.segments else None  # read before the slot is freed
            s, c = _logits(_mma(q_tile, k_smem.at[slot].T, shape), st)
            plgpu.barrier_arrive(k_free.at[slot])
            if masked or mask.segments:
                s = _masked(s, _mask_tile(mask, q_rows, i * block_kv, shape, False, q_seg, kv_seg, edge=masked),
                            -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * c)  # c > 0: the max of the scaled row
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
            alpha = jnp.exp2(m - m_safe)
            p = _exp2(s, c, lax.broadcast_in_dim(m_safe, shape, [0]))
            l = l * alpha + p.sum(axis=1)  # the normaliser counts dropped entries too
            p = _dropped(p, _dropout_keep(st, seed, batch, head, heads, q_rows, i * block_kv, shape, False), st)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_ready.at[slot])

            acc = acc + _mma_from_registers(p.astype(q_tile.dtype), p_smem, wg, v_smem.at[slot], acc.shape)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        row = plgpu.Layout.WGMMA.reduce(1)
        carry = (plgpu.layout_cast(jnp.zeros((WG_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), row),
                 plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), row))
        acc, m, l = _steps(step, ranges, carry)
        empty = l == 0.0
        q_tile[...] = (acc / lax.broadcast_in_dim(jnp.where(empty, 1.0, l), acc.shape, [0])).astype(q_tile.dtype)
        # +inf for rows that saw no key: the backward then recomputes p = exp2(s - lse) = 0.
        lse_smem.at[wg][...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_gmem.at[batch, pl.ds(q_rows, WG_ROWS), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_gmem.at[batch, head, pl.ds(q_rows, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        _stream_kv(k_gmem, v_gmem, kv_seg_gmem, k_smem, v_smem, kv_seg_smem, k_ready, v_ready, k_free, v_free,
                   batch, lax.div(head, groups), lo, hi, block_kv, stages, mask.segments)


def _optional_inputs(q_seg, kv_seg, seed, batch):
    """The segment ids and the dropout seed as the kernels take them (small stand-ins where absent)."""
    seed = jnp.zeros((1,), jnp.uint32) if seed is None else jnp.reshape(seed, (1,)).astype(jnp.uint32)
    if q_seg is None:
        return jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch, 1), jnp.int32), seed
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32), seed


def _forward(q, k, v, q_seg, kv_seg, seed, st, config: AttentionConfig | None = None):
    """`mtjax.kernels.flash_attention`'s forward launcher contract: ``(out, lse)`` on padded arrays."""
    config = tiles_for(config or default_config(), q.shape[-1], "forward")
    q_in = q.shape[1]
    q_seg, kv_seg, seed = _optional_inputs(q_seg, kv_seg, seed, q.shape[0])
    if st.mask.segments:  # padded rows and keys get id 0: padding, never attended
        q_seg, kv_seg = _pad_rows(q_seg, 1, BLOCK_ROWS), _pad_rows(kv_seg, 1, config.block_kv)
    q, k, v = _pad_rows(q, 1, BLOCK_ROWS), _pad_rows(k, 1, config.block_kv), _pad_rows(v, 1, config.block_kv)
    batch, q_pad, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    dtype = q.dtype
    segments = st.mask.segments
    scratch = [
        _wg_tiles(head_dim, dtype), _ring(config, config.block_kv, head_dim, dtype),
        _ring(config, config.block_kv, head_dim, dtype), _staging(config, config.block_kv, dtype),
        plgpu.SMEM((COMPUTE_WGS, WG_ROWS), jnp.float32),
        plgpu.SMEM((COMPUTE_WGS, WG_ROWS), jnp.int32) if segments else None,
        plgpu.SMEM((config.stages, config.block_kv), jnp.int32) if segments else None,
        # every TMA copy arrives once on its barrier: with segment ids, the ids' copy as well
        plgpu.Barrier(num_arrivals=1 + segments, num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_arrivals=1 + segments, num_barriers=config.stages),
        plgpu.Barrier(num_barriers=config.stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=config.stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=config.stages),
    ]
    out, lse = _launch(
        functools.partial(_forward_kernel, st=st, config=config, groups=groups), (q, k, v, q_seg, kv_seg, seed),
        (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)), scratch,
        (q_pad // BLOCK_ROWS, heads, batch), ("q", "heads", "batch"))
    return out[:, :q_in], lse[:, :, :q_in]


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


def _dq_kernel(q_gmem, k_gmem, v_gmem, do_gmem, stats_gmem, q_seg_gmem, kv_seg_gmem, seed_gmem, dq_gmem, q_smem,
               do_smem, stats_smem, k_smem, v_smem, ds_smem, q_seg_smem, kv_seg_smem, tile_ready, k_ready, v_ready,
               k_free, v_free, done, *, st, config: AttentionConfig, groups: int):
    mask = st.mask
    block_kv, stages = config.block_kv, config.stages
    heads, head_dim = q_gmem.shape[2], q_gmem.shape[3]
    # As in dK/dV: split (2 parts), both compute warpgroups share one 64-query tile and each
    # accumulates its half of dQ; else each owns 64 of the CTA's 128 queries.
    parts = q_smem.shape[1]
    split = parts > 1
    part_dim = head_dim // parts
    cta_rows = _cta_rows(parts)
    seed = seed_gmem[0] if st.dropout_rate > 0.0 else None
    qi, head, batch = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    q0 = qi * cta_rows
    lo, hi, ranges = _key_ranges(mask, q0, block_kv, cta_rows)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        tile = 0 if split else wg
        half = wg if split else 0  # the part of dQ this warpgroup accumulates
        q_rows = q0 if split else q0 + wg * WG_ROWS
        q_tile, do_tile, stats = q_smem.at[tile], do_smem.at[tile], stats_smem.at[tile]  # [parts, 64, part_dim]
        rows = pl.ds(q_rows, WG_ROWS)
        columns = pl.ds(half * part_dim, part_dim)
        # Split: each warpgroup loads its part of the shared tiles (and the first the rows' stats and ids).
        plgpu.copy_gmem_to_smem(q_gmem.at[batch, rows, head, columns], q_tile.at[half], tile_ready.at[tile])
        plgpu.copy_gmem_to_smem(do_gmem.at[batch, rows, head, columns], do_tile.at[half], tile_ready.at[tile])

        @pl.when(wg == tile)
        def _():
            plgpu.copy_gmem_to_smem(stats_gmem.at[batch, head, :, rows], stats, tile_ready.at[tile])
            if mask.segments:
                plgpu.copy_gmem_to_smem(q_seg_gmem.at[batch, rows], q_seg_smem.at[tile], tile_ready.at[tile])
        plgpu.barrier_wait(tile_ready.at[tile])
        lse, delta = _rows_vector(stats.at[0]), _rows_vector(stats.at[1])
        q_seg = _rows_vector(q_seg_smem.at[tile]) if mask.segments else None
        shape = (WG_ROWS, block_kv)

        def step(i, masked, dq):
            slot = lax.rem(i - lo, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            kv_seg = _cols_vector(kv_seg_smem.at[slot]) if mask.segments else None
            s, c = _logits(_mma_sum([(q_tile.at[p], k_smem.at[slot, p].T) for p in range(parts)], shape), st)
            p = _exp2(s, c, lax.broadcast_in_dim(lse, shape, [0]))
            if masked or mask.segments:
                p = _masked(p, _mask_tile(mask, q_rows, i * block_kv, shape, False, q_seg, kv_seg, edge=masked), 0.0)
            plgpu.barrier_wait(v_ready.at[slot])
            dp = _mma_sum([(do_tile.at[p], v_smem.at[slot, p].T) for p in range(parts)], shape)
            plgpu.barrier_arrive(v_free.at[slot])
            dp = _dropped(dp, _dropout_keep(st, seed, batch, head, heads, q_rows, i * block_kv, shape, False), st)
            ds = _soft_cap_grad(p * (dp - lax.broadcast_in_dim(delta, shape, [0])), s, st)
            dq = dq + _mma_from_registers(ds.astype(q_tile.dtype), ds_smem, wg, k_smem.at[slot, half], dq.shape)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, part_dim), jnp.float32), plgpu.Layout.WGMMA)
        dq = _steps(step, ranges, zeros)
        if split:  # once both are done reading the shared queries, each writes its half there
            plgpu.barrier_arrive(done.at[0])
            plgpu.barrier_wait(done.at[0])
        q_out = q_tile.at[half]
        q_out[...] = (dq * st.scale).astype(q_out.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_out, dq_gmem.at[batch, rows, head, columns])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        _stream_kv(k_gmem, v_gmem, kv_seg_gmem, k_smem, v_smem, kv_seg_smem, k_ready, v_ready, k_free, v_free,
                   batch, lax.div(head, groups), lo, hi, block_kv, stages, mask.segments, parts)


def _dkdv_kernel(q_gmem, k_gmem, v_gmem, do_gmem, stats_gmem, q_seg_gmem, kv_seg_gmem, seed_gmem, dk_gmem, dv_gmem,
                 k_smem, v_smem, q_smem, do_smem, stats_smem, p_smem, kv_seg_smem, q_seg_smem, tile_ready, q_ready,
                 do_ready, q_free, do_free, done, *, st, config: AttentionConfig, groups: int):
    mask = st.mask
    block_q, stages = config.block_q, config.stages
    heads, head_dim = q_gmem.shape[2], q_gmem.shape[3]
    # The head dimension in `parts` stored halves. Split (2 parts): the compute warpgroups share one
    # 64-key tile and each accumulates its half of dK and dV; else each owns 64 of the CTA's 128 keys.
    parts = k_smem.shape[1]
    split = parts > 1
    part_dim = head_dim // parts
    cta_rows = _cta_rows(parts)
    seed = seed_gmem[0] if st.dropout_rate > 0.0 else None
    ki, kv_head, batch = lax.axis_index("k"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    k0 = ki * cta_rows
    lo, full_lo, full_hi, hi = mask.q_blocks(k0, cta_rows, block_q)
    n = hi - lo
    # Padded query rows need no mask (their output gradient is zero); the band's edges and a key
    # block reaching into the key tail do.
    ranges = ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True))

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        tile = 0 if split else wg
        k_rows = k0 if split else k0 + wg * WG_ROWS
        k_tile, v_tile = k_smem.at[tile], v_smem.at[tile]  # [parts, 64, part_dim]
        half = wg if split else 0  # the part of dK and dV this warpgroup accumulates
        keys = (batch, pl.ds(k_rows, WG_ROWS), kv_head)
        columns = pl.ds(half * part_dim, part_dim)
        # Split: each warpgroup loads its part of the shared tile (and the first the ids).
        plgpu.copy_gmem_to_smem(k_gmem.at[(*keys, columns)], k_tile.at[half], tile_ready.at[tile])
        plgpu.copy_gmem_to_smem(v_gmem.at[(*keys, columns)], v_tile.at[half], tile_ready.at[tile])
        if mask.segments:
            @pl.when(wg == tile)
            def _():
                plgpu.copy_gmem_to_smem(kv_seg_gmem.at[batch, pl.ds(k_rows, WG_ROWS)], kv_seg_smem.at[tile],
                                        tile_ready.at[tile])
        plgpu.barrier_wait(tile_ready.at[tile])
        kv_seg = _rows_vector(kv_seg_smem.at[tile]) if mask.segments else None
        shape = (WG_ROWS, block_q)

        def head_steps(g, carry):
            def step(j, masked, carry):
                dk, dv = carry
                slot = lax.rem(g * n + j - lo, stages)
                plgpu.barrier_wait(q_ready.at[slot])
                s_t, c = _logits(_mma_sum([(k_tile.at[p], q_smem.at[slot, p].T) for p in range(parts)], shape), st)
                lse, delta = _cols_vector(stats_smem.at[slot, 0]), _cols_vector(stats_smem.at[slot, 1])
                q_seg = _cols_vector(q_seg_smem.at[slot]) if mask.segments else None
                p_t = _exp2(s_t, c, lax.broadcast_in_dim(lse, shape, [1]))
                if masked or mask.segments:
                    p_t = _masked(p_t, _mask_tile(mask, j * block_q, k_rows, shape, True, q_seg, kv_seg, edge=masked),
                                  0.0)
                keep = _dropout_keep(st, seed, batch, kv_head * groups + g, heads, j * block_q, k_rows, shape, True)
                plgpu.barrier_wait(do_ready.at[slot])
                dv = dv + _mma_from_registers(_dropped(p_t, keep, st).astype(k_tile.dtype), p_smem, wg,
                                              do_smem.at[slot, half], dv.shape)
                dp_t = _dropped(_mma_sum([(v_tile.at[p], do_smem.at[slot, p].T) for p in range(parts)], shape), keep,
                                st)
                plgpu.barrier_arrive(do_free.at[slot])
                ds_t = _soft_cap_grad(p_t * (dp_t - lax.broadcast_in_dim(delta, shape, [1])), s_t, st)
                dk = dk + _mma_from_registers(ds_t.astype(k_tile.dtype), p_smem, wg, q_smem.at[slot, half],
                                              dk.shape)
                plgpu.barrier_arrive(q_free.at[slot])
                return dk, dv

            return _steps(step, ranges, carry)

        zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, part_dim), jnp.float32), plgpu.Layout.WGMMA)
        dk, dv = lax.fori_loop(0, groups, head_steps, (zeros, zeros))
        if split:  # once both are done with every slot, the ring's first slot takes the outputs
            plgpu.barrier_arrive(done.at[0])
            plgpu.barrier_wait(done.at[0])
            k_out, v_out = q_smem.at[0, half], do_smem.at[0, half]
        else:  # this warpgroup's own keys and values take its dK and dV
            k_out, v_out = k_tile.at[0], v_tile.at[0]
        k_out[...] = (dk * st.scale).astype(k_out.dtype)
        v_out[...] = dv.astype(v_out.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_out, dk_gmem.at[(*keys, columns)])
        plgpu.copy_smem_to_gmem(v_out, dv_gmem.at[(*keys, columns)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        @pl.loop(0, groups * n)
        def _(t):
            slot = lax.rem(t, stages)
            head = kv_head * groups + lax.div(t, n)
            rows = pl.ds((lo + lax.rem(t, n)) * block_q, block_q)

            @pl.when(t >= stages)
            def _():
                plgpu.barrier_wait(q_free.at[slot])
            for part in range(parts):
                plgpu.copy_gmem_to_smem(q_gmem.at[batch, rows, head, pl.ds(part * part_dim, part_dim)],
                                        q_smem.at[slot, part], q_ready.at[slot])
            plgpu.copy_gmem_to_smem(stats_gmem.at[batch, head, :, rows], stats_smem.at[slot], q_ready.at[slot])
            if mask.segments:
                plgpu.copy_gmem_to_smem(q_seg_gmem.at[batch, rows], q_seg_smem.at[slot], q_ready.at[slot])

            @pl.when(t >= stages)
            def _():
                plgpu.barrier_wait(do_free.at[slot])
            for part in range(parts):
                plgpu.copy_gmem_to_smem(do_gmem.at[batch, rows, head, pl.ds(part * part_dim, part_dim)],
                                        do_smem.at[slot, part], do_ready.at[slot])

        _drain(groups * n, stages, q_free, do_free)


def _backward(q, k, v, q_seg, kv_seg, seed, out, lse, do, st, config: AttentionConfig | None = None):
    """`mtjax.kernels.flash_attention`'s backward launcher contract: ``(dq, dk, dv)`` on padded arrays."""
    config = config or default_config()
    dq_config, config = tiles_for(config, q.shape[-1], "dq"), tiles_for(config, q.shape[-1], "dkdv")
    q_in, kv_in = q.shape[1], k.shape[1]
    q_seg, kv_seg, seed = _optional_inputs(q_seg, kv_seg, seed, q.shape[0])
    # delta_i = sum_d dO_id O_id, the softmax-backward row term; a cheap fused XLA reduction.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), out.astype(jnp.float32))
    rows = max(BLOCK_ROWS, config.block_q)
    q, do = _pad_rows(q, 1, rows), _pad_rows(do.astype(q.dtype), 1, rows)
    stats = _pad_rows(jnp.stack([lse, delta], axis=2), 3, rows)  # [batch, heads, 2, q]: one TMA per block
    k_rows = max(BLOCK_ROWS, dq_config.block_kv)
    k, v = _pad_rows(k, 1, k_rows), _pad_rows(v, 1, k_rows)
    if st.mask.segments:  # padded rows and keys get id 0: padding, never attended
        q_seg, kv_seg = _pad_rows(q_seg, 1, rows), _pad_rows(kv_seg, 1, k_rows)
    segments = int(st.mask.segments)
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    dtype = q.dtype
    # Both kernels store the head dimension in `parts` halves, each [rows, head_dim / parts].
    parts = 2 if head_dim > SPLIT_HEAD_DIM else 1
    part_dim = head_dim // parts
    tiles = 1 if parts > 1 else COMPUTE_WGS  # the CTA's own query (dQ) or key (dK/dV) tiles: shared when split
    block_kv = dq_config.block_kv
    dq = _launch(
        functools.partial(_dq_kernel, st=st, config=dq_config, groups=groups),
        (q, k, v, do, stats, q_seg, kv_seg, seed), jax.ShapeDtypeStruct(q.shape, dtype),
        [_smem((tiles, parts, WG_ROWS, part_dim), dtype), _smem((tiles, parts, WG_ROWS, part_dim), dtype),
         plgpu.SMEM((tiles, 2, WG_ROWS), jnp.float32),
         _smem((dq_config.stages, parts, block_kv, part_dim), dtype),
         _smem((dq_config.stages, parts, block_kv, part_dim), dtype), _staging(dq_config, block_kv, dtype),
         plgpu.SMEM((tiles, WG_ROWS), jnp.int32) if segments else None,
         plgpu.SMEM((dq_config.stages, block_kv), jnp.int32) if segments else None,
         # every TMA copy arrives once on its barrier: q, dO, the stats (and the ids); k (and the ids); v
         plgpu.Barrier(num_arrivals=2 * parts + 1 + segments, num_barriers=tiles),
         plgpu.Barrier(num_arrivals=parts + segments, num_barriers=dq_config.stages),
         plgpu.Barrier(num_arrivals=parts, num_barriers=dq_config.stages),
         plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=dq_config.stages),
         plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=dq_config.stages),
         plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=1)],  # split: both compute warpgroups done
        (q_pad // _cta_rows(parts), heads, batch), ("q", "heads", "batch"))
    stages, block_q = config.stages, config.block_q
    dk, dv = _launch(
        functools.partial(_dkdv_kernel, st=st, config=config, groups=groups), (q, k, v, do, stats, q_seg, kv_seg, seed),
        (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)),
        [_smem((tiles, parts, WG_ROWS, part_dim), dtype), _smem((tiles, parts, WG_ROWS, part_dim), dtype),
         _smem((stages, parts, block_q, part_dim), dtype), _smem((stages, parts, block_q, part_dim), dtype),
         plgpu.SMEM((stages, 2, block_q), jnp.float32), _staging(config, block_q, dtype),
         plgpu.SMEM((tiles, WG_ROWS), jnp.int32) if segments else None,
         plgpu.SMEM((stages, block_q), jnp.int32) if segments else None,
         # every TMA copy arrives once on its barrier
         plgpu.Barrier(num_arrivals=2 * parts + segments, num_barriers=tiles),  # k, v (and the ids)
         plgpu.Barrier(num_arrivals=parts + 1 + segments, num_barriers=stages),  # q, the stats (and the ids)
         plgpu.Barrier(num_arrivals=parts, num_barriers=stages),  # dO
         plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=1)],  # split: both compute warpgroups done
        (kv_pad // _cta_rows(parts), kv_heads, batch), ("k", "heads", "batch"))
    return dq[:, :q_in], dk[:, :kv_in], dv[:, :kv_in]


# The Mosaic GPU kernels as `mtjax.kernels.flash_attention.flash_attention(..., launchers=MOSAIC)` takes them.
MOSAIC = Launchers(forward=_forward, backward=_backward)


def launchers(config: AttentionConfig) -> Launchers:
    """The Mosaic GPU kernels with ``config``'s tiles (the benchmark's sweep)."""
    return Launchers(forward=functools.partial(_forward, config=config),
                     backward=functools.partial(_backward, config=config))
