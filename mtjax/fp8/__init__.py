"""FP8 training: formats, recipes, delayed-scaling state as Flax variables, the FP8 GEMM.

Every mtjax GEMM runs in a `DotGeneral` submodule, called like ``lax.dot_general``. Outside
`fp8_autocast` it is exactly that; inside, both operands are quantized to FP8 and the GEMM and its
two backward GEMMs (dgrad, wgrad) run on FP8 tensor cores::

    with fp8_autocast(recipe=DelayedScaling()):
        variables = model.init(key, x)                 # {"params": ..., "fp8_metas": ...}
        grads = jax.grad(loss_fn)(variables, x)        # grads["fp8_metas"] is the NEXT step's meta
    params_and_meta, opt_state = Optimizer(optax.adamw(1e-3)).apply_gradients(variables, grads, opt_state)

`autocast(enabled=False, recipe=None, mesh_resource=None)` is the same context with
TransformerEngine-JAX's signature and defaults (off unless ``enabled=True``). Either is read when a
function is traced: enter it inside the function you `jax.jit` (or around its first call); a
function traced outside it stays a plain-precision function.

Scale convention (as TransformerEngine): ``q = saturate_cast(x * scale)``, ``x ≈ q * scale_inv``,
``scale = (fp8_max / amax) / 2**margin``.

Delayed-scaling state ("meta"): for each GEMM and each tensor role (``input``, ``kernel``,
``output_grad``) an ``amax_history`` (float32 ``[amax_history_len]``, most recent first) and a
``scale`` (float32 ``[]``, the scale the last step quantized with). A step derives its scale from
the history and the last scale (`compute_scale`), quantizes with it, and hands back as the meta's
cotangent ("overwrite with gradient") the history rolled with this step's amax, plus the scale it
used. Deriving the scale at the start of the step (the same number TransformerEngine computes at the
end of the previous one) means all micro-batches of a step quantize with one scale, so
`accumulate_gradients` combines their meta exactly by an elementwise max.

Each GEMM operand is cast once with its transpose and amax (`mtjax.ops.cast_transpose`, a Pallas
kernel on GPUs), and the dequantization scales ride into cuBLASLt's FP8 GEMM (`mtjax.ops.fp8_gemm`). A norm or an
activation in front of a GEMM writes its FP8 input directly (``lhs_prologue``), and an MLP's two
GEMMs run as one op (`fp8_mlp`) whose activation backward writes fc1's FP8 output gradient. On CUDA,
compile FP8 steps with `compiler_options()` (Triton GEMM fusions off: every FP8 GEMM stays on cuBLASLt).

Limitation: one `DotGeneral` instance must run once per differentiated function (``nn.scan`` and
``nn.remat`` are fine): cotangents of a meta read twice would be summed.

The package: `mtjax.fp8.recipes` (formats and recipes), `mtjax.fp8.scaling` (the state and the scale
math), `mtjax.fp8.context` (`fp8_autocast`, `autocast`), `mtjax.fp8.dot_general` (the FP8 GEMM and
`DotGeneral`), `mtjax.fp8.mlp` (the fused FP8 MLP), `mtjax.fp8.grouped_gemm` (FP8 grouped GEMMs
of experts, with a per-expert kernel history under delayed scaling) and `mtjax.fp8.gradients` (the meta on
gradients and optimizers); `mtjax.fp8.block_scaling` holds the matmul and the fused MLP of
`BlockScaling` (1x128 tiles, 128x128 weight blocks, no state; docs/fp8-block-scaling.md).
The FP8 dtypes are `mtjax.dtypes`'; the quantize, cast_transpose and FP8 GEMM ops are `mtjax.ops`', re-exported here.
"""

from mtjax.dtypes import FP8_DTYPES, fp8_max
from mtjax.fp8.block_scaling import block_fp8_matmul
from mtjax.fp8.context import Autocast, autocast, current_autocast, fp8_autocast
from mtjax.fp8.dot_general import DotGeneral, Prologue, compiler_options, dot_with_prologue, fp8_dot_general
from mtjax.fp8.gradients import (
                                 Optimizer,
                                 accumulate_gradients,
                                 finalize_accumulated,
                                 map_param_gradients,
                                 split_gradients,
)
from mtjax.fp8.grouped_gemm import GroupedGemmMeta, fp8_grouped_gemm, init_grouped_meta
from mtjax.fp8.mlp import fp8_mlp, fuses_mlp
from mtjax.fp8.recipes import (
    AMAX_COMPUTE_ALGOS,
    BLOCK_SIZE,
    RECIPE_NAMES,
    RECIPE_TYPES,
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    Format,
    Recipe,
    max_margin,
    recipe_by_name,
)
from mtjax.fp8.scaling import (
                                 AMAX_JUMP_FACTOR,
                                 FP8_COLLECTION,
                                 MAX_SCALE,
                                 META_KEYS,
                                 MIN_SCALE,
                                 ROLES,
                                 amax,
                                 amax_jump,
                                 compute_scale,
                                 history_amax,
                                 init_meta,
                                 roll_amax_history,
)
from mtjax.ops.gemm import fp8_gemm, fp8_gemm_reference
from mtjax.ops.quantization import cast_transpose, cast_transpose_reference, dequantize, quantize

__all__ = [
    "AMAX_COMPUTE_ALGOS", "AMAX_JUMP_FACTOR", "FP8_COLLECTION", "FP8_DTYPES", "MAX_SCALE", "META_KEYS", "MIN_SCALE",
    "RECIPE_NAMES", "RECIPE_TYPES", "ROLES",
    "BLOCK_SIZE", "Autocast", "BlockScaling", "CurrentScaling", "DelayedScaling", "DotGeneral", "Format", "Optimizer",
    "Prologue", "Recipe", "accumulate_gradients", "amax", "amax_jump", "autocast", "block_fp8_matmul",
    "cast_transpose",
    "cast_transpose_reference", "compiler_options",
    "compute_scale", "current_autocast", "dequantize", "dot_with_prologue", "finalize_accumulated", "fp8_autocast",
    "fp8_dot_general",
    "GroupedGemmMeta", "fp8_grouped_gemm", "init_grouped_meta",
    "fp8_gemm", "fp8_gemm_reference", "fp8_max", "fp8_mlp", "fuses_mlp", "history_amax", "init_meta",
    "map_param_gradients", "max_margin", "quantize", "recipe_by_name",
    "roll_amax_history", "split_gradients",
]
