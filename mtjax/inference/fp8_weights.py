"""FP8 weights for inference: every GEMM kernel stored in FP8 E4M3 with per-channel or per-tensor scales.

Decoding is bound by the bytes of weights read per step; FP8 kernels halve them. `quantize_weights`
finds the model's GEMMs by tracing it once (`jax.eval_shape`, no compute: every `mtjax.fp8.DotGeneral`
and the kernel parameter it multiplies), replaces each kernel by its FP8 E4M3 values and stores the
float32 dequantization scale beside it (in the ``params`` collection, as ``weight_scale`` of the GEMM's
``DotGeneral`` submodule), and returns a model whose ``apply`` runs those GEMMs on the FP8 kernels:

- ``mode="fp8_gemm"``: the GEMM's input is quantized to E4M3 with a current scale per row (its
  absolute maximum over the contracted axes, computed in the step) and ``lax.dot_general`` on the two
  FP8 operands runs the FP8 tensor-core GEMM; the row and channel scales multiply its float32 output.
- ``mode="dequantize"``: weight-only; the FP8 kernel is widened to the compute dtype inside the dot
  (what XLA does with that, a fused convert or a widened copy, depends on its GEMM emitter).
- ``mode="auto"`` (default): per GEMM, from its static shape: weight-only for at most
  `WEIGHT_ONLY_MAX_ROWS` input rows (a decode step of a few sequences: the GEMM reads the same FP8
  bytes either way, and quantizing the input adds small kernels to a step bound by launches), the
  FP8 GEMM above that (prefill and large batches, where the tensor-core rate counts).

The FP8 kernels are stored transposed, output axes first (``[*layers, *out, *in]``): the FP8
tensor-core GEMM (cuBLASLt's, and Hopper's FP8 MMA) takes both operands with the contracted axis
innermost, and an input parameter in ``[in, out]`` order would be copied into that layout on every
call. The model's ``apply`` transposes them back logically, which XLA folds into the GEMM.

Scales (``granularity``): ``"channel"``, one per output element of the kernel (the absolute maximum
over its contracted axes, the default), or ``"tensor"``, one per kernel (per layer when stacked).
Embeddings, norms and biases stay as they are; so does a tied output projection (``Embed.attend``).

`output_first_weights` stores the kernels in the same output-first layout without quantizing them:
with a few rows XLA reduces a small GEMM over its contracted axes, contiguous in that layout (the
`mtjax.inference.Engine` stores its 16-bit weights so).

Example::

    model8, params8 = quantize_weights(model, params)
    logits = model8.apply({"params": params8}, tokens)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax import fp8
from mtjax.dtypes import has_float32_range

WEIGHT_DTYPE = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(WEIGHT_DTYPE).max)
SCALE_NAME = "weight_scale"
GRANULARITIES = ("channel", "tensor")
MODES = ("auto", "fp8_gemm", "dequantize")
# `mode="auto"`: GEMMs of at most this many input rows run weight-only (docs/performance.md: decode at
# batch 1 measured faster weight-only than with FP8 GEMMs).
WEIGHT_ONLY_MAX_ROWS = 8
# The name of the GEMM submodule beside a kernel parameter: "kernel" -> "dot_general", "wi_kernel" -> "wi_dot_general".
_KERNEL_SUFFIX, _DOT_SUFFIX = "kernel", "dot_general"


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM of a model whose kernel `quantize_weights` stores in FP8.

    Attributes:
      kernel_path: keys of the kernel parameter in the ``params`` tree.
      scale_path: keys of its ``weight_scale`` (under the GEMM's ``DotGeneral`` submodule).
      in_axes: how many leading axes of the (per-layer) kernel the GEMM contracts.
      layer_axes: 1 when the kernel is stacked over scanned layers (leading ``[layers]`` axis), else 0.
    """

    kernel_path: tuple[str, ...]
    scale_path: tuple[str, ...]
    in_axes: int
    layer_axes: int

    def stored_order(self, ndim: int) -> tuple[int, ...]:
        """The axis permutation from the model's kernel layout to the stored one (output axes first)."""
        layers = tuple(range(self.layer_axes))
        contracted = tuple(range(self.layer_axes, self.layer_axes + self.in_axes))
        out = tuple(range(self.layer_axes + self.in_axes, ndim))
        return layers + out + contracted

    def model_order(self, ndim: int) -> tuple[int, ...]:
        """The inverse of `stored_order`."""
        order = self.stored_order(ndim)
        return tuple(order.index(i) for i in range(ndim))


