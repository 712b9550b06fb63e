"""Block-scaled FP8 in native Triton: the kernels of `mtjax.kernels.block_quantize` (1x128 row tiles,
128x128 blocks, each with its own scale, plus transposed copies) and `mtjax.kernels.block_fp8_gemm`
(one float32 promotion per 128-wide K block, DeepGEMM-style). The tile cast takes the same prologues
(a norm or an activation applied to each loaded tile) as the Pallas kernel, and the activation's
backward writes its gradient's tiles as the Pallas `activation_grad_tile_quantize` does.

The scale math is `block_quantize.tile_scales` (``fp8_max / max(amax, amax_epsilon)``, 1 where that is
not finite or the amax is 0 or NaN, optionally rounded down to a power of two) with IEEE division, so
the casts agree bit for bit with the references.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mtjax.kernels import block_fp8_gemm as pallas_gemm
from mtjax.kernels import block_quantize as pallas_quantize
from mtjax.kernels.activation import ACTIVATIONS, with_fp8_activation_ptx
from mtjax.kernels.common import Launchers
from mtjax.kernels.triton.activation import CODES, GATE_CODES, activation_fn, gate_fn
from mtjax.kernels.triton.language import saturate
from mtjax.kernels.triton.runtime import launch, stand_in

TILE = pallas_quantize.TILE


@triton.jit
def _amax(x, axis: tl.constexpr):
    """``max |x|`` along ``axis``, NaN where a NaN is (as jax.numpy's max on the GPU)."""
    has_nan = tl.max((x != x).to(tl.int32), axis=axis) > 0
    return tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis=axis))


@triton.jit
def _tile_scales(amax, FP8_MAX: tl.constexpr, POWER_OF_TWO: tl.constexpr, AMAX_EPSILON: tl.constexpr):
    """`block_quantize.tile_scales` of float32 amaxes (NaN amaxes stay NaN, as in jax.numpy)."""
    amax = tl.maximum(amax, AMAX_EPSILON, propagate_nan=tl.PropagateNan.ALL)
    # Triton's division (div.full.f32 on NVIDIA GPUs), not the IEEE one: XLA's GPU division and the
    # Pallas kernels' give the same scales to the bit, which block-scaled GEMMs compare against.
    scale = FP8_MAX / amax
    usable = (amax < float("inf")) & (amax > 0.0) & (scale < float("inf"))  # False for NaN
    scale = tl.where(usable, scale, 1.0)
    if POWER_OF_TWO:
        scale = (scale.to(tl.uint32, bitcast=True) & 0xFF800000).to(tl.float32, bitcast=True)
    return scale, 1.0 / scale


@triton.jit
def _load_tile(x_ptr, rows, cols, M: tl.constexpr, K: tl.constexpr, EXACT: tl.constexpr):
    offsets = rows[:, None] * K + cols[None, :]
    if EXACT:
        return tl.load(x_ptr + offsets).to(tl.float32)
    # Masked elements load as 0, which never raises a max of absolute values.
    return tl.load(x_ptr + offsets, mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, offsets, value, mask, EXACT: tl.constexpr):
    if EXACT:
        tl.store(ptr + offsets, value)
    else:
        tl.store(ptr + offsets, value, mask=mask)


@triton.jit
def _load_vector(ptr, index, SIZE: tl.constexpr, EXACT: tl.constexpr):
    if EXACT:
        return tl.load(ptr + index).to(tl.float32)
    return tl.load(ptr + index, mask=index < SIZE, other=0.0).to(tl.float32)


