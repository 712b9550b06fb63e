"""Grouped GEMM: one GEMM per group of rows (a mixture of experts' expert MLPs), in one op.

``lhs [M, K]`` holds the rows of all groups, sorted by group: group ``g`` owns rows
``offsets[g] .. offsets[g + 1]`` with ``offsets = cumsum([0] + group_sizes)``; ``rhs [G, K, N]``
holds one ``[K, N]`` matrix per group (``[G, N, K]`` with ``transpose_rhs=True``). Row ``m`` of
group ``g`` gives ``out[m] = lhs[m] @ rhs[g]``. ``sum(group_sizes) <= M``: rows past the sum belong to
no group and give zeros (a dropless MoE sizes ``M`` statically and fills it partly). Group sizes
need not be multiples of any tile; empty groups are fine. Sizes must be non-negative and sum to at
most ``M``; larger sums are clipped at ``M`` by the kernels (the result is then unspecified).

`grouped_gemm` is differentiable (one `jax.custom_vjp`): ``d lhs`` is a grouped GEMM of the output
gradient with ``rhs`` transposed, ``d rhs`` the per-group ``lhs^T dy`` into ``[G, K, N]``
(`grouped_gemm_wgrad`). Each of the three GEMMs dispatches on its own through `mtjax.backend`:
``"xla"`` is `jax.lax.ragged_dot` (and `jax.lax.ragged_dot_general` for the weight gradient),
``"pallas_triton"`` the kernels of `mtjax.kernels.grouped_gemm`, ``"triton"`` their native Triton ports
(`mtjax.kernels.triton.grouped_gemm`), ``"mosaic_gpu"`` a warp-specialised Hopper kernel, ``"cublaslt"``
one cuBLASLt GEMM per group (`mtjax.kernels.cublaslt`; the group sizes are read to the host first).

`grouped_gemm_fp8` is the FP8 variant (E4M3 operands, E5M2 output gradient by default): a per-tensor
scale for ``lhs`` and the output gradient, a per-group scale for ``rhs``, computed from each tensor's
amax in the same step (current scaling) or given by the caller (delayed scaling, `GroupedFP8Scales`).
Accumulation is float32; the dequantization scales multiply the float32 accumulator in the kernels'
epilogue (one ``[G]`` scale per group), so no float32 product is ever written out. ``d lhs``
multiplies E5M2 gradients by E4M3 weights: on cuBLASLt as they are, elsewhere on their values
dequantized to the model's dtype (`grouped_gemm_tensor_scaled`).

`grouped_gemm_block_fp8` has `mtjax.fp8.BlockScaling`'s numerics: 1x128 tiles for the activations
and gradients, 128x128 blocks per group for ``rhs``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from mtjax import backend
from mtjax.dtypes import check_fp8_dtype, is_fp8, widen_fp8
from mtjax.kernels import grouped_gemm as gg_kernels
from mtjax.kernels.common import interpret as kernel_interpret
from mtjax.kernels.common import saturate_cast, varying_axes
from mtjax.kernels.grouped_gemm import BlockSizes, GemmTiles
from mtjax.ops.block_quantization import TILE, block_dequantize, block_quantize, tile_dequantize, tile_quantize
from mtjax.ops.checks import check_choice, check_float, check_rank, check_tile_options


def _check_group_sizes(op: str, group_sizes: Any, num_groups: int) -> None:
    if jnp.shape(group_sizes) != (num_groups,):
        raise ValueError(f"{op}: group_sizes has shape {jnp.shape(group_sizes)}; expected ({num_groups},)")
    if not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
        raise TypeError(f"{op}: group_sizes has dtype {jnp.result_type(group_sizes)}; expected an integer dtype")


def _check_operands(op: str, lhs: Any, rhs: Any, group_sizes: Any, transpose_rhs: bool) -> tuple[int, int, int, int]:
    check_float(op, "lhs", lhs)
    check_float(op, "rhs", rhs)
    check_rank(op, "lhs", lhs, 2)
    check_rank(op, "rhs", rhs, 3)
    if jnp.result_type(lhs) != jnp.result_type(rhs):
        raise TypeError(f"{op}: lhs ({jnp.result_type(lhs)}) and rhs ({jnp.result_type(rhs)}) must share a dtype")
    if not isinstance(transpose_rhs, bool):
        raise TypeError(f"{op}: transpose_rhs={transpose_rhs!r}; expected True or False")
    m, k = lhs.shape
    g, rk, n = rhs.shape
    if transpose_rhs:
        rk, n = n, rk
    if rk != k:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(f"{op}: lhs {lhs.shape} [M, K] and rhs {rhs.shape} {layout} disagree on K")
    _check_group_sizes(op, group_sizes, g)
    return m, k, n, g


def _out_dtype(op: str, preferred_element_type: DTypeLike | None, default: Any) -> jnp.dtype:
    dtype = jnp.dtype(default if preferred_element_type is None else preferred_element_type)
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
        raise TypeError(f"{op}: preferred_element_type={dtype}; expected float32, bfloat16 or float16")
    return dtype


def _row_group_scale(group_scale: jax.Array, group_sizes: jax.Array, m: int) -> jax.Array:
    """``[M]``: each row's group's value of ``group_scale [G]`` (1 for rows past the groups)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row_group = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")
    return jnp.concatenate([group_scale, jnp.ones((1,), group_scale.dtype)])[row_group]


def _check_block_sizes(op: str, block_sizes: Any, kind: type) -> None:
    if block_sizes is not None and not isinstance(block_sizes, kind):
        raise TypeError(f"{op}: block_sizes={block_sizes!r}; "
                        f"expected None or a mtjax.kernels.grouped_gemm.{kind.__name__}")


# --------------------------------------------------------------------------------------------------
# The three GEMMs, each dispatched on its own
# --------------------------------------------------------------------------------------------------


