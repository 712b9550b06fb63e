"""LayerNorm and RMSNorm over the last axis, with float32 statistics, and their fused variants.

``zero_centered_gamma=True`` stores the scale as ``gamma - 1`` (it is initialised to zeros and
applied as ``1 + gamma``), which keeps weight decay from pulling the scale towards zero.

- `layernorm`, `rmsnorm`: the norms (forward and backward).
- `norm_fp8`: the norm with its output quantized for an FP8 GEMM (``q = saturate_cast(y * scale)``,
  plus ``amax = max |y|`` before scaling), forward only: the FP8 GEMM consuming ``q`` owns the
  backward pass, which is `layernorm`/`rmsnorm`'s.
- `norm_tile_fp8`: the norm with its output cast in 1x128 row tiles for a block-scaled FP8 GEMM
  (`mtjax.fp8.BlockScaling`), each tile with its own scale, and the transposed cast too if asked;
  forward only, like `norm_fp8`.
- `residual_norm`: ``new_residual = dropout(x) + residual`` and ``norm(new_residual)`` together, returned
  as ``(normalized, new_residual)``: the output first, the residual stream second, as the modules do.
- `Norm`: a norm with its parameters bound, as one value (a pytree) that a fused consumer such as
  `mtjax.fp8.fp8_dot_general` can apply, quantize (`Norm.fp8`) and differentiate.

Each has a ``"pallas_triton"`` kernel (kernels/layer_norm.py, kernels/residual_norm.py) that the
automatic selection picks only for the shapes where the norm benchmark found it at least as fast as XLA,
and its native Triton port ``"triton"`` (kernels/triton/layer_norm.py), picked by the same rules where
the jax in use has no Pallas Triton backend.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from mtjax import backend
from mtjax.dtypes import fp8_max, has_float32_range
from mtjax.kernels import block_quantize as block_kernels
from mtjax.kernels import layer_norm as norm_kernels
from mtjax.kernels import residual_norm as residual_norm_kernels
from mtjax.kernels.common import dropout_keep, saturate_cast, too_small, unsupported_array, unsupported_fp8_dtype
from mtjax.ops.block_quantization import tile_quantize_reference
from mtjax.ops.checks import check_choice, check_float, check_fp8_output, check_rank, check_shape, check_tile_options

LAYERNORM_TYPES = ("layernorm", "rmsnorm")
# A GEMM of at most this many input rows (a decoding step) applies an RMSNorm in front of it by its
# row scale after the product, `Norm.folded_dot` (docs/inference-kernels.md).
FOLD_MAX_ROWS = 8
# Whether `Norm.folds_into_gemm` lets a GEMM fold the norm at all (off: the norm runs in front of the
# GEMM at any row count); read at trace time. Off: on the GPU it slowed the bf16 decode step and sped
# up the FP8-weights one (docs/inference-kernels.md).
FOLD_INTO_GEMM = False


def _scale(gamma: jax.Array, zero_centered_gamma: bool) -> jax.Array:
    gamma = gamma.astype(jnp.float32)
    return gamma + 1.0 if zero_centered_gamma else gamma


@backend.register("layernorm", backend.REFERENCE)
def layernorm_reference(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, *, epsilon: float,
                        zero_centered_gamma: bool) -> jax.Array:
    """The ``"xla"`` implementation of `layernorm` (same arguments and result).

    Under `jax.checkpoint`, so the backward keeps only the inputs (as the kernel does) and recomputes
    the float32 intermediates, which would otherwise be saved at twice the size of a bf16 ``x``.
    """

    def normalize(x, gamma, beta):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + epsilon) * _scale(gamma, zero_centered_gamma)
        if beta is not None:
            y = y + beta.astype(jnp.float32)
        return y.astype(x.dtype)

    return jax.checkpoint(normalize)(x, gamma, beta)


@backend.register("rmsnorm", backend.REFERENCE)
def rmsnorm_reference(x: jax.Array, gamma: jax.Array, *, epsilon: float, zero_centered_gamma: bool) -> jax.Array:
    """The ``"xla"`` implementation of `rmsnorm`; keeps only its inputs for the backward, as `layernorm_reference`."""

    def normalize(x, gamma):
        xf = x.astype(jnp.float32)
        ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        return (xf * jax.lax.rsqrt(ms + epsilon) * _scale(gamma, zero_centered_gamma)).astype(x.dtype)

    return jax.checkpoint(normalize)(x, gamma)


def _check(op: str, x, gamma, beta, epsilon) -> None:
    check_float(op, "x", x)
    check_float(op, "gamma", gamma)
    if jnp.ndim(x) < 1:
        raise ValueError(f"{op}: x must have at least one axis (the normalized one); got shape {jnp.shape(x)}")
    hidden = jnp.shape(x)[-1]
    check_shape(op, "gamma", gamma, (hidden,))
    if beta is not None:
        check_float(op, "beta", beta)
        check_shape(op, "beta", beta, (hidden,))
    if not epsilon > 0:
        raise ValueError(f"{op}: epsilon={epsilon!r}; expected a positive float")


def _check_typed(op: str, layernorm_type: str, x, gamma, beta, epsilon) -> None:
    """`_check` for the ops taking a ``layernorm_type`` (RMSNorm has no ``beta``)."""
    check_choice(op, "layernorm_type", layernorm_type, LAYERNORM_TYPES)
    if layernorm_type == "rmsnorm" and beta is not None:
        raise ValueError(f"{op}: beta must be None for layernorm_type='rmsnorm'")
    _check(op, x, gamma, beta, epsilon)


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    *,
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """``(x - mean) / sqrt(var + epsilon) * gamma + beta`` over the last axis.

    Args:
      x: ``[..., hidden]``, any float dtype; statistics are computed in float32.
      gamma: ``[hidden]`` scale (``1 + gamma`` if ``zero_centered_gamma``).
      beta: ``[hidden]`` shift, or ``None``.
      implementation: ``None`` (automatic) or a name from ``backend.implementations("layernorm")``.
    Returns:
      ``[..., hidden]`` in ``x.dtype``.
    """
    _check("layernorm", x, gamma, beta, epsilon)
    return backend.dispatch(
        "layernorm", x, gamma, beta, implementation=implementation,
        epsilon=float(epsilon), zero_centered_gamma=bool(zero_centered_gamma),
    )


def rmsnorm(
    x: jax.Array,
    gamma: jax.Array,
    *,
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """``x / sqrt(mean(x**2) + epsilon) * gamma`` over the last axis; shapes as `layernorm`."""
    _check("rmsnorm", x, gamma, None, epsilon)
    return backend.dispatch(
        "rmsnorm", x, gamma, implementation=implementation,
        epsilon=float(epsilon), zero_centered_gamma=bool(zero_centered_gamma),
    )


def _norm_reference(x, gamma, beta, layernorm_type: str, epsilon: float, zero_centered_gamma: bool):
    """The reference of ``layernorm_type`` (``beta`` is None for RMSNorm)."""
    if layernorm_type == "rmsnorm":
        return rmsnorm_reference(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)
    return layernorm_reference(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)


@backend.register("norm_fp8", backend.REFERENCE)
def norm_fp8_reference(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, scale: jax.Array, *,
                            layernorm_type: str, epsilon: float, zero_centered_gamma: bool,
                            out_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """The ``"xla"`` implementation of `norm_fp8` (``scale`` a float32 scalar of shape ``()``)."""
    # normalize in float32 and quantize that, not a rounded copy
    y = _norm_reference(x.astype(jnp.float32), gamma, beta, layernorm_type, epsilon, zero_centered_gamma)
    amax = jnp.max(jnp.abs(y))
    return saturate_cast(y * scale.astype(jnp.float32), out_dtype), amax


def norm_fp8(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    scale: jax.Array,
    *,
    layernorm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    out_dtype: DTypeLike = jnp.float8_e4m3fn,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Norm with an FP8 output: ``(saturate_cast(y * scale, out_dtype), max |y|)`` for ``y = norm(x)``.

    Args:
      x: ``[..., hidden]``; gamma, beta: ``[hidden]`` (``beta`` must be ``None`` for RMSNorm).
      scale: float32 scalar (``fp8_max / amax / 2**margin`` in the FP8 recipe's convention).
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      out_dtype: ``float8_e4m3fn`` or ``float8_e5m2``.
    Returns:
      ``y_fp8 [..., hidden]`` in ``out_dtype`` and the float32 scalar amax of ``|y|`` before scaling.
      Forward only (not differentiable): the FP8 GEMM that consumes ``y_fp8`` owns the backward.
    """
    op = "norm_fp8"
    _check_typed(op, layernorm_type, x, gamma, beta, epsilon)
    check_fp8_output(op, scale, out_dtype)
    return backend.dispatch(
        op, x, gamma, beta, jnp.reshape(scale, ()), implementation=implementation,
        layernorm_type=layernorm_type, epsilon=float(epsilon), zero_centered_gamma=bool(zero_centered_gamma),
        out_dtype=jnp.dtype(out_dtype),
    )


