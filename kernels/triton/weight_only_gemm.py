"""Weight-only FP8 GEMM of a few rows in native Triton: ``x [M, K] @ w [N, K]^T`` with ``w`` in FP8.

A decode step multiplies a few rows by each weight matrix, so it is bound by the weight bytes it
reads. The kernel reads each FP8 weight once (one byte) and widens it in registers, where XLA's GEMM
of the widened weights first writes and reads them in 16 bits. Each program owns ``BLOCK_N`` output
columns and one of ``SPLIT_K`` slices of the contraction, enough programs to keep every
multiprocessor streaming weights: it accumulates ``x[:, slice] @ w[cols, slice]^T`` in float32 and
writes that partial sum; the slices' sums, the per-channel (or per-tensor) scale and the cast to the
output dtype run after it, in one small XLA fusion. The rows are padded to the tensor core's 16 in
registers (masked loads), so any ``M <= MAX_ROWS`` takes the same kernel. FP8 values widen to
bfloat16 and float16 exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mtjax.kernels.common import MAX_ELEMENTS
from mtjax.kernels.triton.runtime import launch

MAX_ROWS = 16
BLOCK_N = 64
BLOCK_K = 256
# Aim for this many programs: two per multiprocessor of the largest GPUs keeps loads in flight.
TARGET_PROGRAMS = 264
WEIGHT_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@triton.jit
def _kernel(x_ptr, w_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    start = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # K_PER_SPLIT is a multiple of BLOCK_K
        ks = start + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    out = out_ptr + split * M * N + rows[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@dataclasses.dataclass(frozen=True)
class GemvSpec:
    """The launch of one call: ``n_blocks x split_k`` programs, ``k_per_split`` contraction elements each."""

    m: int
    n: int
    k: int
    split_k: int
    k_per_split: int

    @classmethod
    def of(cls, m: int, n: int, k: int) -> GemvSpec:
        n_blocks = triton.cdiv(n, BLOCK_N)
        k_blocks = triton.cdiv(k, BLOCK_K)
        split = max(1, min(k_blocks, triton.cdiv(TARGET_PROGRAMS, n_blocks)))
        k_per_split = triton.cdiv(k_blocks, split) * BLOCK_K
        return cls(m=m, n=n, k=k, split_k=triton.cdiv(k, k_per_split), k_per_split=k_per_split)

    @property
    def grid(self) -> tuple[int, int]:
        return triton.cdiv(self.n, BLOCK_N), self.split_k


def unsupported(x_shape: Sequence[int], w_shape: Sequence[int], x_dtype: Any, w_dtype: Any) -> str | None:
    """Why the kernel cannot take these operands, or None."""
    if len(x_shape) != 2 or len(w_shape) != 2 or x_shape[1] != w_shape[1]:
        return f"x {tuple(x_shape)} and w {tuple(w_shape)} (the kernel takes x [M, K] and w [N, K])"
    if w_shape[0] * w_shape[1] > MAX_ELEMENTS:
        return f"w of {w_shape[0] * w_shape[1]} elements (the kernel's int32 offsets take at most {MAX_ELEMENTS})"
    if x_shape[0] > MAX_ROWS:
        return f"{x_shape[0]} rows (the kernel takes at most {MAX_ROWS}: a decode step's)"
    if jnp.dtype(w_dtype) not in WEIGHT_DTYPES:
        return f"w of dtype {jnp.dtype(w_dtype)} (the kernel takes float8_e4m3fn or float8_e5m2)"
    if jnp.dtype(x_dtype) not in INPUT_DTYPES:
        return f"x of dtype {jnp.dtype(x_dtype)} (the kernel takes bfloat16 or float16)"
    if min(x_shape) < 1 or min(w_shape) < 1:
        return f"an empty operand (x {tuple(x_shape)}, w {tuple(w_shape)})"
    return None


def partial_products(x: jax.Array, w: jax.Array) -> jax.Array:
    """``[split_k, M, N]`` float32 partial sums of ``x [M, K] @ w [N, K]^T`` over slices of K (the
    weights widened to ``x``'s dtype, exactly); their sum is the product."""
    why = unsupported(x.shape, w.shape, x.dtype, w.dtype)
    if why is not None:
        raise ValueError(f"weight_only_gemm: unsupported input: {why}")
    (m, k), n = x.shape, w.shape[0]
    spec = GemvSpec.of(m, n, k)
    [out] = launch(_kernel, x, w, out_shape=[jax.ShapeDtypeStruct((spec.split_k, m, n), jnp.float32)],
                   grid=spec.grid, name="mtjax_triton_weight_only_gemm", num_warps=4, num_stages=4, M=m, N=n, K=k,
                   K_PER_SPLIT=spec.k_per_split, BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