def _exact_for_xla(*operands: jax.Array) -> tuple[jax.Array, ...]:
    """FP8 operands as bfloat16 (which holds every E4M3 and E5M2 value exactly): XLA's ragged dots
    take no FP8 (or mixed-FP8) operands on every platform."""
    if any(is_fp8(x.dtype) for x in operands):
        return tuple(widen_fp8(x, jnp.bfloat16) if is_fp8(x.dtype) else x.astype(jnp.bfloat16) for x in operands)
    return operands


@backend.register("grouped_gemm", backend.REFERENCE)
def grouped_gemm_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_scale: jax.Array | None,
                           *, transpose_rhs: bool, out_dtype: Any, tiles: GemmTiles | None) -> jax.Array:
    """The ``"xla"`` grouped GEMM: `jax.lax.ragged_dot`, float32 accumulation, then each row times its
    group's ``group_scale`` (``[G]`` float32 or ``None``; FP8 dequantization); ``tiles`` unused."""
    del tiles
    lhs, rhs = _exact_for_xla(lhs, rhs)
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    if group_scale is not None:
        out = out * _row_group_scale(group_scale, group_sizes, lhs.shape[0])[:, None]
    return out.astype(out_dtype)


@backend.register("grouped_gemm_wgrad", backend.REFERENCE)
def grouped_gemm_wgrad_reference(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array,
                                 group_scale: jax.Array | None, *, out_dtype: Any,
                                 tiles: GemmTiles | None) -> jax.Array:
    """The ``"xla"`` per-group ``lhs^T grad`` (times ``group_scale[g]``): `jax.lax.ragged_dot_general`
    with a ragged contraction."""
    del tiles
    lhs, grad = _exact_for_xla(lhs, grad)
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    out = lax.ragged_dot_general(lhs, grad, group_sizes.astype(jnp.int32), numbers,
                                 preferred_element_type=jnp.float32)
    if group_scale is not None:
        out = out * group_scale[:, None, None]
    return out.astype(out_dtype)


def _kernel_unsupported_gmm(lhs, rhs, group_sizes, group_scale, *, transpose_rhs, out_dtype, tiles) -> str | None:
    return gg_kernels.unsupported(jnp.shape(lhs), jnp.shape(rhs), jnp.result_type(lhs), jnp.result_type(rhs))


def _kernel_unsupported_wgrad(lhs, grad, group_sizes, group_scale, *, out_dtype, tiles) -> str | None:
    # Checked as a gmm of lhs [M, K] against the output [G, K, N]: every array the kernel indexes (lhs, grad
    # [M, N] and the output) then stays within the int32 bound.
    out_shape = (jnp.shape(group_sizes)[0], jnp.shape(lhs)[1], jnp.shape(grad)[1])
    return gg_kernels.unsupported(jnp.shape(lhs), out_shape, jnp.result_type(lhs), jnp.result_type(grad))


_KERNEL = {"requires": (backend.PALLAS_TRITON,), "priority": 10, "single_device": True}


@backend.register("grouped_gemm", "pallas_triton", unsupported=_kernel_unsupported_gmm, **_KERNEL)
def _grouped_gemm_pallas(lhs, rhs, group_sizes, group_scale, *, transpose_rhs, out_dtype, tiles):
    return gg_kernels.gmm(lhs, rhs, group_sizes, group_scale, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                          tiles=tiles, interpret=kernel_interpret())


@backend.register("grouped_gemm_wgrad", "pallas_triton", unsupported=_kernel_unsupported_wgrad, **_KERNEL)
def _grouped_gemm_wgrad_pallas(lhs, grad, group_sizes, group_scale, *, out_dtype, tiles):
    return gg_kernels.tgmm(lhs, grad, group_sizes, group_scale, out_dtype=out_dtype, tiles=tiles,
                           interpret=kernel_interpret())


# The native Triton kernels above the Pallas ones (measured faster with bf16 operands and with mixed FP8
# operands: docs/performance.md); FP8 operands of one dtype go to the Mosaic GPU kernel first.
_NATIVE = {**_KERNEL, "requires": (backend.TRITON,), "priority": 11}


@backend.register("grouped_gemm", "triton", unsupported=_kernel_unsupported_gmm, **_NATIVE)
def _grouped_gemm_triton(lhs, rhs, group_sizes, group_scale, *, transpose_rhs, out_dtype, tiles):
    from mtjax.kernels.triton import grouped_gemm as native

    return native.gmm(lhs, rhs, group_sizes, group_scale, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                      tiles=tiles)


@backend.register("grouped_gemm_wgrad", "triton", unsupported=_kernel_unsupported_wgrad, **_NATIVE)
def _grouped_gemm_wgrad_triton(lhs, grad, group_sizes, group_scale, *, out_dtype, tiles):
    from mtjax.kernels.triton import grouped_gemm as native

    return native.tgmm(lhs, grad, group_sizes, group_scale, out_dtype=out_dtype, tiles=tiles)


def _mosaic_unsupported_gmm(lhs, rhs, group_sizes, group_scale, *, transpose_rhs, out_dtype, tiles) -> str | None:
    from mtjax.kernels.mosaic_gpu import grouped_gemm as mosaic

    del group_sizes, group_scale, out_dtype, tiles
    return mosaic.unsupported(jnp.shape(lhs), jnp.shape(rhs), jnp.result_type(lhs), jnp.result_type(rhs),
                              transpose_rhs)


def _mosaic_not_preferred(lhs, rhs, *_, **__) -> str | None:
    if not is_fp8(jnp.result_type(lhs)):
        return "the Triton kernels are faster on bf16 operands (docs/performance.md)"
    return None


