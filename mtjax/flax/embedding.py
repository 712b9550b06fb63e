"""`Embed`: token embedding lookup, and the tied output projection (`Embed.attend`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import axes, fp8
from mtjax.flax.params import AxisNames, Dtype, Initializer, param_with_axes


class Embed(nn.Module):
    """An embedding table ``[num_embeddings, features]``.

    ``__call__(inputs)``: integer ids ``[...]`` -> ``[..., features]`` in ``dtype``; an id outside
    ``[0, num_embeddings)`` (negative ones included) gives NaN rather than another row, so a bad id
    shows up in the loss instead of training silently on the wrong token (`mtjax.train` checks ids
    before they reach the device).
    ``attend(query, preferred_element_type=None)``: ``query [..., features]`` -> logits ``[..., num_embeddings]``
    (the tied output layer), a GEMM through the ``attend_dot_general`` `mtjax.fp8.DotGeneral`.

    Attributes:
      num_embeddings: vocabulary size.
      features: embedding width.
      embedding_init: initializer of ``embedding``.
      embedding_axes: its logical axes.
      dtype: compute and output dtype.
      param_dtype: parameter dtype.
    """

    num_embeddings: int
    features: int
    embedding_init: Initializer = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    embedding_axes: AxisNames = (axes.VOCAB, axes.EMBED)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def setup(self):
        if self.num_embeddings < 1 or self.features < 1:
            raise ValueError(f"Embed: num_embeddings={self.num_embeddings} and features={self.features} must be "
                             "positive")
        self.embedding = param_with_axes(self, "embedding", self.embedding_init, (self.num_embeddings, self.features),
                                         self.param_dtype, self.embedding_axes)
        self.attend_dot_general = fp8.DotGeneral()

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise TypeError(f"Embed: inputs has dtype {inputs.dtype}; expected integer ids")
        # jnp.take wraps negative ids around (numpy's rule): send them out of range, where "fill" gives NaN.
        ids = jnp.where(inputs < 0, self.num_embeddings, inputs)
        return jnp.take(self.embedding.astype(self.dtype), ids, axis=0, mode="fill", fill_value=jnp.nan)

    def attend(self, query: jax.Array, preferred_element_type: Dtype | None = None) -> jax.Array:
        if query.shape[-1] != self.features:
            raise ValueError(f"Embed.attend: query has shape {query.shape}; expected [..., {self.features}]")
        dims = (((query.ndim - 1,), (1,)), ((), ()))
        return self.attend_dot_general(query.astype(self.dtype), self.embedding.astype(self.dtype), dims,
                                       preferred_element_type=preferred_element_type)
