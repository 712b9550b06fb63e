"""FP8 training: formats, recipes, delayed-scaling state as Flax variables, the FP8 GEMM.

Every mtjax GEMM runs in a `DotGeneral` submodule, called like ``lax.dot_general``. Outside
`fp8_autocast` it is exactly that; inside, both operands are quantized to FP8 and the GEMM and its
two backward GEMMs (dgrad, wgrad) run on FP8 tensor cores::

    with fp8_autocast(recipe=DelayedScaling()):
        variables = model.init(key, x)                 # {"params": ..., "fp8_meta": ...}
        grads = jax.grad(loss_fn)(variables, x)        # grads["fp8_meta"] is the NEXT step's meta
    params_and_meta, opt_state = Optimizer(optax.adamw(1e-3)).apply_gradients(variables, grads, opt_state)

`fp8_autocast` is read when a function is traced: enter it inside the function you `jax.jit` (or
around its first call); a function traced outside it stays a plain-precision function.

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

Each GEMM operand is cast once with its transpose and amax (`cast_transpose`, a Pallas kernel on
GPUs), and the dequantization scales ride into cuBLASLt's FP8 GEMM (`fp8_gemm`). A norm or an
activation in front of a GEMM writes its FP8 input directly (``lhs_prologue``), and an MLP's two
GEMMs run as one op (`fp8_mlp`) whose activation backward writes fc1's FP8 output gradient. On CUDA,
compile FP8 steps with `compiler_options()` (Triton GEMM fusions off: every FP8 GEMM stays on cuBLASLt).

Limitation: one `DotGeneral` instance must run once per differentiated function (``nn.scan`` and
``nn.remat`` are fine): cotangents of a meta read twice would be summed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from mtjax import backend
from mtjax.kernels import quantize as quantize_kernels
from mtjax.kernels._common import too_small
from mtjax.ops import Activation, Norm, is_gated

# What can run in front of an FP8 GEMM, fused with the quantization of its input.
Prologue = Union[Norm, Activation]

FP8_COLLECTION = "fp8_meta"

# The tensors of one GEMM that get their own scale, in the order the meta lists them.
ROLES = ("input", "kernel", "output_grad")
# The delayed-scaling state of one GEMM: an amax history and a scale per role.
META_KEYS = tuple(f"{role}_{field}" for role in ROLES for field in ("amax_history", "scale"))
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)


# --------------------------------------------------------------------------------------------------
# Formats and recipes
# --------------------------------------------------------------------------------------------------


class Format(enum.Enum):
    """Which FP8 dtypes a recipe uses: forward operands (input, kernel) and output gradients."""

    E4M3 = "E4M3"  # both E4M3 (3 mantissa bits, |x| <= 448)
    E5M2 = "E5M2"  # both E5M2 (2 mantissa bits, |x| <= 57344); E5M2 x E5M2 has no FP8 tensor-core GEMM
    HYBRID = "HYBRID"  # E4M3 forward, E5M2 gradients (which need range more than precision)

    def dtypes(self, fnuz: bool = False) -> tuple[Any, Any]:
        """``(forward dtype, gradient dtype)``; ``fnuz=True`` gives the variants ROCm MI300 computes in."""
        e4m3 = jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn
        e5m2 = jnp.float8_e5m2fnuz if fnuz else jnp.float8_e5m2
        return {Format.E4M3: (e4m3, e4m3), Format.E5M2: (e5m2, e5m2), Format.HYBRID: (e4m3, e5m2)}[self]


def _check_int(owner: str, field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}({field}={value!r}): expected an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"{owner}({field}={value!r}): expected an int >= {minimum}")


def _check_format(owner: str, value: Any) -> None:
    if not isinstance(value, Format):
        raise TypeError(f"{owner}(fp8_format={value!r}): expected one of {[f'Format.{f.name}' for f in Format]}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scales from the amaxes of past steps (TransformerEngine's delayed scaling).

    Attributes:
      margin: ``scale = (fp8_max / amax) / 2**margin``; each unit halves the scale, leaving headroom.
      amax_history_len: how many steps' amaxes each tensor keeps.
      amax_compute_algo: ``"max"`` of the history or its ``"most_recent"`` entry.
      fp8_format: a `Format`; ``HYBRID`` is E4M3 forward and E5M2 gradients.
      reduce_amax: max-reduce each amax over `fp8_autocast`'s ``mesh_axes`` so replicas share a scale.
        (Inside ``shard_map`` amaxes are always reduced over the axes the data varies over and the meta
        does not: replicated meta must stay replicated.)
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: Format = Format.HYBRID
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        _check_int("DelayedScaling", "margin", self.margin, 0)
        _check_int("DelayedScaling", "amax_history_len", self.amax_history_len, 1)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"DelayedScaling(amax_compute_algo={self.amax_compute_algo!r}): accepted: {AMAX_COMPUTE_ALGOS}"
            )
        _check_format("DelayedScaling", self.fp8_format)
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"DelayedScaling(reduce_amax={self.reduce_amax!r}): expected True or False")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor scales from each tensor's own amax in the same step (no state, one extra pass).

    Attributes:
      fp8_format: a `Format`.
    """

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_format("CurrentScaling", self.fp8_format)


