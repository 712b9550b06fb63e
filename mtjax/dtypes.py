"""The FP8 dtypes and their largest finite values, defined once for the kernels, the ops and the recipes.

``float8_e4m3fn`` and ``float8_e5m2`` are the OCP formats (NVIDIA Hopper and Blackwell, AMD MI350);
``float8_e4m3fnuz`` and ``float8_e5m2fnuz`` the variants AMD MI300 computes in (no negative zero, one
NaN, a larger exponent bias, hence different maxima).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

FP8_DTYPES = (
    jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2),
    jnp.dtype(jnp.float8_e4m3fnuz), jnp.dtype(jnp.float8_e5m2fnuz),
)
# The formats of the Open Compute Project's FP8 specification (what the Pallas Triton kernels write).
OCP_FP8_DTYPES = FP8_DTYPES[:2]


def is_fp8(dtype: Any) -> bool:
    """Whether ``dtype`` is one of `FP8_DTYPES`."""
    try:
        return jnp.dtype(dtype) in FP8_DTYPES
    except TypeError:
        return False


def check_fp8_dtype(fn: str, dtype: Any, name: str = "dtype") -> Any:
    """``jnp.dtype(dtype)``, or `TypeError` naming ``fn``, ``name`` and the accepted dtypes."""
    if not is_fp8(dtype):
        try:
            shown = jnp.dtype(dtype).name
        except TypeError:
            shown = repr(dtype)
        raise TypeError(f"{fn}({name}={shown}): expected one of {[d.name for d in FP8_DTYPES]}")
    return jnp.dtype(dtype)


def widen_fp8(q: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """The FP8 values ``q`` in ``dtype`` (float32, or a 16-bit float that holds them exactly), kept as
    rounded.

    XLA's GPU compiler folds a chain of conversions ``float32 -> FP8 -> float32`` into the identity
    (its "excess precision" rewrite, on by default), so a quantize followed by a dequantize in one
    program would drop the FP8 rounding. The optimization barrier keeps the chain apart.
    """
    check_fp8_dtype("widen_fp8", q.dtype, "q.dtype")
    return jax.lax.optimization_barrier(q).astype(dtype)


def has_float32_range(dtype: Any) -> bool:
    """Whether ``dtype`` holds float32's range of magnitudes (bfloat16 and float32; not float16)."""
    return jnp.finfo(dtype).maxexp >= jnp.finfo(jnp.float32).maxexp


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2, 240 for E4M3 fnuz)."""
    return float(jnp.finfo(check_fp8_dtype("fp8_max", dtype)).max)
