"""A tiny causal language model standing in for `mtjax.models.GPT` in the training tests.

It has the same call signature (``model(tokens, *, positions=None, segment_ids=None,
deterministic=True) -> logits``), annotates its parameters with logical axes and runs one GEMM
through `mtjax.fp8.DotGeneral` (so under ``fp8_autocast`` it carries FP8 meta), so the tests
exercise sharding and the FP8 variable plumbing while compiling in about a second.
"""

import flax.linen as nn
import jax.numpy as jnp

from mtjax.fp8 import DotGeneral

RULES = (
    ("activation_batch", ("dp", "fsdp")),
    ("activation_length", None),
    ("embed", "fsdp"),
    ("mlp", "tp"),
    ("vocab", "tp"),
)


class TinyLM(nn.Module):
    """Embedding -> causal mean-pooling mixer -> MLP -> logits.

    Attributes:
      vocab_size: token ids are in ``[0, vocab_size)`` (264: the byte tokenizer's 257, padded to a multiple of 8).
      hidden: embedding width.
      dtype: compute dtype.
      dropout_rate: dropout on the residual stream when not deterministic.
    """

    vocab_size: int = 264
    hidden: int = 16
    dtype: jnp.dtype = jnp.float32
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, tokens, *, positions=None, segment_ids=None, deterministic=True):
        embed = self.param("embed", nn.with_logical_partitioning(nn.initializers.normal(0.1), ("vocab", "embed")),
                           (self.vocab_size, self.hidden))
        x = jnp.take(embed, tokens, axis=0).astype(self.dtype)
        # Causal mixing: each position sees the running mean of the positions before it.
        x = x + jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1, dtype=self.dtype)[:, None]
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "embed"))
        w1 = self.param("w1", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
                        (self.hidden, 4 * self.hidden))
        w2 = self.param("w2", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")),
                        (4 * self.hidden, self.hidden))
        # Through mtjax.fp8.DotGeneral, as every mtjax GEMM: FP8 with its meta under fp8_autocast.
        hidden = DotGeneral()(x, w1.astype(self.dtype), (((2,), (0,)), ((), ())))
        x = x + nn.gelu(hidden) @ w2.astype(self.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
        scale = self.param("norm_scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                           (self.hidden,))
        return (x * scale.astype(self.dtype)) @ embed.T.astype(self.dtype)
