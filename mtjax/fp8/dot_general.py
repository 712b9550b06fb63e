"""The FP8 ``dot_general``: `fp8_dot_general` and `DotGeneral`, the linen module every mtjax GEMM runs in.

Each GEMM operand is cast once with its transpose and amax (`mtjax.ops.cast_transpose`, a Pallas
kernel on GPUs), and the dequantization scales ride into cuBLASLt's FP8 GEMM (`mtjax.ops.fp8_gemm`).
A norm or an activation in front of a GEMM writes its FP8 input directly (``lhs_prologue``). The
pieces of one FP8 GEMM here (its spec, operand casts, forward and backward) also build
`mtjax.fp8.mlp.fp8_mlp`, an MLP's two GEMMs as one op.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax import backend
from mtjax.dtypes import fp8_max
from mtjax.fp8.block_scaling import block_fp8_matmul, prologue_backward
from mtjax.fp8.context import current_autocast
from mtjax.fp8.recipes import RECIPE_TYPES, BlockScaling, CurrentScaling, DelayedScaling, Recipe
from mtjax.fp8.scaling import (
    FP8_COLLECTION,
    META_KEYS,
    ROLES,
    _bound_axes,
    _reduce_max,
    amax,
    compute_scale,
    history_amax,
    init_meta,
    roll_amax_history,
)
from mtjax.kernels.common import varying_axes
from mtjax.ops import Activation, Norm, cast_transpose, fp8_gemm

# What can run in front of an FP8 GEMM, fused with the quantization of its input.
Prologue = Norm | Activation


def _uses_fnuz() -> bool:
    """MI300 (gfx94x) computes FP8 in the fnuz dtypes; other GPUs (and MI350, gfx95x) in the OCP ones."""
    if backend.platform() != "rocm":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("gfx94")


def compiler_options(platform: str | None = None) -> dict[str, Any]:
    """XLA options for a jitted step whose GEMMs run in FP8 on ``platform`` (default: jax's backend).

    On CUDA GPUs Triton GEMM fusions are switched off, so XLA hands every FP8 dot to cuBLASLt's FP8
    GEMM (dequantization scales folded in) instead of autotuning Triton fusions for each shape: the
    step compiles far faster and its FP8 GEMMs run at least as fast (docs/performance.md).
    Elsewhere (CPU, ROCm, PJRT plugins): none. Pass to ``jax.jit(..., compiler_options=...)``;
    ``make_train_step`` and ``mtjax train --fp8`` do.
    """
    return {"xla_gpu_enable_triton_gemm": False} if (platform or backend.platform()) == "cuda" else {}


@dataclasses.dataclass(frozen=True)
class _GemmSpec:
    """The static half of one FP8 matmul (hashable: it is a nondiff argument of the custom_vjp)."""

    recipe: Recipe
    fwd_dtype: Any
    bwd_dtype: Any
    reduce_axes: tuple[str, ...]  # bound mesh axes every amax is max-reduced over
    x_dtype: Any
    w_dtype: Any
    out_dtype: Any
    implementation: str | None

    @classmethod
    def build(cls, recipe: Recipe, reduce_axes: Sequence[str], x_dtype: Any, w_dtype: Any, out_dtype: Any,
              implementation: str | None) -> _GemmSpec:
        """The spec of a GEMM under ``recipe``, its FP8 dtypes from the recipe's format."""
        fwd_dtype, bwd_dtype = recipe.fp8_format.dtypes(fnuz=_uses_fnuz())
        return cls(recipe=recipe, fwd_dtype=fwd_dtype, bwd_dtype=bwd_dtype, reduce_axes=tuple(sorted(reduce_axes)),
                   x_dtype=x_dtype, w_dtype=w_dtype, out_dtype=out_dtype, implementation=implementation)


def _delayed_scale(role: str, meta: Mapping[str, jax.Array], recipe: DelayedScaling, dtype: Any) -> jax.Array:
    """The scale a role quantizes with under `DelayedScaling`: known before the tensor is seen (one per
    group where the role's history has a leading group axis)."""
    history = meta[f"{role}_amax_history"]
    return compute_scale(history_amax(history, recipe.amax_compute_algo), meta[f"{role}_scale"], fp8_max(dtype),
                         recipe.margin)


def _delayed_cast(role: str, meta: Mapping[str, jax.Array], spec: _GemmSpec, dtype: Any,
                  cast: Callable[[jax.Array], tuple]) -> tuple:
    """``(q, q transposed, scale, the role's next state, *extra)`` under `DelayedScaling`: the scale
    comes from the role's history, ``cast(scale) -> (q, q transposed, amax, *extra)`` writes the FP8
    tensor (a cast_transpose, or a kernel fused with the op producing it), and its amax, max-reduced
    over ``spec.reduce_axes``, enters the next state."""
    scale = _delayed_scale(role, meta, spec.recipe, dtype)
    q, q_t, observed, *extra = cast(scale)
    history = roll_amax_history(meta[f"{role}_amax_history"], _reduce_max(observed, spec.reduce_axes))
    return (q, q_t, scale, {f"{role}_amax_history": history, f"{role}_scale": scale}, *extra)


def _quantize_operand(role: str, x: jax.Array, meta: Mapping[str, jax.Array] | None, spec: _GemmSpec,
                      dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(q, q transposed, scale, the role's next state)`` of one GEMM operand; the state is empty
    under current scaling, whose scale needs the amax before the cast."""
    if isinstance(spec.recipe, CurrentScaling):
        scale = compute_scale(amax(x, spec.reduce_axes), jnp.float32(1.0), fp8_max(dtype))
        q, q_t, _ = cast_transpose(x, scale, dtype)
        return q, q_t, scale, {}
    return _delayed_cast(role, meta, spec, dtype, lambda scale: cast_transpose(x, scale, dtype))


def _swap(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_matmul(x, w, meta, spec):
    """``x [*b, M, K] @ w [*b, K, N]`` in FP8. The cotangent of ``meta`` is the next meta."""
    return _fp8_matmul_fwd(x, w, meta, spec)[0]


def _fp8_matmul_fwd(x, w, meta, spec):
    return _quantized_input_matmul_fwd(*_quantize_input(x, None, meta, spec), w, meta, spec)


def _quantize_input(x, prologue, meta, spec):
    """``(q, q transposed, scale, next state)`` of a GEMM's input: ``x`` cast, or ``prologue(x)``
    written in FP8 by the prologue's kernel (under `DelayedScaling`), so it never goes through
    memory in bf16."""
    if prologue is None:
        return _quantize_operand("input", x, meta, spec, spec.fwd_dtype)

    def cast(scale):
        q, observed = prologue.fp8(x, scale, spec.fwd_dtype)
        return q, _swap(q), observed

    return _delayed_cast("input", meta, spec, spec.fwd_dtype, cast)


def _quantized_input_matmul_fwd(x_q, x_q_t, x_scale, x_state, w, meta, spec):
    """The forward GEMM of an input already in FP8 (``x_q`` and its transpose ``x_q_t``, quantized
    with ``x_scale``) and its residuals."""
    w_q, w_q_t, w_scale, w_state = _quantize_operand("kernel", w, meta, spec, spec.fwd_dtype)
    x_inv, w_inv = 1.0 / x_scale, 1.0 / w_scale
    out = fp8_gemm(x_q, w_q_t, x_inv, w_inv, out_dtype=spec.out_dtype, implementation=spec.implementation)
    grad_meta = None if meta is None else {k: v for k, v in meta.items() if k.startswith("output_grad_")}
    # x^T is kept already transposed, so wgrad needs no transpose of a saved tensor; both residuals
    # are FP8, half the bytes of keeping x and w in bf16.
    return out, (x_q_t, w_q, x_inv, w_inv, grad_meta, {**x_state, **w_state})


def _fp8_matmul_bwd(spec, residuals, g):
    g_q, g_q_t, g_scale, g_state = _quantize_operand("output_grad", g, residuals[4], spec, spec.bwd_dtype)
    return _quantized_grad_matmul_bwd(spec, residuals, g_q, g_q_t, g_scale, g_state)


def _quantized_grad_matmul_bwd(spec, residuals, g_q, g_q_t, g_scale, g_state):
    """dgrad, wgrad and the next meta from the output gradient already in FP8 (``g_q [M, N]``, its
    transpose ``g_q_t``, quantized with ``g_scale``; ``g_state`` its role's next state)."""
    x_q_t, w_q, x_inv, w_inv, grad_meta, fwd_state = residuals
    g_inv = 1.0 / g_scale
    # dgrad: g [M, N] . w [K, N] over N;  wgrad: x^T [K, M] . g^T [N, M] over M.
    dx = fp8_gemm(g_q, w_q, g_inv, w_inv, out_dtype=spec.x_dtype, implementation=spec.implementation)
    dw = fp8_gemm(x_q_t, g_q_t, x_inv, g_inv, out_dtype=spec.w_dtype, implementation=spec.implementation)
    next_meta = None if grad_meta is None else {**fwd_state, **g_state}
    return dx, dw, next_meta


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_prologue_matmul(x, prologue, w, meta, spec):
    """``prologue(x) [M, K] @ w [K, N]`` in FP8 under `DelayedScaling`: the prologue's kernel writes
    the FP8 input of the GEMM and its amax in one pass (``prologue.fp8``), so its output never goes
    through memory in bf16."""
    return _fp8_prologue_matmul_fwd(x, prologue, w, meta, spec)[0]


def _fp8_prologue_matmul_fwd(x, prologue, w, meta, spec):
    out, residuals = _quantized_input_matmul_fwd(*_quantize_input(x, prologue, meta, spec), w, meta, spec)
    # The prologue's backward needs only its inputs (the kernels recompute what they need).
    return out, (x, prologue, residuals)


def _fp8_prologue_matmul_bwd(spec, residuals, g):
    x, prologue, gemm_residuals = residuals
    d_operand, dw, next_meta = _fp8_matmul_bwd(spec, gemm_residuals, g)
    return (*prologue_backward(x, prologue, d_operand), dw, next_meta)


_fp8_prologue_matmul.defvjp(_fp8_prologue_matmul_fwd, _fp8_prologue_matmul_bwd)


def _check_meta(meta: Any, recipe: Recipe) -> None:
    if isinstance(recipe, (CurrentScaling, BlockScaling)):
        if meta is not None:
            raise ValueError(f"fp8_dot_general(meta=...): {type(recipe).__name__} keeps no state; pass meta=None")
        return
    expected = set(META_KEYS)
    if not isinstance(meta, Mapping) or set(meta) != expected:
        got = sorted(meta) if isinstance(meta, Mapping) else type(meta).__name__
        raise ValueError(f"fp8_dot_general(meta=...): DelayedScaling needs the keys {sorted(expected)} "
                         f"(see init_meta); got {got}")
    for role in ROLES:
        shape = jnp.shape(meta[f"{role}_amax_history"])
        if shape != (recipe.amax_history_len,):
            raise ValueError(f"fp8_dot_general(meta=...): {role}_amax_history has shape {shape}; the recipe's "
                             f"amax_history_len={recipe.amax_history_len} needs ({recipe.amax_history_len},)")


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                    meta: Mapping[str, jax.Array] | None = None, *, recipe: Recipe | None = None,
                    mesh_axes: Sequence[str] = (), preferred_element_type: Any = None,
                    implementation: str | None = None, lhs_prologue: Prologue | None = None) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with both operands and the output gradient in FP8.

    The operands are arranged as ``x [*batch, M, K]`` and ``w [*batch, K, N]`` (free axes flattened
    into M and N, contracting axes into K); the forward GEMM, dgrad and wgrad each contract over the
    last axis of both of their FP8 operands.

    Args:
      lhs, rhs, dimension_numbers, preferred_element_type: as ``lax.dot_general`` (floating inputs).
      meta: the GEMM's state (`init_meta`) under `DelayedScaling`; ``None`` under `CurrentScaling`
        and `BlockScaling`.
        Differentiating with respect to it gives the next state, not a gradient.
      recipe: `DelayedScaling` (default), `CurrentScaling` or `BlockScaling` (1x128 tiles and
        128x128 weight blocks, `mtjax.fp8.block_scaling`).
      mesh_axes: mesh axes amaxes are max-reduced over where bound (see `fp8_autocast`).
      implementation: the ``fp8_gemm`` implementation (default: chosen by `mtjax.backend`).
      lhs_prologue: an op applied to ``lhs`` first, whose output is the GEMM's left operand:
        `mtjax.ops.Norm` (normalize the last axis) or `mtjax.ops.Activation` (bias + activation;
        ``lhs [..., 2, hidden]`` when gated). ``dimension_numbers`` then refer to its output, which
        must be contracted over its last axis alone, with no batch axes. Under `DelayedScaling` the
        prologue's kernel writes the FP8 input of the GEMM and its amax directly
        (`mtjax.ops.norm_fp8`, `mtjax.ops.activation_fp8`), so its bf16 output never goes
        through memory; its backward is the prologue's own.
    Returns:
      the ``lax.dot_general`` result in ``preferred_element_type`` or the operands' result type.
    """
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, RECIPE_TYPES):
        raise TypeError(f"fp8_dot_general(recipe={recipe!r}): expected a DelayedScaling, CurrentScaling or "
                        "BlockScaling")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"fp8_dot_general: {name} has dtype {x.dtype}; expected a floating dtype")
    _check_meta(meta, recipe)
    operand = _check_lhs_prologue("fp8_dot_general", lhs, dimension_numbers, lhs_prologue)
    # lax's own shape rule validates dimension_numbers and gives the result's shape and dtype.
    result = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                          preferred_element_type=preferred_element_type), operand, rhs)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_contract, rhs_contract = tuple(lhs_contract), tuple(rhs_contract)
    lhs_batch, rhs_batch = tuple(lhs_batch), tuple(rhs_batch)
    lhs_free = tuple(d for d in range(operand.ndim) if d not in lhs_contract + lhs_batch)
    rhs_free = tuple(d for d in range(rhs.ndim) if d not in rhs_contract + rhs_batch)

    def size(x, dims):
        return math.prod(x.shape[d] for d in dims)

    # Inside shard_map: the operands are cast to vary over the same axes (the transpose of that cast
    # sums the gradient of a replicated operand, as autodiff of a plain dot would), and amaxes are
    # max-reduced over every axis the data varies over but the meta does not, so replicated meta
    # stays replicated (plus the bound ``mesh_axes`` the recipe asks to reduce over).
    data_axes = varying_axes(lhs) | varying_axes(rhs)
    lhs = lax.pcast(lhs, tuple(sorted(data_axes - varying_axes(lhs))), to="varying")
    rhs = lax.pcast(rhs, tuple(sorted(data_axes - varying_axes(rhs))), to="varying")
    meta_axes = frozenset().union(*(varying_axes(v) for v in jax.tree.leaves(meta)))
    reduce_axes = set(data_axes - meta_axes) if meta is not None else set()
    if not isinstance(recipe, DelayedScaling) or recipe.reduce_amax:
        reduce_axes |= set(_bound_axes(mesh_axes))

    batch = (size(operand, lhs_batch),) if lhs_batch else ()
    m, k, n = size(operand, lhs_free), size(operand, lhs_contract), size(rhs, rhs_free)
    if lhs_prologue is None:
        x = jnp.transpose(lhs, lhs_batch + lhs_free + lhs_contract).reshape(batch + (m, k))
    else:  # free axes lead, the prologue's own trailing axes ([k] or [2, k]) stay
        x = lhs.reshape((m,) + lhs.shape[len(lhs_free):])
    w = jnp.transpose(rhs, rhs_batch + rhs_contract + rhs_free).reshape(batch + (k, n))
    spec = _GemmSpec.build(recipe, reduce_axes, operand.dtype, rhs.dtype, result.dtype, implementation)
    if isinstance(recipe, BlockScaling):  # the prologue's kernel writes the FP8 tiles of its output
        out = block_fp8_matmul(x, w, spec, lhs_prologue)
    elif lhs_prologue is None:
        out = _fp8_matmul(x, w, meta, spec)
    elif isinstance(recipe, CurrentScaling):  # its scale needs the prologue's amax first: two passes anyway
        out = _fp8_matmul(lhs_prologue(x), w, meta, spec)
    else:
        out = _fp8_prologue_matmul(x, lhs_prologue, w, meta, spec)
    return out.reshape(result.shape)


def _check_lhs_prologue(fn: str, lhs: jax.Array, dimension_numbers: Any,
                        lhs_prologue: Prologue | None) -> jax.ShapeDtypeStruct | jax.Array:
    """The GEMM's left operand (``lhs``, or the shape of ``lhs_prologue(lhs)``), checked: a prologue's
    output must be contracted over its last axis alone."""
    if lhs_prologue is None:
        return lhs
    if not isinstance(lhs_prologue, (Norm, Activation)):
        raise TypeError(f"{fn}(lhs_prologue={lhs_prologue!r}): expected a mtjax.ops.Norm, mtjax.ops.Activation or None")
    operand = jax.eval_shape(lhs_prologue, lhs)
    (lhs_contract, _), (lhs_batch, _) = dimension_numbers
    if tuple(lhs_contract) != (operand.ndim - 1,) or tuple(lhs_batch):
        raise ValueError(f"{fn}(lhs_prologue=...): the prologue's output must be contracted over its last axis "
                         f"alone, with no batch axes; got dimension_numbers={dimension_numbers} for an output of "
                         f"rank {operand.ndim}")
    return operand


def dot_with_prologue(lhs: jax.Array, prologue: Prologue | None, dot: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``dot(prologue(lhs))`` for a ``dot`` contracting the last axis of its operand (not in FP8): an
    RMSNorm of few rows folds into the GEMM (`mtjax.ops.Norm.folded_dot`)."""
    if prologue is None:
        return dot(lhs)
    if isinstance(prologue, Norm) and prologue.folds_into_gemm(lhs):
        return prologue.folded_dot(lhs, dot)
    return dot(prologue(lhs))


# --------------------------------------------------------------------------------------------------
# The linen module every mtjax GEMM runs in
# --------------------------------------------------------------------------------------------------


class DotGeneral(nn.Module):
    """``lax.dot_general`` as a linen module: a plain dot, or FP8 inside `fp8_autocast`.

    Called like ``lax.dot_general(lhs, rhs, dimension_numbers, precision=None,
    preferred_element_type=None)``, plus ``lhs_prologue``: a `mtjax.ops.Norm` or `mtjax.ops.Activation`
    applied to ``lhs`` first (fused with the FP8 quantization of its output under delayed scaling,
    see `fp8_dot_general`).
    Under `DelayedScaling` its state is six variables in the ``FP8_COLLECTION`` collection
    (``{input,kernel,output_grad}_{amax_history,scale}``), created when the model is initialised
    inside `fp8_autocast`; under ``nn.scan`` give that collection ``variable_axes`` 0 and each
    layer gets its own. ``precision`` applies to the plain dot only.

    Attributes: none: the recipe comes from `fp8_autocast`, so one model definition serves both.
    """

    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, lhs_prologue: Prologue | None = None) -> jax.Array:
        state = current_autocast()
        if state is None:
            _check_lhs_prologue("DotGeneral", lhs, dimension_numbers, lhs_prologue)
            return dot_with_prologue(lhs, lhs_prologue, lambda x: lax.dot_general(
                x, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type))
        return fp8_dot_general(lhs, rhs, dimension_numbers, self.fp8_meta(), recipe=state.recipe,
                               mesh_axes=state.mesh_axes, preferred_element_type=preferred_element_type,
                               lhs_prologue=lhs_prologue)

    @nn.compact
    def fp8_meta(self) -> dict[str, jax.Array] | None:
        """This GEMM's delayed-scaling state inside `fp8_autocast` with `DelayedScaling` (``None``
        otherwise), for `fp8_dot_general`, or for an op running several GEMMs at once (`fp8_mlp`)."""
        state = current_autocast()
        if state is None or not isinstance(state.recipe, DelayedScaling):
            return None
        recipe = state.recipe
        missing = not self.has_variable(FP8_COLLECTION, META_KEYS[0])
        if missing and not self.is_mutable_collection(FP8_COLLECTION):
            raise ValueError(
                f"DotGeneral {self.path}: no {FP8_COLLECTION!r} variables; initialise the model inside "
                f"fp8_autocast (or pass mutable=[{FP8_COLLECTION!r}]) to create them"
            )
        initial = init_meta(recipe.amax_history_len) if missing else {}
        return {name: self.variable(FP8_COLLECTION, name, initial.__getitem__, name).value for name in META_KEYS}
