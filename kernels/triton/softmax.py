"""Scaled, masked and causal softmax in native Triton: the algorithm of `mtjax.kernels.softmax`, with its tiles.

Each program keeps ``block_m`` whole rows of ``kv_len`` in registers; the causal mask (bottom-right
aligned) comes from the row index, a keep-mask is read as int8 rows shared by consecutive logits
rows. Fully masked rows give zeros. Backward: ``dx = scale * y * (dy - sum(dy * y))``.
"""

import math

import jax
import triton
import triton.language as tl

from mtjax.kernels import softmax as pallas_softmax
from mtjax.kernels.common import Launchers, check_size
from mtjax.kernels.triton.runtime import launch, stand_in

LOG2E = math.log2(math.e)


@triton.jit
def _tile(M: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, N_PAD)
    return rows, cols, (rows[:, None] < M) & (cols[None, :] < N)


@triton.jit
def _forward_kernel(x_ptr, mask_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, Q_LEN: tl.constexpr, SCALE2: tl.constexpr, CAUSAL: tl.constexpr,
                    MASK_ROWS_PER: tl.constexpr):
    rows, cols, valid = _tile(M, N, N_PAD, BLOCK_M)
    offsets = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    keep = valid
    if CAUSAL:
        last_key = rows % Q_LEN + (N - Q_LEN)
        keep = keep & (cols[None, :] <= last_key[:, None])
    if MASK_ROWS_PER > 0:
        mask_offsets = (rows // MASK_ROWS_PER)[:, None] * N + cols[None, :]
        keep = keep & (tl.load(mask_ptr + mask_offsets, mask=valid, other=0) != 0)
    z = tl.where(keep, x * SCALE2, float("-inf"))  # base 2: SCALE2 = scale * log2 e
    row_max = tl.max(z, axis=1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # fully masked row: no NaN from inf - inf
    e = tl.where(keep, tl.exp2(z - row_max[:, None]), 0.0)
    denom = tl.sum(e, axis=1)
    y = e / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=valid)


def forward(logits, mask, *, scale: float, causal: bool, tile_override=None):
    """`mtjax.kernels.softmax.forward` (same arguments and result) on the native Triton kernel."""
    check_size("softmax forward", logits)
    rows_per, compact = pallas_softmax.mask_rows(mask, logits.shape)
    spec = pallas_softmax._spec(logits.shape, scale, causal, rows_per, tile_override)
    [y] = launch(
        _forward_kernel, logits.reshape(spec.m, spec.n), stand_in() if compact is None else compact,
        out_shape=[jax.ShapeDtypeStruct((spec.m, spec.n), logits.dtype)], grid=(triton.cdiv(spec.m, spec.block_m),),
        name="mtjax_triton_softmax_fwd", num_warps=spec.num_warps, num_stages=1,
        M=spec.m, N=spec.n, N_PAD=spec.n_pad, BLOCK_M=spec.block_m, Q_LEN=spec.q_len, SCALE2=float(scale) * LOG2E,
        CAUSAL=bool(causal), MASK_ROWS_PER=rows_per,
    )
    return y.reshape(logits.shape)


@triton.jit
def _backward_kernel(y_ptr, dy_ptr, dx_ptr, M: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, SCALE: tl.constexpr):
    rows, cols, valid = _tile(M, N, N_PAD, BLOCK_M)
    offsets = rows[:, None] * N + cols[None, :]
    y = tl.load(y_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    dx = SCALE * y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=valid)


def backward(y, dy, *, scale: float, tile_override=None):
    """`mtjax.kernels.softmax.backward` (same arguments and result) on the native Triton kernel."""
    spec = pallas_softmax._spec(y.shape, scale, False, 0, tile_override)
    [dx] = launch(
        _backward_kernel, y.reshape(spec.m, spec.n), dy.reshape(spec.m, spec.n),
        out_shape=[jax.ShapeDtypeStruct((spec.m, spec.n), y.dtype)], grid=(triton.cdiv(spec.m, spec.block_m),),
        name="mtjax_triton_softmax_bwd", num_warps=spec.num_warps, num_stages=1,
        M=spec.m, N=spec.n, N_PAD=spec.n_pad, BLOCK_M=spec.block_m, SCALE=float(scale),
    )
    return dx.reshape(y.shape)


NATIVE = Launchers(forward=forward, backward=backward)


def softmax(logits: jax.Array, mask: jax.Array | None, *, scale: float, causal: bool) -> jax.Array:
    """`mtjax.kernels.softmax.softmax` on the native Triton kernels."""
    return pallas_softmax.softmax(logits, mask, scale=scale, causal=causal, launchers=NATIVE)
