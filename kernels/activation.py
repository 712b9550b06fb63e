"""Bias + activation as Pallas Triton kernels: forward (optionally FP8 output + amax) and backward.

``y = act(x + bias)`` for every activation of `mtjax.ops.activation` but the erf GELU: ``gelu``
(tanh form), ``silu``, ``relu``, ``quick_gelu``, ``squared_relu``, and the gated ones where
``x [..., 2, hidden]`` holds ``a = x[..., 0, :]`` and ``gate = x[..., 1, :]`` (bias ``[2, hidden]``)
and ``y = act(a + bias_a) * g(gate + bias_gate)``, ``g`` the identity or, for ``clamped_swiglu``,
the clamp ``clip(gate, -7, 7) + 1``.
The launchers take 2-D ``[rows, k]``: a contiguous ``[..., 2, hidden]`` is viewed as rows
``[a | gate]`` of ``k = 2 * hidden`` (a free reshape on one device). The erf GELU is not here
(Triton lowering has no erf).
Each program handles a ``[block_m, block_n]`` tile of the output (both halves of the input for the
gated forms). The backward kernel recomputes ``act`` from the saved input and writes ``dx``;
``dbias`` is the column sum of ``dx``. Its FP8 variant (`backward_fp8`, TransformerEngine's
"dact + cast_transpose") writes ``dx`` quantized, its transpose and its amax instead: the output
gradient of the FP8 GEMM that produced ``x``, so that GEMM's backward needs no cast of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtjax.kernels.common import (
    LOG2E,
    Launchers,
    check_kernel_fp8_dtype,
    check_size,
    interpret,
    next_power_of_2,
    pallas_call,
    reduce_tile_maxima,
    saturate_cast,
    unsupported_array,
    vary_together,
    with_ptx,
)
from mtjax.kernels.common import (
    pallas_triton as plgpu,
)

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715
QUICK_GELU_ALPHA = 1.702
# clamped_swiglu's constants: TransformerEngine's ClampedSwigluParams defaults (gpt-oss's values).
CLAMP_LIMIT, CLAMP_ALPHA, CLAMP_GATE_OFFSET = 7.0, 1.702, 1.0


def _gelu(x, sigmoid=None):
    """GELU's tanh form and its derivative; with ``sigmoid``, as ``x * sigmoid(2u)`` (the same function:
    ``(1 + tanh(u)) / 2 = sigmoid(2u)``) through that sigmoid."""
    inner = _SQRT_2_OVER_PI * (x + _GELU_CUBIC * x * x * x)
    slope = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * x * x)
    if sigmoid is not None:
        s = sigmoid(2.0 * inner)
        return x * s, s + 2.0 * x * s * (1.0 - s) * slope
    t = jnp.tanh(inner)
    return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * slope


def _sigmoid_linear(x, k):
    s = 1.0 / (1.0 + jnp.exp(-k * x))
    return x * s, s * (1.0 + k * x * (1.0 - s))


def _relu(x):
    return jnp.maximum(x, 0.0), jnp.where(x > 0.0, 1.0, 0.0)


def _squared_relu(x):
    r = jnp.maximum(x, 0.0)
    return r * r, 2.0 * r


def _sigmoid(x):
    s = 1.0 / (1.0 + jnp.exp(-x))
    return s, s * (1.0 - s)


def _clamped_silu(x):
    y, dy = _sigmoid_linear(jnp.minimum(x, CLAMP_LIMIT), CLAMP_ALPHA)
    return y, jnp.where(x <= CLAMP_LIMIT, dy, 0.0)  # the limit itself passes the gradient, as in TE


def _linear(gate):
    return gate, 1.0


def _clamped_linear(gate):
    inside = (gate >= -CLAMP_LIMIT) & (gate <= CLAMP_LIMIT)
    return jnp.clip(gate, -CLAMP_LIMIT, CLAMP_LIMIT) + CLAMP_GATE_OFFSET, jnp.where(inside, 1.0, 0.0)


# name -> (``f(a) -> (act(a), act'(a))``, ``g(gate) -> (g(gate), g'(gate))`` or None when not
# gated), in float32.
ACTIVATIONS = {
    "gelu": (_gelu, None),
    "silu": (functools.partial(_sigmoid_linear, k=1.0), None),
    "relu": (_relu, None),
    "quick_gelu": (functools.partial(_sigmoid_linear, k=QUICK_GELU_ALPHA), None),
    "squared_relu": (_squared_relu, None),
    "swiglu": (functools.partial(_sigmoid_linear, k=1.0), _linear),
    "geglu": (_gelu, _linear),
    "reglu": (_relu, _linear),
    "qgeglu": (functools.partial(_sigmoid_linear, k=QUICK_GELU_ALPHA), _linear),
    "sreglu": (_squared_relu, _linear),
    "glu": (_sigmoid, _linear),
    "clamped_swiglu": (_clamped_silu, _clamped_linear),
}


def _gated(activation: str) -> bool:
    return ACTIVATIONS[activation][1] is not None


# Whether kernels writing FP8 compute GELU as ``x * sigmoid(2u)`` with NVIDIA's ``ex2.approx.ftz.f32`` and
# ``rcp.approx.ftz.f32`` where they lower for cuda (`with_ptx`): two special-function instructions for
# libdevice's ``tanhf`` (or an exponential and an IEEE division). Relative error about ``|2u| * 2^-24``
# (the exponential's argument rounded to float32), far below an FP8 step and, unlike ``1 + tanh(u)``,
# without cancellation in the negative tail (docs/performance.md: faster on the GPU). Read at trace time.
GELU_PTX_SIGMOID = True
_GELU_ACTIVATIONS = tuple(name for name, (act, _) in ACTIVATIONS.items() if act is _gelu)


def _inline_f32(instruction: str, x):
    [y] = plgpu.elementwise_inline_asm(f"{instruction} $0, $1;", args=[x], constraints="=f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return y


def _sigmoid_ptx(z):
    """``1 / (1 + 2^(-z log2 e))`` by ``ex2.approx.ftz.f32`` and ``rcp.approx.ftz.f32``."""
    return _inline_f32("rcp.approx.ftz.f32", 1.0 + _inline_f32("ex2.approx.ftz.f32", z * -LOG2E))


def fp8_output_activation(activation: str, ptx: bool) -> tuple[Callable, Callable | None]:
    """``ACTIVATIONS[activation]`` for a kernel whose output is FP8: with ``ptx`` (which
    `with_fp8_activation_ptx` sets where `GELU_PTX_SIGMOID` is on and the lowering is for cuda),
    GELU is ``x * sigmoid(2u)`` by `_sigmoid_ptx`."""
    act, gate_fn = ACTIVATIONS[activation]
    if ptx and activation in _GELU_ACTIVATIONS:
        act = functools.partial(_gelu, sigmoid=_sigmoid_ptx)
    return act, gate_fn


def with_fp8_activation_ptx(activation: str, run: Callable[..., Any], *args: Any) -> Any:
    """``run(ptx, *args)`` for a kernel writing FP8 through `fp8_output_activation`: ``ptx`` per
    lowering platform (`with_ptx`) where the activation is a GELU and `GELU_PTX_SIGMOID` is on, else
    False (one kernel, no platform branch)."""
    if GELU_PTX_SIGMOID and activation in _GELU_ACTIVATIONS:
        return with_ptx(run, *args)
    return run(False, *args)


@dataclasses.dataclass(frozen=True)
class ActSpec:
    """Static description of a launch: ``m`` rows, ``hidden`` output columns, the tile, the activation."""

    m: int
    hidden: int
    activation: str
    has_bias: bool
    block_m: int
    block_n: int
    num_warps: int

    @property
    def grid(self) -> tuple[int, int]:
        return pl.cdiv(self.m, self.block_m), pl.cdiv(self.hidden, self.block_n)

    @property
    def exact(self) -> bool:
        """Whether tiles cover the output exactly, so loads and stores need no masks."""
        return self.m % self.block_m == 0 and self.hidden % self.block_n == 0


def tile(hidden: int) -> tuple[int, int, int]:
    """``(block_m, block_n, num_warps)``: tiles of 8192 output elements, at most 2048 wide."""
    block_n = min(next_power_of_2(hidden), 2048)
    return max(1, 8192 // block_n), block_n, 8


def _spec(m, hidden, activation, has_bias, tile_override):
    block_m, block_n, num_warps = tile_override or tile(hidden)
    return ActSpec(m=m, hidden=hidden, activation=activation, has_bias=has_bias, block_m=block_m,
                   block_n=block_n, num_warps=num_warps)


def _indices(spec: ActSpec):
    rows = pl.program_id(0) * spec.block_m + jnp.arange(spec.block_m)
    cols = pl.program_id(1) * spec.block_n + jnp.arange(spec.block_n)
    mask = (rows < spec.m)[:, None] & (cols < spec.hidden)[None, :]
    return rows, cols, mask


def _load(view, mask):
    """A tile as float32; masked elements (``mask`` None: none) read as 0."""
    return (plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0.0)).astype(jnp.float32)


def _load_inputs(spec: ActSpec, x_ref, bias_ref, rows, cols, mask):
    """``[(a, column offset)]``: the activated half, then the gate for gated activations, biased."""
    gated = _gated(spec.activation)
    halves = []
    for offset in ((0, spec.hidden) if gated else (0,)):
        part = _load(x_ref.at[rows[:, None], offset + cols[None, :]], mask)
        if bias_ref is not None:
            part = part + _load(bias_ref.at[offset + cols], None if mask is None else cols < spec.hidden)[None, :]
        halves.append((part, offset))
    return halves


def _input_grads(spec: ActSpec, halves, dy, ptx: bool = False):
    """``d act(x) / dx`` times ``dy`` for each half of the input (float32); ``ptx``: for an FP8
    output (`fp8_output_activation`)."""
    act, gate_fn = fp8_output_activation(spec.activation, ptx)
    y, dact = act(halves[0][0])
    if gate_fn is not None:
        gate, dgate = gate_fn(halves[1][0])
        return [dy * gate * dact, dy * y * dgate]
    return [dy * dact]


def _forward_kernel(*refs, spec: ActSpec, out_fp8, ptx):
    refs = list(refs)
    x_ref = refs.pop(0)
    bias_ref = refs.pop(0) if spec.has_bias else None
    scale_ref = refs.pop(0) if out_fp8 is not None else None
    y_ref = refs.pop(0)
    amax_ref = refs.pop(0) if out_fp8 is not None else None
    rows, cols, mask = _indices(spec)
    halves = _load_inputs(spec, x_ref, bias_ref, rows, cols, mask)
    act, gate_fn = fp8_output_activation(spec.activation, ptx)
    y, _ = act(halves[0][0])
    if gate_fn is not None:
        y = y * gate_fn(halves[1][0])[0]
    if out_fp8 is not None:
        amax_ref[pl.program_id(0), pl.program_id(1)] = jnp.max(jnp.where(mask, jnp.abs(y), 0.0))
        y = saturate_cast(y * scale_ref[0], out_fp8)
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(y_ref.dtype), mask=mask)


def _launcher(kernel, spec: ActSpec, out_shape, name: str) -> Callable[..., Any]:
    """``run(ptx, *inputs)``: ``kernel`` (which takes ``ptx``) over ``spec``'s grid."""
    def run(ptx, *inputs):
        return pallas_call(
            functools.partial(kernel, ptx=ptx), out_shape=out_shape, grid=spec.grid,
            compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps, num_stages=1),
            interpret=interpret(), name=name,
        )(*inputs)

    return run


