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

FP8_COLLECTION = "fp8_meta"

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


def _varying_axes(x: Any) -> frozenset[str]:
    """The shard_map axes ``x`` varies over (empty outside shard_map or without its type checks)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.11; earlier versions called it ``vma``
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _reduce_max(value: jax.Array, axes: Sequence[str]) -> jax.Array:
    return lax.pmax(value, tuple(axes)) if axes else value


def amax(x: jax.Array, mesh_axes: Sequence[str] = ()) -> jax.Array:
    """``max |x|`` as float32, max-reduced over those of ``mesh_axes`` that are bound."""
    return _reduce_max(jnp.max(jnp.abs(x)).astype(jnp.float32), _bound_axes(mesh_axes))


def compute_scale(amax: jax.Array, scale: jax.Array, fp8_max: float, margin: int = 0) -> jax.Array:
    """``(fp8_max / amax) / 2**margin``, or ``scale`` unchanged when amax is 0, NaN or Inf (or the
    result would not be finite), so one bad step never leaves a bad scale behind."""
    amax = jnp.asarray(amax, jnp.float32)
    candidate = (jnp.float32(fp8_max) / amax) / jnp.float32(2.0**margin)
    usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(candidate)
    return jnp.where(usable, candidate, jnp.asarray(scale, jnp.float32))


def roll_amax_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """``[amax, history[0], ..., history[-2]]``; a NaN/Inf amax enters as 0 (it carries no scale)."""
    amax = jnp.asarray(amax, jnp.float32)
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
    return jnp.concatenate([amax[None], history[:-1]])


def history_amax(history: jax.Array, amax_compute_algo: str) -> jax.Array:
    """The amax a scale is computed from: the history's ``"max"`` or its ``"most_recent"`` entry."""
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"history_amax(amax_compute_algo={amax_compute_algo!r}): accepted: {AMAX_COMPUTE_ALGOS}")
    return jnp.max(history) if amax_compute_algo == "max" else history[0]


def init_meta(amax_history_len: int = 1024) -> dict[str, jax.Array]:
    """The delayed-scaling state of one GEMM before its first step: zero histories, unit scales."""
    _check_int("init_meta", "amax_history_len", amax_history_len, 1)
    meta = {}
    for role in ROLES:
        meta[f"{role}_amax_history"] = jnp.zeros((amax_history_len,), jnp.float32)
        meta[f"{role}_scale"] = jnp.ones((), jnp.float32)
    return meta
