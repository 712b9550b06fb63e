"""Helpers shared by the modules (and by code building its own on `mtjax.flax`, such as `mtjax.models`):
parameters with logical axes, GEMMs through `mtjax.fp8.DotGeneral`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Initializer = Callable[..., jax.Array]
Dtype = Any
AxisNames = tuple[str | None, ...]


def canonical_tuple(value: int | Sequence[int]) -> tuple[int, ...]:
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


# What a module's ``dtype`` (compute) and ``param_dtype`` may be: integer or boolean weights would
# silently truncate (a DenseGeneral computing in int32 returns zeros) and FP8 is a recipe, not a dtype.
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def check_float_dtype(owner: str, name: str, dtype: Dtype) -> None:
    """Raise TypeError unless ``dtype`` is one of `FLOAT_DTYPES`."""
    try:
        ok = jnp.dtype(dtype) in [jnp.dtype(d) for d in FLOAT_DTYPES]
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"{owner}: {name}={dtype!r} is not supported; accepted: "
                        f"{', '.join(jnp.dtype(d).name for d in FLOAT_DTYPES)} (FP8 comes from fp8_autocast)")


def check_module_dtypes(module: nn.Module) -> None:
    """`check_float_dtype` of the module's ``dtype`` and ``param_dtype`` attributes (where it has them)."""
    for name in ("dtype", "param_dtype"):
        if hasattr(module, name):
            check_float_dtype(type(module).__name__, name, getattr(module, name))


def param_with_axes(module: nn.Module, name: str, init: Initializer, shape: Sequence[int], dtype: Dtype,
                    axes: AxisNames) -> jax.Array:
    """``module.param`` carrying logical axis names (none when ``axes`` is empty); the module's
    ``dtype``/``param_dtype`` and ``dtype`` itself must be float dtypes (`check_float_dtype`)."""
    check_module_dtypes(module)
    check_float_dtype(type(module).__name__, f"the dtype of parameter {name!r}", dtype)
    shape = tuple(shape)
    if axes:
        if len(axes) != len(shape):
            raise ValueError(
                f"{type(module).__name__}: logical axes {axes} for parameter {name!r} of shape {shape} "
                f"must name every one of its {len(shape)} axes"
            )
        init = nn.with_logical_partitioning(init, axes)
    return module.param(name, init, shape, dtype)


def flat_kernel_init(init: Initializer, num_in_axes: int) -> Initializer:
    """``init`` applied to the 2-D ``[prod(in), prod(out)]`` view, so fan-in/fan-out are right for
    kernels with several input or output axes (e.g. ``[embed, 3, heads, head_dim]``)."""

    def kernel_init(key, shape, dtype=jnp.float32):
        flat = (math.prod(shape[:num_in_axes]), math.prod(shape[num_in_axes:]))
        return jnp.reshape(init(key, flat, dtype), shape)

    return kernel_init


def contract(dot_general: nn.Module, x: jax.Array, kernel: jax.Array, axes: Sequence[int],
             lhs_prologue: Any = None) -> jax.Array:
    """``x`` contracted over ``axes`` with the leading axes of ``kernel``: ``[*x free, *kernel free]``;
    ``lhs_prologue`` (a `mtjax.ops.Norm` or `mtjax.ops.Activation`; ``axes`` then the last axis of its
    output) is applied to ``x`` first, inside the GEMM."""
    dims = ((tuple(axes), tuple(range(len(axes)))), ((), ()))
    return dot_general(x, kernel, dims, lhs_prologue=lhs_prologue)