Recipe = Union[DelayedScaling, CurrentScaling]


def _uses_fnuz() -> bool:
    """MI300 (gfx94x) computes FP8 in the fnuz dtypes; other GPUs (and MI350, gfx95x) in the OCP ones."""
    if backend.platform() != "rocm":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("gfx94")


# --------------------------------------------------------------------------------------------------
# fp8_autocast
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Autocast:
    """What an active `fp8_autocast` set.

    Attributes:
      recipe: the `DelayedScaling` or `CurrentScaling` recipe every FP8 GEMM uses.
      mesh_axes: mesh axis names amaxes are max-reduced over (where bound, e.g. inside shard_map).
    """

    recipe: Recipe
    mesh_axes: tuple[str, ...]


_autocast: contextvars.ContextVar[Autocast | None] = contextvars.ContextVar("mtjax_fp8_autocast", default=None)


def current_autocast() -> Autocast | None:
    """The active `fp8_autocast` settings, or ``None`` outside it (or inside ``enabled=False``)."""
    return _autocast.get()


def _check_mesh_axes(mesh_axes: str | Sequence[str] | None) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    if not all(isinstance(a, str) and a for a in axes):
        raise TypeError(f"fp8_autocast(mesh_axes={mesh_axes!r}): expected None, an axis name or a sequence of them")
    return axes


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Recipe | None = None,
                 mesh_axes: str | Sequence[str] | None = None) -> Iterator[None]:
    """Run every `DotGeneral` traced inside in FP8 with ``recipe`` (default `DelayedScaling()`).

    Args:
      enabled: ``False`` turns FP8 off inside (also inside an enclosing ``fp8_autocast``).
      recipe: `DelayedScaling` or `CurrentScaling`.
      mesh_axes: mesh axes (e.g. ``("dp", "fsdp")``) over which amaxes are max-reduced with
        ``lax.pmax`` where those axes are bound (inside ``shard_map``). Under plain ``jit`` with
        sharded arrays ``jnp.max`` already is the global max, so nothing needs naming there.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast(enabled={enabled!r}): expected True or False")
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise TypeError(f"fp8_autocast(recipe={recipe!r}): expected a DelayedScaling or CurrentScaling")
    state = Autocast(recipe, _check_mesh_axes(mesh_axes)) if enabled else None
    token = _autocast.set(state)
    try:
        yield
    finally:
        _autocast.reset(token)


# --------------------------------------------------------------------------------------------------
# Scaling: amax, scale, history, quantize
# --------------------------------------------------------------------------------------------------


def _check_fp8_dtype(fn: str, dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    if dtype not in [jnp.dtype(d) for d in FP8_DTYPES]:
        raise TypeError(f"{fn}(dtype={dtype}): expected one of {[jnp.dtype(d).name for d in FP8_DTYPES]}")
    return dtype


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2, 240 for E4M3 fnuz)."""
    return float(jnp.finfo(_check_fp8_dtype("fp8_max", dtype)).max)


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


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``saturate_cast(x * scale)`` to the FP8 ``dtype``: values beyond ±fp8_max (and ±Inf) clip to
    ±fp8_max, never Inf; NaN stays NaN. The product is formed in float32."""
    dtype = _check_fp8_dtype("quantize", dtype)
    limit = fp8_max(dtype)
    scaled = x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return jnp.clip(scaled, -limit, limit).astype(dtype)


@backend.register("cast_transpose", backend.REFERENCE)
def cast_transpose_reference(x: jax.Array, scale: jax.Array, *, out_dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = quantize(x, scale, out_dtype)
    return q, jnp.swapaxes(q, -1, -2), amax(x)


# The Pallas kernel reads x once where XLA may run a reduce, the cast and a transpose of the cast.
@backend.register("cast_transpose", "pallas_triton", requires=(backend.PALLAS_TRITON,), priority=10,
                  single_device=True, prefer=too_small,
                  supports=lambda x, scale, *, out_dtype: quantize_kernels.supported(x.shape, x.dtype, out_dtype))
def _cast_transpose_pallas(x, scale, *, out_dtype):
    return quantize_kernels.cast_transpose(x, scale, out_dtype)


def cast_transpose(x: jax.Array, scale: jax.Array, dtype: Any, *,
                   implementation: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q, swapaxes(q, -1, -2), max |x|)`` with ``q = quantize(x, scale, dtype)``: what an FP8 GEMM
    and its backward need of one operand (the transpose feeds the GEMM that contracts the other
    axis). The amax is float32, local (not reduced over mesh axes)."""
    dtype = _check_fp8_dtype("cast_transpose", dtype)
    if jnp.ndim(x) < 2:
        raise ValueError(f"cast_transpose: x must have at least 2 axes; got shape {jnp.shape(x)}")
    return backend.dispatch("cast_transpose", x, jnp.reshape(jnp.asarray(scale, jnp.float32), ()),
                            implementation=implementation, out_dtype=jnp.dtype(dtype))


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """``q * (1 / scale)`` in ``dtype``: the inverse of `quantize` up to FP8 rounding."""
    _check_fp8_dtype("dequantize", q.dtype)
    return (q.astype(jnp.float32) * (1.0 / jnp.asarray(scale, jnp.float32))).astype(dtype)