@backend.register("norm_tile_fp8", backend.REFERENCE)
def norm_tile_fp8_reference(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, *, layernorm_type: str,
                            epsilon: float, zero_centered_gamma: bool, out_dtype: DTypeLike, transpose: bool,
                            power_of_two: bool, amax_epsilon: float) -> tuple[jax.Array, ...]:
    """The ``"xla"`` implementation of `norm_tile_fp8`: the norm in float32, then `tile_quantize`'s."""
    y = _norm_reference(x.astype(jnp.float32), gamma, beta, layernorm_type, epsilon, zero_centered_gamma)
    return tile_quantize_reference(y, out_dtype=out_dtype, transpose=transpose, power_of_two=power_of_two,
                                   amax_epsilon=amax_epsilon)


def norm_tile_fp8(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    *,
    layernorm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    out_dtype: DTypeLike = jnp.float8_e4m3fn,
    transpose: bool = False,
    power_of_two: bool = False,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, ...]:
    """Norm with its output cast for a block-scaled FP8 GEMM: `mtjax.ops.tile_quantize` of ``norm(x)``
    computed in float32, in one kernel (the normalized values never go through memory in bf16).

    Args:
      x: ``[m, hidden]``; gamma, beta: ``[hidden]`` (``beta`` must be ``None`` for RMSNorm).
      layernorm_type, epsilon, zero_centered_gamma: as `layernorm` / `rmsnorm`.
      out_dtype, transpose, power_of_two, amax_epsilon: as `tile_quantize`.
    Returns:
      ``(q [m, hidden], scale_inv [m, ceil(hidden/128)])``, plus ``(q_t [hidden, m],
      scale_inv_t [hidden, ceil(m/128)])`` with ``transpose=True``, as `tile_quantize`. Forward only:
      the block-scaled GEMM consuming ``q`` owns the backward, which is the norm's.
    """
    op = "norm_tile_fp8"
    _check_typed(op, layernorm_type, x, gamma, beta, epsilon)
    check_rank(op, "x", x, 2)
    out_dtype = check_tile_options(op, out_dtype, power_of_two, amax_epsilon, transpose)
    return backend.dispatch(
        op, x, gamma, beta, implementation=implementation, layernorm_type=layernorm_type, epsilon=float(epsilon),
        zero_centered_gamma=bool(zero_centered_gamma), out_dtype=out_dtype, transpose=transpose,
        power_of_two=power_of_two, amax_epsilon=float(amax_epsilon),
    )


