"""FP8 grouped GEMMs (a mixture of experts' expert layers) under each recipe, with delayed-scaling state.

`fp8_grouped_gemm` is `mtjax.ops.grouped_gemm` in FP8 under a recipe: `DelayedScaling` quantizes with
scales derived from amax histories kept as Flax variables (`GroupedGemmMeta`), `CurrentScaling` with
scales from this step's amaxes (`mtjax.ops.grouped_gemm_fp8`), `BlockScaling` in 1x128 tiles and
128x128 blocks per group (`mtjax.ops.grouped_gemm_block_fp8`).

The delayed-scaling state of one grouped GEMM is `init_grouped_meta`'s: the ``input`` and
``output_grad`` roles as in `mtjax.fp8.init_meta`, the ``kernel`` role one history and one scale per
group (expert), ``kernel_amax_history [G, L]`` and ``kernel_scale [G]``, since experts' weights
differ in range. As for `fp8_dot_general`, differentiating with respect to the state gives the next
state (each history rolled with the amax this step observed, each scale the one it used).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax import ops
from mtjax.fp8.context import current_autocast
from mtjax.fp8.dot_general import _delayed_scale
from mtjax.fp8.recipes import RECIPE_TYPES, BlockScaling, CurrentScaling, DelayedScaling, Recipe, _check_int
from mtjax.fp8.scaling import (
    FP8_COLLECTION,
    META_KEYS,
    ROLES,
    _bound_axes,
    init_meta,
    roll_amax_history,
)
from mtjax.kernels.common import vary_together, varying_axes
from mtjax.kernels.grouped_gemm import BlockSizes


def init_grouped_meta(num_groups: int, amax_history_len: int = 1024) -> dict[str, jax.Array]:
    """The delayed-scaling state of one grouped GEMM of ``num_groups`` groups before its first step:
    zero histories, unit scales; the ``kernel`` role has a leading ``[num_groups]`` axis."""
    _check_int("init_grouped_meta", "num_groups", num_groups, 1)
    meta = init_meta(amax_history_len)
    meta["kernel_amax_history"] = jnp.zeros((num_groups, amax_history_len), jnp.float32)
    meta["kernel_scale"] = jnp.ones((num_groups,), jnp.float32)
    return meta


@dataclasses.dataclass(frozen=True)
class _ScaleSpec:
    recipe: DelayedScaling
    dtypes: tuple[Any, Any, Any]  # per role of ROLES
    mesh_axes: tuple[str, ...]  # bound axes the recipe asks amaxes to be max-reduced over


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _meta_scales(meta, spec):
    """The scales of the three roles from the state; the cotangent of the scales (the amaxes the
    grouped GEMM observed) becomes the next state."""
    return _meta_scales_fwd(meta, spec)[0]


def _meta_scales_fwd(meta, spec):
    scales = tuple(_delayed_scale(role, meta, spec.recipe, dtype) for role, dtype in zip(ROLES, spec.dtypes))
    return scales, (meta, scales)


def _meta_scales_bwd(spec, residuals, amaxes):
    meta, scales = residuals
    next_meta = {}
    for role, scale, observed in zip(ROLES, scales, amaxes):
        history = meta[f"{role}_amax_history"]
        # Never across experts: the kernel role's amaxes are per expert, whichever device holds it.
        axes = () if role == "kernel" else tuple(a for a in spec.mesh_axes if a not in varying_axes(history))
        next_meta[f"{role}_amax_history"] = roll_amax_history(history, lax.pmax(observed, axes) if axes else observed)
        next_meta[f"{role}_scale"] = scale
    return (next_meta,)


_meta_scales.defvjp(_meta_scales_fwd, _meta_scales_bwd)


def _check_meta(meta: Any, recipe: Recipe, num_groups: int) -> None:
    fn = "fp8_grouped_gemm"
    if not isinstance(recipe, DelayedScaling):
        if meta is not None:
            raise ValueError(f"{fn}(meta=...): {type(recipe).__name__} keeps no state; pass meta=None")
        return
    if not isinstance(meta, Mapping) or set(meta) != set(META_KEYS):
        got = sorted(meta) if isinstance(meta, Mapping) else type(meta).__name__
        raise ValueError(f"{fn}(meta=...): DelayedScaling needs the keys {sorted(META_KEYS)} (see init_grouped_meta); "
                         f"got {got}")
    length = recipe.amax_history_len
    for role in ROLES:
        lead = (num_groups,) if role == "kernel" else ()
        for field, want in (("amax_history", lead + (length,)), ("scale", lead)):
            shape = tuple(jnp.shape(meta[f"{role}_{field}"]))
            if shape != want:
                raise ValueError(f"{fn}(meta=...): {role}_{field} has shape {shape}; with {num_groups} groups and "
                                 f"amax_history_len={length} it needs {want}")


def fp8_grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                     meta: Mapping[str, jax.Array] | None = None, *, recipe: Recipe | None = None,
                     mesh_axes: Sequence[str] = (), block_sizes: BlockSizes | None = None,
                     implementation: str | None = None) -> jax.Array:
    """`mtjax.ops.grouped_gemm` (``lhs [M, K]`` rows sorted by group, ``rhs [G, K, N]``) in FP8 under ``recipe``.

    Args:
      lhs, rhs, group_sizes: as `mtjax.ops.grouped_gemm`.
      meta: the state (`init_grouped_meta`) under `DelayedScaling`; ``None`` under `CurrentScaling`
        and `BlockScaling`. Differentiating with respect to it gives the next state, not a gradient.
      recipe: `DelayedScaling` (default), `CurrentScaling` or `BlockScaling`; its format gives the
        FP8 dtypes of the operands and of the output gradient.
      mesh_axes: mesh axes the input and gradient amaxes are max-reduced over where bound (see
        `fp8_autocast`); the kernel's are per expert and never reduced over them. Inside a
        ``shard_map`` (with its default ``check_vma=True``, which the state's reductions need) every
        axis the data varies over and the state does not is reduced anyway.
      block_sizes, implementation: as `mtjax.ops.grouped_gemm_fp8` (not `BlockScaling`'s).
    Returns:
      ``[M, N]`` in ``lhs.dtype``.
    """
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, RECIPE_TYPES):
        raise TypeError(f"fp8_grouped_gemm(recipe={recipe!r}): expected a DelayedScaling, CurrentScaling or "
                        "BlockScaling")
    if jnp.ndim(rhs) != 3:
        raise ValueError(f"fp8_grouped_gemm: rhs has shape {jnp.shape(rhs)}; expected [G, K, N]")
    _check_meta(meta, recipe, jnp.shape(rhs)[0])
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    # Inside shard_map the custom_vjps return cotangents that vary as their inputs do: both operands
    # vary over every axis either does (the cast's transpose sums a replicated kernel's gradient).
    lhs, rhs = vary_together(lhs, rhs)
    forward, gradient = recipe.fp8_format.dtypes()
    if isinstance(recipe, BlockScaling):
        return ops.grouped_gemm_block_fp8(lhs, rhs, group_sizes, forward_dtype=forward, gradient_dtype=gradient,
                                          power_of_two=recipe.power_of_two_scales, amax_epsilon=recipe.amax_epsilon,
                                          implementation=implementation)
    scales = None
    if not isinstance(recipe, CurrentScaling):
        reduce = _bound_axes(mesh_axes) if recipe.reduce_amax else ()
        spec = _ScaleSpec(recipe, (forward, forward, gradient), tuple(sorted(reduce)))
        scales = ops.GroupedFP8Scales(*_meta_scales(dict(meta), spec))
    return ops.grouped_gemm_fp8(lhs, rhs, group_sizes, forward_dtype=forward, gradient_dtype=gradient, scales=scales,
                                block_sizes=block_sizes, implementation=implementation)


class GroupedGemmMeta(nn.Module):
    """The delayed-scaling state of one grouped GEMM as Flax variables, for `fp8_grouped_gemm`.

    Called with no arguments inside `fp8_autocast` with `DelayedScaling`, it returns the state
    (six variables in ``FP8_COLLECTION``, `init_grouped_meta`'s, created when the model is
    initialised inside `fp8_autocast`); otherwise ``None``. A module calls it outside any jax
    transformation and hands the state to `fp8_grouped_gemm` (inside a ``shard_map`` as well); under
    ``nn.scan`` give ``FP8_COLLECTION`` ``variable_axes`` 0 and each layer gets its own.

    Attributes:
      num_groups: groups (experts) of the GEMM's ``rhs``.

    Example::

        meta = GroupedGemmMeta(num_experts, name="wi_fp8")()
        h = fp8_grouped_gemm(x, wi, group_sizes, meta, recipe=current_autocast().recipe)
    """

    num_groups: int

    @nn.compact
    def __call__(self) -> dict[str, jax.Array] | None:
        state = current_autocast()
        if state is None or not isinstance(state.recipe, DelayedScaling):
            return None
        missing = not self.has_variable(FP8_COLLECTION, META_KEYS[0])
        if missing and not self.is_mutable_collection(FP8_COLLECTION):
            raise ValueError(
                f"GroupedGemmMeta {self.path}: no {FP8_COLLECTION!r} variables; initialise the model inside "
                f"fp8_autocast (or pass mutable=[{FP8_COLLECTION!r}]) to create them"
            )
        initial = init_grouped_meta(self.num_groups, state.recipe.amax_history_len) if missing else {}
        return {name: self.variable(FP8_COLLECTION, name, initial.__getitem__, name).value for name in META_KEYS}