def _unbox(x: Any) -> Any:
    return x.unbox() if isinstance(x, nn.meta.AxisMetadata) else x


def _get(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _set(tree: Mapping[str, Any], path: Sequence[str], value: Any) -> dict[str, Any]:
    """A copy of ``tree`` (nested dicts) with ``value`` at ``path``."""
    out = dict(tree)
    if len(path) == 1:
        out[path[0]] = value
    else:
        out[path[0]] = _set(tree.get(path[0], {}), path[1:], value)
    return out


def find_gemms(model: nn.Module, params: Mapping[str, Any], *example_args: Any, **example_kwargs: Any) -> list[Gemm]:
    """The GEMMs of ``model`` that multiply a kernel parameter, found by tracing ``model.apply`` once.

    ``example_args``/``example_kwargs`` are a call's inputs (default: one token, ``[[0]]``); only shapes
    matter.
    """
    if not example_args and not example_kwargs:
        example_args = (jnp.zeros((1, 1), jnp.int32),)
    calls: dict[tuple[str, ...], tuple[tuple[int, ...], Any]] = {}

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, fp8.DotGeneral) and context.method_name == "__call__":
            rhs, dims = args[1], args[2]
            calls.setdefault(tuple(context.module.path), (tuple(rhs.shape), dims))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda p: model.apply({"params": p}, *example_args, **example_kwargs), params)

    gemms = []
    for path, (rhs_shape, dims) in calls.items():
        name = path[-1]
        if not name.endswith(_DOT_SUFFIX):
            continue
        kernel_path = path[:-1] + (name[: -len(_DOT_SUFFIX)] + _KERNEL_SUFFIX,)
        kernel = _unbox(_get(params, kernel_path))
        (_, rhs_contract), (_, rhs_batch) = dims
        if kernel is None or not hasattr(kernel, "shape") or rhs_batch:
            continue
        if tuple(sorted(rhs_contract)) != tuple(range(len(rhs_contract))):
            continue  # the kernel's contracted axes must lead, as every mtjax projection has them
        size = math.prod(rhs_shape)
        if math.prod(kernel.shape) == size:
            layer_axes = 0
        elif kernel.ndim > 1 and math.prod(kernel.shape[1:]) == size:
            layer_axes = 1
        else:
            continue
        contracted = math.prod(rhs_shape[i] for i in rhs_contract)
        per_layer = kernel.shape[layer_axes:]
        in_axes = next((i for i in range(1, len(per_layer)) if math.prod(per_layer[:i]) == contracted), None)
        if in_axes is None:
            continue
        gemms.append(Gemm(kernel_path=kernel_path, scale_path=path + (SCALE_NAME,), in_axes=in_axes,
                          layer_axes=layer_axes))
    return gemms


