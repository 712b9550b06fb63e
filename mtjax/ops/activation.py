"""Elementwise and gated activations, with an optional bias added first.

Gated activations take ``[..., 2, hidden]`` (TransformerEngine's layout): ``x[..., 0, :]`` goes
through the activation, ``x[..., 1, :]`` is the gate (linear, or clamped for ``clamped_swiglu``), and
the result is ``[..., hidden]``. Keeping the pair on its own axis means a ``hidden`` split over
devices (tensor parallelism) leaves both halves of every column on the same device: the op is local,
where a ``[..., 2 * hidden]`` layout would make XLA reshuffle the sharded axis to split it in halves.
TransformerEngine-style tuples name the same functions: ``("gelu",)``, ``("silu", "linear")``...

The functions and where they come from:

- ``gelu`` (tanh approximation) and ``gelu_exact`` (erf): Hendrycks & Gimpel, "Gaussian Error
  Linear Units", arXiv:1606.08415; ``quick_gelu`` is that paper's sigmoid approximation
  ``x * sigmoid(1.702 x)`` (used by CLIP).
- ``silu``: ``x * sigmoid(x)``, Elfwing et al., arXiv:1702.03118 (Swish: Ramachandran et al.,
  arXiv:1710.05941).
- ``squared_relu``: ``relu(x)**2``, So et al., "Primer", arXiv:2109.08668.
- ``glu``: ``sigmoid(a) * gate``, Dauphin et al., "Language Modeling with Gated Convolutional
  Networks", arXiv:1612.08083; its variants ``reglu``, ``geglu``, ``swiglu`` (Shazeer, "GLU Variants
  Improve Transformer", arXiv:2002.05202), and ``qgeglu``, ``sreglu`` on the same pattern
  (TransformerEngine's QGEGLU and SREGLU).
- ``clamped_swiglu``: gpt-oss's gated unit (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025)
  with TransformerEngine's default parameters: ``a' = min(a, 7)``,
  ``y = a' * sigmoid(1.702 a') * (clip(gate, -7, 7) + 1)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from mtjax import backend
from mtjax.dtypes import fp8_max
from mtjax.kernels import activation as activation_kernels
from mtjax.kernels import block_quantize as block_kernels
from mtjax.kernels.activation import CLAMP_ALPHA, CLAMP_GATE_OFFSET, CLAMP_LIMIT, QUICK_GELU_ALPHA
from mtjax.kernels.common import saturate_cast, too_small, unsupported_fp8_dtype
from mtjax.ops.block_quantization import tile_quantize_reference
from mtjax.ops.checks import check_float, check_fp8_output, check_shape, check_tile_options


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


def _quick_gelu(x):
    return x * jax.nn.sigmoid(QUICK_GELU_ALPHA * x)


def _squared_relu(x):
    r = jax.nn.relu(x)
    return r * r


# The clamps pass the gradient on at the limits themselves (`where`, not `minimum`/`clip`, which
# split it in halves there), as TransformerEngine's kernels and mtjax's do.
def _clamped_silu(x):
    x = jnp.where(x <= CLAMP_LIMIT, x, CLAMP_LIMIT)
    return x * jax.nn.sigmoid(CLAMP_ALPHA * x)


def _linear(gate):
    return gate


def _clamped_linear(gate):
    return jnp.where(jnp.abs(gate) <= CLAMP_LIMIT, gate, jnp.sign(gate) * CLAMP_LIMIT) + CLAMP_GATE_OFFSET


# name -> (function of the activated input, function of the gate or None when not gated)
ACTIVATIONS: dict[str, tuple] = {
    "gelu": (_gelu_tanh, None),
    "gelu_exact": (_gelu_exact, None),
    "silu": (jax.nn.silu, None),
    "relu": (jax.nn.relu, None),
    "quick_gelu": (_quick_gelu, None),
    "squared_relu": (_squared_relu, None),
    "swiglu": (jax.nn.silu, _linear),
    "geglu": (_gelu_tanh, _linear),
    "reglu": (jax.nn.relu, _linear),
    "qgeglu": (_quick_gelu, _linear),
    "sreglu": (_squared_relu, _linear),
    "glu": (jax.nn.sigmoid, _linear),
    "clamped_swiglu": (_clamped_silu, _clamped_linear),
}

# TransformerEngine's activation tuples (`transformer_engine.jax.cpp_extensions.activation.ActivationEnum`).
_TUPLE_NAMES = {
    ("gelu",): "gelu",
    ("gelu_exact",): "gelu_exact",
    ("silu",): "silu",
    ("relu",): "relu",
    ("quick_gelu",): "quick_gelu",
    ("squared_relu",): "squared_relu",
    ("silu", "linear"): "swiglu",
    ("gelu", "linear"): "geglu",
    ("relu", "linear"): "reglu",
    ("quick_gelu", "linear"): "qgeglu",
    ("squared_relu", "linear"): "sreglu",
    ("sigmoid", "linear"): "glu",
    ("clamped_silu", "clamped_linear"): "clamped_swiglu",
}


def canonical_activation(activation_type: str | Sequence[str]) -> str:
    """The canonical name of an activation given as a name or a TransformerEngine-style tuple."""
    if isinstance(activation_type, str):
        name = activation_type.lower()
    elif isinstance(activation_type, Sequence) and all(isinstance(a, str) for a in activation_type):
        name = _TUPLE_NAMES.get(tuple(a.lower() for a in activation_type), repr(tuple(activation_type)))
    else:  # e.g. a callable, which TransformerEngine accepts and mtjax's kernels cannot
        name = repr(activation_type)
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation: activation_type={activation_type!r} is not supported; accepted: "
            f"{sorted(ACTIVATIONS)} or tuples {sorted(_TUPLE_NAMES)}"
        )
    return name


def is_gated(activation_type: str | Sequence[str]) -> bool:
    """Whether the activation takes ``[..., 2, hidden]`` (activated input and linear gate)."""
    return ACTIVATIONS[canonical_activation(activation_type)][1] is not None


@backend.register("activation", backend.REFERENCE)
def activation_reference(x: jax.Array, bias: jax.Array | None, *, activation_type: str) -> jax.Array:
    """The ``"xla"`` implementation of `activation` (``activation_type`` a canonical name).

    Under `jax.checkpoint`, so the backward keeps only ``x`` and ``bias`` (as the kernel does) rather
    than float32 intermediates of the MLP's widest activation.
    """
    fn, gate = ACTIVATIONS[activation_type]

    def activate(x, bias):
        xf = x.astype(jnp.float32)
        if bias is not None:
            xf = xf + bias.astype(jnp.float32)
        if gate is not None:
            # Index the pair axis; never reshape `hidden`, which tensor parallelism may split.
            y = fn(xf[..., 0, :]) * gate(xf[..., 1, :])
        else:
            y = fn(xf)
        return y.astype(x.dtype)

    return jax.checkpoint(activate)(x, bias)


def activation(
    x: jax.Array,
    activation_type: str | Sequence[str] = "gelu",
    bias: jax.Array | None = None,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """``act(x + bias)``, computed in float32 (forward and backward fused in the Pallas kernel).

    Args:
      x: ``[..., hidden]``, or ``[..., 2, hidden]`` for a gated activation (index 0 activated,
        index 1 the gate).
      activation_type: one of `ACTIVATIONS` or a TE-style tuple; ``"gelu"`` is the tanh
        approximation (``jax.nn.gelu``'s default), ``"gelu_exact"`` the erf form.
      bias: ``[hidden]`` (``[2, hidden]`` for a gated activation) or ``None``.
    Returns:
      ``[..., hidden]`` in ``x.dtype``.
    """
    name = _check("activation", x, activation_type, bias)
    return backend.dispatch("activation", x, bias, implementation=implementation, activation_type=name)


def _check(op: str, x, activation_type, bias) -> str:
    name = canonical_activation(activation_type)
    check_float(op, "x", x)
    gated = ACTIVATIONS[name][1] is not None
    if jnp.ndim(x) < 1:
        raise ValueError(f"{op}: x must have at least one axis; got shape {jnp.shape(x)}")
    if gated and (jnp.ndim(x) < 2 or jnp.shape(x)[-2] != 2):
        raise ValueError(f"{op}: gated {name!r} takes x of shape [..., 2, hidden] (activated input, then "
                         f"the linear gate); x has shape {jnp.shape(x)}")
    if bias is not None:
        check_float(op, "bias", bias)
        check_shape(op, "bias", bias, jnp.shape(x)[-2:] if gated else jnp.shape(x)[-1:])
    return name


def _check_tiled(op: str, x, activation_type, bias) -> str:
    """`_check`, for the ops writing 1x128 tiles: ``x`` is ``[m, hidden]`` (``[m, 2, hidden]`` gated)."""
    name = _check(op, x, activation_type, bias)
    gated = ACTIVATIONS[name][1] is not None
    if jnp.ndim(x) != (3 if gated else 2):
        raise ValueError(f"{op}: x has shape {jnp.shape(x)}; expected {'[m, 2, hidden]' if gated else '[m, hidden]'}"
                         f" for {name!r}")
    return name


@backend.register("activation_fp8", backend.REFERENCE)
def activation_fp8_reference(x: jax.Array, bias: jax.Array | None, scale: jax.Array, *, activation_type: str,
                             out_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """The ``"xla"`` implementation of `activation_fp8` (``scale`` a float32 scalar of shape ``()``)."""
    y = activation_reference(x.astype(jnp.float32), bias, activation_type=activation_type)
    return saturate_cast(y * scale.astype(jnp.float32), out_dtype), jnp.max(jnp.abs(y))


def activation_fp8(
    x: jax.Array,
    activation_type: str | Sequence[str] = "gelu",
    bias: jax.Array | None = None,
    *,
    scale: jax.Array,
    out_dtype: DTypeLike = jnp.float8_e4m3fn,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``y = act(x + bias)`` quantized for an FP8 GEMM: ``(saturate_cast(y * scale, out_dtype), max |y|)``.

    Args as `activation`, plus ``scale`` (float32 scalar) and ``out_dtype`` (``float8_e4m3fn`` or
    ``float8_e5m2``). The amax is of ``|y|`` before scaling. Forward only: the FP8 GEMM consuming the
    output owns the backward, which is `activation`'s.
    """
    op = "activation_fp8"
    name = _check(op, x, activation_type, bias)
    check_fp8_output(op, scale, out_dtype)
    return backend.dispatch(op, x, bias, jnp.reshape(scale, ()), implementation=implementation,
                            activation_type=name, out_dtype=jnp.dtype(out_dtype))


@backend.register("activation_tile_fp8", backend.REFERENCE)
def activation_tile_fp8_reference(x: jax.Array, bias: jax.Array | None, *, activation_type: str, out_dtype: DTypeLike,
                                  transpose: bool, power_of_two: bool, amax_epsilon: float) -> tuple[jax.Array, ...]:
    """The ``"xla"`` implementation of `activation_tile_fp8`: the activation in float32, then
    `tile_quantize`'s."""
    y = activation_reference(x.astype(jnp.float32), bias, activation_type=activation_type)
    return tile_quantize_reference(y, out_dtype=out_dtype, transpose=transpose, power_of_two=power_of_two,
                                   amax_epsilon=amax_epsilon)


def activation_tile_fp8(
    x: jax.Array,
    activation_type: str | Sequence[str] = "gelu",
    bias: jax.Array | None = None,
    *,
    out_dtype: DTypeLike = jnp.float8_e4m3fn,
    transpose: bool = False,
    power_of_two: bool = False,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, ...]:
    """``y = act(x + bias)`` cast for a block-scaled FP8 GEMM: `mtjax.ops.tile_quantize` of ``y``
    computed in float32, in one kernel (``y`` never goes through memory in bf16).

    Args:
      x: ``[m, hidden]``, or ``[m, 2, hidden]`` for a gated activation; activation_type, bias: as
        `activation`.
      out_dtype, transpose, power_of_two, amax_epsilon: as `tile_quantize`.
    Returns:
      as `tile_quantize` for ``y [m, hidden]``. Forward only: the block-scaled GEMM consuming the
      output owns the backward, which is `activation`'s.
    """
    op = "activation_tile_fp8"
    name = _check_tiled(op, x, activation_type, bias)
    out_dtype = check_tile_options(op, out_dtype, power_of_two, amax_epsilon, transpose)
    return backend.dispatch(op, x, bias, implementation=implementation, activation_type=name, out_dtype=out_dtype,
                            transpose=transpose, power_of_two=power_of_two, amax_epsilon=float(amax_epsilon))


@backend.register("activation_grad_fp8", backend.REFERENCE)
def activation_grad_fp8_reference(x: jax.Array, bias: jax.Array | None, dy: jax.Array, scale: jax.Array, *,
                                  activation_type: str, out_dtype: DTypeLike) -> tuple:
    """The ``"xla"`` implementation of `activation_grad_fp8`: autodiff of `activation_reference` in
    float32, then the cast, transpose and amax."""
    f32 = jnp.float32
    bias32 = None if bias is None else bias.astype(f32)
    _, vjp = jax.vjp(lambda x, b: activation_reference(x, b, activation_type=activation_type), x.astype(f32), bias32)
    dx, dbias = vjp(dy.astype(f32))
    dx_q = saturate_cast(dx * scale.astype(f32), out_dtype)
    rows = dy.size // dy.shape[-1]
    return dx_q, dx_q.reshape(rows, -1).T, jnp.max(jnp.abs(dx)), dbias


def activation_grad_fp8(
    x: jax.Array,
    dy: jax.Array,
    activation_type: str | Sequence[str] = "gelu",
    bias: jax.Array | None = None,
    *,
    scale: jax.Array,
    out_dtype: DTypeLike = jnp.float8_e5m2,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """`activation`'s backward with its input gradient quantized for an FP8 GEMM.

    Args as `activation`, plus ``dy`` (the cotangent of its output, ``[..., hidden]``), ``scale``
    (float32 scalar) and ``out_dtype`` (``float8_e5m2`` by default: a gradient).
    Returns:
      ``(dx_q, dx_q_t, amax, dbias)``: ``dx_q = saturate_cast(dx * scale)`` shaped like ``x``;
      ``dx_q_t`` that flattened to 2-D (``[rows, hidden]``, ``[rows, 2 * hidden]`` gated) and
      transposed; ``amax = max |dx|`` (before scaling); ``dbias`` (float32, shaped like ``bias``) or
      ``None``. This is the output gradient of the FP8 GEMM that produced ``x``, in the two layouts
      its dgrad and wgrad read (`mtjax.fp8`'s fused MLP backward).
    """
    op = "activation_grad_fp8"
    name = _check(op, x, activation_type, bias)
    check_float(op, "dy", dy)
    check_shape(op, "dy", dy, jax.eval_shape(lambda x: activation_reference(x, None, activation_type=name), x).shape)
    check_fp8_output(op, scale, out_dtype)
    return backend.dispatch(op, x, bias, dy, jnp.reshape(scale, ()), implementation=implementation,
                            activation_type=name, out_dtype=jnp.dtype(out_dtype))


@backend.register("activation_grad_tile_fp8", backend.REFERENCE)
def activation_grad_tile_fp8_reference(x: jax.Array, bias: jax.Array | None, dy: jax.Array, *, activation_type: str,
                                       out_dtype: DTypeLike, power_of_two: bool,
                                       amax_epsilon: float) -> tuple[jax.Array | None, ...]:
    """The ``"xla"`` implementation of `activation_grad_tile_fp8`: autodiff of `activation_reference`
    in float32, then `tile_quantize`'s with the transpose."""
    f32 = jnp.float32
    bias32 = None if bias is None else bias.astype(f32)
    _, vjp = jax.vjp(lambda x, b: activation_reference(x, b, activation_type=activation_type), x.astype(f32), bias32)
    dx, dbias = vjp(dy.astype(f32))
    tiles = tile_quantize_reference(dx.reshape(dx.shape[0], -1), out_dtype=out_dtype, transpose=True,
                                    power_of_two=power_of_two, amax_epsilon=amax_epsilon)
    return (*tiles, dbias)


def activation_grad_tile_fp8(
    x: jax.Array,
    dy: jax.Array,
    activation_type: str | Sequence[str] = "gelu",
    bias: jax.Array | None = None,
    *,
    out_dtype: DTypeLike = jnp.float8_e4m3fn,
    power_of_two: bool = False,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array | None, ...]:
    """`activation`'s backward written as a block-scaled FP8 GEMM operand, in one kernel: the output
    gradient of the GEMM that produced ``x``, in the two layouts its dgrad and wgrad read
    (TransformerEngine's "dact + cast_transpose", with 1x128 tiles).

    Args:
      x: ``[m, hidden]``, or ``[m, 2, hidden]`` for a gated activation; activation_type, bias: as
        `activation`.
      dy: the cotangent of the activation's output, ``[m, hidden]``.
      out_dtype, power_of_two, amax_epsilon: as `tile_quantize` (``float8_e4m3fn`` by default, as
        DeepSeek-V3's block-scaled gradients are).
    Returns:
      ``(dx_q, scale_inv, dx_q_t, scale_inv_t, dbias)``: `tile_quantize` with ``transpose=True`` of
      ``dx`` (computed in float32, flattened to ``[m, w]``, ``w = 2 * hidden`` gated), and ``dbias``
      (float32, shaped like ``bias``) or ``None``.
    """
    op = "activation_grad_tile_fp8"
    name = _check_tiled(op, x, activation_type, bias)
    check_float(op, "dy", dy)
    check_shape(op, "dy", dy, (jnp.shape(x)[0], jnp.shape(x)[-1]))
    out_dtype = check_tile_options(op, out_dtype, power_of_two, amax_epsilon, True)
    return backend.dispatch(op, x, bias, dy, implementation=implementation, activation_type=name, out_dtype=out_dtype,
                            power_of_two=power_of_two, amax_epsilon=float(amax_epsilon))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["bias"], meta_fields=["activation_type"])
@dataclasses.dataclass(frozen=True)
class Activation:
    """``act(x + bias)`` with its parameters: ``activation(x)`` applies it.

    A pytree (``bias`` is its leaf), like `mtjax.ops.Norm`, so it can ride into a ``custom_vjp``
    (an FP8 GEMM's input prologue) and receive its gradient.

    Attributes:
      bias: ``[hidden]`` (``[2, hidden]`` when gated) or ``None``.
      activation_type: a name of `ACTIVATIONS` or a TransformerEngine-style tuple.
    """

    bias: jax.Array | None = None
    activation_type: str = "gelu"

    def __call__(self, x: jax.Array) -> jax.Array:
        """`activation` of ``x [..., hidden]`` (``[..., 2, hidden]`` when gated), in ``x.dtype``."""
        return activation(x, self.activation_type, self.bias)

    def fp8(self, x: jax.Array, scale: jax.Array, out_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        """`activation_fp8` of ``x``: ``(saturate_cast(act(x) * scale, out_dtype), max |act(x)|)``."""
        return activation_fp8(x, self.activation_type, self.bias, scale=scale, out_dtype=out_dtype)

    def tile_fp8(self, x: jax.Array, out_dtype: DTypeLike, **options: bool | float) -> tuple[jax.Array, ...]:
        """`activation_tile_fp8` of ``x [m, hidden]`` (``[m, 2, hidden]`` gated; ``options``:
        ``transpose``, ``power_of_two``, ``amax_epsilon``): ``act(x)`` cast in 1x128 row tiles."""
        return activation_tile_fp8(x, self.activation_type, self.bias, out_dtype=out_dtype, **options)

    def fp8_grad(self, x: jax.Array, dy: jax.Array, scale: jax.Array,
                 out_dtype: DTypeLike) -> tuple[jax.Array, jax.Array, jax.Array, Activation]:
        """The backward of ``self(x)`` for the cotangent ``dy``, written for an FP8 GEMM
        (`activation_grad_fp8`): ``(dx_q, dx_q_t, max |dx|, the cotangent of self)``."""
        dx_q, dx_q_t, amax, dbias = activation_grad_fp8(x, dy, self.activation_type, self.bias, scale=scale,
                                                        out_dtype=out_dtype)
        d_self = Activation(None if dbias is None else dbias.astype(self.bias.dtype), self.activation_type)
        return dx_q, dx_q_t, amax, d_self

    def tile_fp8_grad(self, x: jax.Array, dy: jax.Array, out_dtype: DTypeLike,
                      **options: bool | float) -> tuple[jax.Array | Activation, ...]:
        """The backward of ``self(x)`` for the cotangent ``dy``, written for a block-scaled FP8 GEMM
        (`activation_grad_tile_fp8`; ``options``: ``power_of_two``, ``amax_epsilon``):
        ``(dx_q, scale_inv, dx_q_t, scale_inv_t, the cotangent of self)``."""
        *tiles, dbias = activation_grad_tile_fp8(x, dy, self.activation_type, self.bias, out_dtype=out_dtype,
                                                 **options)
        return (*tiles, Activation(None if dbias is None else dbias.astype(self.bias.dtype), self.activation_type))


# Pallas Triton kernels (kernels/activation.py); they decline what they cannot compute (gelu_exact,
# fnuz outputs) and automatic selection leaves small arrays to XLA, which is as fast there. On large
# arrays one pass over memory forward and one backward beat XLA's fusions (docs/performance.md).
def _kernel_unsupported(x, *_, activation_type: str, out_dtype=None, **__) -> str | None:
    reason = activation_kernels.unsupported(jnp.shape(x), jnp.result_type(x), activation_type)
    if reason is None and out_dtype is not None:  # the FP8-output variants
        reason = unsupported_fp8_dtype(out_dtype)
    return reason


_KERNEL = dict(requires=(backend.PALLAS_TRITON,), unsupported=_kernel_unsupported, prefer=too_small, priority=10,
               single_device=True)


@backend.register("activation", "pallas_triton", **_KERNEL)
def _activation_pallas(x, bias, *, activation_type: str):
    return activation_kernels.activation(x, bias, activation=activation_type)


@backend.register("activation_grad_fp8", "pallas_triton", **_KERNEL)
def _activation_grad_fp8_pallas(x, bias, dy, scale, *, activation_type: str, out_dtype):
    return activation_kernels.activation_grad_fp8(x, bias, dy, scale, activation=activation_type, out_dtype=out_dtype)


@backend.register("activation_fp8", "pallas_triton", **_KERNEL)
def _activation_fp8_pallas(x, bias, scale, *, activation_type: str, out_dtype):
    return activation_kernels.activation_fp8(x, bias, scale, activation=activation_type, out_dtype=out_dtype)


def _tile_kernel_unsupported(x, *_, activation_type: str, out_dtype, **__) -> str | None:
    shape = jnp.shape(x)
    return (activation_kernels.unsupported(shape, jnp.result_type(x), activation_type)
            or block_kernels.unsupported((shape[0], math.prod(shape[1:])), jnp.result_type(x), out_dtype))


# The tile cast's kernel with the activation applied to each tile it loads.
@backend.register("activation_tile_fp8", "pallas_triton", **{**_KERNEL, "unsupported": _tile_kernel_unsupported})
def _activation_tile_fp8_pallas(x, bias, *, activation_type: str, out_dtype, transpose: bool, power_of_two: bool,
                                amax_epsilon: float):
    return block_kernels.activation_tile_quantize(
        x, bias, out_dtype, activation=activation_type, transpose=transpose, fp8_max=fp8_max(out_dtype),
        power_of_two=power_of_two, amax_epsilon=amax_epsilon)


def _grad_tile_kernel_unsupported(x, bias, dy, *, activation_type: str, out_dtype, **_) -> str | None:
    rows, hidden = math.prod(jnp.shape(dy)[:-1]), jnp.shape(dy)[-1]
    if rows % block_kernels.TILE or hidden % block_kernels.TILE:
        # Whole tiles only in automatic selection: the masked path differs from the reference on an
        # H200 (docs/kernels.md); the kernels themselves take any shape, for their tests.
        return f"{rows} rows and hidden {hidden} (selected for whole {block_kernels.TILE}-wide tiles only)"
    return (_tile_kernel_unsupported(x, activation_type=activation_type, out_dtype=out_dtype)
            or block_kernels.unsupported_activation_grad(jnp.shape(dy), activation_type))


# The activation's backward writing the block-scaled FP8 tiles of its gradient, both layouts.
@backend.register("activation_grad_tile_fp8", "pallas_triton",
                  **{**_KERNEL, "unsupported": _grad_tile_kernel_unsupported})
def _activation_grad_tile_fp8_pallas(x, bias, dy, *, activation_type: str, out_dtype, power_of_two: bool,
                                     amax_epsilon: float):
    *tiles, dbias = block_kernels.activation_grad_tile_quantize(
        x, bias, dy, out_dtype, activation=activation_type, fp8_max=fp8_max(out_dtype), power_of_two=power_of_two,
        amax_epsilon=amax_epsilon)
    return (*tiles, None if dbias is None else dbias.reshape(bias.shape))


# Native Triton ports of the same kernels (kernels/triton/activation.py): the same declines and size
# rule, below the Pallas ones while both can run.
_NATIVE = {**_KERNEL, "requires": (backend.TRITON,), "priority": 9}


@backend.register("activation", "triton", **_NATIVE)
def _activation_triton(x, bias, *, activation_type: str):
    from mtjax.kernels.triton import activation as native

    return native.activation(x, bias, activation=activation_type)


@backend.register("activation_grad_fp8", "triton", **_NATIVE)
def _activation_grad_fp8_triton(x, bias, dy, scale, *, activation_type: str, out_dtype):
    from mtjax.kernels.triton import activation as native

    return native.activation_grad_fp8(x, bias, dy, scale, activation=activation_type, out_dtype=out_dtype)


@backend.register("activation_fp8", "triton", **_NATIVE)
def _activation_fp8_triton(x, bias, scale, *, activation_type: str, out_dtype):
    from mtjax.kernels.triton import activation as native

    return native.activation_fp8(x, bias, scale, activation=activation_type, out_dtype=out_dtype)


@backend.register("activation_tile_fp8", "triton", **{**_NATIVE, "unsupported": _tile_kernel_unsupported})
def _activation_tile_fp8_triton(x, bias, *, activation_type: str, out_dtype, transpose: bool, power_of_two: bool,
                                amax_epsilon: float):
    from mtjax.kernels.triton import block_fp8 as native

    return native.activation_tile_quantize(
        x, bias, out_dtype, activation=activation_type, transpose=transpose, fp8_max=fp8_max(out_dtype),
        power_of_two=power_of_two, amax_epsilon=amax_epsilon)


@backend.register("activation_grad_tile_fp8", "triton", **{**_NATIVE, "unsupported": _grad_tile_kernel_unsupported})
def _activation_grad_tile_fp8_triton(x, bias, dy, *, activation_type: str, out_dtype, power_of_two: bool,
                                     amax_epsilon: float):
    from mtjax.kernels.triton import block_fp8 as native

    *tiles, dbias = native.activation_grad_tile_quantize(
        x, bias, dy, out_dtype, activation=activation_type, fp8_max=fp8_max(out_dtype), power_of_two=power_of_two,
        amax_epsilon=amax_epsilon)
    return (*tiles, None if dbias is None else dbias.reshape(bias.shape))
