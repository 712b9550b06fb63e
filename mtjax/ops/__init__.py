"""One function per fused op. Each dispatches through `mtjax.backend` to a registered
implementation: the plain jax.numpy reference (``"xla"``) defined beside it, or a kernel."""

from mtjax.ops.activation import (ACTIVATIONS, Activation, activation, activation_fp8, activation_grad_fp8,
                                  canonical_activation, is_gated)
from mtjax.ops.attention import MASK_TYPES, attention
from mtjax.ops.cross_entropy import softmax_cross_entropy
from mtjax.ops.normalization import LAYERNORM_TYPES, Norm, layernorm, layernorm_fp8, residual_norm, rmsnorm
from mtjax.ops.paged_attention import PAGE_DTYPES, paged_attention
from mtjax.ops.softmax import softmax

__all__ = [
    "ACTIVATIONS", "MASK_TYPES", "Activation", "activation", "activation_fp8", "activation_grad_fp8", "attention",
    "canonical_activation", "is_gated",
    "LAYERNORM_TYPES", "Norm", "PAGE_DTYPES", "layernorm", "layernorm_fp8", "paged_attention", "residual_norm",
    "rmsnorm", "softmax",
    "softmax_cross_entropy",
]