def quantize_kernel(kernel: jax.Array, *, in_axes: int, layer_axes: int = 0,
                    granularity: str = "channel") -> tuple[jax.Array, jax.Array]:
    """``(kernel_fp8, scale)`` with ``kernel ~= kernel_fp8 * scale`` (``scale`` broadcast over the
    contracted axes): ``scale [*layers, *out]`` per channel, or ``[*layers, 1, ...]`` per tensor."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize_kernel: granularity={granularity!r}; accepted: {', '.join(GRANULARITIES)}")
    w = kernel.astype(jnp.float32)
    contracted = tuple(range(layer_axes, layer_axes + in_axes))
    if granularity == "channel":
        amax = jnp.max(jnp.abs(w), axis=contracted)
    else:
        out_ndim = kernel.ndim - layer_axes - in_axes
        amax = jnp.max(jnp.abs(w), axis=tuple(range(layer_axes, kernel.ndim)))
        amax = amax.reshape(amax.shape + (1,) * out_ndim)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (w / jnp.expand_dims(scale, contracted)).astype(WEIGHT_DTYPE)
    return q, scale


def _permute_box(boxed: Any, value: jax.Array, order: tuple[int, ...]) -> Any:
    """``value`` in ``boxed``'s logical-axis box, its axis names permuted by ``order``."""
    if not isinstance(boxed, nn.meta.AxisMetadata):
        return value
    if getattr(boxed, "names", None) is not None:
        return dataclasses.replace(boxed, value=value, names=tuple(boxed.names[i] for i in order))
    return boxed.replace_boxed(value)


def quantize_params(params: Mapping[str, Any], gemms: Sequence[Gemm], *,
                    granularity: str = "channel") -> dict[str, Any]:
    """``params`` with the kernels of ``gemms`` in FP8 E4M3, stored output axes first
    (`Gemm.stored_order`), and their ``weight_scale`` added (boxed parameters keep their boxes)."""
    out = dict(params)

    @functools.partial(jax.jit, static_argnames=("gemm", "granularity"))
    def quantize(kernel, gemm, granularity):
        q, scale = quantize_kernel(kernel, in_axes=gemm.in_axes, layer_axes=gemm.layer_axes, granularity=granularity)
        return jnp.transpose(q, gemm.stored_order(q.ndim)), scale

    for gemm in gemms:
        boxed = _get(params, gemm.kernel_path)
        q, scale = quantize(_unbox(boxed), gemm, granularity)
        out = _set(out, gemm.kernel_path, _permute_box(boxed, q, gemm.stored_order(q.ndim)))
        out = _set(out, gemm.scale_path, scale)
    return out


def model_layout(params: Mapping[str, Any], gemms: Sequence[Gemm]) -> dict[str, Any]:
    """``params`` of `quantize_params` with the FP8 kernels transposed back to the model's layout (a
    logical transpose inside a traced step, which XLA folds into the GEMMs)."""
    out = dict(params)
    for gemm in gemms:
        boxed = _get(params, gemm.kernel_path)
        kernel = _unbox(boxed)
        order = gemm.model_order(kernel.ndim)
        out = _set(out, gemm.kernel_path, _permute_box(boxed, jnp.transpose(kernel, order), order))
    return out


