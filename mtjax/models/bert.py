"""BERT-style encoder built from `mtjax.flax` modules: post-LN blocks, learned positions, token types.

``BertEncoder(config)(tokens [batch, seq] int, *, token_type_ids=None, segment_ids=None,
deterministic=True) -> hidden states [batch, seq, hidden_size]`` in ``config.dtype``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import axes
from mtjax.flax import Embed, LayerNorm, TransformerLayerType
from mtjax.flax.attention import check_heads
from mtjax.models._stack import apply_layers, check_stack_config


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Size and options of a `BertEncoder` (defaults: BERT-base).

    Attributes:
      vocab_size: tokens.
      hidden_size: model width.
      num_layers: Transformer blocks.
      num_heads: attention heads (``hidden_size`` must be divisible by it).
      mlp_dim: MLP hidden width.
      max_seq_len: size of the learned position table.
      type_vocab_size: token types (sentence A/B).
      activations: MLP activation (BERT: exact GELU).
      layernorm_epsilon: epsilon of every LayerNorm.
      dropout_rate: embedding, hidden and MLP-intermediate dropout.
      attention_dropout: attention-probability dropout.
      init_std: standard deviation of the normal initializer.
      scan_layers: ``nn.scan`` over the layers.
      remat_policy: one of `mtjax.models.REMAT_POLICIES`.
      dtype: compute dtype.
      param_dtype: parameter dtype.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    max_seq_len: int = 512
    type_vocab_size: int = 2
    activations: tuple[str, ...] = ("gelu_exact",)
    layernorm_epsilon: float = 1e-12
    dropout_rate: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02
    scan_layers: bool = True
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        owner = type(self).__name__
        check_stack_config(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "mlp_dim", "max_seq_len",
                                  "type_vocab_size"))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{owner}: hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        check_heads(owner, self.hidden_size // self.num_heads, self.num_heads, None)


class BertEncoder(nn.Module):
    """Token + position + token-type embeddings, LayerNorm, then ``num_layers`` post-LN encoder blocks
    (``y = norm(x + attn(x)); out = norm(y + mlp(y))``), with biases everywhere, as BERT.

    ``__call__(tokens, *, token_type_ids=None, segment_ids=None, deterministic=True)``: ``segment_ids
    [batch, seq]`` mark real tokens (non-zero; equal ids attend to each other) and padding (0); without
    them every token attends to every token. Returns ``[batch, seq, hidden_size]``.

    Attributes:
      config: a `BertConfig`.
    """

    config: BertConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, *, token_type_ids: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
        cfg = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"BertEncoder: tokens must be int [batch, seq]; got {tokens.dtype} {tokens.shape}")
        batch, seq = tokens.shape
        if seq > cfg.max_seq_len:
            raise ValueError(f"BertEncoder: sequence length {seq} exceeds max_seq_len={cfg.max_seq_len}")
        init = nn.initializers.normal(cfg.init_std)
        embed = dict(embedding_init=init, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
        token_type_ids = jnp.zeros_like(tokens) if token_type_ids is None else token_type_ids
        position_axes = (None, axes.EMBED)
        x = (Embed(cfg.vocab_size, cfg.hidden_size, name="token_embed", **embed)(tokens)
             + Embed(cfg.max_seq_len, cfg.hidden_size, embedding_axes=position_axes, name="position_embed",
                     **embed)(positions)
             + Embed(cfg.type_vocab_size, cfg.hidden_size, embedding_axes=position_axes, name="type_embed",
                     **embed)(token_type_ids))
        x = LayerNorm(epsilon=cfg.layernorm_epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="embed_norm")(x)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, axes.BATCH_LENGTH_EMBED)
        layer = dict(
            hidden_size=cfg.hidden_size, mlp_hidden_size=cfg.mlp_dim, num_attention_heads=cfg.num_heads,
            layernorm_type="layernorm", layernorm_epsilon=cfg.layernorm_epsilon, hidden_dropout=cfg.dropout_rate,
            attention_dropout=cfg.attention_dropout, intermediate_dropout=cfg.dropout_rate, mha_kernel_init=init,
            mlp_kernel_init=init, mlp_activations=cfg.activations, use_bias=True,
            apply_residual_connection_post_layernorm=True, output_layernorm=True,
            # Standard scaled attention, no relative biases (TransformerLayer's defaults are T5's).
            enable_relative_embedding=False, scale_attn_logits=True, scaled_query_init=False,
            layer_type=TransformerLayerType.ENCODER,
            self_attn_mask_type="no_mask" if segment_ids is None else "padding",
            dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        )
        return apply_layers(x, layer=layer, num_layers=cfg.num_layers, scan_layers=cfg.scan_layers,
                            remat_policy=cfg.remat_policy, segment_ids=segment_ids, positions=None,
                            deterministic=deterministic, decode=False)
