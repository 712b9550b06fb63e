"""LayerNorm / RMSNorm in native Triton: the algorithm of `mtjax.kernels.layer_norm` (and its residual +
dropout input and FP8 output), with the same tiles, program count and prefetch rule.

One persistent forward kernel and one backward kernel serve every variant; constexpr flags pick the
inputs. `PROGRAMS` programs walk strided blocks of ``block_m`` whole rows (``n_pad`` columns, masked
past ``n`` unless the tiles cover the array exactly), loading the next block before computing this
one while the prefetched tiles fit in registers (`NormSpec.prefetch`). Statistics are float32; the
backward recomputes them from the saved input and writes per-program partial sums of
``dgamma``/``dbeta``, which XLA adds. Inputs and outputs a variant lacks are one-element stand-ins
the kernel never touches.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mtjax.dtypes import fp8_max
from mtjax.kernels import layer_norm as pallas_norm
from mtjax.kernels import residual_norm as pallas_residual_norm
from mtjax.kernels.common import Launchers, check_size, reduce_tile_maxima
from mtjax.kernels.triton.language import cdiv, dropout_keep, dropout_threshold, saturate
from mtjax.kernels.triton.runtime import launch, seed_input, stand_in


@triton.jit
def _block(ptr, block, M: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
           EXACT: tl.constexpr):
    """Row block ``block`` of the ``[M, N]`` array at ``ptr``, in its dtype (zeros outside the array)."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, N_PAD)
    offsets = rows[:, None] * N + cols[None, :]
    if EXACT:
        return tl.load(ptr + offsets)
    return tl.load(ptr + offsets, mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)


@triton.jit
def _store_block(ptr, value, block, M: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 EXACT: tl.constexpr):
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, N_PAD)
    offsets = rows[:, None] * N + cols[None, :]
    if EXACT:
        tl.store(ptr + offsets, value.to(ptr.dtype.element_ty))
    else:
        tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _vector(ptr, N: tl.constexpr, N_PAD: tl.constexpr):
    cols = tl.arange(0, N_PAD)
    if N == N_PAD:
        return tl.load(ptr + cols).to(tl.float32)
    return tl.load(ptr + cols, mask=cols < N, other=0.0).to(tl.float32)


@triton.jit
def _normalize(h, block, M: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
               RMS: tl.constexpr, EPSILON: tl.constexpr, EXACT: tl.constexpr):
    """``(x_hat, rstd)`` of the float32 block ``h`` (zeros outside the array)."""
    if RMS:
        centered = h
    else:
        mean = tl.sum(h, axis=1) / N
        centered = h - mean[:, None]
        if not EXACT:
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = tl.arange(0, N_PAD)
            centered = tl.where((rows[:, None] < M) & (cols[None, :] < N), centered, 0.0)
    var = tl.sum(centered * centered, axis=1) / N
    rstd = tl.math.rsqrt(var + EPSILON)
    return centered * rstd[:, None], rstd


