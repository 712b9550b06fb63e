"""`fp8_mlp`: a Transformer MLP's two FP8 GEMMs as one op, so the activation's backward writes fc1's
output gradient directly in FP8 (TransformerEngine's "dact + cast_transpose"): per tensor under
`DelayedScaling`, in 1x128 tiles under `BlockScaling` (`mtjax.fp8.block_scaling.block_fp8_mlp`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from mtjax.fp8.block_scaling import block_fp8_mlp, prologue_backward
from mtjax.fp8.context import current_autocast
from mtjax.fp8.dot_general import (
    _check_meta,
    _delayed_cast,
    _fp8_matmul_bwd,
    _GemmSpec,
    _quantize_input,
    _quantized_grad_matmul_bwd,
    _quantized_input_matmul_fwd,
)
from mtjax.fp8.recipes import BlockScaling, DelayedScaling
from mtjax.fp8.scaling import _bound_axes
from mtjax.kernels.common import varying_axes
from mtjax.ops import Activation, Norm, is_gated


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _fp8_mlp(x, norm, w1, activation, w2, meta1, meta2, spec1, spec2):
    """``activation(norm(x) @ w1) @ w2`` in FP8 under `DelayedScaling` (``x [M, hidden]``, ``w1
    [hidden, mlp]`` or ``[hidden, 2, mlp]``, ``w2 [mlp, out]``): both GEMMs with their prologues
    fused into their FP8 inputs, and fc1's output gradient written in FP8 by the activation's
    backward (`mtjax.ops.activation_grad_fp8`) instead of in bf16 and cast again."""
    return _fp8_mlp_fwd(x, norm, w1, activation, w2, meta1, meta2, spec1, spec2)[0]


def _fp8_mlp_fwd(x, norm, w1, activation, w2, meta1, meta2, spec1, spec2):
    w1_2d = w1.reshape(w1.shape[0], -1)
    h, gemm1 = _quantized_input_matmul_fwd(*_quantize_input(x, norm, meta1, spec1), w1_2d, meta1, spec1)
    h = h.reshape((x.shape[0],) + w1.shape[1:])  # [M, mlp] or, gated, [M, 2, mlp]
    y, gemm2 = _quantized_input_matmul_fwd(*_quantize_input(h, activation, meta2, spec2), w2, meta2, spec2)
    return y, (None if norm is None else x, norm, w1.shape, gemm1, h, activation, gemm2)


def _fp8_mlp_bwd(spec1, spec2, residuals, g):
    x, norm, w1_shape, gemm1, h, activation, gemm2 = residuals
    d_activation_out, dw2, next_meta2 = _fp8_matmul_bwd(spec2, gemm2, g)
    # fc1's output gradient, quantized with fc1's output_grad scale by the activation's backward.
    g_q, g_q_t, g_scale, g_state, d_activation = _delayed_cast(
        "output_grad", gemm1[4], spec1, spec1.bwd_dtype,
        lambda scale: activation.fp8_grad(h, d_activation_out, scale, spec1.bwd_dtype))
    d_fc1_input, dw1, next_meta1 = _quantized_grad_matmul_bwd(spec1, gemm1, g_q.reshape(h.shape[0], -1), g_q_t,
                                                              g_scale, g_state)
    dx, d_norm = prologue_backward(x, norm, d_fc1_input)
    return dx, d_norm, dw1.reshape(w1_shape), d_activation, dw2, next_meta1, next_meta2


_fp8_mlp.defvjp(_fp8_mlp_fwd, _fp8_mlp_bwd)


def fuses_mlp(*arrays: jax.Array) -> bool:
    """Whether `fp8_mlp` applies to these operands here: inside `fp8_autocast` with
    `DelayedScaling` or `BlockScaling`, and not per-device arrays of ``shard_map`` (which take
    `fp8_dot_general`'s path, one GEMM at a time)."""
    state = current_autocast()
    return (state is not None and isinstance(state.recipe, (DelayedScaling, BlockScaling))
            and not any(varying_axes(a) for a in arrays))


def fp8_mlp(x: jax.Array, w1: jax.Array, w2: jax.Array, meta1: Mapping[str, jax.Array] | None,
            meta2: Mapping[str, jax.Array] | None, *, activation: Activation, norm: Norm | None = None,
            recipe: DelayedScaling | BlockScaling | None = None, mesh_axes: Sequence[str] = (),
            implementation: str | None = None) -> jax.Array:
    """``activation(norm(x) @ w1) @ w2`` with both GEMMs in FP8 (a Transformer MLP without dropout).

    The same numbers as `fp8_dot_general` with ``lhs_prologue=norm`` for fc1 and
    ``lhs_prologue=activation`` for fc2 (in float32; in bf16 the fused backward casts the float32
    gradient of the activation, one rounding fewer), in one ``custom_vjp`` so that the activation's backward
    writes fc1's output gradient directly in FP8 with its transpose (TransformerEngine's "dact +
    cast_transpose"): one pass over the MLP's widest tensor fewer. Under `DelayedScaling` with
    fc1's delayed output-gradient scale (`mtjax.ops.activation_grad_fp8`); under `BlockScaling` in
    1x128 tiles with their own scales (`mtjax.ops.activation_grad_tile_fp8`).

    Args:
      x: ``[..., hidden]``.
      w1: ``[hidden, mlp]``, or ``[hidden, 2, mlp]`` for a gated activation.
      w2: ``[mlp, out]``.
      meta1, meta2: the two GEMMs' delayed-scaling states (`init_meta`); differentiating gives the next
        ones. ``None`` under `BlockScaling`, which keeps no state.
      activation: a `mtjax.ops.Activation` (its bias and type).
      norm: a `mtjax.ops.Norm` applied to ``x`` first, or ``None``.
      recipe: a `DelayedScaling` (the default, ``DelayedScaling()``) or a `BlockScaling`.
      mesh_axes, implementation: as `fp8_dot_general`.
    Returns:
      ``[..., out]`` in the result type of the operands.
    """
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, (DelayedScaling, BlockScaling)):
        raise TypeError(f"fp8_mlp(recipe={recipe!r}): expected a DelayedScaling (its scales are known before "
                        "the tensors are seen, which the fused backward needs) or a BlockScaling (each tile's "
                        "scale is its own)")
    if not isinstance(activation, Activation) or not (norm is None or isinstance(norm, Norm)):
        raise TypeError(f"fp8_mlp: activation must be a mtjax.ops.Activation and norm a mtjax.ops.Norm or None; "
                        f"got {type(activation).__name__} and {type(norm).__name__}")
    _check_meta(meta1, recipe)
    _check_meta(meta2, recipe)
    gated = is_gated(activation.activation_type)
    hidden = x.shape[-1]
    if w1.ndim != (3 if gated else 2) or w1.shape[0] != hidden or (gated and w1.shape[1] != 2):
        expected = "[hidden, 2, mlp]" if gated else "[hidden, mlp]"
        raise ValueError(f"fp8_mlp: w1 of shape {w1.shape} for x [..., {hidden}] and activation "
                         f"{activation.activation_type!r}; expected {expected}")
    if w2.ndim != 2 or w2.shape[0] != w1.shape[-1]:
        raise ValueError(f"fp8_mlp: w2 of shape {w2.shape}; expected [mlp, out] with mlp = {w1.shape[-1]}")
    if any(varying_axes(a) for a in (x, w1, w2)):
        raise ValueError("fp8_mlp: operands vary over shard_map axes; use fp8_dot_general per GEMM there")
    reduce_axes = _bound_axes(mesh_axes) if isinstance(recipe, DelayedScaling) and recipe.reduce_amax else ()
    h_dtype = jnp.result_type(x.dtype, w1.dtype)
    specs = [_GemmSpec.build(recipe, reduce_axes, x_dtype, w.dtype, jnp.result_type(x_dtype, w.dtype), implementation)
             for x_dtype, w in ((x.dtype, w1), (h_dtype, w2))]
    if isinstance(recipe, BlockScaling):
        out = block_fp8_mlp(x.reshape(-1, hidden), norm, w1, activation, w2, *specs)
    else:
        out = _fp8_mlp(x.reshape(-1, hidden), norm, w1, activation, w2, meta1, meta2, *specs)
    return out.reshape(x.shape[:-1] + w2.shape[1:])
