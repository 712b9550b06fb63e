"""Elementwise and gated activations, with an optional bias added first.

Gated activations (``swiglu``, ``geglu``, ``reglu``) take ``[..., 2 * hidden]``: the first half
goes through the activation, the second half is the linear gate, and the result is ``[..., hidden]``.
TransformerEngine-style tuples name the same functions: ``("gelu",)``, ``("silu", "linear")``...
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from mtjax import backend
from mtjax.ops._checks import check_float, check_shape


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


def _quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


# name -> (function applied to the activated half, gated?)
ACTIVATIONS: dict[str, tuple] = {
    "gelu": (_gelu_tanh, False),
    "gelu_exact": (_gelu_exact, False),
    "silu": (jax.nn.silu, False),
    "relu": (jax.nn.relu, False),
    "quick_gelu": (_quick_gelu, False),
    "swiglu": (jax.nn.silu, True),
    "geglu": (_gelu_tanh, True),
    "reglu": (jax.nn.relu, True),
}

_TUPLE_NAMES = {
    ("gelu",): "gelu",
    ("gelu_exact",): "gelu_exact",
    ("silu",): "silu",
    ("relu",): "relu",
    ("quick_gelu",): "quick_gelu",
    ("silu", "linear"): "swiglu",
    ("gelu", "linear"): "geglu",
    ("relu", "linear"): "reglu",
}


def canonical_activation(activation_type: str | Sequence[str]) -> str:
    """The canonical name of an activation given as a name or a TransformerEngine-style tuple."""
    if isinstance(activation_type, str):
        name = activation_type.lower()
    else:
        name = _TUPLE_NAMES.get(tuple(a.lower() for a in activation_type), repr(tuple(activation_type)))
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation: activation_type={activation_type!r} is not supported; accepted: "
            f"{sorted(ACTIVATIONS)} or tuples {sorted(_TUPLE_NAMES)}"
        )
    return name


def is_gated(activation_type: str | Sequence[str]) -> bool:
    return ACTIVATIONS[canonical_activation(activation_type)][1]


@backend.register("activation", backend.REFERENCE)
def activation_reference(x, bias, *, activation_type: str):
    fn, gated = ACTIVATIONS[activation_type]
    xf = x.astype(jnp.float32)
    if bias is not None:
        xf = xf + bias.astype(jnp.float32)
    if gated:
        act, linear = jnp.split(xf, 2, axis=-1)
        y = fn(act) * linear
    else:
        y = fn(xf)
    return y.astype(x.dtype)


def activation(
    x: jax.Array,
    activation_type: str | Sequence[str] = "gelu",
    bias: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """``act(x + bias)``, computed in float32.

    Args:
      x: ``[..., hidden]``, or ``[..., 2 * hidden]`` for a gated activation.
      activation_type: one of `ACTIVATIONS` or a TE-style tuple; ``"gelu"`` is the tanh
        approximation (``jax.nn.gelu``'s default), ``"gelu_exact"`` the erf form.
      bias: ``[x.shape[-1]]`` or ``None``.
    Returns:
      ``[..., hidden]`` in ``x.dtype``.
    """
    name = canonical_activation(activation_type)
    check_float("activation", "x", x)
    if jnp.ndim(x) < 1:
        raise ValueError(f"activation: x must have at least one axis; got shape {jnp.shape(x)}")
    if ACTIVATIONS[name][1] and jnp.shape(x)[-1] % 2:
        raise ValueError(f"activation: gated {name!r} needs an even last axis (2 * hidden); x has shape {jnp.shape(x)}")
    if bias is not None:
        check_float("activation", "bias", bias)
        check_shape("activation", "bias", bias, (jnp.shape(x)[-1],))
    return backend.dispatch("activation", x, bias, implementation=implementation, activation_type=name)