# Warp-specialised Mosaic GPU kernel for Hopper (one dtype for both operands; FP8 with K-major rhs):
# first for FP8 operands, where it is the fastest grouped GEMM on an H100 (docs/performance.md).
@backend.register("grouped_gemm", "mosaic_gpu", requires=(backend.PALLAS_MOSAIC_GPU,), priority=12,
                  single_device=True, unsupported=_mosaic_unsupported_gmm, prefer=_mosaic_not_preferred)
def _grouped_gemm_mosaic(lhs, rhs, group_sizes, group_scale, *, transpose_rhs, out_dtype, tiles):
    from mtjax.kernels.mosaic_gpu import grouped_gemm as mosaic

    del tiles  # the Triton kernels' tiles; the Mosaic GPU kernel has its own (`GroupedConfig`)
    return mosaic.gmm(lhs, rhs, group_sizes, group_scale, transpose_rhs=transpose_rhs, out_dtype=out_dtype)


def _cublaslt_unsupported_gmm(lhs, rhs, group_sizes, group_scale, *, transpose_rhs, out_dtype, tiles) -> str | None:
    from mtjax.kernels import cublaslt

    del group_sizes, group_scale, tiles  # each group's GEMM takes its scale as its alpha
    return cublaslt.grouped_unsupported(jnp.shape(lhs), jnp.shape(rhs), jnp.result_type(lhs), jnp.result_type(rhs),
                                        out_dtype, transpose_rhs=transpose_rhs) or cublaslt.load()


def _cublaslt_unsupported_wgrad(lhs, grad, group_sizes, group_scale, *, out_dtype, tiles) -> str | None:
    from mtjax.kernels import cublaslt

    del group_sizes, tiles
    return cublaslt.grouped_wgrad_unsupported(jnp.shape(lhs), jnp.shape(grad), jnp.result_type(lhs),
                                              jnp.result_type(grad), out_dtype,
                                              scaled=group_scale is not None) or cublaslt.load()


_CUBLASLT = {"platforms": ("cuda",), "priority": 13, "single_device": True}


# cuBLASLt, one GEMM per group (`mtjax.kernels.cublaslt`, once its FFI library is built): first wherever
# it takes the operands, 16-bit or FP8 (faster than the Triton kernels on an H100: docs/performance.md).
# It multiplies E4M3 and E5M2 operands on the FP8 tensor cores as they are.
@backend.register("grouped_gemm", "cublaslt", unsupported=_cublaslt_unsupported_gmm, **_CUBLASLT)
def _grouped_gemm_cublaslt(lhs, rhs, group_sizes, group_scale, *, transpose_rhs, out_dtype, tiles):
    from mtjax.kernels import cublaslt

    del tiles
    return cublaslt.grouped_gemm(lhs, rhs, group_sizes, group_scale, transpose_rhs=transpose_rhs, out_dtype=out_dtype)


@backend.register("grouped_gemm_wgrad", "cublaslt", unsupported=_cublaslt_unsupported_wgrad, **_CUBLASLT)
def _grouped_gemm_wgrad_cublaslt(lhs, grad, group_sizes, group_scale, *, out_dtype, tiles):
    from mtjax.kernels import cublaslt

    del group_scale, tiles
    return cublaslt.grouped_gemm_wgrad(lhs, grad, group_sizes, out_dtype=out_dtype)


# Implementations that run some of an op's GEMMs only: where one declines a GEMM (the weight gradient,
# FP8 operands of two dtypes, the block-scaled op), that GEMM takes the automatic choice.
PARTIAL_IMPLEMENTATIONS = ("mosaic_gpu", "cublaslt")


def _choice(op: str, implementation: str | None, *args, **static) -> str | None:
    if implementation not in PARTIAL_IMPLEMENTATIONS:
        return implementation
    if implementation not in backend.implementations(op):
        return None
    return None if backend.get_implementation(op, implementation).unsupported(*args, **static) else implementation


def _gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, tiles, implementation, group_scale=None):
    static = dict(transpose_rhs=transpose_rhs, out_dtype=jnp.dtype(out_dtype), tiles=tiles)
    args = (lhs, rhs, group_sizes, group_scale)
    return backend.dispatch("grouped_gemm", *args, implementation=_choice("grouped_gemm", implementation, *args,
                                                                          **static), **static)


def _tgmm(lhs, grad, group_sizes, out_dtype, tiles, implementation, group_scale=None):
    static = dict(out_dtype=jnp.dtype(out_dtype), tiles=tiles)
    args = (lhs, grad, group_sizes, group_scale)
    return backend.dispatch("grouped_gemm_wgrad", *args,
                            implementation=_choice("grouped_gemm_wgrad", implementation, *args, **static), **static)


# --------------------------------------------------------------------------------------------------
# bf16 / f32: the differentiable op
# --------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _grouped_gemm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, blocks, implementation):
    return _gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, blocks.forward, implementation)


def _grouped_gemm_fwd(lhs, rhs, group_sizes, transpose_rhs, out_dtype, blocks, implementation):
    out = _gmm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, blocks.forward, implementation)
    return out, (lhs, rhs, group_sizes)


def _grouped_gemm_bwd(transpose_rhs, out_dtype, blocks, implementation, residuals, grad):
    lhs, rhs, group_sizes = residuals
    grad = grad.astype(lhs.dtype)
    d_lhs = _gmm(grad, rhs, group_sizes, not transpose_rhs, lhs.dtype, blocks.dlhs, implementation)
    # [G, N, K] = grad^T lhs when rhs is stored transposed, else [G, K, N] = lhs^T grad.
    d_rhs = (_tgmm(grad, lhs, group_sizes, rhs.dtype, blocks.wgrad, implementation) if transpose_rhs
             else _tgmm(lhs, grad, group_sizes, rhs.dtype, blocks.wgrad, implementation))
    return d_lhs, d_rhs, None


_grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)


def grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
                 preferred_element_type: DTypeLike | None = None, block_sizes: BlockSizes | None = None,
                 implementation: str | None = None) -> jax.Array:
    """Per-group ``lhs @ rhs[g]`` over rows sorted by group (module docstring); differentiable.

    Args:
      lhs: ``[M, K]`` float, rows sorted by group.
      rhs: ``[G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``), the dtype of ``lhs``.
      group_sizes: ``[G]`` integer rows per group, ``sum <= M``.
      transpose_rhs: ``rhs`` is stored ``[G, N, K]`` (each group's matrix transposed).
      preferred_element_type: output dtype (default ``lhs.dtype``); accumulation is float32 always.
      block_sizes: tiles of the three kernels (forward, ``d lhs``, weight gradient); default
        `BlockSizes.default` for the shapes. The ``"xla"`` implementation ignores them.
      implementation: ``"xla"``, ``"pallas_triton"`` or ``"triton"`` for all three GEMMs; default per
        platform. ``"mosaic_gpu"`` (Hopper) runs the forward and ``d lhs`` GEMMs on the Mosaic GPU
        kernel (`mtjax.kernels.mosaic_gpu.grouped_gemm`) where it takes them; the weight gradient, and
        a GEMM it declines, take the default. ``"cublaslt"`` (CUDA, once `mtjax.kernels.cublaslt`'s
        library is built) runs one cuBLASLt GEMM per group, after reading the group sizes to the
        host; a GEMM it declines takes the default.
    Returns:
      ``[M, N]``; rows past ``sum(group_sizes)`` are zeros.
    """
    op = "grouped_gemm"
    m, k, n, g = _check_operands(op, lhs, rhs, group_sizes, transpose_rhs)
    _check_block_sizes(op, block_sizes, BlockSizes)
    out_dtype = _out_dtype(op, preferred_element_type, lhs.dtype)
    blocks = block_sizes or BlockSizes.default(m, k, n, g, lhs.dtype)
    return _grouped_gemm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, blocks, implementation)


def grouped_gemm_wgrad(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, *,
                       preferred_element_type: DTypeLike | None = None, block_sizes: GemmTiles | None = None,
                       implementation: str | None = None) -> jax.Array:
    """``out[g] = lhs[rows of g]^T @ grad[rows of g]``: the weight gradient of `grouped_gemm`.

    Args:
      lhs: ``[M, K]``; grad: ``[M, N]``, same dtype; group_sizes: ``[G]``, ``sum <= M``.
      preferred_element_type: output dtype (default ``lhs.dtype``).
      block_sizes: the kernel's tiles (default `BlockSizes.default`'s ``wgrad``).
    Returns:
      ``[G, K, N]``; empty groups give zeros. Not differentiable itself (no second derivatives).
    """
    op = "grouped_gemm_wgrad"
    for name, x in (("lhs", lhs), ("grad", grad)):
        check_float(op, name, x)
        check_rank(op, name, x, 2)
    if jnp.result_type(lhs) != jnp.result_type(grad):
        raise TypeError(f"{op}: lhs ({jnp.result_type(lhs)}) and grad ({jnp.result_type(grad)}) must share a dtype")
    if lhs.shape[0] != grad.shape[0]:
        raise ValueError(f"{op}: lhs {lhs.shape} and grad {grad.shape} must share M (the first axis)")
    if jnp.ndim(group_sizes) != 1:
        raise ValueError(f"{op}: group_sizes has shape {jnp.shape(group_sizes)}; expected [G]")
    _check_group_sizes(op, group_sizes, jnp.shape(group_sizes)[0])
    _check_block_sizes(op, block_sizes, GemmTiles)
    out_dtype = _out_dtype(op, preferred_element_type, lhs.dtype)
    (m, k), n, g = lhs.shape, grad.shape[1], group_sizes.shape[0]
    tiles = block_sizes or BlockSizes.default(m, k, n, g, lhs.dtype).wgrad
    return _tgmm(lhs, grad, group_sizes, out_dtype, tiles, implementation)


# --------------------------------------------------------------------------------------------------
# FP8 with current scaling
# --------------------------------------------------------------------------------------------------


def _fp8_scale(amax: jax.Array, dtype: Any) -> jax.Array:
    """``fp8_max / amax`` (1 where amax is 0 or not finite): mtjax.fp8's scale convention, margin 0."""
    amax = amax.astype(jnp.float32)
    usable = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(usable, jnp.float32(jnp.finfo(dtype).max) / jnp.where(usable, amax, 1.0), 1.0)


class GroupedFP8Scales(NamedTuple):
    """The scales `grouped_gemm_fp8` quantizes with when a caller keeps them (delayed scaling):
    ``q = saturate_cast(x * scale)``, float32.

    Attributes:
      lhs: ``[]``, the scale of ``lhs``.
      rhs: ``[G]``, one per group of ``rhs``.
      grad: ``[]``, the scale of the output gradient.
    """

    lhs: jax.Array
    rhs: jax.Array
    grad: jax.Array


def _amax(x: jax.Array, axis: Any = None) -> jax.Array:
    return jnp.max(jnp.abs(x), axis=axis).astype(jnp.float32)


