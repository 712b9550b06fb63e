"""Delayed-scaling state and the scale math: amaxes, scales, amax histories.

Scale convention (as TransformerEngine): ``q = saturate_cast(x * scale)``, ``x ≈ q * scale_inv``,
``scale = (fp8_max / amax) / 2**margin``.

The state ("meta") of one GEMM: for each tensor role (``input``, ``kernel``, ``output_grad``) an
``amax_history`` (float32 ``[amax_history_len]``, most recent first) and a ``scale`` (float32
``[]``, the scale the last step quantized with), kept as Flax variables in ``FP8_COLLECTION``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mtjax.fp8.recipes import AMAX_COMPUTE_ALGOS, _check_int

FP8_COLLECTION = "fp8_metas"

# The tensors of one GEMM that get their own scale, in the order the meta lists them.
ROLES = ("input", "kernel", "output_grad")
# The delayed-scaling state of one GEMM: an amax history and a scale per role.
META_KEYS = tuple(f"{role}_{field}" for role in ROLES for field in ("amax_history", "scale"))


def _bound_axes(mesh_axes: Sequence[str]) -> tuple[str, ...]:
    """The axes among ``mesh_axes`` that collectives can name here (bound by shard_map or pmap)."""
    bound = []
    for axis in mesh_axes:
        try:
            lax.axis_size(axis)
        except NameError:
            continue
        bound.append(axis)
    return tuple(bound)


def _reduce_max(value: jax.Array, axes: Sequence[str]) -> jax.Array:
    return lax.pmax(value, tuple(axes)) if axes else value


def amax(x: jax.Array, mesh_axes: Sequence[str] = ()) -> jax.Array:
    """``max |x|`` as float32, max-reduced over those of ``mesh_axes`` that are bound."""
    return _reduce_max(jnp.max(jnp.abs(x)).astype(jnp.float32), _bound_axes(mesh_axes))


# Scales stay within float32's normal range: a scale and its inverse are both finite and non-zero.
MIN_SCALE = float(jnp.finfo(jnp.float32).tiny)  # 2**-126
MAX_SCALE = 1.0 / MIN_SCALE


def compute_scale(amax: jax.Array, scale: jax.Array, fp8_max: float, margin: int = 0) -> jax.Array:
    """``(fp8_max / amax) / 2**margin``, or ``scale`` unchanged when amax is 0, NaN or Inf (or the
    result would not be a positive finite number), so one bad step never leaves a bad scale behind.

    The result is clamped to ``[MIN_SCALE, MAX_SCALE]`` (a previous ``scale`` that is not a positive
    finite number counts as 1): a scale is never 0 or Inf, whatever the amax and ``margin``.
    """
    _check_int("compute_scale", "margin", margin, 0)
    amax = jnp.asarray(amax, jnp.float32)
    # 2**127 is already Inf in float32; beyond it the result is clamped to MIN_SCALE either way.
    candidate = (jnp.float32(fp8_max) / amax) / jnp.float32(2.0 ** min(margin, 127))
    usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(candidate) & (candidate > 0)
    previous = jnp.asarray(scale, jnp.float32)
    previous = jnp.where(jnp.isfinite(previous) & (previous > 0), previous, 1.0)
    return jnp.clip(jnp.where(usable, candidate, previous), MIN_SCALE, MAX_SCALE)


# An amax this many times larger than every earlier one in its history is reported (`amax_jump`): under
# delayed scaling with amax_compute_algo="max" it shrinks that tensor's scale for amax_history_len steps.
AMAX_JUMP_FACTOR = 1000.0


def amax_jump(fp8_meta: Any) -> jax.Array:
    """The largest ratio, over every amax history in ``fp8_meta`` (any nesting, stacked layers too),
    of the newest amax to the largest earlier one (0 where a history has no earlier amax).

    A cheap scalar to compute in the train step and read on the host with the loss (`mtjax.train`
    warns when it reaches `AMAX_JUMP_FACTOR`): one outlier amax under ``amax_compute_algo="max"``
    divides the scale of its tensor, hence the resolution of every later value, for the whole
    history length.
    """
    ratios = [jnp.float32(0.0)]
    for path, history in jax.tree_util.tree_leaves_with_path(fp8_meta):
        name = str(getattr(path[-1], "key", path[-1])) if path else ""
        if not name.endswith("amax_history") or history.shape[-1] < 2:
            continue
        newest = history[..., 0].astype(jnp.float32)
        earlier = jnp.max(history[..., 1:], axis=-1).astype(jnp.float32)
        ratios.append(jnp.max(jnp.where(earlier > 0, newest / earlier, 0.0)))
    return jnp.max(jnp.stack(ratios))


def roll_amax_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """``[amax, history[0], ..., history[-2]]`` along the last axis (``history [..., L]``, ``amax
    [...]``: one history per group too); a NaN/Inf amax enters as 0 (it carries no scale)."""
    amax = jnp.asarray(amax, jnp.float32)
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
    return jnp.concatenate([amax[..., None], history[..., :-1]], axis=-1)


def history_amax(history: jax.Array, amax_compute_algo: str) -> jax.Array:
    """The amax a scale is computed from: the ``"max"`` or the ``"most_recent"`` entry of ``history
    [..., L]`` (along the last axis)."""
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"history_amax(amax_compute_algo={amax_compute_algo!r}): accepted: {AMAX_COMPUTE_ALGOS}")
    return jnp.max(history, axis=-1) if amax_compute_algo == "max" else history[..., 0]


def init_meta(amax_history_len: int = 1024) -> dict[str, jax.Array]:
    """The delayed-scaling state of one GEMM before its first step: zero histories, unit scales."""
    _check_int("init_meta", "amax_history_len", amax_history_len, 1)
    meta = {}
    for role in ROLES:
        meta[f"{role}_amax_history"] = jnp.zeros((amax_history_len,), jnp.float32)
        meta[f"{role}_scale"] = jnp.ones((), jnp.float32)
    return meta
