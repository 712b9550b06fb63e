"""A stack of `TransformerLayer`s: scanned with ``nn.scan`` (one compiled layer, parameters stacked on a
leading ``"layers"`` axis) or unrolled, each optionally rematerialised with a named policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import axes, ops
from mtjax.flax import TransformerLayer
from mtjax.flax.attention import CACHE_COLLECTION
from mtjax.fp8 import FP8_COLLECTION

# The logical axis name of a scanned stack's leading layer axis (its parameters' first dimension).

# name -> jax.checkpoint policy (what the backward pass may keep instead of recomputing); "none": no remat.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def check_stack_config(config: Any, positive_ints: Sequence[str]) -> None:
    """The checks `GPTConfig` and `BertConfig` share, from their ``__post_init__``.

    Makes ``config.activations`` a tuple (a name becomes a 1-tuple) and raises ValueError naming the
    field for: a name of ``positive_ints`` that is not a positive int, an unknown activation or
    ``remat_policy``, a ``dropout_rate``/``attention_dropout`` outside ``[0, 1)``.
    """
    owner = type(config).__name__
    activations = config.activations
    object.__setattr__(config, "activations", (activations,) if isinstance(activations, str) else tuple(activations))
    for name in positive_ints:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name}={value!r}; expected a positive int")
    ops.canonical_activation(config.activations)
    if config.remat_policy not in REMAT_POLICIES:
        raise ValueError(f"{owner}: remat_policy={config.remat_policy!r} is not supported; "
                         f"accepted: {', '.join(REMAT_POLICIES)}")
    for name in ("dropout_rate", "attention_dropout"):
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ValueError(f"{owner}: {name}={getattr(config, name)}; expected 0 <= rate < 1")


class _StackedLayer(TransformerLayer):
    """`TransformerLayer` with positional arguments and the ``(carry, output)`` result ``nn.scan`` wants.

    The carry is the stream, or with ``defer_residual_add`` the pair ``(branch, stream)`` whose sum
    the stream is (``stream`` ``None`` before an unrolled stack's first layer)."""

    def __call__(self, carry, segment_ids, positions, deterministic, decode):
        x, residual = carry if self.defer_residual_add else (carry, None)
        y = super().__call__(x, segment_ids=segment_ids, positions=positions, deterministic=deterministic,
                             decode=decode, residual=residual)
        return y, None


def apply_layers(x: jax.Array, *, layer: Mapping[str, Any], num_layers: int, scan_layers: bool, remat_policy: str,
                 segment_ids: jax.Array | None, positions: jax.Array | None, deterministic: bool,
                 decode: bool) -> jax.Array:
    """Runs ``num_layers`` ``TransformerLayer(**layer)`` on ``x``; call from a compact method.

    Parameters are ``layers/...`` with a leading layer axis when scanned, ``layers_{i}/...`` otherwise.
    With ``layer["defer_residual_add"]`` each layer adds the previous one's output branch to the
    stream in its attention's norm kernel, and the result is the pair ``(branch, stream)`` whose sum
    is the stack's output (a scanned stack starts from ``(x, zeros)``, so its first norm adds zeros).
    """
    defer = layer.get("defer_residual_add", False)
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={remat_policy!r} is not supported; accepted: {', '.join(REMAT_POLICIES)}")
    block = _StackedLayer
    if remat_policy != "none":
        # static_argnums count `self`: deterministic and decode are Python bools.
        block = nn.remat(block, policy=REMAT_POLICIES[remat_policy], prevent_cse=not scan_layers, static_argnums=(4, 5))
    if scan_layers:
        stack = nn.scan(
            block,
            variable_axes={"params": 0, FP8_COLLECTION: 0, CACHE_COLLECTION: 0},
            split_rngs={"params": True, layer.get("dropout_rng_name", "dropout"): True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=num_layers,
            metadata_params={nn.PARTITION_NAME: axes.LAYERS},
        )
        carry = (x, jnp.zeros_like(x)) if defer else x
        carry, _ = stack(name="layers", **layer)(carry, segment_ids, positions, deterministic, decode)
        return carry
    carry = (x, None) if defer else x
    for i in range(num_layers):
        carry, _ = block(name=f"layers_{i}", **layer)(carry, segment_ids, positions, deterministic, decode)
    return carry