def forward(x, bias, scale=None, *, activation: str, out_dtype=None, tile_override=None):
    """Launch the forward kernel on 2-D ``x [m, k]``; returns ``(y,)`` or ``(y_fp8, amax)`` with ``scale``."""
    m, k = x.shape
    check_size("activation forward", x)
    hidden = k // 2 if _gated(activation) else k
    spec = _spec(m, hidden, activation, bias is not None, tile_override)
    out_fp8 = None if scale is None else jnp.dtype(out_dtype)
    inputs = [x] + ([bias] if bias is not None else [])
    out_shape = [jax.ShapeDtypeStruct((m, hidden), out_dtype or x.dtype)]
    if scale is not None:
        inputs.append(scale.astype(jnp.float32).reshape(1))
        out_shape.append(jax.ShapeDtypeStruct(spec.grid, jnp.float32))

    run = _launcher(functools.partial(_forward_kernel, spec=spec, out_fp8=out_fp8), spec, out_shape,
                    f"mtjax_{activation}_fwd")
    outs = list(run(False, *inputs) if out_fp8 is None else with_fp8_activation_ptx(activation, run, *inputs))
    if scale is not None:
        outs[-1] = reduce_tile_maxima(outs[-1])
    return tuple(outs)


def _backward_kernel(*refs, spec: ActSpec):
    refs = list(refs)
    x_ref = refs.pop(0)
    bias_ref = refs.pop(0) if spec.has_bias else None
    dy_ref, dx_ref = refs
    rows, cols, mask = _indices(spec)
    halves = _load_inputs(spec, x_ref, bias_ref, rows, cols, mask)
    dy = _load(dy_ref.at[rows[:, None], cols[None, :]], mask)
    for grad, (_, offset) in zip(_input_grads(spec, halves, dy), halves):
        plgpu.store(dx_ref.at[rows[:, None], offset + cols[None, :]], grad.astype(dx_ref.dtype), mask=mask)