def init_meta(amax_history_len: int = 1024) -> dict[str, jax.Array]:
    """The delayed-scaling state of one GEMM before its first step: zero histories, unit scales."""
    _check_int("init_meta", "amax_history_len", amax_history_len, 1)
    meta = {}
    for role in ROLES:
        meta[f"{role}_amax_history"] = jnp.zeros((amax_history_len,), jnp.float32)
        meta[f"{role}_scale"] = jnp.ones((), jnp.float32)
    return meta


def compiler_options(platform: str | None = None) -> dict[str, Any]:
    """XLA options for a jitted step whose GEMMs run in FP8 on ``platform`` (default: jax's backend).

    On CUDA GPUs Triton GEMM fusions are switched off, so XLA hands every FP8 dot to cuBLASLt's FP8
    GEMM (dequantization scales folded in) instead of autotuning Triton fusions for each shape. On
    an H200 (jax 0.11.2) the 1.3B GPT train step under `fp8_autocast` then compiled in 2 s instead of
    163 s, and the dense FP8 GEMMs all ran on cuBLASLt, at or above the speed of the Triton choice.
    Elsewhere (CPU, ROCm, PJRT plugins: not measured): none. Pass to ``jax.jit(...,
    compiler_options=...)``; ``make_train_step`` and ``mtjax train --fp8`` do.
    """
    return {"xla_gpu_enable_triton_gemm": False} if (platform or backend.platform()) == "cuda" else {}


# --------------------------------------------------------------------------------------------------
# The scaled FP8 GEMM (op "fp8_gemm") and fp8_dot_general
# --------------------------------------------------------------------------------------------------


def _accumulator_dtype(out_dtype: Any) -> Any:
    # The GEMM writes bf16 directly when that is the output (no f32 round trip through memory);
    # float16 would overflow before the scales shrink the result, so it goes through float32.
    return jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32


