"""Argument checks shared by the ops: errors that name the argument and the accepted values."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import jax.numpy as jnp

from mtjax.dtypes import FP8_DTYPES, check_fp8_dtype


def check_float(op: str, name: str, x: Any) -> None:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}: {name} has dtype {dtype}; expected a floating dtype (float32, bfloat16, float16)")


def check_rank(op: str, name: str, x: Any, ranks: Iterable[int] | int) -> None:
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if jnp.ndim(x) not in ranks:
        raise ValueError(f"{op}: {name} has shape {jnp.shape(x)} (rank {jnp.ndim(x)}); expected rank "
                         f"{' or '.join(map(str, ranks))}")


def check_shape(op: str, name: str, x: Any, shape: Sequence[int | None]) -> None:
    actual = jnp.shape(x)
    if len(actual) != len(shape) or any(s is not None and s != a for s, a in zip(shape, actual)):
        expected = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{op}: {name} has shape {actual}; expected {expected}")


def check_choice(op: str, name: str, value: Any, accepted: Iterable[Any]) -> None:
    accepted = tuple(accepted)
    if value not in accepted:
        raise ValueError(f"{op}: {name}={value!r} is not supported; accepted: {', '.join(map(repr, accepted))}")


def check_fp8_output(op: str, scale: Any, out_dtype: Any) -> None:
    """The quantizing ops' ``scale`` (a float scalar) and ``out_dtype`` (one of the FP8 dtypes)."""
    check_float(op, "scale", scale)
    if jnp.size(scale) != 1:
        raise ValueError(f"{op}: scale has shape {jnp.shape(scale)}; expected a scalar")
    check_choice(op, "out_dtype", jnp.dtype(out_dtype), FP8_DTYPES)


def is_finite_number(value: Any, minimum: float, *, exclusive: bool = False) -> bool:
    """Whether ``value`` is a real number (not a bool), finite, and at least ``minimum`` (above it
    with ``exclusive``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return False
    return value > minimum if exclusive else value >= minimum


def check_tile_options(op: str, dtype: Any, power_of_two: Any, amax_epsilon: Any, transpose: Any = False,
                       dtype_name: str = "out_dtype") -> Any:
    """The options of the 1x128-tile casts (`mtjax.ops.tile_quantize` and the ops fused with one);
    returns ``jnp.dtype(dtype)`` (``dtype_name``: the op's name of that argument)."""
    for name, value in (("power_of_two", power_of_two), ("transpose", transpose)):
        if not isinstance(value, bool):
            raise TypeError(f"{op}({name}={value!r}): expected True or False")
    if isinstance(amax_epsilon, bool) or not isinstance(amax_epsilon, numbers.Real):
        raise TypeError(f"{op}(amax_epsilon={amax_epsilon!r}): expected a finite float >= 0")
    if not is_finite_number(amax_epsilon, 0.0):
        raise ValueError(f"{op}(amax_epsilon={amax_epsilon!r}): expected a finite float >= 0")
    return check_fp8_dtype(op, dtype, dtype_name)
