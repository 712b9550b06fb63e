"""Scaled, masked and causal softmax over the last axis (float32 inside).

Mask convention (the same as ``jax.nn.dot_product_attention``): ``True`` keeps a position.
A row with every position masked returns zeros, never NaN.
Causal masks are aligned bottom-right: query ``i`` of ``T`` sees key ``j`` of ``S`` when
``j <= i + (S - T)``, which is what decoding against a KV cache needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtjax import backend
from mtjax.kernels import softmax as softmax_kernels
from mtjax.kernels.common import too_small
from mtjax.ops.checks import check_float


def causal_mask(q_len: int, kv_len: int) -> jax.Array:
    """``[q_len, kv_len]`` bool, True where query i may see key j (bottom-right aligned)."""
    rows = jnp.arange(q_len)[:, None] + (kv_len - q_len)
    return jnp.arange(kv_len)[None, :] <= rows


def masked_softmax(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Softmax in float32 over the last axis; masked entries get 0; fully masked rows are all 0."""
    logits = logits.astype(jnp.float32)
    if mask is None:
        return jax.nn.softmax(logits, axis=-1)
    neg = jnp.finfo(jnp.float32).min
    masked = jnp.where(mask, logits, neg)
    row_max = jnp.max(masked, axis=-1, keepdims=True)
    row_max = jnp.where(row_max == neg, 0.0, row_max)
    e = jnp.where(mask, jnp.exp(masked - jax.lax.stop_gradient(row_max)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(denom == 0.0, 1.0, denom)


@backend.register("softmax", backend.REFERENCE)
def softmax_reference(logits: jax.Array, mask: jax.Array | None, *, scale: float, causal: bool) -> jax.Array:
    """The ``"xla"`` implementation of `softmax` (same arguments and result)."""
    dtype = logits.dtype
    logits = logits.astype(jnp.float32) * scale
    if causal:
        cm = causal_mask(logits.shape[-2], logits.shape[-1])
        mask = cm if mask is None else jnp.logical_and(mask, cm)
    return masked_softmax(logits, mask).astype(dtype)


def softmax(
    logits: jax.Array,
    mask: jax.Array | None = None,
    *,
    scale: float = 1.0,
    causal: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """``softmax(scale * logits)`` over the last axis, with an optional keep-mask and causal mask.

    Args:
      logits: ``[..., q_len, kv_len]`` (any rank >= 1; >= 2 when ``causal``).
      mask: bool, broadcastable to ``logits``; ``True`` keeps a position.
      scale: multiplies the logits before the softmax.
      causal: apply the bottom-right-aligned causal mask over the last two axes.
    Returns:
      probabilities in ``logits.dtype``.
    """
    check_float("softmax", "logits", logits)
    if causal and jnp.ndim(logits) < 2:
        raise ValueError(f"softmax: causal=True needs logits of rank >= 2 ([..., q, k]); got shape {jnp.shape(logits)}")
    if mask is not None:
        if jnp.result_type(mask) != jnp.bool_:
            raise TypeError(f"softmax: mask has dtype {jnp.result_type(mask)}; expected bool (True keeps)")
        try:
            jnp.broadcast_shapes(jnp.shape(mask), jnp.shape(logits))
        except ValueError:
            raise ValueError(f"softmax: mask of shape {jnp.shape(mask)} does not broadcast to logits "
                             f"{jnp.shape(logits)}") from None
    return backend.dispatch(
        "softmax", logits, mask, implementation=implementation, scale=float(scale), causal=bool(causal)
    )


# The Pallas Triton kernel (kernels/softmax.py); it declines rows over 16384 and masks it cannot
# read as shared rows, and automatic selection leaves small arrays to XLA (as fast there).
def _kernel_unsupported(logits, mask, **_) -> str | None:
    return softmax_kernels.unsupported(jnp.shape(logits), jnp.result_type(logits),
                                     None if mask is None else jnp.shape(mask))


@backend.register("softmax", "pallas_triton", requires=(backend.PALLAS_TRITON,), unsupported=_kernel_unsupported,
                  prefer=too_small, priority=10, single_device=True)
def _softmax_pallas(logits, mask, *, scale: float, causal: bool):
    return softmax_kernels.softmax(logits, mask, scale=scale, causal=causal)


@backend.register("softmax", "triton", requires=(backend.TRITON,), unsupported=_kernel_unsupported, prefer=too_small,
                  priority=9, single_device=True)
def _softmax_triton(logits, mask, *, scale: float, causal: bool):
    from mtjax.kernels.triton import softmax as native

    return native.softmax(logits, mask, scale=scale, causal=causal)
