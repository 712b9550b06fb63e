"""Residual add (+ dropout) + LayerNorm/RMSNorm in one pass, forward and backward (Pallas Triton).

``new_residual = dropout(x) + residual`` and ``normalized = norm(new_residual)`` come out of one
kernel (the norm kernels of ``layer_norm.py`` with their residual input); the backward kernel
adds the new residual's cotangent to the norm's input gradient and sends it through the same
dropout mask, which both passes regenerate from ``seed`` (`common.dropout_keep`) instead of
storing it. Only ``new_residual`` (an output anyway), ``gamma`` and ``seed`` are kept for the
backward pass.
"""

from __future__ import annotations

import functools

import jax

from mtjax.kernels import layer_norm as norm_kernels
from mtjax.kernels.common import Launchers, vary_together


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _residual_norm(x, residual, gamma, beta, seed, rms, epsilon, zero_centered_gamma, dropout_rate, launchers):
    return _fwd(x, residual, gamma, beta, seed, rms, epsilon, zero_centered_gamma, dropout_rate, launchers)[0]


def _fwd(x, residual, gamma, beta, seed, rms, epsilon, zero_centered_gamma, dropout_rate, launchers):
    n = x.shape[-1]
    normalized, new_residual = launchers.forward(
        x.reshape(-1, n), gamma, beta, residual.reshape(-1, n), seed, rms=rms, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, dropout_rate=dropout_rate,
    )
    new_residual = new_residual.reshape(residual.shape)
    saved = (new_residual, gamma, beta, seed)
    return (normalized.reshape(x.shape), new_residual), saved


def _bwd(rms, epsilon, zero_centered_gamma, dropout_rate, launchers, saved, cotangents):
    new_residual, gamma, beta, seed = saved
    d_normalized, d_residual = cotangents
    n = new_residual.shape[-1]
    dh, dx, dgamma, dbeta = launchers.backward(
        new_residual.reshape(-1, n), gamma, d_normalized.reshape(-1, n), d_residual.reshape(-1, n), seed,
        rms=rms, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma, has_beta=beta is not None,
        dropout_rate=dropout_rate, dx_dtype=d_normalized.dtype,  # normalized has x's dtype, so does its cotangent
    )
    shape = new_residual.shape
    dbeta = None if beta is None else dbeta.astype(beta.dtype)
    return dx.reshape(shape), dh.reshape(shape), dgamma.astype(gamma.dtype), dbeta, None


_residual_norm.defvjp(_fwd, _bwd)


def residual_norm(x: jax.Array, residual: jax.Array, gamma: jax.Array, beta: jax.Array | None,
                  seed: jax.Array | None, *, rms: bool, epsilon: float, zero_centered_gamma: bool,
                  dropout_rate: float, launchers: Launchers = norm_kernels.PALLAS) -> tuple[jax.Array, jax.Array]:
    """``(norm(new_residual), new_residual)`` with ``new_residual = dropout(x) + residual``.

    Args:
      x, residual: ``[..., hidden]`` (the new residual takes ``residual.dtype``, the normalized
        output ``x.dtype``).
      gamma, beta: ``[hidden]``; ``beta`` ``None`` for RMSNorm.
      seed: uint32 scalar drawing the dropout mask (`common.dropout_keep`); unused when
        ``dropout_rate == 0``.
      launchers: the norm kernels (`layer_norm.PALLAS`, or `mtjax.kernels.triton.layer_norm.NATIVE`).
    """
    if dropout_rate > 0.0 and seed is None:
        raise ValueError("residual_norm: dropout_rate > 0 needs a seed")
    x, residual, gamma, beta, seed = vary_together(x, residual, gamma, beta, seed)
    return _residual_norm(x, residual, gamma, beta, seed, rms, float(epsilon), bool(zero_centered_gamma),
                          float(dropout_rate), launchers)
