"""The block-scaled FP8 GEMM as a Mosaic GPU kernel: TMA, FP8 wgmma and warp specialisation (Hopper).

Same contract as `mtjax.kernels.block_fp8_gemm` (whose padding and argument handling it reuses, as a
`Launchers` entry): ``out [m, n] = sum_kb dot(a[:, kb], b[:, kb]^T) * (sa[:, kb] ⊗ sb[:, kb])`` for
FP8 ``a [m, k]`` and ``b [n, k]`` contracting over their last axis, with the scales of every row and
128-wide K block (``sa_t [k/128, m]``, ``sb_t [k/128, n]``).

Each CTA owns a ``[128, block_n]`` output tile and runs three warpgroups. The memory warpgroup
(`plgpu.emit_pipeline_warp_specialized`) copies, for each K block, the ``[128, 128]`` tile of ``a``,
the ``[block_n, 128]`` tile of ``b`` and both scale vectors into a ring of ``stages`` shared-memory
slots with TMA. Each of the two compute warpgroups owns 64 rows of the tile: per K block it runs one
FP8 wgmma (both operands K-major, as FP8 tensor cores take them) into a fresh float32 accumulator and
adds it to its running sum with the block's scales applied (DeepGEMM's promotion on the CUDA cores),
while the other warpgroup's wgmma keeps the tensor cores busy. The sum is written through shared
memory with one TMA store per warpgroup.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mtjax.kernels import block_fp8_gemm as portable
from mtjax.kernels.common import Launchers, vary_together
from mtjax.kernels.mosaic_gpu.common import (
    BLOCK_ROWS,
    COMPUTE_WGS,
    MEMORY_REGISTERS,
    WG_ROWS,
    interpret_params,
    swizzled,
)

BLOCK_K = portable.BLOCK_K
BLOCK_M = BLOCK_ROWS  # two compute warpgroups of 64 rows
SMEM_BYTES = 227 * 1024  # what one CTA may use on Hopper


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
    """Launch parameters of the Mosaic GPU kernel (the M tile is fixed at 128).

    Attributes:
      block_n: the output tile's columns (a multiple of 64, at most 256: one wgmma's N).
      stages: K blocks in flight in shared memory (the TMA ring).
    """

    block_n: int = 128
    stages: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.block_n, int) or self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"MosaicGemmConfig(block_n={self.block_n!r}): expected 64, 128, 192 or 256")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"MosaicGemmConfig(stages={self.stages!r}): expected an int >= 2")

    @property
    def block_m(self) -> int:
        return BLOCK_M

    def smem_bytes(self, out_itemsize: int) -> int:
        """Shared memory of one CTA, as Mosaic GPU lays it out: the ring of operand tiles and scales and
        the output staging, each buffer aligned to 1 KiB, and a KiB for the barriers."""
        def aligned(nbytes):
            return -(-nbytes // 1024) * 1024

        ring = [self.stages * BLOCK_M * BLOCK_K, self.stages * self.block_n * BLOCK_K, self.stages * 4 * BLOCK_M,
                self.stages * 4 * self.block_n]
        return sum(map(aligned, ring)) + aligned(BLOCK_M * self.block_n * out_itemsize) + 1024

    def label(self) -> str:
        return f"mosaic {BLOCK_M}x{self.block_n}x{BLOCK_K} s{self.stages}"


DEFAULT_CONFIG = MosaicGemmConfig()
# block_n 256 is left out: its two float32 accumulators (the sum and a K block's) would take 256
# registers a thread, over what a compute warpgroup gets.
SWEEP_CONFIGS = (MosaicGemmConfig(128, 3), MosaicGemmConfig(128, 5), MosaicGemmConfig(192, 3),
                 MosaicGemmConfig(64, 4))


def unsupported(a_shape, a_dtype, b_shape, b_dtype) -> str | None:
    """``None`` if the kernel takes these operands, else why not (the portable kernel's rules; one
    FP8 dtype for both operands)."""
    reason = portable.unsupported(a_shape, a_dtype, b_shape, b_dtype)
    if reason is None and jnp.dtype(a_dtype) != jnp.dtype(b_dtype):
        reason = f"a {jnp.dtype(a_dtype).name} with b {jnp.dtype(b_dtype).name} (one FP8 dtype for both)"
    return reason


def _operand_spec(rows: int, index_map) -> plgpu.BlockSpec:
    # 128-byte rows of FP8, as wgmma reads them
    return plgpu.BlockSpec((rows, BLOCK_K), index_map, transforms=swizzled(BLOCK_K, jnp.float8_e4m3fn))


def _kernel(a_gmem, sa_gmem, b_gmem, sb_gmem, o_gmem, o_smem, *, k_blocks: int, config: MosaicGemmConfig):
    m_block, n_block = lax.axis_index("m"), lax.axis_index("n")
    wg = lax.axis_index("wg")
    rows = pl.ds(wg * WG_ROWS, WG_ROWS)
    shape = (WG_ROWS, config.block_n)

    def accumulate(_, a_smem, sa_smem, b_smem, sb_smem, acc):
        def mma(partial_ref):
            plgpu.wgmma(partial_ref, a_smem.at[rows], b_smem.T)
            return partial_ref[...]

        partial = pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))
        sa = plgpu.load(sa_smem.at[rows], layout=plgpu.Layout.WGMMA.reduce(1))
        sb = plgpu.load(sb_smem, layout=plgpu.Layout.WGMMA.reduce(0))
        return acc + partial * (lax.broadcast_in_dim(sa, shape, [0]) * lax.broadcast_in_dim(sb, shape, [1]))

    def compute(pipeline):
        acc = pipeline(plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA))
        out = o_smem.at[wg]
        out[...] = acc.astype(out.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, o_gmem.at[pl.ds(m_block * BLOCK_M + wg * WG_ROWS, WG_ROWS),
                                              pl.ds(n_block * config.block_n, config.block_n)])
        plgpu.wait_smem_to_gmem(0)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        accumulate, grid=(k_blocks,), memory_registers=MEMORY_REGISTERS,
        in_specs=[_operand_spec(BLOCK_M, lambda k: (m_block, k)),
                  plgpu.BlockSpec((None, BLOCK_M), lambda k: (k, m_block)),
                  _operand_spec(config.block_n, lambda k: (n_block, k)),
                  plgpu.BlockSpec((None, config.block_n), lambda k: (k, n_block))],
        max_concurrent_steps=min(config.stages, k_blocks), wg_axis="wg", num_compute_wgs=COMPUTE_WGS,
        compute_context=compute,
    )
    pipeline(a_gmem, sa_gmem, b_gmem, sb_gmem)


def _launch(a: jax.Array, sa_t: jax.Array, b: jax.Array, sb_t: jax.Array, out_dtype,
            config: MosaicGemmConfig) -> jax.Array:
    """The kernel on operands padded to whole tiles (`mtjax.kernels.block_fp8_gemm._launch`'s contract)."""
    (mp, kp), np_ = a.shape, b.shape[0]
    kernel = functools.partial(_kernel, k_blocks=kp // BLOCK_K, config=config)
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        scratch_types=[plgpu.SMEM((COMPUTE_WGS, WG_ROWS, config.block_n), out_dtype)],
        grid=(mp // BLOCK_M, np_ // config.block_n), grid_names=("m", "n"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg", interpret=interpret_params(),
    )(a, sa_t, b, sb_t)
    return vary_together(out, a, sa_t, b, sb_t)[0]


MOSAIC = Launchers(forward=_launch)


def block_fp8_gemm(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, out_dtype, *,
                   config: MosaicGemmConfig = DEFAULT_CONFIG) -> jax.Array:
    """`mtjax.kernels.block_fp8_gemm.block_fp8_gemm` (same arguments and result) on the Mosaic GPU kernel."""
    why = unsupported(a.shape, a.dtype, b.shape, b.dtype)
    if why is not None:
        raise ValueError(f"block_fp8_gemm: unsupported input: {why}")
    if config.smem_bytes(jnp.dtype(out_dtype).itemsize) > SMEM_BYTES:
        raise ValueError(f"block_fp8_gemm: {config.label()} needs {config.smem_bytes(jnp.dtype(out_dtype).itemsize)} "
                         f"bytes of shared memory with a {jnp.dtype(out_dtype).name} output; at most {SMEM_BYTES}")
    return portable.block_fp8_gemm(a, sa, b, sb, out_dtype, config=config, launchers=MOSAIC)
