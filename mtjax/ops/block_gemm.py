"""The block-scaled FP8 GEMM: ``a [m, k] @ b [n, k]^T`` with one float32 scale per 128-wide K block
of every row of ``a`` and every row (or 128x128 block) of ``b``.

The partial product of each K block is accumulated in float32 with its scales applied as it is
added (DeepGEMM's promotion): ``out = sum_kb dot(a_kb, b_kb^T) * sa[:, kb, None] * sb[None, :, kb]``.
Operands come from `mtjax.ops.tile_quantize` (1x128 row tiles) and `mtjax.ops.block_quantize`
(128x128 blocks).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mtjax import backend
from mtjax.dtypes import is_fp8
from mtjax.kernels import block_fp8_gemm as gemm_kernel

BLOCK_K = gemm_kernel.BLOCK_K


def _row_scales(b_scale_inv: jax.Array, n: int) -> jax.Array:
    """``b``'s scales as one per row and K block, ``[n, kb]`` (128x128 block scales repeated over their rows)."""
    if b_scale_inv.shape[0] == n:
        return b_scale_inv
    return jnp.repeat(b_scale_inv, BLOCK_K, axis=0)[:n]


@backend.register("block_fp8_gemm", backend.REFERENCE)
def block_fp8_gemm_reference(a, a_scale_inv, b, b_scale_inv, *, out_dtype):
    """The ``"xla"`` implementation of `block_fp8_gemm`: one FP8 ``dot_general`` per K block (contracting
    the last axis of both operands), accumulated in float32 with its scales."""
    k, n = a.shape[1], b.shape[0]
    kb = a_scale_inv.shape[1]
    pad = kb * BLOCK_K - k
    if pad:
        a, b = jnp.pad(a, ((0, 0), (0, pad))), jnp.pad(b, ((0, 0), (0, pad)))
    sa, sb = a_scale_inv.astype(jnp.float32), _row_scales(b_scale_inv, n).astype(jnp.float32)

    def block(i):
        a_blk = lax.dynamic_slice_in_dim(a, i * BLOCK_K, BLOCK_K, axis=1)
        b_blk = lax.dynamic_slice_in_dim(b, i * BLOCK_K, BLOCK_K, axis=1)
        partial = lax.dot_general(a_blk, b_blk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        sa_i = lax.dynamic_index_in_dim(sa, i, axis=1, keepdims=False)
        sb_i = lax.dynamic_index_in_dim(sb, i, axis=1, keepdims=False)
        return partial * (sa_i[:, None] * sb_i[None, :])

    # The first block starts the sum (not zeros), so inside shard_map the carry varies as the operands do.
    return lax.fori_loop(1, kb, lambda i, acc: acc + block(i), block(0)).astype(out_dtype)


@backend.register("block_fp8_gemm", "pallas_triton", requires=(backend.PALLAS_TRITON,), priority=9,
                  single_device=True,
                  unsupported=lambda a, sa, b, sb, **_: gemm_kernel.unsupported(a.shape, a.dtype, b.shape, b.dtype))
def _block_fp8_gemm_pallas(a, a_scale_inv, b, b_scale_inv, *, out_dtype):
    return gemm_kernel.block_fp8_gemm(a, a_scale_inv, b, _row_scales(b_scale_inv, b.shape[0]), out_dtype)


# The native Triton kernel ahead of its Pallas twin (faster on an H100: docs/performance.md).
@backend.register("block_fp8_gemm", "triton", requires=(backend.TRITON,), priority=10, single_device=True,
                  unsupported=lambda a, sa, b, sb, **_: gemm_kernel.unsupported(a.shape, a.dtype, b.shape, b.dtype))
def _block_fp8_gemm_triton(a, a_scale_inv, b, b_scale_inv, *, out_dtype):
    from mtjax.kernels.triton import block_fp8 as native

    return native.block_fp8_gemm(a, a_scale_inv, b, _row_scales(b_scale_inv, b.shape[0]), out_dtype)


def _mosaic_unsupported(a, sa, b, sb, *, out_dtype, **_) -> str | None:
    from mtjax.kernels.mosaic_gpu import block_fp8_gemm as mosaic

    reason = mosaic.unsupported(a.shape, a.dtype, b.shape, b.dtype)
    needed = mosaic.DEFAULT_CONFIG.smem_bytes(jnp.dtype(out_dtype).itemsize)
    if reason is None and needed > mosaic.SMEM_BYTES:
        reason = f"{needed} bytes of shared memory (at most {mosaic.SMEM_BYTES})"
    return reason


# Above the Triton kernels: Hopper's warpgroup MMAs fed by the bulk tensor copy engine.
@backend.register("block_fp8_gemm", "mosaic_gpu", requires=(backend.PALLAS_MOSAIC_GPU,), priority=11,
                  single_device=True, unsupported=_mosaic_unsupported)
def _block_fp8_gemm_mosaic(a, a_scale_inv, b, b_scale_inv, *, out_dtype):
    from mtjax.kernels.mosaic_gpu import block_fp8_gemm as mosaic

    return mosaic.block_fp8_gemm(a, a_scale_inv, b, _row_scales(b_scale_inv, b.shape[0]), out_dtype)


def _cublaslt_unsupported(a, sa, b, sb, *, out_dtype, **_) -> str | None:
    from mtjax.kernels import cublaslt

    reason = cublaslt.unsupported(a.dtype, b.dtype, out_dtype)
    if reason is None and backend.cuda_compute_capability()[0] != 9:
        reason = "cuBLASLt's 1x128 and 128x128 block scales run on Hopper (sm_90) GPUs"
    return reason or cublaslt.block_modes_problem()


# cuBLASLt's block-scaled modes through an FFI call: first wherever its library is built and the
# GPU is a Hopper (docs/performance.md compares it with the kernels).
@backend.register("block_fp8_gemm", "cublaslt", requires=(backend.FP8_GEMM,), platforms=("cuda",), priority=12,
                  single_device=True, unsupported=_cublaslt_unsupported)
def _block_fp8_gemm_cublaslt(a, a_scale_inv, b, b_scale_inv, *, out_dtype):
    from mtjax.kernels import cublaslt

    return cublaslt.block_fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype)


