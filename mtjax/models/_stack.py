"""A stack of `TransformerLayer`s: scanned with ``nn.scan`` (one compiled layer, parameters stacked on a
leading ``"layers"`` axis) or unrolled, each optionally rematerialised with a named policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from mtjax import axes, ops
from mtjax.flax import MOE_LOSSES, MOE_METRICS, MoETransformerLayer, TransformerLayer
from mtjax.flax.attention import CACHE_COLLECTION, PAGED_KV_COLLECTION, PagedKV
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

    def __call__(self, carry, segment_ids, positions, deterministic, decode, paged_kv, encoded=None, encoder_mask=None,
                 attention_bias=None):
        x, residual = carry if self.defer_residual_add else (carry, None)
        y = super().__call__(x, encoded, encoder_decoder_mask=encoder_mask, segment_ids=segment_ids,
                             positions=positions, deterministic=deterministic, decode=decode, residual=residual,
                             paged_kv=paged_kv, attention_bias=attention_bias)
        return y, None


class _StackedMoELayer(MoETransformerLayer):
    """`MoETransformerLayer` called as `_StackedLayer`."""

    def __call__(self, carry, segment_ids, positions, deterministic, decode, paged_kv, encoded=None,  # noqa: D102
                 encoder_mask=None, attention_bias=None):
        x, residual = carry if self.defer_residual_add else (carry, None)
        y = super().__call__(x, encoded, encoder_decoder_mask=encoder_mask, segment_ids=segment_ids,
                             positions=positions, deterministic=deterministic, decode=decode, residual=residual,
                             paged_kv=paged_kv, attention_bias=attention_bias)
        return y, None


def apply_layers(x: Any, *, layer: Mapping[str, Any], num_layers: int, scan_layers: bool, remat_policy: str,
                 segment_ids: jax.Array | None, positions: jax.Array | None, deterministic: bool,
                 decode: bool, paged_kv: PagedKV | None = None, moe: Mapping[str, Any] | None = None,
                 name: str = "layers", first_index: int = 0, encoded: jax.Array | None = None,
                 encoder_mask: jax.Array | None = None, attention_bias: jax.Array | None = None) -> Any:
    """Runs ``num_layers`` ``TransformerLayer(**layer)`` on ``x``; call from a compact method.

    Parameters are ``{name}/...`` with a leading layer axis when scanned, ``layers_{i}/...`` otherwise
    (``i`` counted from ``first_index``, so consecutive stacks number their layers on). With ``moe``
    (`mtjax.flax.MoEBlock` keyword arguments) the layers are `mtjax.flax.MoETransformerLayer`s; their
    sown auxiliary losses and metrics get a leading layer axis when scanned. ``x`` may be the
    ``(branch, stream)`` pair a previous stack returned under ``defer_residual_add``.
    With ``layer["defer_residual_add"]`` each layer adds the previous one's output branch to the
    stream in its attention's norm kernel, and the result is the pair ``(branch, stream)`` whose sum
    is the stack's output (a scanned stack starts from ``(x, zeros)``, so its first norm adds zeros).
    ``paged_kv`` (a `mtjax.flax.PagedKV`, shared by the layers) runs every self-attention on its own
    pages in the `PAGED_KV_COLLECTION` collection (stacked on the layer axis when scanned).
    ``encoded`` (``[batch, kv_len, hidden]``, with ``layer["layer_type"]`` DECODER) is what every layer
    cross-attends to, ``encoder_mask`` its keep-mask ``[batch|1, 1, 1|length, kv_len]``;
    ``attention_bias`` is added to every layer's self-attention logits (T5's shared relative
    position biases).
    """
    defer = layer.get("defer_residual_add", False)
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={remat_policy!r} is not supported; accepted: {', '.join(REMAT_POLICIES)}")
    block, layer = _StackedLayer, dict(layer)
    if moe is not None:
        block, layer["moe"] = _StackedMoELayer, FrozenDict(moe)
    if remat_policy != "none":
        # static_argnums count `self`: deterministic and decode are Python bools.
        block = nn.remat(block, policy=REMAT_POLICIES[remat_policy], prevent_cse=not scan_layers, static_argnums=(4, 5))
    args = (segment_ids, positions, deterministic, decode, paged_kv, encoded, encoder_mask, attention_bias)
    if scan_layers:
        stack = nn.scan(
            block,
            variable_axes={"params": 0, FP8_COLLECTION: 0, CACHE_COLLECTION: 0, PAGED_KV_COLLECTION: 0, MOE_LOSSES: 0,
                           MOE_METRICS: 0},
            split_rngs={"params": True, layer.get("dropout_rng_name", "dropout"): True},
            in_axes=(nn.broadcast,) * 8,
            length=num_layers,
            metadata_params={nn.PARTITION_NAME: axes.LAYERS},
        )
        continued = defer and isinstance(x, tuple)
        carry = x if continued or not defer else (x, jnp.zeros_like(x))
        carry, _ = stack(name=name, **layer)(carry, *args)
        return carry
    carry = x if not defer or isinstance(x, tuple) else (x, None)
    for i in range(first_index, first_index + num_layers):
        carry, _ = block(name=f"layers_{i}", **layer)(carry, *args)
    return carry


def unstack_layers(params: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The parameters of a scanned stack (``layers/...`` with a leading layer axis) as an unrolled
    stack's (``layers_{i}/...``): the same model with ``scan_layers=False`` computes the same thing.

    Inference unrolls: a scanned stack would carry each layer's cache pages through the scan and
    copy them every step."""
    params = dict(params)
    if "layers" not in params:
        raise ValueError(f"unstack_layers: params have no 'layers' entry (not a scanned stack); "
                         f"top-level keys: {sorted(params)}")
    stacked = nn.meta.unbox(params.pop("layers"))
    for i in range(num_layers):
        params[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params
