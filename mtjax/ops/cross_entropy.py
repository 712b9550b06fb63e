"""Softmax cross-entropy against integer labels, with a backward pass that writes only the logits' gradient.

The usual formulation (``optax.softmax_cross_entropy_with_integer_labels``) picks the label's logit
with ``take_along_axis``, whose transpose is a scatter-add into a float32 buffer the size of the
logits; at a 32768-word vocabulary and 16384 tokens that is 2 GiB written, scattered into and then
cast back to the logits' dtype. Here the backward is ``(softmax(logits) - one_hot(labels)) * g``,
one elementwise pass that XLA fuses from the logits (in their own dtype) to their gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return _forward(logits, labels)[0]


def _forward(logits, labels):
    logits_f32 = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits_f32, axis=-1)
    valid = (labels >= 0) & (labels < logits.shape[-1])
    label_logits = jnp.take_along_axis(logits_f32, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(valid, lse - label_logits, jnp.nan), (logits, labels, lse)


def _backward(saved, g):
    logits, labels, lse = saved
    probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    one_hot = labels[..., None] == jnp.arange(logits.shape[-1], dtype=labels.dtype)
    dlogits = (probs - one_hot.astype(jnp.float32)) * g[..., None].astype(jnp.float32)
    return dlogits.astype(logits.dtype), None


_cross_entropy.defvjp(_forward, _backward)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-position cross-entropy ``logsumexp(logits) - logits[label]`` in float32.

    Args:
      logits: ``[..., vocab]``, any float dtype (statistics are computed in float32; the gradient
        comes back in ``logits.dtype``).
      labels: integer ``[...]`` with values in ``[0, vocab)``.

    Returns:
      float32 ``[...]``, the same values as ``optax.softmax_cross_entropy_with_integer_labels``;
      NaN where a label is outside ``[0, vocab)`` (rather than another class's loss).
    """
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"softmax_cross_entropy: logits.dtype={logits.dtype}; accepted: a float dtype")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"softmax_cross_entropy: labels.dtype={labels.dtype}; accepted: an integer dtype")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"softmax_cross_entropy: labels.shape={labels.shape} must be logits.shape[:-1]="
                         f"{logits.shape[:-1]}")
    return _cross_entropy(logits, labels)
