"""One function per fused op. Each dispatches through `mtjax.backend` to a registered
implementation: the plain jax.numpy reference (``"xla"``) defined beside it, or a kernel.
Importing this package registers them all."""

from mtjax.ops.activation import (
                                  ACTIVATIONS,
                                  Activation,
                                  activation,
                                  activation_fp8,
                                  activation_grad_fp8,
                                  canonical_activation,
                                  is_gated,
)
from mtjax.ops.attention import MASK_TYPES, attention
from mtjax.ops.cross_entropy import softmax_cross_entropy
from mtjax.ops.gemm import fp8_gemm
from mtjax.ops.normalization import LAYERNORM_TYPES, Norm, layernorm, norm_fp8, residual_norm, rmsnorm
from mtjax.ops.quantization import cast_transpose, dequantize, quantize
from mtjax.ops.softmax import softmax

__all__ = [
    "ACTIVATIONS", "MASK_TYPES", "Activation", "activation", "activation_fp8", "activation_grad_fp8", "attention",
    "canonical_activation", "cast_transpose", "dequantize", "fp8_gemm", "is_gated",
    "LAYERNORM_TYPES", "Norm", "layernorm", "norm_fp8", "quantize", "residual_norm", "rmsnorm", "softmax",
    "softmax_cross_entropy",
]
