"""The grouped GEMM ``gmm`` as a Mosaic GPU kernel (Hopper): TMA, wgmma and warp specialisation.

``out[m] = lhs[m] @ rhs[g(m)]`` for ``lhs [M, K]`` sorted by group and ``rhs [G, N, K]`` (K-major,
``transpose_rhs``; the layout FP8 wgmma needs) or, for 16-bit operands, ``[G, K, N]``; an optional
float32 scale per group multiplies the accumulator (per-tensor FP8 dequantization). The tile schedule
is the Pallas kernel's (`mtjax.kernels.grouped_gemm.visits`): one CTA per (visit, N-tile), a visit
being one group's rows inside one 128-row M-tile.

Each CTA runs three warpgroups: a memory warpgroup streams the visit's ``[128, block_k]`` tiles of
``lhs`` and ``[block_n, block_k]`` tiles of ``rhs[g]`` into a ring of shared-memory slots with TMA
(`plgpu.emit_pipeline_warp_specialized`), two compute warpgroups of 64 rows each accumulate with
wgmma. A visit stores only its own group's rows: the TMA store is split into power-of-two row
counts (64, 32, ..., 1), each a box that starts at the first row still to be written, so a tile
shared by two groups is written by two visits without either touching the other's rows. Rows past
``sum(group_sizes)`` form the scheduler's pseudo-group, whose visits store zeros without loading
anything. The kernel takes M a multiple of 8, K of 128 bytes and N of 64 (`unsupported`); a partial
last M-tile or N-tile is TMA's out-of-bounds fill (loads) and clipping (stores).

Block-scaled FP8 (``block_scales``, `mtjax.fp8.BlockScaling`'s grouped GEMMs): ``lhs`` carries one
float32 scale per row and 128-wide K block, ``rhs[g]`` one per output column and K block; each K
step's wgmma goes into a fresh accumulator that is added to the sum with the two scale vectors
applied (the promotion of `mtjax.kernels.mosaic_gpu.block_fp8_gemm`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtjax.kernels import grouped_gemm as portable
from mtjax.kernels.common import MAX_ELEMENTS
from mtjax.kernels.mosaic_gpu.common import (
    BLOCK_ROWS,
    COMPUTE_WGS,
    MEMORY_REGISTERS,
    WG_ROWS,
    interpret_params,
    swizzled,
)

BLOCK_M = BLOCK_ROWS  # two compute warpgroups of 64 rows
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
WIDE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Tiles of the Mosaic GPU grouped GEMM (the M tile is fixed at 128 rows).

    Attributes:
      block_n: output columns per CTA (a multiple of 64, at most 256).
      stages: K steps in flight in shared memory.
    The K step is 128 bytes of a row: 128 FP8 or 64 16-bit values.
    """

    block_n: int = 128
    stages: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.block_n, int) or self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"GroupedConfig(block_n={self.block_n!r}): expected 64, 128, 192 or 256")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"GroupedConfig(stages={self.stages!r}): expected an int >= 2")


DEFAULT_CONFIG = GroupedConfig()


def unsupported(lhs_shape, rhs_shape, lhs_dtype, rhs_dtype, transpose_rhs: bool) -> str | None:
    """Why the kernel cannot take these operands, or ``None``."""
    dtype = jnp.dtype(lhs_dtype)
    if dtype != jnp.dtype(rhs_dtype):
        return f"lhs {dtype.name} with rhs {jnp.dtype(rhs_dtype).name} (one dtype for both)"
    if dtype not in FP8_DTYPES + WIDE_DTYPES:
        return f"dtype {dtype.name} (bfloat16, float16, float8_e4m3fn or float8_e5m2)"
    if dtype in FP8_DTYPES and not transpose_rhs:
        return "FP8 rhs [G, K, N] (FP8 wgmma takes rhs K-major: [G, N, K], transpose_rhs=True)"
    if min(lhs_shape) == 0 or min(rhs_shape) == 0:
        return "an empty array"
    # The tiled TMA copies take arrays whose tiled dimensions are whole tiles (the kernel takes those).
    m, k = lhs_shape
    n = rhs_shape[1] if transpose_rhs else rhs_shape[2]
    block_k = 128 // dtype.itemsize
    for name, size, multiple in (("M", m, 8), ("K", k, block_k), ("N", n, 64)):
        if size % multiple:
            return f"{name}={size} (the Mosaic GPU kernel takes multiples of {multiple})"
    if max(lhs_shape[0] * k, rhs_shape[0] * rhs_shape[1] * rhs_shape[2]) > MAX_ELEMENTS:
        return f"arrays of more than {MAX_ELEMENTS} elements"
    return None


