"""Straightforward float64 numpy formulas: the ground truth the jax references are tested against."""

import math

import numpy as np


def layernorm(x, gamma, beta, eps, zero_centered):
    x = x.astype(np.float64)
    g = gamma.astype(np.float64) + (1.0 if zero_centered else 0.0)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * g
    return y if beta is None else y + beta.astype(np.float64)


def rmsnorm(x, gamma, eps, zero_centered):
    x = x.astype(np.float64)
    g = gamma.astype(np.float64) + (1.0 if zero_centered else 0.0)
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * g


_erf = np.vectorize(math.erf)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


ACT = {
    "gelu": _gelu_tanh,
    "gelu_exact": lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
    "silu": lambda x: x * _sigmoid(x),
    "relu": lambda x: np.maximum(x, 0),
    "quick_gelu": lambda x: x * _sigmoid(1.702 * x),
    "squared_relu": lambda x: np.maximum(x, 0) ** 2,
    "sigmoid": _sigmoid,
    # gpt-oss's clamped SiLU (limit 7, alpha 1.702; TransformerEngine's ClampedSwigluParams defaults)
    "clamped_silu": lambda x: np.minimum(x, 7.0) * _sigmoid(1.702 * np.minimum(x, 7.0)),
}
_linear = lambda gate: gate
# gated name -> (activation of x[..., 0, :], function of the gate x[..., 1, :])
GATED = {"swiglu": ("silu", _linear), "geglu": ("gelu", _linear), "reglu": ("relu", _linear),
         "qgeglu": ("quick_gelu", _linear), "sreglu": ("squared_relu", _linear), "glu": ("sigmoid", _linear),
         "clamped_swiglu": ("clamped_silu", lambda gate: np.clip(gate, -7.0, 7.0) + 1.0)}


def activation(x, name, bias):
    x = x.astype(np.float64)
    if bias is not None:
        x = x + bias
    if name in GATED:  # x [..., 2, hidden]: activated input, then the gate
        act, gate = GATED[name]
        return ACT[act](x[..., 0, :]) * gate(x[..., 1, :])
    return ACT[name](x)


def softmax(logits, keep):
    logits = logits.astype(np.float64)
    if keep is None:
        keep = np.ones(logits.shape, bool)
    keep = np.broadcast_to(keep, logits.shape)
    out = np.zeros(logits.shape)
    it = np.ndindex(*logits.shape[:-1])
    for idx in it:
        row, k = logits[idx], keep[idx]
        if k.any():
            e = np.where(k, np.exp(row - row[k].max()), 0.0)
            out[idx] = e / e.sum()
    return out


def causal(q_len, kv_len):
    return np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)


def attention(q, k, v, *, bias=None, keep=None, scale, soft_cap=None):
    """q [B,T,N,D], k/v [B,S,K,D]; keep broadcastable to [B,N,T,S]."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    b, t, n, d = q.shape
    kh = k.shape[2]
    g = n // kh
    k_rep = np.repeat(k, g, axis=2)
    v_rep = np.repeat(v, g, axis=2)
    logits = np.einsum("btnd,bsnd->bnts", q, k_rep) * scale
    if bias is not None:
        logits = logits + bias
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    p = softmax(logits, keep)
    return np.einsum("bnts,bsnd->btnd", p, v_rep)