@backend.register("fp8_gemm", backend.REFERENCE)
def fp8_gemm_reference(a, b, a_scale_inv, b_scale_inv, *, out_dtype):
    # dot_general on the float8 operands themselves: XLA turns this into cuBLASLt's FP8 GEMM (it
    # does not rewrite "dequantize, then a bf16 dot"); contracting the last axis of both is the
    # layout FP8 tensor cores take without a transpose. The dequantization scale multiplies the
    # GEMM's output in its own dtype, so XLA's GEMM rewriter folds it into cuBLASLt's scale operand
    # instead of running an elementwise pass over the result (a convert in between would stop it).
    # For bf16 this rounds the scale to bf16 (relative error at most 2**-9, far below E4M3's 2**-4).
    batch = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (b.ndim - 1,)), (batch, batch))
    accumulator = _accumulator_dtype(out_dtype)
    out = lax.dot_general(a, b, dims, preferred_element_type=accumulator)
    return (out * (a_scale_inv * b_scale_inv).astype(accumulator)).astype(out_dtype)


def fp8_gemm(a: jax.Array, b: jax.Array, a_scale_inv: jax.Array, b_scale_inv: jax.Array, *,
             out_dtype: Any, implementation: str | None = None) -> jax.Array:
    """``(a @ b^T) * a_scale_inv * b_scale_inv``, the GEMM every FP8 dot reduces to.

    Args:
      a: float8 ``[*batch, M, K]``.
      b: float8 ``[*batch, N, K]`` (both contract over their last axis).
      a_scale_inv, b_scale_inv: float32 scalars, ``1 / scale`` of each operand.
      out_dtype: dtype of the ``[*batch, M, N]`` result.
      implementation: ``"xla"`` (XLA's cuBLASLt FP8 GEMM on GPUs) or a registered kernel.
    """
    for name, x in (("a", a), ("b", b)):
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FP8_DTYPES]:
            raise TypeError(f"fp8_gemm: {name} has dtype {x.dtype}; expected a float8 dtype")
    if a.ndim < 2 or a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"fp8_gemm: a {a.shape} and b {b.shape} must be [*batch, M, K] and [*batch, N, K]")
    return backend.dispatch("fp8_gemm", a, b, a_scale_inv, b_scale_inv, implementation=implementation,
                            out_dtype=jnp.dtype(out_dtype))


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
              implementation: str | None) -> "_GemmSpec":
        """The spec of a GEMM under ``recipe``, its FP8 dtypes from the recipe's format."""
        fwd_dtype, bwd_dtype = recipe.fp8_format.dtypes(fnuz=_uses_fnuz())
        return cls(recipe=recipe, fwd_dtype=fwd_dtype, bwd_dtype=bwd_dtype, reduce_axes=tuple(sorted(reduce_axes)),
                   x_dtype=x_dtype, w_dtype=w_dtype, out_dtype=out_dtype, implementation=implementation)


def _delayed_scale(role: str, meta: Mapping[str, jax.Array], spec: _GemmSpec, dtype: Any) -> jax.Array:
    """The scale a role quantizes with under `DelayedScaling`: known before the tensor is seen."""
    recipe = spec.recipe
    history = meta[f"{role}_amax_history"]
    return compute_scale(history_amax(history, recipe.amax_compute_algo), meta[f"{role}_scale"], fp8_max(dtype),
                         recipe.margin)


def _delayed_cast(role: str, meta: Mapping[str, jax.Array], spec: _GemmSpec, dtype: Any,
                  cast: Callable[[jax.Array], tuple]) -> tuple:
    """``(q, q transposed, scale, the role's next state, *extra)`` under `DelayedScaling`: the scale
    comes from the role's history, ``cast(scale) -> (q, q transposed, amax, *extra)`` writes the FP8
    tensor (a cast_transpose, or a kernel fused with the op producing it), and its amax, max-reduced
    over ``spec.reduce_axes``, enters the next state."""
    scale = _delayed_scale(role, meta, spec, dtype)
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
    return (*_prologue_bwd(x, prologue, d_operand), dw, next_meta)


def _prologue_bwd(x, prologue, d_out):
    """``(dx, d_prologue)``: the prologue's own backward from its saved input (``prologue`` None: the
    identity)."""
    if prologue is None:
        return d_out, None
    _, prologue_vjp = jax.vjp(lambda x, prologue: prologue(x), x, prologue)
    return prologue_vjp(d_out)