def _store_rows(o_smem, out_gmem, first, count, row0, cols):
    """TMA-store rows ``first .. first + count`` of ``o_smem [64, block_n]`` to ``out_gmem`` at
    ``row0 + first``: one box per set bit of ``count``, largest first."""
    size = WG_ROWS
    while size:
        offset = first + (count & ~(2 * size - 1))  # the rows of the larger boxes come first

        @pl.when((count & size) != 0)
        def _(size=size, offset=offset):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, size)], out_gmem.at[pl.ds(row0 + offset, size), cols])
        size //= 2


def _kernel(group_gmem, tile_gmem, lo_gmem, hi_gmem, scale_gmem, lhs_gmem, rhs_gmem, lhs_scale_gmem, rhs_scale_gmem,
            out_gmem, o_smem, *, num_groups: int, k_steps: int, block_k: int, transpose_rhs: bool,
            config: GroupedConfig):
    visit, n_block, wg = lax.axis_index("visit"), lax.axis_index("n"), lax.axis_index("wg")
    group, tile = group_gmem[visit], tile_gmem[visit]
    lo, hi = lo_gmem[visit], hi_gmem[visit]
    rhs_group = jnp.minimum(group, num_groups - 1)  # in range for the index maps; the pseudo-group loads none
    block_n = config.block_n
    shape = (WG_ROWS, block_n)
    rows = pl.ds(wg * WG_ROWS, WG_ROWS)

    def accumulate(_, lhs_smem, rhs_smem, *scales_and_acc):
        *scales, acc = scales_and_acc

        def mma(out_ref):
            plgpu.wgmma(out_ref, lhs_smem.at[rows], rhs_smem.T if transpose_rhs else rhs_smem)
            return out_ref[...]

        partial = pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))
        if scales:  # block-scaled: this K block's row and column scales
            lhs_scale = plgpu.load(scales[0].at[rows], layout=plgpu.Layout.WGMMA.reduce(1))
            rhs_scale = plgpu.load(scales[1], layout=plgpu.Layout.WGMMA.reduce(0))
            partial = partial * (lax.broadcast_in_dim(lhs_scale, shape, [0]) *
                                 lax.broadcast_in_dim(rhs_scale, shape, [1]))
        return acc + partial

    def store(acc):
        """This warpgroup's rows of the visit, from the float32 ``acc``."""
        out = o_smem.at[wg]
        out[...] = acc.astype(out.dtype)
        plgpu.commit_smem()
        # This warpgroup's rows of the visit, relative to its 64 rows of the tile.
        first = jnp.clip(lo - tile * BLOCK_M - wg * WG_ROWS, 0, WG_ROWS)
        last = jnp.clip(hi - tile * BLOCK_M - wg * WG_ROWS, 0, WG_ROWS)
        _store_rows(out, out_gmem, first, jnp.maximum(last - first, 0), tile * BLOCK_M + wg * WG_ROWS,
                    pl.ds(n_block * block_n, block_n))
        plgpu.wait_smem_to_gmem(0)

    def compute(pipeline):
        acc = pipeline(plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA))
        store(acc if scale_gmem is None else acc * scale_gmem[rhs_group])

    if transpose_rhs:
        rhs_spec = plgpu.BlockSpec((None, block_n, block_k), lambda k: (rhs_group, n_block, k),
                                   transforms=swizzled(block_k, rhs_gmem.dtype))
    else:
        rhs_spec = plgpu.BlockSpec((None, block_k, block_n), lambda k: (rhs_group, k, n_block),
                                   transforms=swizzled(block_n, rhs_gmem.dtype))
    scale_specs = [] if lhs_scale_gmem is None else [
        plgpu.BlockSpec((None, BLOCK_M), lambda k: (k, tile)),
        plgpu.BlockSpec((None, None, block_n), lambda k: (rhs_group, k, n_block))]
    pipeline = plgpu.emit_pipeline_warp_specialized(
        accumulate, grid=(k_steps,), memory_registers=MEMORY_REGISTERS,
        in_specs=[plgpu.BlockSpec((BLOCK_M, block_k), lambda k: (tile, k),
                                  transforms=swizzled(block_k, lhs_gmem.dtype)), rhs_spec,
                  *scale_specs],
        max_concurrent_steps=min(config.stages, k_steps), wg_axis="wg", num_compute_wgs=COMPUTE_WGS,
        compute_context=compute,
    )

    @pl.when((lo < hi) & (group < num_groups))
    def _():
        pipeline(lhs_gmem, rhs_gmem, *(() if lhs_scale_gmem is None else (lhs_scale_gmem, rhs_scale_gmem)))

    # The pseudo-group past the last group: zeros, whatever its rows of lhs hold (no GEMM).
    @pl.when((lo < hi) & (group >= num_groups) & (wg < COMPUTE_WGS))
    def _():
        store(plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA))


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_scale: jax.Array | None = None, *,
        transpose_rhs: bool = False, out_dtype=None, block_scales: tuple[jax.Array, jax.Array] | None = None,
        config: GroupedConfig = DEFAULT_CONFIG) -> jax.Array:
    """`mtjax.kernels.grouped_gemm.gmm` (same arguments and result, but ``tiles``) on the Mosaic GPU kernel.

    ``block_scales``: ``(lhs_scale_inv [M, ceil(K/128)], rhs_scale_inv [G, ceil(K/128), N])`` for
    block-scaled FP8 operands (``rhs`` K-major, no ``group_scale``): ``out[m] = sum_kb (lhs[m, kb] @
    rhs[g, :, kb]^T) * lhs_scale_inv[m, kb] * rhs_scale_inv[g, kb, :]``.
    """
    why = unsupported(lhs.shape, rhs.shape, lhs.dtype, rhs.dtype, transpose_rhs)
    if why is None and block_scales is not None and (not transpose_rhs or group_scale is not None or
                                                     jnp.dtype(lhs.dtype) not in FP8_DTYPES):
        why = "block scales need FP8 operands, rhs K-major and no group_scale"
    if why is not None:
        raise ValueError(f"gmm: unsupported input: {why}")
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if (rhs.shape[2] if transpose_rhs else rhs.shape[1]) != k or group_sizes.shape != (g,):
        raise ValueError(f"gmm: lhs {lhs.shape}, rhs {rhs.shape} (transpose_rhs={transpose_rhs}) and group_sizes "
                         f"{group_sizes.shape} do not fit together")
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    block_k = 128 // jnp.dtype(lhs.dtype).itemsize
    k_steps = pl.cdiv(k, block_k)
    scale = None if group_scale is None else group_scale.astype(jnp.float32)
    scales = (None, None)
    if block_scales is not None:
        lhs_scale, rhs_scale = block_scales
        if lhs_scale.shape != (m, k_steps) or rhs_scale.shape != (g, k_steps, n):
            raise ValueError(f"gmm: block scales {lhs_scale.shape} and {rhs_scale.shape}; expected ({m}, {k_steps}) "
                             f"and ({g}, {k_steps}, {n})")
        scales = (lhs_scale.T.astype(jnp.float32), rhs_scale.astype(jnp.float32))
    kernel = functools.partial(_kernel, num_groups=g, k_steps=k_steps, block_k=block_k, transpose_rhs=transpose_rhs,
                               config=config)

    def body(group, tile, lo, hi, *refs):
        refs = list(refs)  # [scale], lhs, rhs, [lhs scales, rhs scales], out, staging
        scale_ref = refs.pop(0) if scale is not None else None
        lhs_ref, rhs_ref = refs.pop(0), refs.pop(0)
        lhs_scale_ref, rhs_scale_ref = (refs.pop(0), refs.pop(0)) if block_scales is not None else (None, None)
        return kernel(group, tile, lo, hi, scale_ref, lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref, *refs)

    inputs = (*(() if scale is None else (scale,)), lhs, rhs, *(() if block_scales is None else scales))
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        scratch_types=[plgpu.SMEM((COMPUTE_WGS, WG_ROWS, config.block_n), out_dtype)],
        grid=(portable.num_visits(m, g, BLOCK_M), pl.cdiv(n, config.block_n)), grid_names=("visit", "n"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        interpret=interpret_params(),
    )(*portable.visits(group_sizes, m, BLOCK_M), *inputs)
