"""Flax linen modules with TransformerEngine-JAX names, built on `mtjax.ops` and `mtjax.fp8.DotGeneral`.

Every parameter carries logical axis names and every ``[batch, length, ...]`` activation a logical
constraint (the names of `mtjax.axes`); without a mesh and rules they are no-ops.
"""

from mtjax.flax.attention import (
    ATTN_BIAS_TYPES,
    ROTARY_GROUP_METHODS,
    DotProductAttention,
    MultiHeadAttention,
    RelativePositionBiases,
    apply_rotary_pos_emb,
)
from mtjax.flax.dense import DenseGeneral, LayerNormDenseGeneral
from mtjax.flax.embedding import Embed
from mtjax.flax.mlp import LayerNormMLP
from mtjax.flax.normalization import LAYERNORM_TYPES, LayerNorm
from mtjax.flax.transformer import TransformerLayer, TransformerLayerType

__all__ = [
    "ATTN_BIAS_TYPES", "LAYERNORM_TYPES", "ROTARY_GROUP_METHODS", "DenseGeneral", "DotProductAttention", "Embed",
    "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "MultiHeadAttention", "RelativePositionBiases",
    "TransformerLayer", "TransformerLayerType", "apply_rotary_pos_emb",
]
