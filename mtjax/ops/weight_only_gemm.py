"""Weight-only FP8 GEMM: ``lax.dot_general`` of 16-bit inputs and FP8 weights, times the weights' scale.

Decoding with FP8 weights (`mtjax.inference.fp8_weights`, ``mode="dequantize"``) multiplies a few
rows by each weight matrix stored in FP8 with per-channel or per-tensor scales. ``"xla"`` widens the
weights to the input's dtype inside the dot; ``"triton"`` is a native Triton kernel that reads each
FP8 weight once and widens it in registers (`mtjax.kernels.triton.weight_only_gemm`), for at most its
``MAX_ROWS`` rows. The kernel is chosen by name (``implementation=`` or `mtjax.config.override`)
until a GPU measurement puts it into automatic selection (docs/inference-kernels.md).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mtjax import backend
from mtjax.dtypes import is_fp8


def _float32_range(dtype: Any) -> bool:
    """Whether ``dtype`` holds float32's range of magnitudes (bfloat16 and float32; not float16)."""
    return jnp.finfo(dtype).maxexp >= jnp.finfo(jnp.float32).maxexp


def _free(x: Any, dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in range(jnp.ndim(x)) if d not in dims)


@backend.register("weight_only_gemm", backend.REFERENCE)
def weight_only_gemm_reference(lhs: jax.Array, rhs: jax.Array, scale: jax.Array, *, dimension_numbers: Any,
                               out_dtype: Any) -> jax.Array:
    """The ``"xla"`` implementation of `weight_only_gemm`."""
    w = rhs.astype(lhs.dtype)
    if _float32_range(lhs.dtype) and jnp.dtype(out_dtype).itemsize <= jnp.dtype(lhs.dtype).itemsize:
        # A result in the input's dtype (its tiles accumulate in float32): asking a float32 result of a
        # 16-bit dot makes XLA widen both operands to float32 first, a slower GEMM on the same bytes.
        # float16 keeps the float32 result: the products of an unscaled kernel (its channels stretched
        # to the FP8 range) can pass float16's largest value.
        y = lax.dot_general(lhs, w, dimension_numbers).astype(jnp.float32)
    else:
        y = lax.dot_general(lhs, w, dimension_numbers, preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype)


def _operands_2d(lhs, rhs, dimension_numbers):
    """``(x [M, K], w [N, K], output shape)``: free axes first, contracted axes last, in order."""
    (lhs_contract, rhs_contract), _ = dimension_numbers
    lhs_free, rhs_free = _free(lhs, tuple(lhs_contract)), _free(rhs, tuple(rhs_contract))
    k = math.prod(jnp.shape(lhs)[d] for d in lhs_contract)
    x = jnp.transpose(lhs, lhs_free + tuple(lhs_contract)).reshape(-1, k)
    w = jnp.transpose(rhs, rhs_free + tuple(rhs_contract)).reshape(-1, k)
    shape = tuple(jnp.shape(lhs)[d] for d in lhs_free) + tuple(jnp.shape(rhs)[d] for d in rhs_free)
    return x, w, shape


def _triton_unsupported(lhs, rhs, scale, *, dimension_numbers, out_dtype) -> str | None:
    from mtjax.kernels.triton import weight_only_gemm as native

    (lhs_contract, rhs_contract), _ = dimension_numbers
    m = math.prod(jnp.shape(lhs)[d] for d in _free(lhs, tuple(lhs_contract)))
    n = math.prod(jnp.shape(rhs)[d] for d in _free(rhs, tuple(rhs_contract)))
    k = math.prod(jnp.shape(lhs)[d] for d in lhs_contract)
    return native.unsupported((m, k), (n, k), jnp.result_type(lhs), jnp.result_type(rhs))


# Below the reference in automatic selection until measured on a GPU: chosen by name only.
@backend.register("weight_only_gemm", "triton", requires=(backend.TRITON,), priority=-1, single_device=True,
                  unsupported=_triton_unsupported)
def _weight_only_gemm_triton(lhs, rhs, scale, *, dimension_numbers, out_dtype):
    from mtjax.kernels.triton import weight_only_gemm as native

    x, w, shape = _operands_2d(lhs, rhs, dimension_numbers)
    y = jnp.sum(native.partial_products(x, w), axis=0).reshape(shape)
    return (y * scale).astype(out_dtype)


def weight_only_gemm(lhs: jax.Array, rhs: jax.Array, scale: jax.Array, dimension_numbers: Any, *,
                     out_dtype: Any = None, implementation: str | None = None) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers) * scale`` with ``rhs`` in FP8, in ``out_dtype``.

    Args:
      lhs: the input, float.
      rhs: the weights, FP8 values (``float8_e4m3fn`` or ``float8_e5m2``).
      scale: float32, broadcastable against the output's trailing (``rhs``'s free) axes: one per output
        channel, or a scalar.
      dimension_numbers: as ``lax.dot_general``'s, without batch dimensions.
      out_dtype: the result's dtype (default ``lhs.dtype``); the product accumulates in float32.
      implementation: ``"xla"`` (the default) or ``"triton"`` (at most 16 rows of bfloat16 or float16;
        inference only: it has no derivative).
    """
    op = "weight_only_gemm"
    floats = [jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32)]
    if not is_fp8(jnp.result_type(rhs)):
        raise TypeError(f"{op}: rhs has dtype {jnp.result_type(rhs)}; expected an FP8 dtype")
    if jnp.result_type(lhs) not in floats:
        raise TypeError(f"{op}: lhs has dtype {jnp.result_type(lhs)}; expected bfloat16, float16 or float32")
    out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
    if out_dtype not in floats:
        raise TypeError(f"{op}: out_dtype={out_dtype}; expected bfloat16, float16 or float32")
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if tuple(lhs_batch) or tuple(rhs_batch):
        raise ValueError(f"{op}: dimension_numbers={dimension_numbers} has batch dimensions; none are supported")
    # lax's shape rule checks dimension_numbers against the operands
    jax.eval_shape(lambda a, b: lax.dot_general(a, b.astype(a.dtype), dimension_numbers), lhs, rhs)
    rhs_free = tuple(jnp.shape(rhs)[d] for d in _free(rhs, tuple(rhs_contract)))
    try:
        broadcasts = jnp.broadcast_shapes(jnp.shape(scale), rhs_free) == rhs_free
    except ValueError:
        broadcasts = False
    if not broadcasts:
        raise ValueError(f"{op}: scale has shape {jnp.shape(scale)}; expected a scalar or a shape broadcasting "
                         f"to rhs's free axes {rhs_free}")
    return backend.dispatch(op, lhs, rhs, jnp.asarray(scale, jnp.float32), implementation=implementation,
                            dimension_numbers=_static(dimension_numbers), out_dtype=out_dtype)


def _static(dimension_numbers: Any) -> tuple:
    """``dimension_numbers`` as nested tuples (hashable: a static argument of the implementations)."""
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
