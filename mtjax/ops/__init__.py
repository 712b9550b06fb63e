"""One function per fused op. Each dispatches through `mtjax.backend` to a registered
implementation: the plain jax.numpy reference (``"xla"``) defined beside it, or a kernel.
Importing this package registers them all."""

from mtjax.ops.activation import (
                                  ACTIVATIONS,
                                  Activation,
                                  activation,
                                  activation_fp8,
                                  activation_grad_fp8,
                                  activation_grad_tile_fp8,
                                  activation_tile_fp8,
                                  canonical_activation,
                                  is_gated,
)
from mtjax.ops.attention import MASK_TYPES, attention
from mtjax.ops.block_gemm import block_fp8_gemm
from mtjax.ops.block_quantization import block_dequantize, block_quantize, tile_dequantize, tile_quantize
from mtjax.ops.collective_matmul import (
                                  COLLECTIVE_MATMUL_KINDS,
                                  all_gather_matmul,
                                  matmul_reduce_scatter,
                                  sequence_parallel_matmul,
)
from mtjax.ops.context_parallel import (
                                  CONTEXT_PARALLEL_STRATEGIES,
                                  all_gather_attention,
                                  attention_with_lse,
                                  attention_with_lse_backward,
                                  context_parallel_attention,
                                  merge_attention,
                                  ring_attention,
)
from mtjax.ops.cross_entropy import softmax_cross_entropy
from mtjax.ops.gemm import fp8_gemm
from mtjax.ops.grouped_gemm import (
    GroupedFP8Scales,
    grouped_gemm,
    grouped_gemm_block_fp8,
    grouped_gemm_fp8,
    grouped_gemm_wgrad,
)
from mtjax.ops.normalization import LAYERNORM_TYPES, Norm, layernorm, norm_fp8, norm_tile_fp8, residual_norm, rmsnorm
from mtjax.ops.paged_attention import PAGE_DTYPES, paged_attention
from mtjax.ops.permutation import PermuteState, expert_capacity, permute, unpermute
from mtjax.ops.quantization import cast_transpose, dequantize, quantize
from mtjax.ops.router import (
    SCORE_FUNCTIONS,
    RouterOutput,
    expert_counts,
    load_balancing_loss,
    route,
    router_z_loss,
    update_expert_bias,
)
from mtjax.ops.softmax import softmax

__all__ = [
    "ACTIVATIONS", "MASK_TYPES", "Activation", "activation", "activation_fp8", "activation_grad_fp8",
    "activation_grad_tile_fp8", "activation_tile_fp8", "attention",
    "block_dequantize", "block_fp8_gemm", "block_quantize", "tile_dequantize", "tile_quantize",
    "canonical_activation", "cast_transpose", "dequantize", "fp8_gemm", "is_gated",
    "COLLECTIVE_MATMUL_KINDS", "all_gather_matmul", "matmul_reduce_scatter", "sequence_parallel_matmul",
    "CONTEXT_PARALLEL_STRATEGIES", "all_gather_attention", "attention_with_lse", "attention_with_lse_backward",
    "context_parallel_attention", "merge_attention", "ring_attention",
    "GroupedFP8Scales", "grouped_gemm", "grouped_gemm_block_fp8", "grouped_gemm_fp8", "grouped_gemm_wgrad",
    "PermuteState", "expert_capacity", "permute", "unpermute",
    "SCORE_FUNCTIONS", "RouterOutput", "expert_counts", "load_balancing_loss", "route", "router_z_loss",
    "update_expert_bias",
    "LAYERNORM_TYPES", "Norm", "PAGE_DTYPES", "layernorm", "norm_fp8", "norm_tile_fp8", "paged_attention", "quantize",
    "residual_norm", "rmsnorm", "softmax",
    "softmax_cross_entropy",
]
