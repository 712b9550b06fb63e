"""Block-scaled FP8 quantization as Pallas Triton kernels: 1x128 row tiles and 128x128 blocks.

Block scaling (DeepSeek-V3's FP8 recipe) gives every ``1 x 128`` tile of an activation or gradient
row and every ``128 x 128`` block of a weight its own float32 scale, from the tile's own amax.

- `tile_quantize` casts ``x [m, k]`` in row tiles along ``k`` (scales ``[m, ceil(k/128)]``); with
  ``transpose=True`` it also writes ``x.T [k, m]`` cast in row tiles along ``m`` (scales
  ``[k, ceil(m/128)]``): the weight-gradient GEMM contracts over the tokens, so its operands need
  tiles re-cut along that axis, from the original values (not from the first cast). Each program
  reads one ``128 x 128`` tile of ``x`` once and writes both.
- Its ``prologue`` fuses the op in front of a GEMM into the cast, so that op's output never goes
  through memory in bf16: `NormPrologue` (LayerNorm/RMSNorm, the row statistics computed beforehand
  by `row_statistics`, one read of ``x``) or `ActivationPrologue` (bias + activation, gated or not).
  Each program applies it to the tile it loads, in float32, and quantizes the result.
- `activation_grad_tile_quantize` is the activation's backward written as the block-scaled FP8 output
  gradient of the GEMM in front of it, both layouts and the bias gradient in one pass
  (TransformerEngine's "dact + cast_transpose").
- `block_quantize` casts ``w [k, n]`` in ``128 x 128`` blocks (scales ``[ceil(k/128), ceil(n/128)]``)
  and writes its transpose too: a block's scale is the same for ``w`` and ``w.T``.

The scale math (`tile_scales`) is shared with the jax.numpy references in `mtjax.ops`, so on the
CPU (interpret mode) kernel and reference agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from mtjax.kernels.activation import ACTIVATIONS, fp8_output_activation, with_fp8_activation_ptx
from mtjax.kernels.common import (
    interpret,
    pallas_call,
    saturate_cast,
    unsupported_array,
    unsupported_fp8_dtype,
)
from mtjax.kernels.common import (
    pallas_triton as plgpu,
)

TILE = 128  # the width of a row tile and the side of a weight block
NUM_WARPS = 8
# Rows per program when no transposed copy is written (each program then handles [ROWS, TILE]).
ROWS = 64

_EXPONENT_MASK = np.uint32(0xFF800000)  # sign and exponent bits of a float32


def tile_scales(amax: jax.Array, fp8_max: float, power_of_two: bool, amax_epsilon: float
                ) -> tuple[jax.Array, jax.Array]:
    """``(scale, scale_inv)`` of tiles with these amaxes: ``scale = fp8_max / max(amax, amax_epsilon)``,
    rounded down to a power of two if asked (by clearing the mantissa, exact everywhere); ``1`` for a
    tile whose amax is 0, NaN or Inf (or whose scale would not be finite): an all-zero tile needs none,
    and a non-finite one cannot be scaled (its NaN stays NaN, its Inf saturates)."""
    amax = jnp.maximum(amax.astype(jnp.float32), jnp.float32(amax_epsilon))
    scale = jnp.float32(fp8_max) / amax
    usable = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale)
    scale = jnp.where(usable, scale, jnp.float32(1.0))
    if power_of_two:
        scale = lax.bitcast_convert_type(lax.bitcast_convert_type(scale, jnp.uint32) & _EXPONENT_MASK, jnp.float32)
    return scale, jnp.float32(1.0) / scale


def unsupported(shape, dtype, out_dtype) -> str | None:
    """``None`` if the kernels take ``x`` of this shape and dtype, else why not."""
    if len(shape) != 2:
        return f"x of rank {len(shape)} (2-D only)"
    reason = unsupported_fp8_dtype(out_dtype)
    if reason is not None:
        return reason
    return unsupported_array(shape, dtype, max_row=None)


@dataclasses.dataclass(frozen=True)
class NormPrologue:
    """The tile cast normalizes what it loads: ``(x - mean) * rstd * gamma (+ beta)`` per row, RMSNorm
    without the mean (``gamma`` taken as ``1 + gamma`` if ``zero_centered_gamma``). Its operands:
    ``rstd [m]`` (and ``mean [m]`` first, for LayerNorm) from `row_statistics`, ``gamma [k]``, ``beta [k]``
    if ``has_beta``."""

    rms: bool
    zero_centered_gamma: bool
    has_beta: bool


@dataclasses.dataclass(frozen=True)
class ActivationPrologue:
    """The tile cast applies ``act(x + bias)`` to what it loads (an activation of
    `mtjax.kernels.activation.ACTIVATIONS`); gated ones read ``x [m, 2 * k]`` as rows ``[a | gate]``
    (a contiguous ``[m, 2, k]``). Its operand: ``bias [k]`` (``[2 * k]`` gated) if ``has_bias``."""

    activation: str
    has_bias: bool

    @property
    def gated(self) -> bool:
        return ACTIVATIONS[self.activation][1] is not None


Prologue = NormPrologue | ActivationPrologue


def row_statistics(x: jax.Array, *, rms: bool, epsilon: float) -> tuple[jax.Array, ...]:
    """The float32 row statistics `NormPrologue` reads, as the norms' references compute them:
    ``(mean [m], rstd [m])`` for LayerNorm, ``(rstd [m],)`` for RMSNorm."""
    xf = x.astype(jnp.float32)
    if rms:
        return (lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1) + epsilon),)
    mean = jnp.mean(xf, axis=-1)
    var = jnp.mean(jnp.square(xf - mean[:, None]), axis=-1)
    return mean, lax.rsqrt(var + epsilon)


def _load(x_ref, rows, cols, m, k, exact):
    mask = None if exact else (rows < m)[:, None] & (cols < k)[None, :]
    tile = x_ref.at[rows[:, None], cols[None, :]]
    x = plgpu.load(tile) if mask is None else plgpu.load(tile, mask=mask, other=0.0)
    return x.astype(jnp.float32), mask


def _load_vector(ref, index, size, exact):
    value = plgpu.load(ref.at[index]) if exact else plgpu.load(ref.at[index], mask=index < size, other=0.0)
    return value.astype(jnp.float32)


def _prologue_tile(x_ref, operands, prologue, rows, cols, m, k, exact, ptx):
    """The float32 ``[rows, cols]`` tile of ``prologue(x)`` (of ``x`` without one; ``ptx``: an
    activation's `fp8_output_activation`), 0 where masked,
    and the mask (None when the tiles cover the array exactly)."""
    x, mask = _load(x_ref, rows, cols, m, k, exact)
    if prologue is None:
        return x, mask  # masked elements load as 0 already
    if isinstance(prologue, NormPrologue):
        gamma_ref, *rest = operands[1:] if prologue.rms else operands[2:]
        rstd = _load_vector(operands[0] if prologue.rms else operands[1], rows, m, exact)
        gamma = _load_vector(gamma_ref, cols, k, exact)
        gamma = gamma + 1.0 if prologue.zero_centered_gamma else gamma
        y = x if prologue.rms else x - _load_vector(operands[0], rows, m, exact)[:, None]
        y = y * rstd[:, None] * gamma[None, :]
        if prologue.has_beta:
            y = y + _load_vector(rest[0], cols, k, exact)[None, :]
    else:
        fn, gate_fn = fp8_output_activation(prologue.activation, ptx)
        if prologue.has_bias:
            x = x + _load_vector(operands[0], cols, k, exact)[None, :]
        y = fn(x)[0]
        if gate_fn is not None:
            gate, _ = _load(x_ref, rows, cols + k, m, 2 * k, exact)
            if prologue.has_bias:
                gate = gate + _load_vector(operands[0], cols + k, 2 * k, exact)[None, :]
            y = y * gate_fn(gate)[0]
    # The prologue of a masked (zero) element need not be 0; it must not enter an amax.
    return (y, mask) if mask is None else (jnp.where(mask, y, 0.0), mask)


def _tile_kernel(*refs, m, k, rows_per_program, transpose, fp8_max, power_of_two, amax_epsilon, prologue, ptx,
                 num_operands):
    x_ref, operands = refs[0], refs[1:1 + num_operands]
    q_ref, s_ref, *rest = refs[1 + num_operands:]
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * rows_per_program + jnp.arange(rows_per_program)
    cols = j * TILE + jnp.arange(TILE)
    exact = m % rows_per_program == 0 and k % TILE == 0
    x, mask = _prologue_tile(x_ref, operands, prologue, rows, cols, m, k, exact, ptx)
    scale, scale_inv = tile_scales(jnp.max(jnp.abs(x), axis=1), fp8_max, power_of_two, amax_epsilon)
    plgpu.store(q_ref.at[rows[:, None], cols[None, :]], saturate_cast(x * scale[:, None], q_ref.dtype), mask=mask)
    plgpu.store(s_ref.at[rows, j], scale_inv, mask=None if exact else rows < m)
    if transpose:  # the same 128 x 128 tile, cut into row tiles of x.T (columns of x)
        qt_ref, st_ref = rest
        scale_t, scale_inv_t = tile_scales(jnp.max(jnp.abs(x), axis=0), fp8_max, power_of_two, amax_epsilon)
        q_t = saturate_cast(x * scale_t[None, :], qt_ref.dtype)
        plgpu.store(qt_ref.at[cols[:, None], rows[None, :]], q_t.T, mask=None if mask is None else mask.T)
        plgpu.store(st_ref.at[cols, i], scale_inv_t, mask=None if exact else cols < k)


def tile_quantize(x: jax.Array, out_dtype, *, transpose: bool = False, fp8_max: float, power_of_two: bool = False,
                  amax_epsilon: float = 0.0, prologue: Prologue | None = None, operands: tuple[jax.Array, ...] = (),
                  num_warps: int = NUM_WARPS) -> tuple[jax.Array, ...]:
    """``(q [m, k], scale_inv [m, ceil(k/128)])``, plus ``(q_t [k, m], scale_inv_t [k, ceil(m/128)])``
    with ``transpose=True``: ``x [m, k]`` (or ``prologue(x)`` with its ``operands``; a gated
    activation's ``x`` is ``[m, 2 * k]``) cast in 1x128 row tiles (see the module docstring)."""
    why = unsupported(x.shape, x.dtype, out_dtype)
    if why is not None:
        raise ValueError(f"tile_quantize: unsupported input: {why}")
    m, k = x.shape
    if isinstance(prologue, ActivationPrologue) and prologue.gated:
        k //= 2
    rows = TILE if transpose else ROWS
    grid = (pl.cdiv(m, rows), pl.cdiv(k, TILE))
    out_shape = [jax.ShapeDtypeStruct((m, k), out_dtype), jax.ShapeDtypeStruct((m, grid[1]), jnp.float32)]
    if transpose:
        out_shape += [jax.ShapeDtypeStruct((k, m), out_dtype), jax.ShapeDtypeStruct((k, grid[0]), jnp.float32)]
    def run(ptx, x, *operands):
        kernel = functools.partial(
            _tile_kernel, m=m, k=k, rows_per_program=rows, transpose=transpose, fp8_max=fp8_max,
            power_of_two=power_of_two, amax_epsilon=amax_epsilon, num_operands=len(operands), prologue=prologue,
            ptx=ptx)
        return tuple(pallas_call(
            kernel, out_shape=tuple(out_shape), grid=grid,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret(), name=kernel_name(prologue),
        )(x, *operands))

    if isinstance(prologue, ActivationPrologue):
        return with_fp8_activation_ptx(prologue.activation, run, x, *operands)
    return run(False, x, *operands)


def kernel_name(prologue: Prologue | None, prefix: str = "mtjax") -> str:
    """The tile cast's kernel name (what profiles show): which prologue it runs, if any."""
    kind = {NormPrologue: "norm_", ActivationPrologue: "activation_"}.get(type(prologue), "")
    return f"{prefix}_{kind}tile_quantize"


def norm_tile_quantize(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, out_dtype, *, rms: bool,
                       epsilon: float, zero_centered_gamma: bool, transpose: bool = False, fp8_max: float,
                       power_of_two: bool = False, amax_epsilon: float = 0.0) -> tuple[jax.Array, ...]:
    """`tile_quantize` of ``norm(x)`` for ``x [m, k]`` (LayerNorm, or RMSNorm with ``rms``; ``beta``
    None for RMSNorm): the row statistics first, then the norm applied in the cast's kernel."""
    prologue = NormPrologue(rms=rms, zero_centered_gamma=zero_centered_gamma, has_beta=beta is not None)
    operands = (*row_statistics(x, rms=rms, epsilon=epsilon), gamma, *(() if beta is None else (beta,)))
    return tile_quantize(x, out_dtype, transpose=transpose, fp8_max=fp8_max, power_of_two=power_of_two,
                         amax_epsilon=amax_epsilon, prologue=prologue, operands=operands)


def activation_tile_quantize(x: jax.Array, bias: jax.Array | None, out_dtype, *, activation: str,
                             transpose: bool = False, fp8_max: float, power_of_two: bool = False,
                             amax_epsilon: float = 0.0) -> tuple[jax.Array, ...]:
    """`tile_quantize` of ``act(x + bias)`` for ``x [m, k]`` (``[m, 2, k]`` for a gated activation,
    ``bias`` then ``[2, k]``), the activation applied in the cast's kernel."""
    prologue = ActivationPrologue(activation=activation, has_bias=bias is not None)
    operands = () if bias is None else (bias.reshape(-1),)
    return tile_quantize(x.reshape(x.shape[0], -1), out_dtype, transpose=transpose, fp8_max=fp8_max,
                         power_of_two=power_of_two, amax_epsilon=amax_epsilon, prologue=prologue, operands=operands)


def unsupported_activation_grad(shape, activation: str) -> str | None:
    """``None`` if `activation_grad_tile_quantize` takes a forward input of this shape (``[m, hidden]``,
    or ``[m, 2, hidden]`` gated), else why not: a gated activation's two halves must each be whole
    tiles (``hidden`` a multiple of 128), since each program writes the same tile of both."""
    if ACTIVATIONS[activation][1] is not None and shape[-1] % TILE:
        return f"gated activation with hidden {shape[-1]} (kernel: a multiple of {TILE})"
    return None


def _activation_grad_kernel(*refs, m, hidden, activation, has_bias, fp8_max, power_of_two, amax_epsilon, ptx):
    refs = list(refs)
    x_ref = refs.pop(0)
    bias_ref = refs.pop(0) if has_bias else None
    dy_ref, q_ref, s_ref, qt_ref, st_ref = refs[:5]
    dbias_ref = refs[5] if has_bias else None
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * TILE + jnp.arange(TILE)
    cols = j * TILE + jnp.arange(TILE)
    exact = m % TILE == 0 and hidden % TILE == 0
    fn, gate_fn = fp8_output_activation(activation, ptx)
    halves = []  # (the biased input of each half, its column offset in x)
    for offset in ((0, hidden) if gate_fn is not None else (0,)):
        part, mask = _load(x_ref, rows, offset + cols, m, offset + hidden, exact)
        if has_bias:
            part = part + _load_vector(bias_ref, offset + cols, offset + hidden, exact)[None, :]
        halves.append(part)
    dy, _ = _load(dy_ref, rows, cols, m, hidden, exact)  # 0 where masked, so every gradient is 0 there
    y, dact = fn(halves[0])
    if gate_fn is None:
        grads = [dy * dact]
    else:
        gate, dgate = gate_fn(halves[1])
        grads = [dy * gate * dact, dy * y * dgate]
    tiles_per_half = pl.cdiv(hidden, TILE)
    for half, grad in enumerate(grads):
        out_cols = half * hidden + cols
        scale, scale_inv = tile_scales(jnp.max(jnp.abs(grad), axis=1), fp8_max, power_of_two, amax_epsilon)
        plgpu.store(q_ref.at[rows[:, None], out_cols[None, :]], saturate_cast(grad * scale[:, None], q_ref.dtype),
                    mask=mask)
        plgpu.store(s_ref.at[rows, half * tiles_per_half + j], scale_inv, mask=None if exact else rows < m)
        scale_t, scale_inv_t = tile_scales(jnp.max(jnp.abs(grad), axis=0), fp8_max, power_of_two, amax_epsilon)
        q_t = saturate_cast(grad * scale_t[None, :], qt_ref.dtype)
        plgpu.store(qt_ref.at[out_cols[:, None], rows[None, :]], q_t.T, mask=None if mask is None else mask.T)
        plgpu.store(st_ref.at[out_cols, i], scale_inv_t, mask=None if exact else cols < hidden)
        if has_bias:  # this row block's column sums of the unquantized gradient
            plgpu.store(dbias_ref.at[i, out_cols], jnp.sum(grad, axis=0), mask=None if exact else cols < hidden)


def activation_grad_tile_quantize(x: jax.Array, bias: jax.Array | None, dy: jax.Array, out_dtype, *,
                                  activation: str, fp8_max: float, power_of_two: bool = False,
                                  amax_epsilon: float = 0.0,
                                  num_warps: int = NUM_WARPS) -> tuple[jax.Array, ...]:
    """The backward of ``act(x + bias)`` for the cotangent ``dy [m, hidden]``, written as the block-scaled
    FP8 output gradient of the GEMM that produced ``x`` ("dact + cast_transpose"): ``dx`` never goes
    through memory in bf16.

    ``x [m, hidden]`` (``[m, 2, hidden]`` gated, ``bias`` then ``[2, hidden]``). Returns ``(q [m, w],
    scale_inv [m, ceil(w/128)], q_t [w, m], scale_inv_t [w, ceil(m/128)], dbias [w] or None)`` for
    ``dx`` flattened to ``[m, w]`` (``w = 2 * hidden`` gated): `tile_quantize` with ``transpose=True``
    of ``dx`` computed in float32, and the float32 column sums of ``dx`` (the bias gradient). Each
    program reads one ``128 x 128`` tile of ``x`` (both halves, gated) and of ``dy`` once."""
    why = unsupported((x.shape[0], math.prod(x.shape[1:])), x.dtype, out_dtype) or unsupported_activation_grad(
        dy.shape, activation)
    if why is not None:
        raise ValueError(f"activation_grad_tile_quantize: unsupported input: {why}")
    m, hidden = dy.shape
    x2 = x.reshape(m, -1)
    width = x2.shape[1]
    grid = (pl.cdiv(m, TILE), pl.cdiv(hidden, TILE))
    inputs = [x2] + ([] if bias is None else [bias.reshape(-1)]) + [dy]
    out_shape = [jax.ShapeDtypeStruct((m, width), out_dtype),
                 jax.ShapeDtypeStruct((m, pl.cdiv(width, TILE)), jnp.float32),
                 jax.ShapeDtypeStruct((width, m), out_dtype), jax.ShapeDtypeStruct((width, grid[0]), jnp.float32)]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((grid[0], width), jnp.float32))
    def run(ptx, *inputs):
        kernel = functools.partial(_activation_grad_kernel, m=m, hidden=hidden, activation=activation,
                                   has_bias=bias is not None, fp8_max=fp8_max, power_of_two=power_of_two,
                                   amax_epsilon=amax_epsilon, ptx=ptx)
        return pallas_call(
            kernel, out_shape=tuple(out_shape), grid=grid,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret(), name="mtjax_activation_grad_tile_quantize",
        )(*inputs)

    outs = with_fp8_activation_ptx(activation, run, *inputs)
    dbias = None if bias is None else jnp.sum(outs[4], axis=0)
    return (*outs[:4], dbias)


def _block_kernel(w_ref, q_ref, qt_ref, s_ref, *, k, n, fp8_max, power_of_two, amax_epsilon):
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * TILE + jnp.arange(TILE)
    cols = j * TILE + jnp.arange(TILE)
    w, mask = _load(w_ref, rows, cols, k, n, k % TILE == 0 and n % TILE == 0)
    scale, scale_inv = tile_scales(jnp.max(jnp.abs(w)), fp8_max, power_of_two, amax_epsilon)
    q = saturate_cast(w * scale, q_ref.dtype)
    plgpu.store(q_ref.at[rows[:, None], cols[None, :]], q, mask=mask)
    plgpu.store(qt_ref.at[cols[:, None], rows[None, :]], q.T, mask=None if mask is None else mask.T)
    s_ref[i, j] = scale_inv


def block_quantize(w: jax.Array, out_dtype, *, fp8_max: float, power_of_two: bool = False, amax_epsilon: float = 0.0,
                   num_warps: int = NUM_WARPS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q [k, n], q.T, scale_inv [ceil(k/128), ceil(n/128)])``: ``w [k, n]`` cast in 128x128 blocks."""
    why = unsupported(w.shape, w.dtype, out_dtype)
    if why is not None:
        raise ValueError(f"block_quantize: unsupported input: {why}")
    k, n = w.shape
    grid = (pl.cdiv(k, TILE), pl.cdiv(n, TILE))
    kernel = functools.partial(_block_kernel, k=k, n=n, fp8_max=fp8_max, power_of_two=power_of_two,
                               amax_epsilon=amax_epsilon)
    return pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((k, n), out_dtype), jax.ShapeDtypeStruct((n, k), out_dtype),
                   jax.ShapeDtypeStruct(grid, jnp.float32)),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret(), name="mtjax_block_quantize",
    )(w)