def fp8_weight_dot_general(weight_scale: jax.Array, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                           precision: Any = None, preferred_element_type: Any = None, lhs_prologue: Any = None, *,
                           mode: str = "auto") -> jax.Array:
    """`mtjax.fp8.DotGeneral`'s call on a kernel holding FP8 values (``rhs``, possibly widened by the
    model's cast: narrowing it again is exact and XLA drops the pair of converts) with its
    ``weight_scale``. Returns ``lhs``'s dtype (or ``preferred_element_type``)."""
    if mode not in MODES:
        raise ValueError(f"fp8_weight_dot_general: mode={mode!r}; accepted: {', '.join(MODES)}")
    if lhs_prologue is not None:
        (lhs_contract, _), (lhs_batch, _) = dimension_numbers
        if tuple(lhs_contract) != (jax.eval_shape(lhs_prologue, lhs).ndim - 1,) or lhs_batch:
            raise ValueError(f"fp8_weight_dot_general: lhs_prologue needs its output contracted over its last "
                             f"axis alone; got dimension_numbers={dimension_numbers}")
        return fp8.dot_with_prologue(lhs, lhs_prologue, lambda x: fp8_weight_dot_general(
            weight_scale, x, rhs, dimension_numbers, precision, preferred_element_type, mode=mode))
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_batch or rhs_batch:
        raise ValueError("fp8_weight_dot_general: GEMMs with batch dimensions are not supported")
    out_dtype = preferred_element_type or lhs.dtype
    rhs_free = tuple(rhs.shape[i] for i in range(rhs.ndim) if i not in rhs_contract)
    lhs_free = tuple(lhs.shape[i] for i in range(lhs.ndim) if i not in lhs_contract)
    w_scale = weight_scale.reshape(rhs_free) if weight_scale.size > 1 else weight_scale.reshape(())
    w8 = rhs.astype(WEIGHT_DTYPE)
    if mode == "auto":
        mode = "dequantize" if math.prod(lhs_free) <= WEIGHT_ONLY_MAX_ROWS else "fp8_gemm"
    if mode == "dequantize":
        w = w8.astype(lhs.dtype)
        if has_float32_range(lhs.dtype) and jnp.dtype(out_dtype).itemsize <= jnp.dtype(lhs.dtype).itemsize:
            # A result in the input's dtype (its tiles accumulate in float32): asking a float32 result
            # of a 16-bit dot makes XLA widen both operands to float32 first, a slower GEMM on the same
            # bytes. float16 keeps the float32 result: the products of the unscaled kernel (its
            # channels stretched to the E4M3 range) can pass float16's largest value.
            y = lax.dot_general(lhs, w, dimension_numbers).astype(jnp.float32)
        else:
            y = lax.dot_general(lhs, w, dimension_numbers, preferred_element_type=jnp.float32)
    else:
        x = lhs.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x), axis=tuple(lhs_contract), keepdims=True)
        x_scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
        x8 = (x / x_scale).astype(WEIGHT_DTYPE)
        y = lax.dot_general(x8, w8, dimension_numbers, preferred_element_type=jnp.float32)
        y = y * x_scale.reshape(lhs_free + (1,) * len(rhs_free))
    return (y * w_scale).astype(out_dtype)


def fp8_weights_interceptor(mode: str = "auto"):
    """A `flax.linen.intercept_methods` interceptor: every `mtjax.fp8.DotGeneral` that has a
    ``weight_scale`` parameter runs `fp8_weight_dot_general`; everything else runs unchanged."""
    if mode not in MODES:
        raise ValueError(f"fp8_weights_interceptor: mode={mode!r}; accepted: {', '.join(MODES)}")

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if (context.method_name == "__call__" and isinstance(module, fp8.DotGeneral)
                and module.has_variable("params", SCALE_NAME)):
            if fp8.current_autocast() is not None:
                raise ValueError("FP8 weights: do not run the model inside mtjax.fp8.fp8_autocast as well")
            return fp8_weight_dot_general(module.get_variable("params", SCALE_NAME), *args, mode=mode, **kwargs)
        return next_fun(*args, **kwargs)

    return intercept


def _stored_weights_class(cls: type) -> type:
    """A subclass of the model class whose ``apply`` takes kernels stored output axes first
    (``stored_gemms``) and, with a ``fp8_weights_mode``, runs under `fp8_weights_interceptor`."""

    def apply(self, variables, *args, **kwargs):
        variables = {**variables, "params": model_layout(variables["params"], self.stored_gemms)}
        if self.fp8_weights_mode is None:
            return cls.apply(self, variables, *args, **kwargs)
        with nn.intercept_methods(fp8_weights_interceptor(self.fp8_weights_mode)):
            return cls.apply(self, variables, *args, **kwargs)

    return type(f"StoredWeights{cls.__name__}", (cls,), {
        "__module__": __name__, "__annotations__": {"fp8_weights_mode": str | None, "stored_gemms": tuple},
        "fp8_weights_mode": None, "stored_gemms": (),
        "apply": nn.nowrap(apply),
        "__doc__": f"`{cls.__name__}` whose GEMM kernels are stored output axes first, FP8 or not "
                   "(`mtjax.inference.fp8_weights`).",
    })


_classes: dict[type, type] = {}