@functools.partial(jax.tree_util.register_dataclass, data_fields=["gamma", "beta"],
                   meta_fields=["layernorm_type", "epsilon", "zero_centered_gamma"])
@dataclasses.dataclass(frozen=True)
class Norm:
    """LayerNorm or RMSNorm over the last axis with its parameters: ``norm(x)`` applies it.

    A pytree (``gamma`` and ``beta`` are its leaves), so it can be passed through ``jax.vjp`` and
    ``custom_vjp`` functions and receive gradients.

    Attributes:
      gamma: ``[hidden]`` scale (``1 + gamma`` if ``zero_centered_gamma``).
      beta: ``[hidden]`` shift for LayerNorm; ``None`` for RMSNorm.
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      epsilon: added to the variance.
      zero_centered_gamma: as `layernorm`.
    """

    gamma: jax.Array
    beta: jax.Array | None = None
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False

    def __call__(self, x: jax.Array) -> jax.Array:
        """`layernorm` or `rmsnorm` of ``x [..., hidden]``, in ``x.dtype``."""
        _check_typed("Norm", self.layernorm_type, x, self.gamma, self.beta, self.epsilon)
        if self.layernorm_type == "rmsnorm":
            return rmsnorm(x, self.gamma, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma)
        return layernorm(x, self.gamma, self.beta, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma)

    def folds_into_gemm(self, x: jax.Array | jax.ShapeDtypeStruct) -> bool:
        """Whether a GEMM of ``norm(x)`` runs as `folded_dot`: an RMSNorm of at most `FOLD_MAX_ROWS` rows
        of a dtype with float32's range (float16's could not hold the unnormalized product)."""
        return (FOLD_INTO_GEMM and self.layernorm_type == "rmsnorm"
                and has_float32_range(x.dtype)
                and math.prod(jnp.shape(x)[:-1]) <= FOLD_MAX_ROWS)

    def folded_dot(self, x: jax.Array, dot: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """``dot(norm(x))`` for a ``dot`` contracting the last axis of its operand, whose output starts
        with the operand's other axes, as ``dot(x * gamma) * rsqrt(mean(x**2) + epsilon)``: the norm's
        per-row scale applied to the product, in float32, so with few rows the norm needs no kernel
        of its own (``x * gamma`` fuses into the GEMM's operand, the scale into its output). RMSNorm
        only (`folds_into_gemm`)."""
        if self.layernorm_type != "rmsnorm":
            raise ValueError(f"Norm.folded_dot: layernorm_type={self.layernorm_type!r}; only 'rmsnorm' folds")
        _check_typed("Norm", self.layernorm_type, x, self.gamma, self.beta, self.epsilon)
        xf = x.astype(jnp.float32)
        row_scale = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1) + self.epsilon)
        y = dot((xf * _scale(self.gamma, self.zero_centered_gamma)).astype(x.dtype))
        row_scale = row_scale.reshape(row_scale.shape + (1,) * (y.ndim - row_scale.ndim))
        return (y.astype(jnp.float32) * row_scale).astype(y.dtype)

    def with_residual(self, x: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`residual_norm`: ``(norm(x + residual), x + residual)`` in one pass."""
        return residual_norm(x, residual, self.gamma, self.beta, layernorm_type=self.layernorm_type,
                             epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma)

    def fp8(self, x: jax.Array, scale: jax.Array, out_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        """`norm_fp8` of ``x``: ``(saturate_cast(norm(x) * scale, out_dtype), max |norm(x)|)``."""
        return norm_fp8(x, self.gamma, self.beta, scale, layernorm_type=self.layernorm_type,
                             epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma, out_dtype=out_dtype)

    def tile_fp8(self, x: jax.Array, out_dtype: DTypeLike, **options: bool | float) -> tuple[jax.Array, ...]:
        """`norm_tile_fp8` of ``x [m, hidden]`` (``options``: ``transpose``, ``power_of_two``,
        ``amax_epsilon``): ``norm(x)`` cast in 1x128 row tiles, as `tile_quantize` returns it."""
        return norm_tile_fp8(x, self.gamma, self.beta, layernorm_type=self.layernorm_type, epsilon=self.epsilon,
                             zero_centered_gamma=self.zero_centered_gamma, out_dtype=out_dtype, **options)


@backend.register("residual_norm", backend.REFERENCE)
def residual_norm_reference(x: jax.Array, residual: jax.Array, gamma: jax.Array, beta: jax.Array | None,
                            seed: jax.Array | None, *, layernorm_type: str, epsilon: float,
                            zero_centered_gamma: bool, dropout_rate: float) -> tuple[jax.Array, jax.Array]:
    """The ``"xla"`` implementation of `residual_norm`; ``seed`` is the uint32 scalar drawn from
    ``dropout_rng`` (None without dropout)."""
    h = x.astype(jnp.float32)
    if dropout_rate > 0.0:
        rows = jnp.arange(h.size // h.shape[-1]).reshape(h.shape[:-1] + (1,))
        keep = dropout_keep(seed, rows, jnp.arange(h.shape[-1]), dropout_rate)
        h = jnp.where(keep, h / (1.0 - dropout_rate), 0.0)
    new_residual = (h + residual.astype(jnp.float32)).astype(residual.dtype)
    normalized = _norm_reference(new_residual.astype(jnp.float32), gamma, beta, layernorm_type, epsilon,
                                 zero_centered_gamma)
    return normalized.astype(x.dtype), new_residual


def residual_norm(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    *,
    layernorm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``new_residual = dropout(x) + residual``; returns ``(norm(new_residual), new_residual)``.

    The pre-norm Transformer's "add the sublayer output to the stream, normalize for the next
    sublayer", in one pass over memory forward and one backward.

    Args:
      x: ``[..., hidden]``, the sublayer output (dropout applies to it).
      residual: the residual stream, same shape; the new residual keeps ``residual.dtype``
        (e.g. float32 while ``x`` is bfloat16).
      gamma, beta: ``[hidden]`` (``beta`` must be ``None`` for RMSNorm).
      dropout_rate: probability of zeroing an element of ``x`` (kept ones scale by ``1/(1-rate)``).
      dropout_rng: a PRNG key, needed when ``dropout_rate > 0``. The mask is a counter-based hash of
        (a 32-bit seed drawn from the key, row, column), identical in every implementation.
    Returns:
      ``(normalized [x.dtype], new_residual [residual.dtype])``.
    """
    op = "residual_norm"
    _check_typed(op, layernorm_type, x, gamma, beta, epsilon)
    check_float(op, "residual", residual)
    check_shape(op, "residual", residual, jnp.shape(x))
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"{op}: dropout_rate={dropout_rate!r}; expected 0 <= dropout_rate < 1")
    seed = None
    if dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(f"{op}: dropout_rate={dropout_rate} needs dropout_rng (a PRNG key)")
        seed = jax.random.bits(dropout_rng, (), jnp.uint32)
    return backend.dispatch(
        op, x, residual, gamma, beta, seed, implementation=implementation, layernorm_type=layernorm_type,
        epsilon=float(epsilon), zero_centered_gamma=bool(zero_centered_gamma), dropout_rate=float(dropout_rate),
    )