def _cast(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    return saturate_cast(x.astype(jnp.float32) * scale, dtype)


def _observed(amax: jax.Array, scale: jax.Array) -> jax.Array:
    """``amax`` typed as ``scale`` is inside ``shard_map``: max-reduced over the axes the data varies
    over and the scale does not (the cotangent of a scale must vary as the scale does)."""
    extra = varying_axes(amax) - varying_axes(scale)
    if extra:
        amax = lax.pmax(amax, tuple(sorted(extra)))
    missing = varying_axes(scale) - varying_axes(amax)
    return lax.pcast(amax, tuple(sorted(missing)), to="varying") if missing else amax


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _grouped_gemm_fp8(lhs, rhs, group_sizes, scales, forward_dtype, gradient_dtype, out_dtype, blocks, implementation):
    return _grouped_gemm_fp8_fwd(lhs, rhs, group_sizes, scales, forward_dtype, gradient_dtype, out_dtype, blocks,
                                 implementation)[0]


def _grouped_gemm_fp8_fwd(lhs, rhs, group_sizes, scales, forward_dtype, gradient_dtype, out_dtype, blocks,
                          implementation):
    lhs_amax, rhs_amax = _amax(lhs), _amax(rhs, axis=(1, 2))
    if scales is None:  # current scaling: from this step's amaxes
        lhs_scale, rhs_scale, observed = _fp8_scale(lhs_amax, forward_dtype), _fp8_scale(rhs_amax, forward_dtype), None
    else:
        lhs_scale, rhs_scale = scales.lhs, scales.rhs
        observed = (_observed(lhs_amax, scales.lhs), _observed(rhs_amax, scales.rhs))
    lhs_q, lhs_scale_inv = _cast(lhs, lhs_scale, forward_dtype), 1.0 / lhs_scale
    rhs_q, rhs_scale_inv = _cast(rhs, rhs_scale[:, None, None], forward_dtype), 1.0 / rhs_scale
    # Written as [G, N, K], contraction innermost: Hopper's FP8 tensor-core GEMM takes both operands
    # K-major (the transpose rides along in the cast's fusion).
    out = _gmm(lhs_q, jnp.swapaxes(rhs_q, 1, 2), group_sizes, True, out_dtype, blocks.forward, implementation,
               group_scale=rhs_scale_inv * lhs_scale_inv)
    return out, (lhs_q, lhs_scale_inv, rhs_q, rhs_scale_inv, group_sizes, scales, observed)


def _grouped_gemm_fp8_bwd(forward_dtype, gradient_dtype, out_dtype, blocks, implementation, residuals, grad):
    lhs_q, lhs_scale_inv, rhs_q, rhs_scale_inv, group_sizes, scales, observed = residuals
    grad_amax = _amax(grad)
    if scales is None:
        grad_scale, d_scales = _fp8_scale(grad_amax, gradient_dtype), None
    else:  # the "gradient" of the scales: the amaxes this step observed (the state's next entries)
        grad_scale, d_scales = scales.grad, GroupedFP8Scales(*observed, _observed(grad_amax, scales.grad))
    grad_q, grad_scale_inv = _cast(grad, grad_scale, gradient_dtype), 1.0 / grad_scale
    grad_dq = _dequantize(grad_q, grad_scale_inv, out_dtype)
    # d lhs = grad @ rhs[g]^T: FP8 operands of two formats (`grouped_gemm_tensor_scaled`).
    d_lhs = _scaled_gmm("grouped_gemm_tensor_scaled", grad_q, grad_scale_inv, rhs_q, rhs_scale_inv, group_sizes,
                        out_dtype, blocks.dlhs, implementation)
    # d rhs[g] = lhs[g]^T grad[g], contracted over rows, which FP8 tensor-core GEMMs do not take as
    # laid out here: on the dequantized values.
    d_rhs = _tgmm(_dequantize(lhs_q, lhs_scale_inv, out_dtype), grad_dq, group_sizes, out_dtype, blocks.wgrad,
                  implementation)
    return d_lhs, d_rhs, None, d_scales


def _dequantize(q: jax.Array, scale_inv: jax.Array, dtype: Any) -> jax.Array:
    """``q * scale_inv`` in ``dtype``, computed in float32 (exact for float32, within 2^-9 relative of each
    value for bfloat16)."""
    return (widen_fp8(q) * scale_inv).astype(dtype)


_grouped_gemm_fp8.defvjp(_grouped_gemm_fp8_fwd, _grouped_gemm_fp8_bwd)


# `grouped_gemm_tensor_scaled`: ``a @ rhs[g]^T`` per group for FP8 ``a [M, C]`` with one dequantization
# scale (``a_scale_inv []``) and FP8 ``rhs_q [G, D, C]`` with one per group (``rhs_scale_inv [G]``),
# ``[M, D]`` in ``out_dtype``: ``d lhs`` of `grouped_gemm_fp8`, whose operands come in two formats (E5M2
# gradients, E4M3 weights). cuBLASLt multiplies them on the FP8 tensor cores as they are; the Triton and
# Pallas kernels would widen them in registers, which ran about three times slower than their bf16 GEMMs
# (docs/performance.md), so they (and the reference) take the values dequantized to ``out_dtype``.


def _tensor_dequantize(a_q, a_scale_inv, rhs_q, rhs_scale_inv, dtype):
    a = _dequantize(a_q, a_scale_inv, dtype)
    return a, jnp.swapaxes(_dequantize(rhs_q, rhs_scale_inv[:, None, None], dtype), 1, 2)  # [G, C, D]


def _dequantized_kernel_unsupported(a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes, *, out_dtype, tiles):
    g, d, c = jnp.shape(rhs_q)
    return gg_kernels.unsupported(jnp.shape(a_q), (g, c, d), out_dtype, out_dtype)


def _on_dequantized(dequantize, gemm):
    """``dequantize(a_q, a_scale_inv, rhs_q, rhs_scale_inv, dtype) -> (a [M, C], rhs [G, C, D])``, then
    ``gemm`` (a `grouped_gemm` implementation) on them."""
    def fn(a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes, *, out_dtype, tiles):
        a, rhs = dequantize(a_q, a_scale_inv, rhs_q, rhs_scale_inv, out_dtype)
        return gemm(a, rhs, group_sizes, None, transpose_rhs=False, out_dtype=out_dtype, tiles=tiles)

    return fn


def _register_dequantized(op: str, dequantize) -> None:
    """Register ``op``'s reference, Pallas and native Triton implementations on the dequantized operands."""
    backend.register(op, backend.REFERENCE)(_on_dequantized(dequantize, grouped_gemm_reference))
    backend.register(op, "pallas_triton", unsupported=_dequantized_kernel_unsupported, **_KERNEL)(
        _on_dequantized(dequantize, _grouped_gemm_pallas))
    backend.register(op, "triton", unsupported=_dequantized_kernel_unsupported, **_NATIVE)(
        _on_dequantized(dequantize, _grouped_gemm_triton))


def _dequantized_mosaic_unsupported(a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes, *, out_dtype, tiles):
    g, d, c = jnp.shape(rhs_q)
    return _mosaic_unsupported_gmm(jax.ShapeDtypeStruct(jnp.shape(a_q), out_dtype),
                                   jax.ShapeDtypeStruct((g, c, d), out_dtype), group_sizes, None, transpose_rhs=False,
                                   out_dtype=out_dtype, tiles=tiles)


_register_dequantized("grouped_gemm_tensor_scaled", _tensor_dequantize)
# The Mosaic GPU kernel on the dequantized operands, for ``implementation="mosaic_gpu"`` (below the Triton
# kernels in automatic selection, as for bf16 `grouped_gemm`).
backend.register("grouped_gemm_tensor_scaled", "mosaic_gpu", requires=(backend.PALLAS_MOSAIC_GPU,), priority=9,
                 single_device=True, unsupported=_dequantized_mosaic_unsupported)(
    _on_dequantized(_tensor_dequantize, _grouped_gemm_mosaic))


def _tensor_scaled_cublaslt_unsupported(a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes, *, out_dtype, tiles):
    return _cublaslt_unsupported_gmm(a_q, rhs_q, group_sizes, rhs_scale_inv, transpose_rhs=True, out_dtype=out_dtype,
                                     tiles=tiles)


@backend.register("grouped_gemm_tensor_scaled", "cublaslt", unsupported=_tensor_scaled_cublaslt_unsupported,
                  **_CUBLASLT)
def _tensor_scaled_cublaslt(a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes, *, out_dtype, tiles):
    return _grouped_gemm_cublaslt(a_q, rhs_q, group_sizes, a_scale_inv * rhs_scale_inv, transpose_rhs=True,
                                  out_dtype=out_dtype, tiles=tiles)


def _scaled_gmm(op, a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes, dtype, tiles, implementation):
    """``op`` (`grouped_gemm_tensor_scaled` or `grouped_gemm_block_scaled`) through `mtjax.backend`
    (``implementation``: an explicit choice; a partial implementation asked for where it cannot take the
    operands, or that ``op`` lacks, leaves the choice to selection)."""
    static = dict(out_dtype=jnp.dtype(dtype), tiles=tiles)
    args = (a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes)
    return backend.dispatch(op, *args, implementation=_choice(op, implementation, *args, **static), **static)


def grouped_gemm_fp8(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                     forward_dtype: DTypeLike = jnp.float8_e4m3fn, gradient_dtype: DTypeLike = jnp.float8_e5m2,
                     scales: GroupedFP8Scales | None = None, block_sizes: BlockSizes | None = None,
                     implementation: str | None = None) -> jax.Array:
    """`grouped_gemm` with FP8 operands; differentiable.

    ``lhs`` is quantized with one scale, ``rhs`` with one scale per group, the output gradient with
    one scale. Without ``scales`` they come from the tensors of this step (``fp8_max / amax(lhs)``,
    ``fp8_max / amax(rhs[g])``: TransformerEngine's current scaling); with ``scales`` the caller gives
    them (delayed scaling: `mtjax.fp8.fp8_grouped_gemm` computes them from amax histories, so the
    casts need no amax first). The forward GEMM takes the FP8 operands
    (on FP8 tensor cores where a kernel takes them), accumulates in float32 and applies the
    dequantization scales to the accumulator, per row (the row's group's ``rhs`` scale). The backward
    GEMMs take the same quantized values and the quantized output gradient: ``d lhs`` multiplies them
    on FP8 tensor cores on cuBLASLt, and both it elsewhere and the weight gradient (contracted over
    rows, which FP8 tensor-core GEMMs do not take) dequantized to ``lhs.dtype`` (exact for float32,
    within 2^-9 of each value for bfloat16) through the grouped GEMM's kernels (docs/moe-kernels.md).

    Args:
      lhs: ``[M, K]`` float, rows sorted by group; rhs: ``[G, K, N]`` of the same dtype.
      group_sizes: ``[G]`` integer, ``sum <= M``.
      forward_dtype: FP8 dtype of ``lhs`` and ``rhs``; gradient_dtype: of the output gradient.
      scales: None (current scaling), or `GroupedFP8Scales` (float32 ``lhs []``, ``rhs [G]``, ``grad
        []``, positive and finite) to quantize with. Differentiating with respect to them gives,
        instead of a derivative, the amaxes the step observed: ``max |lhs|``, ``max |rhs[g]|`` and
        ``max |grad|`` (float32; inside ``shard_map`` max-reduced over the axes the tensor varies over
        and its scale does not), which a delayed-scaling state rolls into its amax histories.
      block_sizes, implementation: as in `grouped_gemm`.
    Returns:
      ``[M, N]`` in ``lhs.dtype``; gradients in ``lhs.dtype`` too.
    """
    op = "grouped_gemm_fp8"
    m, k, n, g = _check_operands(op, lhs, rhs, group_sizes, False)
    _check_block_sizes(op, block_sizes, BlockSizes)
    if scales is not None:
        if not isinstance(scales, GroupedFP8Scales):
            raise TypeError(f"{op}(scales={scales!r}): expected None or a GroupedFP8Scales")
        for name, want in (("lhs", ()), ("rhs", (g,)), ("grad", ())):
            value = getattr(scales, name)
            if jnp.shape(value) != want or jnp.result_type(value) != jnp.float32:
                raise ValueError(f"{op}: scales.{name} is {jnp.result_type(value)}{list(jnp.shape(value))}; "
                                 f"expected float32{list(want)}")
    fp8 = [jnp.dtype(d) for d in gg_kernels.FP8_DTYPES]
    forward_dtype, gradient_dtype = jnp.dtype(forward_dtype), jnp.dtype(gradient_dtype)
    check_choice(op, "forward_dtype", forward_dtype, fp8)
    check_choice(op, "gradient_dtype", gradient_dtype, fp8)
    if block_sizes is None:  # FP8 tiles for the forward, the output dtype's for the dequantized backward
        backward = BlockSizes.default(m, k, n, g, lhs.dtype)
        blocks = dataclasses.replace(BlockSizes.default(m, k, n, g, forward_dtype), dlhs=backward.dlhs,
                                     wgrad=backward.wgrad)
    else:
        blocks = block_sizes
    return _grouped_gemm_fp8(lhs, rhs, group_sizes, scales, forward_dtype, gradient_dtype, jnp.dtype(lhs.dtype),
                             blocks, implementation)


# --------------------------------------------------------------------------------------------------
# FP8 with block scaling
# --------------------------------------------------------------------------------------------------


def _group_blocks(rhs: jax.Array, dtype: Any, power_of_two: bool, amax_epsilon: float) -> tuple[jax.Array, jax.Array]:
    """``rhs [G, K, N]`` cast in 128x128 blocks per group: ``(q [G, K, N], scale_inv [G, ceil(K/128),
    ceil(N/128)])``. Each group's K is padded to whole blocks, so no block spans two groups."""
    g, k, n = rhs.shape
    padded = jnp.pad(rhs, ((0, 0), (0, (-k) % TILE), (0, 0)))
    q, _, scale_inv = block_quantize(padded.reshape(-1, n), dtype, power_of_two=power_of_two,
                                     amax_epsilon=amax_epsilon)
    return q.reshape(g, -1, n)[:, :k], scale_inv.reshape(g, -1, scale_inv.shape[-1])


def _group_dequantize(q: jax.Array, scale_inv: jax.Array, dtype: Any) -> jax.Array:
    """`block_dequantize` of each group of ``q [G, K, N]``."""
    return jax.vmap(lambda q, s: block_dequantize(q, s, dtype))(q, scale_inv)


# `grouped_gemm_block_scaled`: ``a @ rhs[g]^T`` per group for block-scaled FP8 ``a [M, C]`` (1x128 tiles
# along C, ``a_scale_inv [M, ceil(C/128)]``) and ``rhs_q [G, D, C]`` (128x128 blocks, ``rhs_scale_inv
# [G, ceil(C/128), ceil(D/128)]``, contraction blocks first), ``[M, D]`` in ``out_dtype``: the forward and
# ``d lhs`` GEMMs of `grouped_gemm_block_fp8`. The Mosaic GPU kernel runs it on FP8 tensor cores with the
# scales applied per K block; the other implementations dequantize and run the grouped GEMM.


def _block_dequantize(a_q, a_scale_inv, rhs_q, rhs_scale_inv, dtype):
    """``a [M, C]`` from its tiles and ``rhs [G, C, D]`` from its blocks (laid out contraction first)."""
    return tile_dequantize(a_q, a_scale_inv, dtype), _group_dequantize(jnp.swapaxes(rhs_q, 1, 2), rhs_scale_inv, dtype)


_register_dequantized("grouped_gemm_block_scaled", _block_dequantize)


def _block_scaled_mosaic_unsupported(a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes, *, out_dtype,
                                     tiles) -> str | None:
    from mtjax.kernels.mosaic_gpu import grouped_gemm as mosaic

    return mosaic.unsupported(jnp.shape(a_q), jnp.shape(rhs_q), jnp.result_type(a_q), jnp.result_type(rhs_q), True)


# FP8 tensor cores on Hopper: first wherever it takes the operands (faster than the dequantized
# grouped GEMM forward and backward on an H100: docs/performance.md).
@backend.register("grouped_gemm_block_scaled", "mosaic_gpu", requires=(backend.PALLAS_MOSAIC_GPU,), priority=12,
                  single_device=True, unsupported=_block_scaled_mosaic_unsupported)
def _block_scaled_mosaic(a_q, a_scale_inv, rhs_q, rhs_scale_inv, group_sizes, *, out_dtype, tiles):
    from mtjax.kernels.mosaic_gpu import grouped_gemm as mosaic

    del tiles  # the Triton kernels' tiles
    # one scale per output column and contraction block: the blocks' scales repeated over their columns
    columns = jnp.repeat(rhs_scale_inv, TILE, axis=2)[:, :, :rhs_q.shape[1]]
    return mosaic.gmm(a_q, rhs_q, group_sizes, transpose_rhs=True, out_dtype=out_dtype,
                      block_scales=(a_scale_inv, columns))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _grouped_gemm_block_fp8(lhs, rhs, group_sizes, forward_dtype, gradient_dtype, power_of_two, amax_epsilon, blocks,
                            implementation):
    return _block_forward(lhs, rhs, group_sizes, forward_dtype, power_of_two, amax_epsilon, blocks, implementation,
                          transpose=False)[0]


def _block_forward(lhs, rhs, group_sizes, forward_dtype, power_of_two, amax_epsilon, blocks, implementation, *,
                   transpose):
    """``(out, lhs casts, rhs casts)``; ``transpose`` also casts ``lhs`` in tiles along M (the weight
    gradient's operand, re-cut from the same values), which only differentiation needs."""
    lhs_casts = tile_quantize(lhs, forward_dtype, transpose=transpose, power_of_two=power_of_two,
                              amax_epsilon=amax_epsilon)
    rhs_q, rhs_scale_inv = _group_blocks(rhs, forward_dtype, power_of_two, amax_epsilon)
    # rhs[g]^T [N, K] K-major, its block scales [K blocks, N blocks]
    out = _scaled_gmm("grouped_gemm_block_scaled", *lhs_casts[:2], jnp.swapaxes(rhs_q, 1, 2), rhs_scale_inv,
                      group_sizes, lhs.dtype, blocks.forward, implementation)
    return out, lhs_casts, (rhs_q, rhs_scale_inv)


def _grouped_gemm_block_fp8_fwd(lhs, rhs, group_sizes, forward_dtype, gradient_dtype, power_of_two, amax_epsilon,
                                blocks, implementation):
    out, (_, _, lhs_q_t, lhs_scale_inv_t), (rhs_q, rhs_scale_inv) = _block_forward(
        lhs, rhs, group_sizes, forward_dtype, power_of_two, amax_epsilon, blocks, implementation, transpose=True)
    return out, (lhs_q_t, lhs_scale_inv_t, rhs_q, rhs_scale_inv, group_sizes)


def _grouped_gemm_block_fp8_bwd(forward_dtype, gradient_dtype, power_of_two, amax_epsilon, blocks, implementation,
                                residuals, grad):
    lhs_q_t, lhs_scale_inv_t, rhs_q, rhs_scale_inv, group_sizes = residuals
    dtype = grad.dtype
    # The output gradient in 1x128 tiles along N (d lhs contracts N) and along M (d rhs contracts M).
    grad_q, grad_scale_inv, grad_q_t, grad_scale_inv_t = tile_quantize(
        grad, gradient_dtype, transpose=True, power_of_two=power_of_two, amax_epsilon=amax_epsilon)
    # d lhs = grad @ rhs[g]^T: rhs [G, K, N] is K-major for this GEMM (its contraction, N, last).
    d_lhs = _scaled_gmm("grouped_gemm_block_scaled", grad_q, grad_scale_inv, rhs_q, jnp.swapaxes(rhs_scale_inv, 1, 2),
                        group_sizes, dtype, blocks.dlhs, implementation)
    d_rhs = _tgmm(tile_dequantize(lhs_q_t, lhs_scale_inv_t, dtype).T, tile_dequantize(grad_q_t, grad_scale_inv_t,
                                                                                       dtype).T,
                  group_sizes, dtype, blocks.wgrad, implementation)
    return d_lhs, d_rhs, None


_grouped_gemm_block_fp8.defvjp(_grouped_gemm_block_fp8_fwd, _grouped_gemm_block_fp8_bwd)


def grouped_gemm_block_fp8(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                           forward_dtype: DTypeLike = jnp.float8_e4m3fn, gradient_dtype: DTypeLike = jnp.float8_e4m3fn,
                           power_of_two: bool = False, amax_epsilon: float = 0.0,
                           block_sizes: BlockSizes | None = None, implementation: str | None = None) -> jax.Array:
    """`grouped_gemm` with block-scaled FP8 operands (`mtjax.fp8.BlockScaling`'s numerics); differentiable.

    ``lhs`` is cast in 1x128 tiles along K, each group's ``rhs[g]`` in 128x128 blocks (K padded per
    group, so no block spans two experts), the output gradient in 1x128 tiles along N for ``d lhs``;
    the weight gradient contracts M, so ``lhs`` and the output gradient are cast again from their
    own values in 1x128 tiles along M (a tile may span the boundary of two groups: one scale then
    covers rows of both). Every scale comes from its tile's amax in this step (`mtjax.ops.tile_quantize`,
    `mtjax.ops.block_quantize`); only FP8 values and scales are kept for the backward pass.

    On Hopper the forward and ``d lhs`` GEMMs run on FP8 tensor cores with the scales applied per
    128-wide K block (`mtjax.kernels.mosaic_gpu.grouped_gemm`, implementation ``mosaic_gpu``, chosen
    automatically where it takes the operands: one FP8 dtype for both, whole tiles). Elsewhere, and for
    the weight gradient, the GEMMs take the dequantized operands in ``lhs.dtype`` through the grouped
    GEMM's kernels (float32 accumulation): the rounding is block-scaled FP8's (a float32 ``lhs`` gives
    it exactly; bfloat16 adds at most 2^-9 relative to each dequantized value), the speed is the bf16
    grouped GEMM's plus the casts.

    Args:
      lhs: ``[M, K]`` float, rows sorted by group; rhs: ``[G, K, N]`` of the same dtype.
      group_sizes: ``[G]`` integer, ``sum <= M``.
      forward_dtype: FP8 dtype of ``lhs`` and ``rhs``; gradient_dtype: of the output gradient.
      power_of_two, amax_epsilon: as `mtjax.fp8.BlockScaling`'s ``power_of_two_scales`` and ``amax_epsilon``.
      block_sizes, implementation: as in `grouped_gemm`.
    Returns:
      ``[M, N]`` in ``lhs.dtype``; gradients in ``lhs.dtype`` too.
    """
    op = "grouped_gemm_block_fp8"
    m, k, n, g = _check_operands(op, lhs, rhs, group_sizes, False)
    _check_block_sizes(op, block_sizes, BlockSizes)
    forward_dtype = check_tile_options(op, forward_dtype, power_of_two, amax_epsilon, dtype_name="forward_dtype")
    gradient_dtype = check_fp8_dtype(op, gradient_dtype, "gradient_dtype")
    blocks = block_sizes or BlockSizes.default(m, k, n, g, lhs.dtype)
    return _grouped_gemm_block_fp8(lhs, rhs, group_sizes, forward_dtype, gradient_dtype, power_of_two,
                                   float(amax_epsilon), blocks, implementation)
