"""FP8 quantization: ``quantize`` / ``dequantize`` and ``cast_transpose``, what an FP8 GEMM needs of an operand.

Scale convention (as TransformerEngine): ``q = saturate_cast(x * scale)``, ``x ≈ q * (1 / scale)``.
The scales themselves (recipes, amax histories) are `mtjax.fp8`'s business.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mtjax import backend
from mtjax.dtypes import check_fp8_dtype, fp8_max, widen_fp8
from mtjax.kernels import quantize as quantize_kernels
from mtjax.kernels.common import too_small


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``saturate_cast(x * scale)`` to the FP8 ``dtype``: values beyond ±fp8_max (and ±Inf) clip to
    ±fp8_max, never Inf; NaN stays NaN. The product is formed in float32."""
    dtype = check_fp8_dtype("quantize", dtype)
    limit = fp8_max(dtype)
    scaled = x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return jnp.clip(scaled, -limit, limit).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """``q * (1 / scale)`` in ``dtype``: the inverse of `quantize` up to FP8 rounding."""
    check_fp8_dtype("dequantize", q.dtype)
    return (widen_fp8(q) * (1.0 / jnp.asarray(scale, jnp.float32))).astype(dtype)


@backend.register("cast_transpose", backend.REFERENCE)
def cast_transpose_reference(x: jax.Array, scale: jax.Array, *,
                             out_dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``"xla"`` implementation of `cast_transpose` (``scale`` a float32 scalar of shape ``()``)."""
    q = quantize(x, scale, out_dtype)
    return q, jnp.swapaxes(q, -1, -2), jnp.max(jnp.abs(x)).astype(jnp.float32)


# The Pallas kernel reads x once where XLA may run a reduce, the cast and a transpose of the cast.
@backend.register("cast_transpose", "pallas_triton", requires=(backend.PALLAS_TRITON,), priority=10,
                  single_device=True, prefer=too_small,
                  unsupported=lambda x, scale, *, out_dtype: quantize_kernels.unsupported(x.shape, x.dtype, out_dtype))
def _cast_transpose_pallas(x, scale, *, out_dtype):
    return quantize_kernels.cast_transpose(x, scale, out_dtype)


@backend.register("cast_transpose", "triton", requires=(backend.TRITON,), priority=9, single_device=True,
                  prefer=too_small,
                  unsupported=lambda x, scale, *, out_dtype: quantize_kernels.unsupported(x.shape, x.dtype, out_dtype))
def _cast_transpose_triton(x, scale, *, out_dtype):
    from mtjax.kernels.triton import quantize as native

    return native.cast_transpose(x, scale, out_dtype)


def cast_transpose(x: jax.Array, scale: jax.Array, dtype: Any, *,
                   implementation: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q, swapaxes(q, -1, -2), max |x|)`` with ``q = quantize(x, scale, dtype)``: what an FP8 GEMM
    and its backward need of one operand (the transpose feeds the GEMM that contracts the other
    axis). The amax is float32, local (not reduced over mesh axes)."""
    dtype = check_fp8_dtype("cast_transpose", dtype)
    if jnp.ndim(x) < 2:
        raise ValueError(f"cast_transpose: x must have at least 2 axes; got shape {jnp.shape(x)}")
    return backend.dispatch("cast_transpose", x, jnp.reshape(jnp.asarray(scale, jnp.float32), ()),
                            implementation=implementation, out_dtype=jnp.dtype(dtype))