def backward(x, bias, dy, *, activation: str, tile_override=None):
    """``(dx [m, k], dbias [k] or None)`` for the cotangent ``dy [m, hidden]``."""
    m, k = x.shape
    spec = _spec(m, dy.shape[1], activation, bias is not None, tile_override)
    inputs = [x] + ([bias] if bias is not None else []) + [dy]
    dx = pallas_call(
        functools.partial(_backward_kernel, spec=spec),
        out_shape=jax.ShapeDtypeStruct((m, k), x.dtype),
        grid=spec.grid,
        compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps, num_stages=1),
        interpret=interpret(),
        name=f"mtjax_{activation}_bwd",
    )(*inputs)
    dbias = None if bias is None else jnp.sum(dx, axis=0, dtype=jnp.float32).astype(bias.dtype)
    return dx, dbias


# The FP8 backward writes each tile and its transpose: square tiles, as `kernels.quantize`'s
# cast_transpose (whose 64x64 tiles on 8 warps are its fastest).
BACKWARD_FP8_TILE = (64, 64, 8)


def _backward_fp8_kernel(*refs, spec: ActSpec, out_fp8, ptx):
    refs = list(refs)
    x_ref = refs.pop(0)
    bias_ref = refs.pop(0) if spec.has_bias else None
    dy_ref, scale_ref, dx_ref, dxt_ref, amax_ref = refs[:5]
    dbias_ref = refs[5] if spec.has_bias else None
    rows, cols, mask = _indices(spec)
    mask = None if spec.exact else mask
    halves = _load_inputs(spec, x_ref, bias_ref, rows, cols, mask)
    dy = _load(dy_ref.at[rows[:, None], cols[None, :]], mask)
    grads = _input_grads(spec, halves, dy, ptx)  # 0 where masked: dy loads as 0 there
    amax = jnp.max(jnp.abs(grads[0]))
    if len(grads) == 2:
        amax = jnp.maximum(amax, jnp.max(jnp.abs(grads[1])))
    amax_ref[pl.program_id(0), pl.program_id(1)] = amax
    for grad, (_, offset) in zip(grads, halves):
        q = saturate_cast(grad * scale_ref[0], out_fp8)
        plgpu.store(dx_ref.at[rows[:, None], offset + cols[None, :]], q, mask=mask)
        plgpu.store(dxt_ref.at[offset + cols[:, None], rows[None, :]], q.T, mask=None if mask is None else mask.T)
        if dbias_ref is not None:  # this row block's column sums of the unquantized gradient
            plgpu.store(dbias_ref.at[pl.program_id(0), offset + cols], jnp.sum(grad, axis=0),
                        mask=None if mask is None else cols < spec.hidden)


