"""LayerNorm and RMSNorm over the last axis, with float32 statistics.

``zero_centered_gamma=True`` stores the scale as ``gamma - 1`` (it is initialised to zeros and
applied as ``1 + gamma``), which keeps weight decay from pulling the scale towards zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtjax import backend
from mtjax.ops._checks import check_float, check_shape


def _scale(gamma: jax.Array, zero_centered_gamma: bool) -> jax.Array:
    gamma = gamma.astype(jnp.float32)
    return gamma + 1.0 if zero_centered_gamma else gamma


@backend.register("layernorm", backend.REFERENCE)
def layernorm_reference(x, gamma, beta, *, epsilon: float, zero_centered_gamma: bool):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + epsilon) * _scale(gamma, zero_centered_gamma)
    if beta is not None:
        y = y + beta.astype(jnp.float32)
    return y.astype(x.dtype)


@backend.register("rmsnorm", backend.REFERENCE)
def rmsnorm_reference(x, gamma, *, epsilon: float, zero_centered_gamma: bool):
    xf = x.astype(jnp.float32)
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(ms + epsilon) * _scale(gamma, zero_centered_gamma)
    return y.astype(x.dtype)


def _check(op: str, x, gamma, beta, epsilon) -> None:
    check_float(op, "x", x)
    check_float(op, "gamma", gamma)
    if jnp.ndim(x) < 1:
        raise ValueError(f"{op}: x must have at least one axis (the normalized one); got shape {jnp.shape(x)}")
    hidden = jnp.shape(x)[-1]
    check_shape(op, "gamma", gamma, (hidden,))
    if beta is not None:
        check_float(op, "beta", beta)
        check_shape(op, "beta", beta, (hidden,))
    if not epsilon > 0:
        raise ValueError(f"{op}: epsilon={epsilon!r}; expected a positive float")


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    *,
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """``(x - mean) / sqrt(var + epsilon) * gamma + beta`` over the last axis.

    Args:
      x: ``[..., hidden]``, any float dtype; statistics are computed in float32.
      gamma: ``[hidden]`` scale (``1 + gamma`` if ``zero_centered_gamma``).
      beta: ``[hidden]`` shift, or ``None``.
      implementation: ``None`` (automatic) or a name from ``backend.implementations("layernorm")``.
    Returns:
      ``[..., hidden]`` in ``x.dtype``.
    """
    _check("layernorm", x, gamma, beta, epsilon)
    return backend.dispatch(
        "layernorm", x, gamma, beta, implementation=implementation,
        epsilon=float(epsilon), zero_centered_gamma=bool(zero_centered_gamma),
    )


def rmsnorm(
    x: jax.Array,
    gamma: jax.Array,
    *,
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """``x / sqrt(mean(x**2) + epsilon) * gamma`` over the last axis; shapes as `layernorm`."""
    _check("rmsnorm", x, gamma, None, epsilon)
    return backend.dispatch(
        "rmsnorm", x, gamma, implementation=implementation,
        epsilon=float(epsilon), zero_centered_gamma=bool(zero_centered_gamma),
    )