def block_fp8_gemm(a: jax.Array, a_scale_inv: jax.Array, b: jax.Array, b_scale_inv: jax.Array, *,
                   out_dtype: Any, implementation: str | None = None) -> jax.Array:
    """``(a @ b^T)`` with block scales, in ``out_dtype``: the GEMM every block-scaled FP8 dot reduces to.

    Args:
      a: float8 ``[m, k]``.
      a_scale_inv: float32 ``[m, ceil(k/128)]``: ``a``'s dequantization scale per row and K block.
      b: float8 ``[n, k]`` (both contract over their last axis).
      b_scale_inv: float32 ``[n, ceil(k/128)]`` (per row and K block, as ``a``'s) or
        ``[ceil(n/128), ceil(k/128)]`` (per 128x128 block).
      out_dtype: dtype of the ``[m, n]`` result.
      implementation: ``"xla"`` (a loop of FP8 dots), ``"pallas_triton"`` (the kernel,
        `mtjax.kernels.block_fp8_gemm`), ``"triton"`` (its native Triton port) or ``"mosaic_gpu"``
        (a warp-specialised Mosaic GPU kernel for Hopper, `mtjax.kernels.mosaic_gpu.block_fp8_gemm`;
        one FP8 dtype for both operands) or ``"cublaslt"`` (cuBLASLt's block-scaled modes on Hopper,
        `mtjax.kernels.cublaslt`, once its FFI library is built).
    """
    for name, x in (("a", a), ("b", b)):
        if not is_fp8(x.dtype):
            raise TypeError(f"block_fp8_gemm: {name} has dtype {x.dtype}; expected a float8 dtype")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"block_fp8_gemm: a {a.shape} and b {b.shape} must be [m, k] and [n, k]")
    (m, k), n = a.shape, b.shape[0]
    kb, nb = -(-k // BLOCK_K), -(-n // BLOCK_K)
    if jnp.shape(a_scale_inv) != (m, kb):
        raise ValueError(f"block_fp8_gemm: a_scale_inv has shape {jnp.shape(a_scale_inv)}; expected ({m}, {kb})")
    if jnp.shape(b_scale_inv) not in ((n, kb), (nb, kb)):
        raise ValueError(f"block_fp8_gemm: b_scale_inv has shape {jnp.shape(b_scale_inv)}; expected ({n}, {kb}) "
                         f"(per row) or ({nb}, {kb}) (per 128x128 block)")
    return backend.dispatch("block_fp8_gemm", a, a_scale_inv, b, b_scale_inv, implementation=implementation,
                            out_dtype=jnp.dtype(out_dtype))