@triton.jit
def _forward_kernel(x_ptr, gamma_ptr, beta_ptr, residual_ptr, seed_ptr, scale_ptr, y_ptr, residual_out_ptr, amax_ptr,
                    M: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                    PROGRAMS: tl.constexpr, EXACT: tl.constexpr, PREFETCH: tl.constexpr, RMS: tl.constexpr,
                    EPSILON: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_BETA: tl.constexpr,
                    RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr, THRESHOLD: tl.constexpr,
                    KEEP_SCALE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    program = tl.program_id(0)
    num_blocks: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    trips = cdiv(num_blocks - program, PROGRAMS)
    cols = tl.arange(0, N_PAD)
    gamma = _vector(gamma_ptr, N, N_PAD)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    beta = _vector(beta_ptr, N, N_PAD) if HAS_BETA else gamma
    scale = tl.load(scale_ptr) if FP8 else 1.0
    seed = tl.load(seed_ptr).to(tl.uint32, bitcast=True) if DROPOUT else 0
    amax = tl.full((), 0.0, tl.float32)
    x_next = _block(x_ptr, program, M, N, N_PAD, BLOCK_M, EXACT)
    r_next = _block(residual_ptr, program, M, N, N_PAD, BLOCK_M, EXACT) if RESIDUAL else x_next
    for i in range(trips):
        block = program + i * PROGRAMS
        if PREFETCH:  # the next block's loads go out before this block's reductions
            x_tile, r_tile = x_next, r_next
            following = tl.minimum(block + PROGRAMS, num_blocks - 1)
            x_next = _block(x_ptr, following, M, N, N_PAD, BLOCK_M, EXACT)
            r_next = _block(residual_ptr, following, M, N, N_PAD, BLOCK_M, EXACT) if RESIDUAL else x_next
        else:
            x_tile = _block(x_ptr, block, M, N, N_PAD, BLOCK_M, EXACT)
            r_tile = _block(residual_ptr, block, M, N, N_PAD, BLOCK_M, EXACT) if RESIDUAL else x_tile
        h = x_tile.to(tl.float32)
        if RESIDUAL:
            if DROPOUT:
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                keep = dropout_keep(seed, rows[:, None], cols[None, :], THRESHOLD)
                h = tl.where(keep, h * KEEP_SCALE, 0.0)
            # Normalize the residual as stored (rounded to its dtype): the backward recomputes the
            # statistics from that stored tensor and must see the same values.
            stored = (h + r_tile.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
            _store_block(residual_out_ptr, stored, block, M, N, N_PAD, BLOCK_M, EXACT)
            h = stored.to(tl.float32)
        x_hat, _ = _normalize(h, block, M, N, N_PAD, BLOCK_M, RMS, EPSILON, EXACT)
        y = x_hat * gamma[None, :]
        if HAS_BETA:
            y = y + beta[None, :]
        if FP8:
            if not EXACT:
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                y = tl.where((rows[:, None] < M) & (cols[None, :] < N), y, 0.0)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
            y = saturate(y * scale, FP8_MAX)
        _store_block(y_ptr, y, block, M, N, N_PAD, BLOCK_M, EXACT)
    if FP8:
        tl.store(amax_ptr + program, amax)


def forward(x, gamma, beta, residual=None, seed=None, scale=None, *, rms: bool, epsilon: float,
            zero_centered_gamma: bool, dropout_rate: float = 0.0, out_dtype=None, tile=None, programs=None):
    """`mtjax.kernels.layer_norm.forward` (same arguments and results) on the native Triton kernel."""
    m, n = x.shape
    check_size("norm forward", x)
    spec = pallas_norm._spec(
        m, n, tile=tile or pallas_norm.forward_tile(n), rms=rms, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, has_beta=beta is not None, residual=residual is not None,
        dropout_rate=dropout_rate if residual is not None else 0.0,
    )
    programs = min(spec.num_blocks, programs or pallas_norm.PROGRAMS)
    fp8 = scale is not None
    y_dtype = out_dtype or x.dtype
    out_shape = [
        jax.ShapeDtypeStruct((m, n), y_dtype),
        jax.ShapeDtypeStruct((m, n) if residual is not None else (1,), residual.dtype if residual is not None
                             else jnp.float32),
        jax.ShapeDtypeStruct((programs,) if fp8 else (1,), jnp.float32),
    ]
    y, new_residual, amax = launch(
        _forward_kernel, x, gamma, stand_in() if beta is None else beta, stand_in() if residual is None else residual,
        seed_input(seed if spec.dropout_rate > 0.0 else None),
        stand_in() if scale is None else jnp.reshape(scale, (1,)).astype(jnp.float32),
        out_shape=out_shape, grid=(programs,), name=f"mtjax_triton_{'rms' if rms else 'layer'}_norm_fwd",
        num_warps=spec.num_warps, num_stages=1,
        M=m, N=n, N_PAD=spec.n_pad, BLOCK_M=spec.block_m, PROGRAMS=programs, EXACT=spec.exact,
        PREFETCH=spec.prefetch(2 if spec.residual else 1), RMS=rms, EPSILON=float(epsilon),
        ZERO_CENTERED=bool(zero_centered_gamma), HAS_BETA=beta is not None, RESIDUAL=residual is not None,
        DROPOUT=spec.dropout_rate > 0.0, THRESHOLD=dropout_threshold(spec.dropout_rate),
        KEEP_SCALE=1.0 / (1.0 - spec.dropout_rate), FP8=fp8, FP8_MAX=fp8_max(y_dtype) if fp8 else 1.0,
    )
    outs = [y]
    if residual is not None:
        outs.append(new_residual)
    if fp8:
        outs.append(reduce_tile_maxima(amax))
    return tuple(outs)


@triton.jit
def _backward_kernel(h_ptr, gamma_ptr, dy_ptr, dres_ptr, seed_ptr, dh_ptr, dx_ptr, dgamma_ptr, dbeta_ptr,
                     M: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                     PROGRAMS: tl.constexpr, EXACT: tl.constexpr, PREFETCH: tl.constexpr, RMS: tl.constexpr,
                     EPSILON: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_BETA: tl.constexpr,
                     RESIDUAL: tl.constexpr, SPLIT_DX: tl.constexpr, DROPOUT: tl.constexpr,
                     THRESHOLD: tl.constexpr, KEEP_SCALE: tl.constexpr):
    program = tl.program_id(0)
    num_blocks: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    trips = cdiv(num_blocks - program, PROGRAMS)
    cols = tl.arange(0, N_PAD)
    gamma = _vector(gamma_ptr, N, N_PAD)
    if ZERO_CENTERED:
        gamma = gamma + 1.0
    seed = tl.load(seed_ptr).to(tl.uint32, bitcast=True) if DROPOUT else 0
    dgamma = tl.zeros((N_PAD,), tl.float32)
    dbeta = tl.zeros((N_PAD,), tl.float32)
    h_next = _block(h_ptr, program, M, N, N_PAD, BLOCK_M, EXACT)
    dy_next = _block(dy_ptr, program, M, N, N_PAD, BLOCK_M, EXACT)
    dr_next = _block(dres_ptr, program, M, N, N_PAD, BLOCK_M, EXACT) if RESIDUAL else dy_next
    for i in range(trips):
        block = program + i * PROGRAMS
        if PREFETCH:
            h_tile, dy_tile, dr_tile = h_next, dy_next, dr_next
            following = tl.minimum(block + PROGRAMS, num_blocks - 1)
            h_next = _block(h_ptr, following, M, N, N_PAD, BLOCK_M, EXACT)
            dy_next = _block(dy_ptr, following, M, N, N_PAD, BLOCK_M, EXACT)
            dr_next = _block(dres_ptr, following, M, N, N_PAD, BLOCK_M, EXACT) if RESIDUAL else dy_next
        else:
            h_tile = _block(h_ptr, block, M, N, N_PAD, BLOCK_M, EXACT)
            dy_tile = _block(dy_ptr, block, M, N, N_PAD, BLOCK_M, EXACT)
            dr_tile = _block(dres_ptr, block, M, N, N_PAD, BLOCK_M, EXACT) if RESIDUAL else dy_tile
        dy = dy_tile.to(tl.float32)
        x_hat, rstd = _normalize(h_tile.to(tl.float32), block, M, N, N_PAD, BLOCK_M, RMS, EPSILON, EXACT)
        g_dy = dy * gamma[None, :]
        proj = tl.sum(g_dy * x_hat, axis=1) / N
        if RMS:
            dh = (g_dy - x_hat * proj[:, None]) * rstd[:, None]
        else:
            dh = (g_dy - (tl.sum(g_dy, axis=1) / N)[:, None] - x_hat * proj[:, None]) * rstd[:, None]
            if not EXACT:
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                dh = tl.where((rows[:, None] < M) & (cols[None, :] < N), dh, 0.0)
        if RESIDUAL:
            dh = dh + dr_tile.to(tl.float32)
        _store_block(dh_ptr, dh, block, M, N, N_PAD, BLOCK_M, EXACT)
        if SPLIT_DX:
            if DROPOUT:
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                keep = dropout_keep(seed, rows[:, None], cols[None, :], THRESHOLD)
                dh = tl.where(keep, dh * KEEP_SCALE, 0.0)
            _store_block(dx_ptr, dh, block, M, N, N_PAD, BLOCK_M, EXACT)
        dgamma += tl.sum(dy * x_hat, axis=0)
        dbeta += tl.sum(dy, axis=0)
    if N == N_PAD:
        tl.store(dgamma_ptr + program * N + cols, dgamma)
        if HAS_BETA:
            tl.store(dbeta_ptr + program * N + cols, dbeta)
    else:
        tl.store(dgamma_ptr + program * N + cols, dgamma, mask=cols < N)
        if HAS_BETA:
            tl.store(dbeta_ptr + program * N + cols, dbeta, mask=cols < N)


def backward(h, gamma, dy, dresidual=None, seed=None, *, rms: bool, epsilon: float, zero_centered_gamma: bool,
             has_beta: bool, dropout_rate: float = 0.0, dx_dtype=None, tile=None, programs=None):
    """`mtjax.kernels.layer_norm.backward` (same arguments and results) on the native Triton kernel."""
    m, n = h.shape
    check_size("norm backward", h)
    spec = pallas_norm._spec(
        m, n, tile=tile or pallas_norm.backward_tile(n), rms=rms, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, has_beta=has_beta, residual=dresidual is not None,
        dropout_rate=dropout_rate if dresidual is not None else 0.0,
    )
    dx_dtype = jnp.dtype(dx_dtype or h.dtype)
    split_dx = spec.dropout_rate > 0.0 or dx_dtype != h.dtype
    programs = min(spec.num_blocks, programs or pallas_norm.PROGRAMS)
    out_shape = [jax.ShapeDtypeStruct((m, n), h.dtype),
                 jax.ShapeDtypeStruct((m, n) if split_dx else (1,), dx_dtype),
                 jax.ShapeDtypeStruct((programs, n), jnp.float32),
                 jax.ShapeDtypeStruct((programs, n) if has_beta else (1,), jnp.float32)]
    dh, dx, dgamma, dbeta = launch(
        _backward_kernel, h, gamma, dy, stand_in() if dresidual is None else dresidual,
        seed_input(seed if spec.dropout_rate > 0.0 else None),
        out_shape=out_shape, grid=(programs,), name=f"mtjax_triton_{'rms' if rms else 'layer'}_norm_bwd",
        num_warps=spec.num_warps, num_stages=1,
        M=m, N=n, N_PAD=spec.n_pad, BLOCK_M=spec.block_m, PROGRAMS=programs, EXACT=spec.exact,
        PREFETCH=spec.prefetch(3 if spec.residual else 2), RMS=rms, EPSILON=float(epsilon),
        ZERO_CENTERED=bool(zero_centered_gamma), HAS_BETA=has_beta, RESIDUAL=dresidual is not None, SPLIT_DX=split_dx,
        DROPOUT=spec.dropout_rate > 0.0, THRESHOLD=dropout_threshold(spec.dropout_rate),
        KEEP_SCALE=1.0 / (1.0 - spec.dropout_rate),
    )
    return dh, dx if split_dx else dh, jnp.sum(dgamma, axis=0), jnp.sum(dbeta, axis=0) if has_beta else None


NATIVE = Launchers(forward=forward, backward=backward)


def layer_norm(x, gamma, beta, *, epsilon: float, zero_centered_gamma: bool) -> jax.Array:
    """`mtjax.kernels.layer_norm.layer_norm` on the native Triton kernels."""
    return pallas_norm.layer_norm(x, gamma, beta, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                                  launchers=NATIVE)


def rms_norm(x, gamma, *, epsilon: float, zero_centered_gamma: bool) -> jax.Array:
    """`mtjax.kernels.layer_norm.rms_norm` on the native Triton kernels."""
    return pallas_norm.rms_norm(x, gamma, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma, launchers=NATIVE)


def norm_fp8(x, gamma, beta, scale, **options) -> tuple[jax.Array, jax.Array]:
    """`mtjax.kernels.layer_norm.norm_fp8` on the native Triton forward kernel."""
    return pallas_norm.norm_fp8(x, gamma, beta, scale, launchers=NATIVE, **options)


def residual_norm(x, residual, gamma, beta, seed, **options) -> tuple[jax.Array, jax.Array]:
    """`mtjax.kernels.residual_norm.residual_norm` on the native Triton kernels."""
    return pallas_residual_norm.residual_norm(x, residual, gamma, beta, seed, launchers=NATIVE, **options)