def backward_fp8(x, bias, dy, scale, *, activation: str, out_dtype, tile_override=None):
    """``(dx_q [m, k], dx_q.T, max |dx|, dbias [k] or None)`` for the cotangent ``dy [m, hidden]``,
    ``dx_q = saturate_cast(dx * scale, out_dtype)``: the backward pass writing the FP8 gradient (and
    its transpose) that the GEMM which produced ``x`` consumes, so ``dx`` never goes through memory
    in bf16. ``dbias`` is float32."""
    m, k = x.shape
    check_size("activation backward", x)
    spec = _spec(m, dy.shape[1], activation, bias is not None, tile_override or BACKWARD_FP8_TILE)
    inputs = [x] + ([bias] if bias is not None else []) + [dy, scale.astype(jnp.float32).reshape(1)]
    out_shape = [jax.ShapeDtypeStruct((m, k), out_dtype), jax.ShapeDtypeStruct((k, m), out_dtype),
                 jax.ShapeDtypeStruct(spec.grid, jnp.float32)]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((spec.grid[0], k), jnp.float32))

    run = _launcher(functools.partial(_backward_fp8_kernel, spec=spec, out_fp8=jnp.dtype(out_dtype)), spec,
                    out_shape, f"mtjax_{activation}_bwd_fp8")
    outs = with_fp8_activation_ptx(activation, run, *inputs)
    dbias = jnp.sum(outs[3], axis=0) if bias is not None else None
    return outs[0], outs[1], reduce_tile_maxima(outs[2]), dbias