_fp8_prologue_matmul.defvjp(_fp8_prologue_matmul_fwd, _fp8_prologue_matmul_bwd)


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
    dx, d_norm = _prologue_bwd(x, norm, d_fc1_input)
    return dx, d_norm, dw1.reshape(w1_shape), d_activation, dw2, next_meta1, next_meta2


_fp8_mlp.defvjp(_fp8_mlp_fwd, _fp8_mlp_bwd)


def fuses_mlp(*arrays: jax.Array) -> bool:
    """Whether `fp8_mlp` applies to these operands here: inside `fp8_autocast` with
    `DelayedScaling`, and not per-device arrays of ``shard_map`` (which take `fp8_dot_general`'s
    path, one GEMM at a time)."""
    state = current_autocast()
    return (state is not None and isinstance(state.recipe, DelayedScaling)
            and not any(_varying_axes(a) for a in arrays))


def fp8_mlp(x: jax.Array, w1: jax.Array, w2: jax.Array, meta1: Mapping[str, jax.Array],
            meta2: Mapping[str, jax.Array], *, activation: Activation, norm: Norm | None = None,
            recipe: DelayedScaling | None = None, mesh_axes: Sequence[str] = (),
            implementation: str | None = None) -> jax.Array:
    """``activation(norm(x) @ w1) @ w2`` with both GEMMs in FP8 (a Transformer MLP without dropout).

    The same numbers as `fp8_dot_general` with ``lhs_prologue=norm`` for fc1 and
    ``lhs_prologue=activation`` for fc2, in one ``custom_vjp`` so that the activation's backward
    writes fc1's output gradient directly in FP8 with its transpose (`mtjax.ops.activation_grad_fp8`,
    TransformerEngine's "dact + cast_transpose"): one pass over the MLP's widest tensor fewer.

    Args:
      x: ``[..., hidden]``.
      w1: ``[hidden, mlp]``, or ``[hidden, 2, mlp]`` for a gated activation.
      w2: ``[mlp, out]``.
      meta1, meta2: the two GEMMs' delayed-scaling states (`init_meta`); differentiating gives the next ones.
      activation: a `mtjax.ops.Activation` (its bias and type).
      norm: a `mtjax.ops.Norm` applied to ``x`` first, or ``None``.
      recipe: a `DelayedScaling` (default: ``DelayedScaling()``).
      mesh_axes, implementation: as `fp8_dot_general`.
    Returns:
      ``[..., out]`` in the result type of the operands.
    """
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"fp8_mlp(recipe={recipe!r}): expected a DelayedScaling (its scales are known before "
                        "the tensors are seen, which the fused backward needs)")
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
    if any(_varying_axes(a) for a in (x, w1, w2)):
        raise ValueError("fp8_mlp: operands vary over shard_map axes; use fp8_dot_general per GEMM there")
    reduce_axes = _bound_axes(mesh_axes) if recipe.reduce_amax else ()
    h_dtype = jnp.result_type(x.dtype, w1.dtype)
    specs = [_GemmSpec.build(recipe, reduce_axes, x_dtype, w.dtype, jnp.result_type(x_dtype, w.dtype), implementation)
             for x_dtype, w in ((x.dtype, w1), (h_dtype, w2))]
    out = _fp8_mlp(x.reshape(-1, hidden), norm, w1, activation, w2, meta1, meta2, *specs)
    return out.reshape(x.shape[:-1] + w2.shape[1:])