def quantize_weights(model: nn.Module, params: Mapping[str, Any], *, granularity: str = "channel",
                     mode: str = "auto", example_args: Sequence[Any] = ()) -> tuple[nn.Module, dict[str, Any]]:
    """``(model_fp8, params_fp8)``: ``model`` (a subclass instance with the same fields, so it is still
    e.g. a `mtjax.models.GPT`) whose ``apply`` runs the GEMMs on FP8 kernels, and ``params`` with those
    kernels quantized and stored transposed (module docstring): use them with ``model_fp8.apply`` only.

    Args:
      model: a flax module whose projections go through `mtjax.fp8.DotGeneral` (every mtjax model).
      params: its ``params`` collection (boxed or not).
      granularity: ``"channel"`` or ``"tensor"`` scales.
      mode: ``"auto"`` (weight-only up to `WEIGHT_ONLY_MAX_ROWS` input rows, FP8 GEMMs above),
        ``"fp8_gemm"`` (FP8 GEMMs, inputs quantized per row) or ``"dequantize"`` (weight-only).
      example_args: inputs of one call for the trace that finds the GEMMs (default ``[[0]]`` tokens).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize_weights: granularity={granularity!r}; accepted: {', '.join(GRANULARITIES)}")
    if mode not in MODES:
        raise ValueError(f"quantize_weights: mode={mode!r}; accepted: {', '.join(MODES)}")
    gemms = _gemms_of("quantize_weights", model, params, example_args)
    return (_stored_weights_model(model, gemms, fp8_weights_mode=mode),
            quantize_params(params, gemms, granularity=granularity))


def output_first_weights(model: nn.Module, params: Mapping[str, Any], *,
                         example_args: Sequence[Any] = ()) -> tuple[nn.Module, dict[str, Any]]:
    """``(model_t, params_t)``: ``model``'s GEMM kernels in their own dtype but stored output axes first,
    as FP8 weights are (``[*layers, *out, *in]``); ``model_t`` (a subclass instance with the same fields)
    transposes them back logically in its ``apply``, which XLA folds into the GEMMs.

    Why: with a few rows (a decode step) XLA computes a small GEMM as a multiply and a reduction over
    the contracted axes. Stored output axes first, those are the innermost, contiguous axes of each
    kernel: one fused row reduction. In the model's ``[*in, *out]`` layout they are the outer axes,
    which XLA either transposes into place first or reduces as a separate multiply written to memory.

    Args:
      model, params, example_args: as in `quantize_weights`.
    """
    gemms = _gemms_of("output_first_weights", model, params, example_args)
    out = dict(params)

    @functools.partial(jax.jit, static_argnames=("order",))
    def transpose(kernel, order):
        return jnp.transpose(kernel, order)

    for gemm in gemms:
        boxed = _get(params, gemm.kernel_path)
        order = gemm.stored_order(_unbox(boxed).ndim)
        out = _set(out, gemm.kernel_path, _permute_box(boxed, transpose(_unbox(boxed), order), order))
    return _stored_weights_model(model, gemms, fp8_weights_mode=None), out


def _gemms_of(owner: str, model: nn.Module, params: Mapping[str, Any], example_args: Sequence[Any]) -> list[Gemm]:
    if getattr(model, "stored_gemms", None) is not None:
        raise ValueError(f"{owner}: the model's kernels are stored output first already (FP8 or not)")
    gemms = find_gemms(model, params, *example_args)
    if not gemms:
        raise ValueError(f"{owner}: found no GEMM kernels in {type(model).__name__} (projections must go "
                         "through mtjax.fp8.DotGeneral)")
    return gemms


def _stored_weights_model(model: nn.Module, gemms: Sequence[Gemm], *, fp8_weights_mode: str | None) -> nn.Module:
    base = type(model)
    if base not in _classes:
        _classes[base] = _stored_weights_class(base)
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.init and f.name not in ("parent", "name")}
    return _classes[base](**fields, fp8_weights_mode=fp8_weights_mode, stored_gemms=tuple(gemms))