def unsupported(x_shape, x_dtype, activation: str) -> str | None:
    """``None`` if the kernels take this input, else why not (for the op's ``unsupported=``)."""
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} (kernels: {sorted(ACTIVATIONS)})"
    return unsupported_array(x_shape, x_dtype, max_row=None)


def _rows(x: jax.Array, activation: str) -> jax.Array:
    """The 2-D view the launchers take: ``[rows, 2 * hidden]`` for gated ``[..., 2, hidden]``, else
    ``[rows, hidden]``."""
    k = x.shape[-1] * (2 if _gated(activation) else 1)
    return x.reshape(-1, k)


def _out_shape(x_shape: tuple[int, ...], activation: str) -> tuple[int, ...]:
    """``[..., hidden]``: a gated input loses its pair axis."""
    return x_shape[:-2] + x_shape[-1:] if _gated(activation) else x_shape


def _flat_bias(bias):
    return None if bias is None else bias.reshape(-1)


# forward(x, bias, scale=None, *, activation, out_dtype=None) and backward(x, bias, dy, *, activation), as above.
PALLAS = Launchers(forward=forward, backward=backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _activation(x, bias, activation, launchers):
    return _activation_fwd(x, bias, activation, launchers)[0]


def _activation_fwd(x, bias, activation, launchers):
    (y,) = launchers.forward(_rows(x, activation), _flat_bias(bias), activation=activation)
    return y.reshape(_out_shape(x.shape, activation)), (x, bias)


def _activation_bwd(activation, launchers, saved, dy):
    x, bias = saved
    dx, dbias = launchers.backward(_rows(x, activation), _flat_bias(bias), dy.reshape(-1, dy.shape[-1]),
                                   activation=activation)
    return dx.reshape(x.shape), None if bias is None else dbias.reshape(bias.shape)


_activation.defvjp(_activation_fwd, _activation_bwd)


def activation(x: jax.Array, bias: jax.Array | None, *, activation: str, launchers: Launchers = PALLAS) -> jax.Array:
    """``act(x + bias)`` over ``x [..., hidden]`` (``[..., 2, hidden]`` and bias ``[2, hidden]`` when gated);
    returns ``[..., hidden]`` in x.dtype. ``launchers``: these Pallas kernels or the native Triton ones
    (`mtjax.kernels.triton.activation.NATIVE`)."""
    x, bias = vary_together(x, bias)
    return _activation(x, bias, activation, launchers)


def activation_grad_fp8(x: jax.Array, bias: jax.Array | None, dy: jax.Array, scale: jax.Array, *, activation: str,
                        out_dtype, launch: Callable = backward_fp8
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """`backward_fp8` (or ``launch``, its native Triton port) over the layouts of `activation`:
    ``x [..., hidden]`` (``[..., 2, hidden]`` gated) and ``dy [..., hidden]`` give ``(dx_q`` shaped
    like x, ``dx_q`` flattened to 2-D and transposed, ``max |dx|``, ``dbias`` shaped like bias``)``."""
    check_kernel_fp8_dtype("activation_grad_fp8", out_dtype)
    dx_q, dx_q_t, amax, dbias = launch(_rows(x, activation), _flat_bias(bias), dy.reshape(-1, dy.shape[-1]),
                                       scale, activation=activation, out_dtype=out_dtype)
    return dx_q.reshape(x.shape), dx_q_t, amax, None if bias is None else dbias.reshape(bias.shape)


def activation_fp8(x: jax.Array, bias: jax.Array | None, scale: jax.Array, *, activation: str,
                   out_dtype, launchers: Launchers = PALLAS) -> tuple[jax.Array, jax.Array]:
    """``(saturate_cast(y * scale, out_dtype), max |y|)`` for ``y = act(x + bias)`` (layouts as
    `activation`); forward only."""
    check_kernel_fp8_dtype("activation_fp8", out_dtype)
    y, amax = launchers.forward(_rows(x, activation), _flat_bias(bias), scale, activation=activation,
                                out_dtype=out_dtype)
    return y.reshape(_out_shape(x.shape, activation)), amax