# --------------------------------------------------------------------------------------------------
# Pallas Triton kernels: `unsupported` declines what they cannot compute, `prefer` (automatic
# selection only) the shapes where XLA is as fast (`mtjax bench norm`, docs/performance.md).
# LayerNorm is picked on forward+backward speed (training), where the kernels win on large arrays;
# its forward alone is close to XLA's either way.
# --------------------------------------------------------------------------------------------------

# RMSNorm above this hidden size: XLA's own fusion is faster forward+backward; up to it the
# persistent kernels are faster (`mtjax bench norm --sweep`).
RMSNORM_MAX_KERNEL_HIDDEN = 8192


def _kernel_unsupported(x, *_, **__) -> str | None:
    return unsupported_array(jnp.shape(x), jnp.result_type(x))


def _fp8_kernel_unsupported(x, *_, out_dtype, **__) -> str | None:
    return unsupported_array(jnp.shape(x), jnp.result_type(x)) or unsupported_fp8_dtype(out_dtype)


def _rms_kernel_preferred(x, *_, **__) -> str | None:
    hidden = jnp.shape(x)[-1]
    if hidden > RMSNORM_MAX_KERNEL_HIDDEN:
        return f"hidden size {hidden} > {RMSNORM_MAX_KERNEL_HIDDEN}: XLA's fusion is faster for RMSNorm"
    return too_small(x)


