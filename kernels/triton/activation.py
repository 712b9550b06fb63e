"""Bias + activation in native Triton: the algorithm of `mtjax.kernels.activation`, with its tiles.

``y = act(x + bias)`` for every activation of `mtjax.kernels.activation.ACTIVATIONS`: gelu (tanh
form), silu, relu, quick_gelu, squared_relu and the gated ones (``x`` viewed as rows ``[a | gate]``
of ``2 * hidden``, ``y = act(a) * g(gate)``, ``g`` the identity or clamped_swiglu's clamp), forward
(optionally an FP8 output and per-tile amaxes) and backward; `backward_fp8` writes the input
gradient quantized, its transpose, its per-tile amaxes and per-row-block bias sums
(TransformerEngine's "dact + cast_transpose"). Each program owns one ``[block_m, block_n]`` tile of
the output, masked past the array unless the tiles cover it exactly.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mtjax.dtypes import fp8_max
from mtjax.kernels import activation as pallas_activation
from mtjax.kernels.common import Launchers, check_size, reduce_tile_maxima
from mtjax.kernels.triton.language import saturate, sigmoid_ptx, tanh
from mtjax.kernels.triton.runtime import launch, stand_in

# The activation of each name as the kernels' ACT code (the activated half's function) and GATE code
# (0: the gate is linear; 1: clamped_swiglu's clamped gate).
CODES = {"gelu": 0, "silu": 1, "relu": 2, "quick_gelu": 3, "squared_relu": 4, "swiglu": 1, "geglu": 0,
         "reglu": 2, "qgeglu": 3, "sreglu": 4, "glu": 5, "clamped_swiglu": 6}
GATE_CODES = {"clamped_swiglu": 1}
assert set(CODES) == set(pallas_activation.ACTIVATIONS), "every activation of the Pallas kernels has a code here"
# The kernels spell clamped_swiglu's constants as literals (7.0, 1.702, 1.0), as Triton's interpreter needs.
assert (pallas_activation.CLAMP_LIMIT, pallas_activation.CLAMP_ALPHA, pallas_activation.CLAMP_GATE_OFFSET) == (
    7.0, 1.702, 1.0)


@triton.jit
def _sigmoid_linear(x, k):
    s = 1.0 / (1.0 + tl.exp(-k * x))
    return x * s, s * (1.0 + k * x * (1.0 - s))


@triton.jit
def activation_fn(x, ACT: tl.constexpr, PTX_SIGMOID: tl.constexpr = False):
    """``(act(x), act'(x))`` in float32, as `mtjax.kernels.activation.ACTIVATIONS` (gelu: sqrt(2 / pi)
    = 0.7978845608028654, cubic coefficient 0.044715; quick_gelu's 1.702; literals, which Triton's
    compiler and interpreter both take inside a kernel). ``PTX_SIGMOID``: GELU as ``x * sigmoid(2u)``
    by `sigmoid_ptx` (for kernels writing FP8; compiled only, the interpreter runs no PTX)."""
    if ACT == 0:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        slope = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
        if PTX_SIGMOID:
            s = sigmoid_ptx(2.0 * u)
            y = x * s
            dy = s + 2.0 * x * s * (1.0 - s) * slope
        else:
            t = tanh(u)
            y = 0.5 * x * (1.0 + t)
            dy = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * slope
    elif ACT == 2:
        y = tl.maximum(x, 0.0)
        dy = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 4:  # squared_relu
        r = tl.maximum(x, 0.0)
        y = r * r
        dy = 2.0 * r
    elif ACT == 5:  # sigmoid (glu's activated half)
        y = 1.0 / (1.0 + tl.exp(-x))
        dy = y * (1.0 - y)
    elif ACT == 6:  # clamped_swiglu's silu: x clamped above at 7, alpha 1.702; the limit passes the gradient
        y, dy = _sigmoid_linear(tl.minimum(x, 7.0), 1.702)
        dy = tl.where(x <= 7.0, dy, 0.0)
    else:
        y, dy = _sigmoid_linear(x, 1.0 if ACT == 1 else 1.702)
    return y, dy


@triton.jit
def gate_fn(gate, GATE: tl.constexpr):
    """``(g(gate), g'(gate))``: the identity, or clamped_swiglu's ``clip(gate, -7, 7) + 1``."""
    if GATE == 1:
        inside = (gate >= -7.0) & (gate <= 7.0)
        g = tl.minimum(tl.maximum(gate, -7.0), 7.0) + 1.0
        dg = tl.where(inside, 1.0, 0.0)
    else:  # one return of one type: the compiler (unlike the interpreter) checks both branches
        g = gate
        dg = tl.full(gate.shape, 1.0, tl.float32)
    return g, dg


@triton.jit
def _tile(pid_m, pid_n, M: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, (rows[:, None] < M) & (cols[None, :] < HIDDEN)


@triton.jit
def _load(ptr, offsets, mask, EXACT: tl.constexpr):
    if EXACT:
        return tl.load(ptr + offsets).to(tl.float32)
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _inputs(x_ptr, bias_ptr, rows, cols, mask, HIDDEN: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
            GATED: tl.constexpr, EXACT: tl.constexpr):
    """The activated half ``a`` and (gated) the linear gate of a tile, biased, in float32."""
    a = _load(x_ptr, rows[:, None] * K + cols[None, :], mask, EXACT)
    if HAS_BIAS:
        a += _load(bias_ptr, cols[None, :], cols[None, :] < HIDDEN, EXACT)
    gate = a
    if GATED:
        gate = _load(x_ptr, rows[:, None] * K + HIDDEN + cols[None, :], mask, EXACT)
        if HAS_BIAS:
            gate += _load(bias_ptr, HIDDEN + cols[None, :], cols[None, :] < HIDDEN, EXACT)
    return a, gate


@triton.jit
def _store(ptr, offsets, value, mask, EXACT: tl.constexpr):
    if EXACT:
        tl.store(ptr + offsets, value.to(ptr.dtype.element_ty))
    else:
        tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _forward_kernel(x_ptr, bias_ptr, scale_ptr, y_ptr, amax_ptr, M: tl.constexpr, HIDDEN: tl.constexpr,
                    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
                    GATE: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr,
                    FP8: tl.constexpr, FP8_MAX: tl.constexpr, PTX_SIGMOID: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows, cols, mask = _tile(pid_m, pid_n, M, HIDDEN, BLOCK_M, BLOCK_N)
    a, gate = _inputs(x_ptr, bias_ptr, rows, cols, mask, HIDDEN, K, HAS_BIAS, GATED, EXACT)
    y, _ = activation_fn(a, ACT, PTX_SIGMOID)
    if GATED:
        g, _ = gate_fn(gate, GATE)
        y = y * g
    if FP8:
        tl.store(amax_ptr + pid_m * tl.num_programs(1) + pid_n, tl.max(tl.max(tl.where(mask, tl.abs(y), 0.0), 1), 0))
        y = saturate(y * tl.load(scale_ptr), FP8_MAX)
    _store(y_ptr, rows[:, None] * HIDDEN + cols[None, :], y, mask, EXACT)


def _constexprs(spec, k: int, activation: str) -> dict:
    return dict(M=spec.m, HIDDEN=spec.hidden, K=k, BLOCK_M=spec.block_m, BLOCK_N=spec.block_n,
                ACT=CODES[activation], GATE=GATE_CODES.get(activation, 0),
                GATED=pallas_activation.ACTIVATIONS[activation][1] is not None,
                HAS_BIAS=spec.has_bias, EXACT=spec.exact)


def forward(x, bias, scale=None, *, activation: str, out_dtype=None, tile_override=None):
    """`mtjax.kernels.activation.forward` (same arguments and results) on the native Triton kernel."""
    m, k = x.shape
    check_size("activation forward", x)
    gated = pallas_activation.ACTIVATIONS[activation][1] is not None
    hidden = k // 2 if gated else k
    spec = pallas_activation._spec(m, hidden, activation, bias is not None, tile_override)
    fp8 = scale is not None
    y_dtype = out_dtype or x.dtype
    def run(ptx, *inputs):
        return launch(
            _forward_kernel, *inputs,
            out_shape=[jax.ShapeDtypeStruct((m, hidden), y_dtype),
                       jax.ShapeDtypeStruct(spec.grid if fp8 else (1,), jnp.float32)],
            grid=spec.grid, name=f"mtjax_triton_{activation}_fwd", num_warps=spec.num_warps, num_stages=1,
            FP8=fp8, FP8_MAX=fp8_max(y_dtype) if fp8 else 1.0, PTX_SIGMOID=ptx, **_constexprs(spec, k, activation),
        )

    inputs = (x, stand_in() if bias is None else bias,
              stand_in() if scale is None else jnp.reshape(scale, (1,)).astype(jnp.float32))
    y, amax = pallas_activation.with_fp8_activation_ptx(activation, run, *inputs) if fp8 else run(False, *inputs)
    return (y, reduce_tile_maxima(amax)) if fp8 else (y,)


@triton.jit
def _backward_kernel(x_ptr, bias_ptr, dy_ptr, dx_ptr, M: tl.constexpr, HIDDEN: tl.constexpr, K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, GATE: tl.constexpr,
                     GATED: tl.constexpr, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr):
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), M, HIDDEN, BLOCK_M, BLOCK_N)
    a, gate = _inputs(x_ptr, bias_ptr, rows, cols, mask, HIDDEN, K, HAS_BIAS, GATED, EXACT)
    dy = _load(dy_ptr, rows[:, None] * HIDDEN + cols[None, :], mask, EXACT)
    y, dact = activation_fn(a, ACT)
    offsets = rows[:, None] * K + cols[None, :]
    if GATED:
        g, dg = gate_fn(gate, GATE)
        _store(dx_ptr, offsets, dy * g * dact, mask, EXACT)
        _store(dx_ptr, offsets + HIDDEN, dy * y * dg, mask, EXACT)
    else:
        _store(dx_ptr, offsets, dy * dact, mask, EXACT)


def backward(x, bias, dy, *, activation: str, tile_override=None):
    """`mtjax.kernels.activation.backward` (same arguments and results) on the native Triton kernel."""
    m, k = x.shape
    spec = pallas_activation._spec(m, dy.shape[1], activation, bias is not None, tile_override)
    [dx] = launch(
        _backward_kernel, x, stand_in() if bias is None else bias, dy,
        out_shape=[jax.ShapeDtypeStruct((m, k), x.dtype)], grid=spec.grid, name=f"mtjax_triton_{activation}_bwd",
        num_warps=spec.num_warps, num_stages=1, **_constexprs(spec, k, activation),
    )
    dbias = None if bias is None else jnp.sum(dx, axis=0, dtype=jnp.float32).astype(bias.dtype)
    return dx, dbias


@triton.jit
def _backward_fp8_half(grad, dx_ptr, dxt_ptr, dbias_ptr, rows, cols, mask, offset, scale, pid_m, M: tl.constexpr,
                       K: tl.constexpr, HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr,
                       FP8_MAX: tl.constexpr):
    """One half of the input gradient (the activated input's, or the gate's at ``offset``): quantized,
    transposed, and this row block's column sums of the unquantized gradient."""
    q = saturate(grad * scale, FP8_MAX).to(dx_ptr.dtype.element_ty)
    _store(dx_ptr, rows[:, None] * K + offset + cols[None, :], q, mask, EXACT)
    _store(dxt_ptr, (offset + cols[:, None]) * M + rows[None, :], tl.trans(q), tl.trans(mask), EXACT)
    if HAS_BIAS:
        _store(dbias_ptr, pid_m * K + offset + cols, tl.sum(grad, axis=0), cols < HIDDEN, EXACT)


@triton.jit
def _backward_fp8_kernel(x_ptr, bias_ptr, dy_ptr, scale_ptr, dx_ptr, dxt_ptr, amax_ptr, dbias_ptr, M: tl.constexpr,
                         HIDDEN: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         ACT: tl.constexpr, GATE: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                         EXACT: tl.constexpr, FP8_MAX: tl.constexpr, PTX_SIGMOID: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows, cols, mask = _tile(pid_m, pid_n, M, HIDDEN, BLOCK_M, BLOCK_N)
    a, gate = _inputs(x_ptr, bias_ptr, rows, cols, mask, HIDDEN, K, HAS_BIAS, GATED, EXACT)
    dy = _load(dy_ptr, rows[:, None] * HIDDEN + cols[None, :], mask, EXACT)  # 0 where masked: so are the grads
    y, dact = activation_fn(a, ACT, PTX_SIGMOID)
    scale = tl.load(scale_ptr)
    if GATED:
        g, dg = gate_fn(gate, GATE)
        grad = dy * g * dact
        grad_gate = dy * y * dg
        amax = tl.maximum(tl.max(tl.max(tl.abs(grad), 1), 0), tl.max(tl.max(tl.abs(grad_gate), 1), 0))
        _backward_fp8_half(grad_gate, dx_ptr, dxt_ptr, dbias_ptr, rows, cols, mask, HIDDEN, scale, pid_m, M, K, HIDDEN,
                           HAS_BIAS, EXACT, FP8_MAX)
    else:
        grad = dy * dact
        amax = tl.max(tl.max(tl.abs(grad), 1), 0)
    tl.store(amax_ptr + pid_m * tl.num_programs(1) + pid_n, amax)
    _backward_fp8_half(grad, dx_ptr, dxt_ptr, dbias_ptr, rows, cols, mask, 0, scale, pid_m, M, K, HIDDEN, HAS_BIAS,
                       EXACT, FP8_MAX)


def backward_fp8(x, bias, dy, scale, *, activation: str, out_dtype, tile_override=None):
    """`mtjax.kernels.activation.backward_fp8` (same arguments and results) on the native Triton kernel."""
    m, k = x.shape
    check_size("activation backward", x)
    spec = pallas_activation._spec(m, dy.shape[1], activation, bias is not None,
                                   tile_override or pallas_activation.BACKWARD_FP8_TILE)
    out_shape = [jax.ShapeDtypeStruct((m, k), out_dtype), jax.ShapeDtypeStruct((k, m), out_dtype),
                 jax.ShapeDtypeStruct(spec.grid, jnp.float32),
                 jax.ShapeDtypeStruct((spec.grid[0], k) if bias is not None else (1,), jnp.float32)]
    def run(ptx, *inputs):
        return launch(
            _backward_fp8_kernel, *inputs, out_shape=out_shape, grid=spec.grid,
            name=f"mtjax_triton_{activation}_bwd_fp8", num_warps=spec.num_warps, num_stages=1,
            FP8_MAX=fp8_max(out_dtype), PTX_SIGMOID=ptx, **_constexprs(spec, k, activation),
        )

    dx_q, dx_q_t, amax, dbias = pallas_activation.with_fp8_activation_ptx(
        activation, run, x, stand_in() if bias is None else bias, dy, jnp.reshape(scale, (1,)).astype(jnp.float32))
    return dx_q, dx_q_t, reduce_tile_maxima(amax), None if bias is None else jnp.sum(dbias, axis=0)


NATIVE = Launchers(forward=forward, backward=backward)


def activation(x, bias, *, activation: str) -> jax.Array:
    """`mtjax.kernels.activation.activation` on the native Triton kernels."""
    return pallas_activation.activation(x, bias, activation=activation, launchers=NATIVE)


def activation_fp8(x, bias, scale, *, activation: str, out_dtype) -> tuple[jax.Array, jax.Array]:
    """`mtjax.kernels.activation.activation_fp8` on the native Triton forward kernel."""
    return pallas_activation.activation_fp8(x, bias, scale, activation=activation, out_dtype=out_dtype,
                                            launchers=NATIVE)


def activation_grad_fp8(x, bias, dy, scale, *, activation: str, out_dtype) -> tuple:
    """`mtjax.kernels.activation.activation_grad_fp8` on the native Triton kernel."""
    return pallas_activation.activation_grad_fp8(x, bias, dy, scale, activation=activation, out_dtype=out_dtype,
                                                 launch=backward_fp8)
