"""Device functions shared by the native Triton kernels: the counter-based dropout hash, tanh, FP8
saturation, bounds of masked block ranges.

Each mirrors a jax.numpy function the references use (`mtjax.kernels.common.dropout_keep`,
`jnp.tanh`, `common.saturate_cast`) so kernel and reference agree.
"""

import triton
import triton.language as tl


@triton.jit
def mix32(h):
    """`mtjax.kernels.common._mix` on a uint32 tensor: xorshift-multiply, every bit to every bit."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D).to(tl.uint32, bitcast=True)
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B).to(tl.uint32, bitcast=True)
    return h ^ (h >> 16)


@triton.jit
def dropout_keep(seed, rows, cols, THRESHOLD: tl.constexpr):
    """`mtjax.kernels.common.dropout_keep`: True keeps (row, col); ``seed`` a uint32 scalar, ``rows``
    and ``cols`` int32 tensors that broadcast, ``THRESHOLD`` = ``min(int(rate * 2**32), 2**32 - 1)``."""
    h = mix32(rows.to(tl.uint32, bitcast=True) ^ seed)
    h = mix32(h + (cols.to(tl.uint32, bitcast=True) * 0x9E3779B1).to(tl.uint32, bitcast=True))
    return h >= tl.full(h.shape, THRESHOLD, tl.uint32)


def dropout_threshold(rate: float) -> int:
    """The uint32 threshold of `dropout_keep` for a drop probability ``rate``."""
    return min(int(rate * 2.0**32), 2**32 - 1)


@triton.jit
def tanh(x):
    """``tanh`` of a float32 tensor through one exponential (Triton has no portable tanh):
    ``1 - 2 / (exp(2x) + 1)``, exact at the saturated ends (``exp`` overflowing to inf gives 1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def sigmoid_ptx(x):
    """``1 / (1 + exp(-x))`` of a float32 tensor by NVIDIA's ``ex2.approx.ftz.f32`` and
    ``rcp.approx.ftz.f32``: two special-function instructions, relative error about ``|x| * 2^-24``
    (the argument rounded to float32; an overflowing exponential gives 0, an underflowing one 1).
    ``-log2(e)`` is a literal: Triton's compiler and interpreter both take it inside a kernel."""
    e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -1.4426950408889634], dtype=tl.float32,
                                  is_pure=True, pack=1)
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def saturate(x, FP8_MAX: tl.constexpr):
    """Clip a float32 tensor to ``[-FP8_MAX, FP8_MAX]`` before an FP8 cast (`common.saturate_cast`);
    NaN stays NaN."""
    return tl.where(x > FP8_MAX, FP8_MAX, tl.where(x < -FP8_MAX, -FP8_MAX, x))


@triton.jit
def cdiv(a, b: tl.constexpr):
    return (a + b - 1) // b


@triton.jit
def clip(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)
