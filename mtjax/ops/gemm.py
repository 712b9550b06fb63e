"""The scaled FP8 GEMM every FP8 dot reduces to: ``(a @ b^T) * a_scale_inv * b_scale_inv``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mtjax import backend
from mtjax.dtypes import is_fp8


def _accumulator_dtype(out_dtype: Any) -> Any:
    # The GEMM writes bf16 directly when that is the output (no f32 round trip through memory);
    # float16 would overflow before the scales shrink the result, so it goes through float32.
    return jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32


@backend.register("fp8_gemm", backend.REFERENCE)
def fp8_gemm_reference(a, b, a_scale_inv, b_scale_inv, *, out_dtype):
    """The ``"xla"`` implementation of `fp8_gemm`."""
    # dot_general on the float8 operands themselves: XLA turns this into cuBLASLt's FP8 GEMM (it
    # does not rewrite "dequantize, then a bf16 dot"); contracting the last axis of both is the
    # layout FP8 tensor cores take without a transpose. The dequantization scale multiplies the
    # GEMM's output in its own dtype, so XLA's GEMM rewriter folds it into cuBLASLt's scale operand
    # instead of running an elementwise pass over the result (a convert in between would stop it).
    # For bf16 this rounds the scale to bf16 (relative error at most 2**-9, far below E4M3's 2**-4).
    batch = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch))
    accumulator = _accumulator_dtype(out_dtype)
    out = lax.dot_general(a, b, dims, preferred_element_type=accumulator)
    return (out * (a_scale_inv * b_scale_inv).astype(accumulator)).astype(out_dtype)


def fp8_gemm(a: jax.Array, b: jax.Array, a_scale_inv: jax.Array, b_scale_inv: jax.Array, *,
             out_dtype: Any, implementation: str | None = None) -> jax.Array:
    """``(a @ b^T) * a_scale_inv * b_scale_inv``, the GEMM every FP8 dot reduces to.

    Args:
      a: float8 ``[*batch, M, K]``.
      b: float8 ``[*batch, N, K]`` (both contract over their last axis).
      a_scale_inv, b_scale_inv: float32 scalars, ``1 / scale`` of each operand.
      out_dtype: dtype of the ``[*batch, M, N]`` result.
      implementation: ``"xla"`` (XLA's cuBLASLt FP8 GEMM on GPUs) or a registered kernel.
    """
    for name, x in (("a", a), ("b", b)):
        if not is_fp8(x.dtype):
            raise TypeError(f"fp8_gemm: {name} has dtype {x.dtype}; expected a float8 dtype")
    if a.ndim < 2 or a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"fp8_gemm: a {a.shape} and b {b.shape} must be [*batch, M, K] and [*batch, N, K]")
    return backend.dispatch("fp8_gemm", a, b, a_scale_inv, b_scale_inv, implementation=implementation,
                            out_dtype=jnp.dtype(out_dtype))