_KERNEL = dict(requires=(backend.PALLAS_TRITON,), unsupported=_kernel_unsupported, prefer=too_small, priority=10,
               single_device=True)


@backend.register("layernorm", "pallas_triton", **_KERNEL)
def _layernorm_pallas(x, gamma, beta, *, epsilon: float, zero_centered_gamma: bool):
    return norm_kernels.layer_norm(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)


@backend.register("rmsnorm", "pallas_triton", **{**_KERNEL, "prefer": _rms_kernel_preferred})
def _rmsnorm_pallas(x, gamma, *, epsilon: float, zero_centered_gamma: bool):
    return norm_kernels.rms_norm(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)


# One pass over memory instead of XLA's norm then quantize, for both norm types.
@backend.register("norm_fp8", "pallas_triton", **{**_KERNEL, "unsupported": _fp8_kernel_unsupported})
def _norm_fp8_pallas(x, gamma, beta, scale, *, layernorm_type: str, epsilon: float,
                          zero_centered_gamma: bool, out_dtype):
    return norm_kernels.norm_fp8(x, gamma, beta, scale, rms=layernorm_type == "rmsnorm", epsilon=epsilon,
                                 zero_centered_gamma=zero_centered_gamma, out_dtype=out_dtype)


def _tile_kernel_unsupported(x, *_, out_dtype, **__) -> str | None:
    return block_kernels.unsupported(jnp.shape(x), jnp.result_type(x), out_dtype)