def _check_meta(meta: Any, recipe: Recipe) -> None:
    if isinstance(recipe, CurrentScaling):
        if meta is not None:
            raise ValueError("fp8_dot_general(meta=...): CurrentScaling keeps no state; pass meta=None")
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
      meta: the GEMM's state (`init_meta`) under `DelayedScaling`; ``None`` under `CurrentScaling`.
        Differentiating with respect to it gives the next state, not a gradient.
      recipe: `DelayedScaling` (default) or `CurrentScaling`.
      mesh_axes: mesh axes amaxes are max-reduced over where bound (see `fp8_autocast`).
      implementation: the ``fp8_gemm`` implementation (default: chosen by `mtjax.backend`).
      lhs_prologue: an op applied to ``lhs`` first, whose output is the GEMM's left operand:
        `mtjax.ops.Norm` (normalize the last axis) or `mtjax.ops.Activation` (bias + activation;
        ``lhs [..., 2, hidden]`` when gated). ``dimension_numbers`` then refer to its output, which
        must be contracted over its last axis alone, with no batch axes. Under `DelayedScaling` the
        prologue's kernel writes the FP8 input of the GEMM and its amax directly
        (`mtjax.ops.layernorm_fp8`, `mtjax.ops.activation_fp8`), so its bf16 output never goes
        through memory; its backward is the prologue's own.
    Returns:
      the ``lax.dot_general`` result in ``preferred_element_type`` or the operands' result type.
    """
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise TypeError(f"fp8_dot_general(recipe={recipe!r}): expected a DelayedScaling or CurrentScaling")
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
    data_axes = _varying_axes(lhs) | _varying_axes(rhs)
    lhs = lax.pcast(lhs, tuple(sorted(data_axes - _varying_axes(lhs))), to="varying")
    rhs = lax.pcast(rhs, tuple(sorted(data_axes - _varying_axes(rhs))), to="varying")
    meta_axes = frozenset().union(*(_varying_axes(v) for v in jax.tree.leaves(meta)))
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
    if lhs_prologue is None:
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
            lhs = lhs if lhs_prologue is None else lhs_prologue(lhs)
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)
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


# --------------------------------------------------------------------------------------------------
# Gradients: the meta rides on them; optimizers never see it
# --------------------------------------------------------------------------------------------------


def split_gradients(grads: Any) -> tuple[Any, Any]:
    """``(param_grads, new_fp8_meta)``: ``grads`` without its ``FP8_COLLECTION`` entry, and that
    entry (``{}`` when there is none, e.g. outside `fp8_autocast`)."""
    if not isinstance(grads, Mapping) or FP8_COLLECTION not in grads:
        return grads, {}
    return {k: v for k, v in grads.items() if k != FP8_COLLECTION}, grads[FP8_COLLECTION]


def _with_meta(tree: Any, meta: Any) -> Any:
    return {**tree, FP8_COLLECTION: meta} if meta else tree


def accumulate_gradients(acc: Any | None, grads: Any) -> Any:
    """Add one micro-batch's gradients to ``acc`` (``None`` for the first): parameter gradients are
    summed, FP8 meta combined by elementwise max, which gives the meta one batch of all the
    micro-batches would give: every micro-batch rolled the same history and used the same scale,
    and the amax of a union is the max of the amaxes."""
    if acc is None:
        return grads
    acc_params, acc_meta = split_gradients(acc)
    params, meta = split_gradients(grads)
    summed = jax.tree.map(jnp.add, acc_params, params)
    return _with_meta(summed, jax.tree.map(jnp.maximum, acc_meta, meta))


def finalize_accumulated(acc: Any, num_micro_batches: int) -> Any:
    """Average the parameter gradients of ``num_micro_batches`` accumulated micro-batches (for losses
    that are means over each micro-batch); the meta is already final."""
    _check_int("finalize_accumulated", "num_micro_batches", num_micro_batches, 1)
    params, meta = split_gradients(acc)
    averaged = jax.tree.map(lambda g: (g / num_micro_batches).astype(g.dtype), params)
    return _with_meta(averaged, meta)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax transformation applied to everything but the FP8 meta; the meta is replaced.

    ``tx`` sees only the non-meta part of the variables and gradients, so clipping, global norms,
    Adam moments and weight decay never touch the meta; the new meta from the gradients replaces
    the old one (adding an update could not reproduce it exactly).

    Attributes:
      tx: any ``optax.GradientTransformation``.
    """

    tx: optax.GradientTransformation

    def init(self, variables: Any) -> optax.OptState:
        """The optimizer state for the non-meta part of ``variables``."""
        return self.tx.init(split_gradients(variables)[0])

    def apply_gradients(self, variables: Any, grads: Any, opt_state: optax.OptState) -> tuple[Any, optax.OptState]:
        """``(new_variables, new_opt_state)``; the meta of ``grads`` (else of ``variables``) is kept."""
        params, old_meta = split_gradients(variables)
        param_grads, new_meta = split_gradients(grads)
        updates, opt_state = self.tx.update(param_grads, opt_state, params)
        return _with_meta(optax.apply_updates(params, updates), new_meta or old_meta), opt_state