@triton.jit
def _load_gate(x_ptr, offsets, mask, bias_ptr, cols, K: tl.constexpr, EXACT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The float32 gate half (columns ``K + cols`` of a gated activation's ``[m, 2 * K]`` input), its
    bias added; 0 where masked."""
    if EXACT:
        gate = tl.load(x_ptr + offsets + K).to(tl.float32)
    else:
        gate = tl.load(x_ptr + offsets + K, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate = gate + _load_vector(bias_ptr, K + cols, 2 * K, EXACT)[None, :]
    return gate


@triton.jit
def _prologue_tile(x_ptr, a_ptr, b_ptr, c_ptr, d_ptr, rows, cols, M: tl.constexpr, K: tl.constexpr,
                   EXACT: tl.constexpr, PROLOGUE: tl.constexpr, RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                   HAS_SHIFT: tl.constexpr, ACT: tl.constexpr, GATE: tl.constexpr, GATED: tl.constexpr,
                   PTX_SIGMOID: tl.constexpr):
    """The float32 ``[rows, cols]`` tile of the prologue applied to ``x`` (PROLOGUE 0: none; 1: a norm
    with ``mean, rstd, gamma, beta`` at ``a..d``; 2: an activation with its bias at ``a``), 0 where
    masked."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x_cols: tl.constexpr = 2 * K if GATED else K
    offsets = rows[:, None] * x_cols + cols[None, :]
    if EXACT:
        x = tl.load(x_ptr + offsets).to(tl.float32)
    else:  # masked elements load as 0, which never raises a max of absolute values
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        gamma = _load_vector(c_ptr, cols, K, EXACT)
        if ZERO_CENTERED:
            gamma += 1.0
        if not RMS:
            x = x - _load_vector(a_ptr, rows, M, EXACT)[:, None]
        x = x * _load_vector(b_ptr, rows, M, EXACT)[:, None] * gamma[None, :]
        if HAS_SHIFT:
            x = x + _load_vector(d_ptr, cols, K, EXACT)[None, :]
    elif PROLOGUE == 2:
        if HAS_SHIFT:
            x = x + _load_vector(a_ptr, cols, K, EXACT)[None, :]
        x, _ = activation_fn(x, ACT, PTX_SIGMOID)
        if GATED:
            g, _ = gate_fn(_load_gate(x_ptr, offsets, mask, a_ptr, cols, K, EXACT, HAS_SHIFT), GATE)
            x = x * g
    if PROLOGUE != 0 and not EXACT:  # a masked element's prologue need not be 0
        x = tl.where(mask, x, 0.0)
    return x, mask


@triton.jit
def _tile_kernel(x_ptr, a_ptr, b_ptr, c_ptr, d_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M: tl.constexpr, K: tl.constexpr,
                 ROWS: tl.constexpr, TILE: tl.constexpr, TRANSPOSE: tl.constexpr, EXACT: tl.constexpr,
                 FP8_MAX: tl.constexpr, POWER_OF_TWO: tl.constexpr, AMAX_EPSILON: tl.constexpr,
                 PROLOGUE: tl.constexpr, RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_SHIFT: tl.constexpr,
                 ACT: tl.constexpr, GATE: tl.constexpr, GATED: tl.constexpr, PTX_SIGMOID: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    rows = i * ROWS + tl.arange(0, ROWS)
    cols = j * TILE + tl.arange(0, TILE)
    x, mask = _prologue_tile(x_ptr, a_ptr, b_ptr, c_ptr, d_ptr, rows, cols, M, K, EXACT, PROLOGUE, RMS,
                             ZERO_CENTERED, HAS_SHIFT, ACT, GATE, GATED, PTX_SIGMOID)
    scale, scale_inv = _tile_scales(_amax(x, 1), FP8_MAX, POWER_OF_TWO, AMAX_EPSILON)
    q = saturate(x * scale[:, None], FP8_MAX).to(q_ptr.dtype.element_ty)
    _store(q_ptr, rows[:, None] * K + cols[None, :], q, mask, EXACT)
    _store(s_ptr, rows * tl.num_programs(1) + j, scale_inv, rows < M, EXACT)
    if TRANSPOSE:  # the same 128 x 128 tile, cut into row tiles of x.T (columns of x)
        scale_t, scale_inv_t = _tile_scales(_amax(x, 0), FP8_MAX, POWER_OF_TWO, AMAX_EPSILON)
        q_t = saturate(x * scale_t[None, :], FP8_MAX).to(qt_ptr.dtype.element_ty)
        _store(qt_ptr, cols[:, None] * M + rows[None, :], tl.trans(q_t), tl.trans(mask), EXACT)
        _store(st_ptr, cols * tl.num_programs(0) + i, scale_inv_t, cols < K, EXACT)


_NO_PROLOGUE = dict(PROLOGUE=0, RMS=False, ZERO_CENTERED=False, HAS_SHIFT=False, ACT=0, GATE=0, GATED=False,
                    PTX_SIGMOID=False)


def _tile_launch(x, operands, k, out_dtype, *, name, transpose, fp8_max, power_of_two, amax_epsilon, num_warps,
                 **prologue):
    """The tile cast of ``x [m, *]`` into ``k`` columns, the four operand slots filled with stand-ins."""
    m = x.shape[0]
    rows = TILE if transpose else pallas_quantize.ROWS
    grid = (triton.cdiv(m, rows), triton.cdiv(k, TILE))
    out_shape = [jax.ShapeDtypeStruct((m, k), out_dtype), jax.ShapeDtypeStruct((m, grid[1]), jnp.float32)]
    out_shape += ([jax.ShapeDtypeStruct((k, m), out_dtype), jax.ShapeDtypeStruct((k, grid[0]), jnp.float32)]
                  if transpose else [jax.ShapeDtypeStruct((1,), out_dtype), jax.ShapeDtypeStruct((1,), jnp.float32)])
    operands = tuple(stand_in() if a is None else a for a in operands)
    outs = launch(
        _tile_kernel, x, *operands, out_shape=out_shape, grid=grid, name=name,
        num_warps=num_warps, num_stages=1, M=m, K=k, ROWS=rows, TILE=TILE, TRANSPOSE=bool(transpose),
        EXACT=m % rows == 0 and k % TILE == 0, FP8_MAX=float(fp8_max), POWER_OF_TWO=bool(power_of_two),
        AMAX_EPSILON=float(amax_epsilon), **{**_NO_PROLOGUE, **prologue},
    )
    return tuple(outs if transpose else outs[:2])


def _check(x, out_dtype, op):
    why = pallas_quantize.unsupported(x.shape, x.dtype, out_dtype)
    if why is not None:
        raise ValueError(f"{op}: unsupported input: {why}")


def tile_quantize(x: jax.Array, out_dtype, *, transpose: bool = False, fp8_max: float, power_of_two: bool = False,
                  amax_epsilon: float = 0.0, num_warps: int = pallas_quantize.NUM_WARPS) -> tuple[jax.Array, ...]:
    """`mtjax.kernels.block_quantize.tile_quantize` (same arguments and results) in native Triton."""
    _check(x, out_dtype, "tile_quantize")
    return _tile_launch(x, (None,) * 4, x.shape[1], out_dtype, name="mtjax_triton_tile_quantize", transpose=transpose,
                        fp8_max=fp8_max, power_of_two=power_of_two, amax_epsilon=amax_epsilon, num_warps=num_warps)


def norm_tile_quantize(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, out_dtype, *, rms: bool,
                       epsilon: float, zero_centered_gamma: bool, transpose: bool = False, fp8_max: float,
                       power_of_two: bool = False, amax_epsilon: float = 0.0,
                       num_warps: int = pallas_quantize.NUM_WARPS) -> tuple[jax.Array, ...]:
    """`mtjax.kernels.block_quantize.norm_tile_quantize` (same arguments and results) in native Triton."""
    _check(x, out_dtype, "norm_tile_quantize")
    stats = pallas_quantize.row_statistics(x, rms=rms, epsilon=epsilon)
    mean, rstd = (None, *stats) if rms else stats
    return _tile_launch(x, (mean, rstd, gamma, beta), x.shape[1], out_dtype, name="mtjax_triton_norm_tile_quantize",
                        transpose=transpose, fp8_max=fp8_max, power_of_two=power_of_two, amax_epsilon=amax_epsilon,
                        num_warps=num_warps, PROLOGUE=1,
                        RMS=bool(rms), ZERO_CENTERED=bool(zero_centered_gamma), HAS_SHIFT=beta is not None)


def activation_tile_quantize(x: jax.Array, bias: jax.Array | None, out_dtype, *, activation: str,
                             transpose: bool = False, fp8_max: float, power_of_two: bool = False,
                             amax_epsilon: float = 0.0,
                             num_warps: int = pallas_quantize.NUM_WARPS) -> tuple[jax.Array, ...]:
    """`mtjax.kernels.block_quantize.activation_tile_quantize` (same arguments and results) in native Triton."""
    x2 = x.reshape(x.shape[0], -1)
    _check(x2, out_dtype, "activation_tile_quantize")
    gated = pallas_quantize.ActivationPrologue(activation, has_bias=bias is not None).gated
    bias = None if bias is None else bias.reshape(-1)

    def run(ptx, x2, *bias):  # the bias, if any, as an operand of the platform branches
        return _tile_launch(x2, (bias[0] if bias else None, None, None, None), x.shape[-1], out_dtype,
                            name="mtjax_triton_activation_tile_quantize", transpose=transpose, fp8_max=fp8_max,
                            power_of_two=power_of_two, amax_epsilon=amax_epsilon, num_warps=num_warps, PROLOGUE=2,
                            HAS_SHIFT=bool(bias), ACT=CODES[activation], GATE=GATE_CODES.get(activation, 0),
                            GATED=gated, PTX_SIGMOID=ptx)

    return with_fp8_activation_ptx(activation, run, x2, *([] if bias is None else [bias]))


@triton.jit
def _store_grad_tiles(grad, q_ptr, s_ptr, qt_ptr, st_ptr, dbias_ptr, rows, out_cols, scale_col, i, mask,
                      M: tl.constexpr, WIDTH: tl.constexpr, SCALE_COLS: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                      EXACT: tl.constexpr, FP8_MAX: tl.constexpr, POWER_OF_TWO: tl.constexpr,
                      AMAX_EPSILON: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One half's gradient tile: its row tiles and scales, the transposed tiles and scales, and this
    row block's column sums (the bias gradient's partials)."""
    scale, scale_inv = _tile_scales(_amax(grad, 1), FP8_MAX, POWER_OF_TWO, AMAX_EPSILON)
    q = saturate(grad * scale[:, None], FP8_MAX).to(q_ptr.dtype.element_ty)
    _store(q_ptr, rows[:, None] * WIDTH + out_cols[None, :], q, mask, EXACT)
    _store(s_ptr, rows * SCALE_COLS + scale_col, scale_inv, rows < M, EXACT)
    scale_t, scale_inv_t = _tile_scales(_amax(grad, 0), FP8_MAX, POWER_OF_TWO, AMAX_EPSILON)
    q_t = saturate(grad * scale_t[None, :], FP8_MAX).to(qt_ptr.dtype.element_ty)
    col_mask = tl.max(mask.to(tl.int32), axis=0) > 0
    _store(qt_ptr, out_cols[:, None] * M + rows[None, :], tl.trans(q_t), tl.trans(mask), EXACT)
    _store(st_ptr, out_cols * ROW_BLOCKS + i, scale_inv_t, col_mask, EXACT)
    if HAS_BIAS:
        _store(dbias_ptr, i * WIDTH + out_cols, tl.sum(grad, axis=0), col_mask, EXACT)


@triton.jit
def _activation_grad_kernel(x_ptr, bias_ptr, dy_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, dbias_ptr, M: tl.constexpr,
                            HIDDEN: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr, FP8_MAX: tl.constexpr,
                            POWER_OF_TWO: tl.constexpr, AMAX_EPSILON: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ACT: tl.constexpr, GATE: tl.constexpr, GATED: tl.constexpr, PTX_SIGMOID: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    rows = i * TILE + tl.arange(0, TILE)
    cols = j * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < HIDDEN)
    WIDTH: tl.constexpr = 2 * HIDDEN if GATED else HIDDEN
    SCALE_COLS: tl.constexpr = (WIDTH + TILE - 1) // TILE
    ROW_BLOCKS: tl.constexpr = (M + TILE - 1) // TILE
    offsets = rows[:, None] * WIDTH + cols[None, :]
    if EXACT:
        a = tl.load(x_ptr + offsets).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * HIDDEN + cols[None, :]).to(tl.float32)
    else:  # dy loads as 0 where masked, so every gradient is 0 there
        a = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * HIDDEN + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a = a + _load_vector(bias_ptr, cols, HIDDEN, EXACT)[None, :]
    y, dact = activation_fn(a, ACT, PTX_SIGMOID)
    if GATED:
        g, dg = gate_fn(_load_gate(x_ptr, offsets, mask, bias_ptr, cols, HIDDEN, EXACT, HAS_BIAS), GATE)
        _store_grad_tiles(dy * g * dact, q_ptr, s_ptr, qt_ptr, st_ptr, dbias_ptr, rows, cols, j, i, mask, M, WIDTH,
                          SCALE_COLS, ROW_BLOCKS, EXACT, FP8_MAX, POWER_OF_TWO, AMAX_EPSILON, HAS_BIAS)
        _store_grad_tiles(dy * y * dg, q_ptr, s_ptr, qt_ptr, st_ptr, dbias_ptr, rows, HIDDEN + cols,
                          HIDDEN // TILE + j, i, mask, M, WIDTH, SCALE_COLS, ROW_BLOCKS, EXACT, FP8_MAX,
                          POWER_OF_TWO, AMAX_EPSILON, HAS_BIAS)
    else:
        _store_grad_tiles(dy * dact, q_ptr, s_ptr, qt_ptr, st_ptr, dbias_ptr, rows, cols, j, i, mask, M, WIDTH,
                          SCALE_COLS, ROW_BLOCKS, EXACT, FP8_MAX, POWER_OF_TWO, AMAX_EPSILON, HAS_BIAS)


def activation_grad_tile_quantize(x: jax.Array, bias: jax.Array | None, dy: jax.Array, out_dtype, *,
                                  activation: str, fp8_max: float, power_of_two: bool = False,
                                  amax_epsilon: float = 0.0,
                                  num_warps: int = pallas_quantize.NUM_WARPS) -> tuple[jax.Array | None, ...]:
    """`mtjax.kernels.block_quantize.activation_grad_tile_quantize` (same arguments and results) in
    native Triton."""
    m, hidden = dy.shape
    x2 = x.reshape(m, -1)
    width = x2.shape[1]
    _check(x2, out_dtype, "activation_grad_tile_quantize")
    why = pallas_quantize.unsupported_activation_grad(dy.shape, activation)
    if why is not None:
        raise ValueError(f"activation_grad_tile_quantize: unsupported input: {why}")
    grid = (triton.cdiv(m, TILE), triton.cdiv(hidden, TILE))
    out_shape = [jax.ShapeDtypeStruct((m, width), out_dtype),
                 jax.ShapeDtypeStruct((m, triton.cdiv(width, TILE)), jnp.float32),
                 jax.ShapeDtypeStruct((width, m), out_dtype), jax.ShapeDtypeStruct((width, grid[0]), jnp.float32),
                 jax.ShapeDtypeStruct((grid[0], width) if bias is not None else (1,), jnp.float32)]
    has_bias = bias is not None

    def run(ptx, x2, bias, dy):
        return launch(
            _activation_grad_kernel, x2, bias, dy, out_shape=out_shape,
            grid=grid, name="mtjax_triton_activation_grad_tile_quantize", num_warps=num_warps, num_stages=1,
            M=m, HIDDEN=hidden, TILE=TILE, EXACT=m % TILE == 0 and hidden % TILE == 0, FP8_MAX=float(fp8_max),
            POWER_OF_TWO=bool(power_of_two), AMAX_EPSILON=float(amax_epsilon), HAS_BIAS=has_bias,
            ACT=CODES[activation], GATE=GATE_CODES.get(activation, 0), GATED=ACTIVATIONS[activation][1] is not None,
            PTX_SIGMOID=ptx,
        )

    outs = with_fp8_activation_ptx(activation, run, x2, bias.reshape(-1) if has_bias else stand_in(), dy)
    return (*outs[:4], None if bias is None else jnp.sum(outs[4], axis=0))


@triton.jit
def _block_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, K: tl.constexpr, N: tl.constexpr, TILE: tl.constexpr,
                  EXACT: tl.constexpr,
                  FP8_MAX: tl.constexpr, POWER_OF_TWO: tl.constexpr, AMAX_EPSILON: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    rows = i * TILE + tl.arange(0, TILE)
    cols = j * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < K) & (cols[None, :] < N)
    w = _load_tile(w_ptr, rows, cols, K, N, EXACT)
    row_amax = _amax(w, 1)
    amax = tl.where(tl.max((row_amax != row_amax).to(tl.int32), axis=0) > 0, float("nan"), tl.max(row_amax, axis=0))
    scale, scale_inv = _tile_scales(amax, FP8_MAX, POWER_OF_TWO, AMAX_EPSILON)
    q = saturate(w * scale, FP8_MAX).to(q_ptr.dtype.element_ty)
    _store(q_ptr, rows[:, None] * N + cols[None, :], q, mask, EXACT)
    _store(qt_ptr, cols[:, None] * K + rows[None, :], tl.trans(q), tl.trans(mask), EXACT)
    tl.store(s_ptr + i * tl.num_programs(1) + j, scale_inv)


def block_quantize(w: jax.Array, out_dtype, *, fp8_max: float, power_of_two: bool = False, amax_epsilon: float = 0.0,
                   num_warps: int = pallas_quantize.NUM_WARPS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`mtjax.kernels.block_quantize.block_quantize` (same arguments and results) in native Triton."""
    why = pallas_quantize.unsupported(w.shape, w.dtype, out_dtype)
    if why is not None:
        raise ValueError(f"block_quantize: unsupported input: {why}")
    k, n = w.shape
    grid = (triton.cdiv(k, TILE), triton.cdiv(n, TILE))
    q, qt, scale_inv = launch(
        _block_kernel, w,
        out_shape=[jax.ShapeDtypeStruct((k, n), out_dtype), jax.ShapeDtypeStruct((n, k), out_dtype),
                   jax.ShapeDtypeStruct(grid, jnp.float32)],
        grid=grid, name="mtjax_triton_block_quantize", num_warps=num_warps, num_stages=1,
        K=k, N=n, TILE=TILE, EXACT=k % TILE == 0 and n % TILE == 0, FP8_MAX=float(fp8_max),
        POWER_OF_TWO=bool(power_of_two), AMAX_EPSILON=float(amax_epsilon),
    )
    return q, qt, scale_inv


@triton.jit
def _gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, o_ptr, MP: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MIXED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in tl.range(0, KP // BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * KP + kb * BLOCK_K + ks[None, :])
        b = tl.load(b_ptr + cols[:, None] * KP + kb * BLOCK_K + ks[None, :])
        if MIXED:  # E4M3 x E5M2 (HYBRID's gradients): bfloat16 holds both exactly
            a = a.to(tl.bfloat16)
            b = b.to(tl.bfloat16)
        partial = tl.dot(a, tl.trans(b))
        # Promotion: this K block's partial product with its scales, accumulated in float32.
        scales = tl.load(sa_ptr + kb * MP + rows)[:, None] * tl.load(sb_ptr + kb * NP + cols)[None, :]
        acc += partial * scales
    tl.store(o_ptr + rows[:, None] * NP + cols[None, :], acc.to(o_ptr.dtype.element_ty))


def _gemm(a, sa_t, b, sb_t, out_dtype, config):
    """`mtjax.kernels.block_fp8_gemm._launch` (same arguments and result) on the native Triton kernel."""
    (mp, kp), np_ = a.shape, b.shape[0]
    [out] = launch(
        _gemm_kernel, a, sa_t, b, sb_t, out_shape=[jax.ShapeDtypeStruct((mp, np_), out_dtype)],
        grid=(mp // config.block_m, np_ // config.block_n), name="mtjax_triton_block_fp8_gemm",
        num_warps=config.num_warps, num_stages=config.num_stages,
        MP=mp, NP=np_, KP=kp, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=pallas_gemm.BLOCK_K,
        MIXED=jnp.dtype(a.dtype) != jnp.dtype(b.dtype),
    )
    return out


NATIVE = Launchers(forward=_gemm)


def block_fp8_gemm(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, out_dtype, *,
                   config: pallas_gemm.GemmConfig = pallas_gemm.DEFAULT_CONFIG) -> jax.Array:
    """`mtjax.kernels.block_fp8_gemm.block_fp8_gemm` on the native Triton kernel."""
    return pallas_gemm.block_fp8_gemm(a, sa, b, sb, out_dtype, config=config, launchers=NATIVE)
