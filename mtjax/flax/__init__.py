"""Flax linen modules with TransformerEngine-JAX names, built on `mtjax.ops` and `mtjax.fp8.DotGeneral`.

Every parameter carries logical axis names and every ``[batch, length, ...]`` activation a logical
constraint (the names of `mtjax.axes`); without a mesh and rules they are no-ops.
"""

from mtjax.flax.attention import (
    ATTN_BIAS_TYPES,
    PAGED_KV_COLLECTION,
    ROPE_SCALING_KINDS,
    ROTARY_GROUP_METHODS,
    DotProductAttention,
    MultiHeadAttention,
    PagedKV,
    RelativePositionBiases,
    RopeScaling,
    apply_rotary_pos_emb,
)
from mtjax.flax.dense import DenseGeneral, LayerNormDenseGeneral
from mtjax.flax.embedding import Embed
from mtjax.flax.mlp import LayerNormMLP
from mtjax.flax.moe import MOE_LOSSES, MOE_METRICS, MoEBlock, MoETransformerLayer, moe_aux_loss, moe_metrics
from mtjax.flax.normalization import LAYERNORM_TYPES, LayerNorm
from mtjax.flax.transformer import TransformerLayer, TransformerLayerType

__all__ = [
    "ATTN_BIAS_TYPES", "LAYERNORM_TYPES", "PAGED_KV_COLLECTION", "ROTARY_GROUP_METHODS", "DenseGeneral",
    "DotProductAttention", "Embed", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "MOE_LOSSES", "MOE_METRICS",
    "MoEBlock", "MoETransformerLayer", "MultiHeadAttention", "PagedKV", "ROPE_SCALING_KINDS", "RelativePositionBiases",
    "RopeScaling",
    "TransformerLayer", "TransformerLayerType", "apply_rotary_pos_emb", "moe_aux_loss", "moe_metrics",
]
