"""Grouped GEMM in native Triton: the algorithms of `mtjax.kernels.grouped_gemm` (``gmm`` and ``tgmm``).

``gmm``: ``out[m] = lhs[m] @ rhs[g(m)]`` over the (group, M-tile) visits that `gg.visits` lists in
XLA before the launch; each program computes one visit's rows times ``block_n`` columns (a masked
store keeps each visit to its own group's rows), programs walk the (visit, N-tile) plane in bands of
``group_m`` visits for L2 reuse, optionally as ``num_programs`` persistent programs.
``tgmm``: ``out[g] = lhs[rows of g]^T @ dy[rows of g]``, one program per (N-tile, K-tile, group)
looping over the group's rows. Both accumulate in float32 with ``tl.dot``, software-pipeline their
inner loop over ``num_stages`` stages and scale each K step's product by an optional per-group scale
(FP8's promotion, as the Pallas kernels do).
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mtjax.kernels import grouped_gemm as gg
from mtjax.kernels.triton.language import cdiv
from mtjax.kernels.triton.runtime import launch, stand_in


@triton.jit
def _accumulate(a, b, acc, scale, SCALED: tl.constexpr, MIXED: tl.constexpr, PRECISION: tl.constexpr):
    """`mtjax.kernels.grouped_gemm._accumulate`: ``acc + dot(a, b) [* scale]``. With a scale (FP8
    operands) each K step's product is scaled and added outside the tensor core ("promotion"): Hopper's
    FP8 MMA accumulates with fewer mantissa bits than float32. Two FP8 formats (E5M2 gradients against
    E4M3 weights) multiply as bfloat16, which holds every E4M3 and E5M2 value exactly: Hopper's FP8 MMA
    takes the two formats as they are, but Triton's pipeline for them measured slower (docs/performance.md)."""
    if MIXED:
        a = a.to(tl.bfloat16)
        b = b.to(tl.bfloat16)
    if SCALED:
        acc += tl.dot(a, b, input_precision=PRECISION) * scale
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gmm_tile(pid, group_ptr, tile_ptr, lo_ptr, hi_ptr, lhs_ptr, rhs_ptr, scale_ptr, out_ptr, M: tl.constexpr,
              K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, NUM_VISITS: tl.constexpr,
              TRANSPOSE_RHS: tl.constexpr, SCALED: tl.constexpr, MIXED: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile ``pid`` of the grouped order: one visit's rows, ``BLOCK_N`` columns."""
    n_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    band: tl.constexpr = GROUP_M * n_tiles
    first = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(NUM_VISITS - first, GROUP_M)
    visit = first + (pid % band) % rows_in_band
    n0 = ((pid % band) // rows_in_band) * BLOCK_N
    group = tl.load(group_ptr + visit)
    lo = tl.load(lo_ptr + visit)
    hi = tl.load(hi_ptr + visit)
    rows = tl.load(tile_ptr + visit) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    if lo < hi:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        # The pseudo-group past the last group runs no iteration: its rows are zeros whatever scale they get.
        steps = tl.where(group < G, (K + BLOCK_K - 1) // BLOCK_K, 0)
        scale = tl.load(scale_ptr + tl.minimum(group, G - 1)) if SCALED else 1.0
        rhs_base = rhs_ptr + group.to(tl.int64) * K * N
        for kk in tl.range(0, steps):
            k = kk * BLOCK_K + ks
            a = tl.load(lhs_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                        other=0.0)
            if TRANSPOSE_RHS:  # rhs [G, N, K]
                b = tl.load(rhs_base + cols[None, :] * K + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K),
                            other=0.0)
            else:
                b = tl.load(rhs_base + k[:, None] * N + cols[None, :], mask=(k[:, None] < K) & (cols[None, :] < N),
                            other=0.0)
            acc = _accumulate(a, b, acc, scale, SCALED, MIXED, PRECISION)
        keep = (rows[:, None] >= lo) & (rows[:, None] < hi) & (cols[None, :] < N)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _gmm_kernel(group_ptr, tile_ptr, lo_ptr, hi_ptr, lhs_ptr, rhs_ptr, scale_ptr, out_ptr, M: tl.constexpr,
                K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, NUM_VISITS: tl.constexpr,
                TRANSPOSE_RHS: tl.constexpr, SCALED: tl.constexpr, MIXED: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                NUM_PROGRAMS: tl.constexpr):
    if NUM_PROGRAMS == 0:
        _gmm_tile(tl.program_id(0), group_ptr, tile_ptr, lo_ptr, hi_ptr, lhs_ptr, rhs_ptr, scale_ptr, out_ptr, M, K, N,
                  G, NUM_VISITS, TRANSPOSE_RHS, SCALED, MIXED, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:  # persistent: program p computes tiles p, p + NUM_PROGRAMS, ... of the grouped order
        total: tl.constexpr = NUM_VISITS * ((N + BLOCK_N - 1) // BLOCK_N)
        for pid in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
            _gmm_tile(pid, group_ptr, tile_ptr, lo_ptr, hi_ptr, lhs_ptr, rhs_ptr, scale_ptr, out_ptr, M, K, N, G,
                      NUM_VISITS, TRANSPOSE_RHS, SCALED, MIXED, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


def _precision(*dtypes) -> str:
    return "ieee" if any(jnp.dtype(d) == jnp.float32 for d in dtypes) else "tf32"


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_scale: jax.Array | None = None, *,
        transpose_rhs: bool = False, out_dtype=None, tiles: gg.GemmTiles | None = None) -> jax.Array:
    """`mtjax.kernels.grouped_gemm.gmm` (same arguments but ``interpret``, same result) in native Triton."""
    m, k, n, g, tiles, out_dtype = gg.prepare_gmm(lhs, rhs, group_sizes, group_scale, transpose_rhs, out_dtype, tiles)
    visits = gg.num_visits(m, g, tiles.block_m)
    num_tiles = visits * triton.cdiv(n, tiles.block_n)
    [out] = launch(
        _gmm_kernel, *gg.visits(group_sizes, m, tiles.block_m), lhs, rhs,
        stand_in() if group_scale is None else group_scale.astype(jnp.float32),
        out_shape=[jax.ShapeDtypeStruct((m, n), out_dtype)],
        grid=(num_tiles if tiles.num_programs is None else min(tiles.num_programs, num_tiles),),
        name="mtjax_triton_grouped_gemm", num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        M=m, K=k, N=n, G=g, NUM_VISITS=visits, TRANSPOSE_RHS=bool(transpose_rhs), SCALED=group_scale is not None,
        MIXED=jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype), PRECISION=_precision(lhs.dtype, rhs.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        NUM_PROGRAMS=tiles.num_programs or 0,
    )
    return out


@triton.jit
def _tgmm_kernel(offsets_ptr, lhs_ptr, dy_ptr, scale_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr,
                 N: tl.constexpr, SCALED: tl.constexpr, MIXED: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    g = tl.program_id(2)
    start = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    row_ids = tl.arange(0, BLOCK_M)
    scale = tl.load(scale_ptr + g) if SCALED else 1.0
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for i in tl.range(0, cdiv(end - start, BLOCK_M)):
        rows = start + i * BLOCK_M + row_ids
        a = tl.load(lhs_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < end) & (ks[None, :] < K),
                    other=0.0)
        b = tl.load(dy_ptr + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < end) & (cols[None, :] < N),
                    other=0.0)
        acc = _accumulate(tl.trans(a), b, acc, scale, SCALED, MIXED, PRECISION)
    out = out_ptr + g.to(tl.int64) * K * N + ks[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ks[:, None] < K) & (cols[None, :] < N))


def tgmm(lhs: jax.Array, dy: jax.Array, group_sizes: jax.Array, group_scale: jax.Array | None = None, *,
         out_dtype=None, tiles: gg.GemmTiles | None = None) -> jax.Array:
    """`mtjax.kernels.grouped_gemm.tgmm` (same arguments but ``interpret``, same result) in native Triton."""
    m, k, n, g, tiles, out_dtype, offsets = gg.prepare_tgmm(lhs, dy, group_sizes, group_scale, out_dtype, tiles)
    [out] = launch(
        _tgmm_kernel, offsets, lhs, dy, stand_in() if group_scale is None else group_scale.astype(jnp.float32),
        out_shape=[jax.ShapeDtypeStruct((g, k, n), out_dtype)],
        grid=(triton.cdiv(n, tiles.block_n), triton.cdiv(k, tiles.block_k), g), name="mtjax_triton_grouped_gemm_wgrad",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        M=m, K=k, N=n, SCALED=group_scale is not None, MIXED=jnp.dtype(lhs.dtype) != jnp.dtype(dy.dtype),
        PRECISION=_precision(lhs.dtype, dy.dtype), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
    )
    return out