# The tile cast's kernel with the norm applied to each tile it loads, after a row-statistics pass.
@backend.register("norm_tile_fp8", "pallas_triton", **{**_KERNEL, "unsupported": _tile_kernel_unsupported})
def _norm_tile_fp8_pallas(x, gamma, beta, *, layernorm_type: str, epsilon: float, zero_centered_gamma: bool,
                          out_dtype, transpose: bool, power_of_two: bool, amax_epsilon: float):
    return block_kernels.norm_tile_quantize(
        x, gamma, beta, out_dtype, rms=layernorm_type == "rmsnorm", epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, transpose=transpose, fp8_max=fp8_max(out_dtype),
        power_of_two=power_of_two, amax_epsilon=amax_epsilon)


@backend.register("residual_norm", "pallas_triton", **_KERNEL)
def _residual_norm_pallas(x, residual, gamma, beta, seed, *, layernorm_type: str, epsilon: float,
                          zero_centered_gamma: bool, dropout_rate: float):
    return residual_norm_kernels.residual_norm(
        x, residual, gamma, beta, seed, rms=layernorm_type == "rmsnorm", epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, dropout_rate=dropout_rate,
    )


# Native Triton ports of the same kernels: the same declines and shape rules, below the Pallas ones
# while both can run.
_NATIVE = {**_KERNEL, "requires": (backend.TRITON,), "priority": 9}


@backend.register("layernorm", "triton", **_NATIVE)
def _layernorm_triton(x, gamma, beta, *, epsilon: float, zero_centered_gamma: bool):
    from mtjax.kernels.triton import layer_norm as native

    return native.layer_norm(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)


@backend.register("rmsnorm", "triton", **{**_NATIVE, "prefer": _rms_kernel_preferred})
def _rmsnorm_triton(x, gamma, *, epsilon: float, zero_centered_gamma: bool):
    from mtjax.kernels.triton import layer_norm as native

    return native.rms_norm(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)


@backend.register("norm_fp8", "triton", **{**_NATIVE, "unsupported": _fp8_kernel_unsupported})
def _norm_fp8_triton(x, gamma, beta, scale, *, layernorm_type: str, epsilon: float, zero_centered_gamma: bool,
                     out_dtype):
    from mtjax.kernels.triton import layer_norm as native

    return native.norm_fp8(x, gamma, beta, scale, rms=layernorm_type == "rmsnorm", epsilon=epsilon,
                           zero_centered_gamma=zero_centered_gamma, out_dtype=out_dtype)


@backend.register("residual_norm", "triton", **_NATIVE)
def _residual_norm_triton(x, residual, gamma, beta, seed, *, layernorm_type: str, epsilon: float,
                          zero_centered_gamma: bool, dropout_rate: float):
    from mtjax.kernels.triton import layer_norm as native

    return native.residual_norm(x, residual, gamma, beta, seed, rms=layernorm_type == "rmsnorm", epsilon=epsilon,
                                zero_centered_gamma=zero_centered_gamma, dropout_rate=dropout_rate)


@backend.register("norm_tile_fp8", "triton", **{**_NATIVE, "unsupported": _tile_kernel_unsupported})
def _norm_tile_fp8_triton(x, gamma, beta, *, layernorm_type: str, epsilon: float, zero_centered_gamma: bool,
                          out_dtype, transpose: bool, power_of_two: bool, amax_epsilon: float):
    from mtjax.kernels.triton import block_fp8 as native

    return native.norm_tile_quantize(
        x, gamma, beta, out_dtype, rms=layernorm_type == "rmsnorm", epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, transpose=transpose, fp8_max=fp8_max(out_dtype),
        power_of_two=power_of_two, amax_epsilon=amax_epsilon)
