"""The block-scaled FP8 GEMM as a Pallas Triton kernel (DeepGEMM-style promotion).

``out [m, n] = sum_kb dot(a[:, kb], b[:, kb]^T) * (sa[:, kb] ⊗ sb[:, kb])``: ``a [m, k]`` and
``b [n, k]`` are FP8 and contract over their last axis (the layout FP8 tensor cores take), each
128-wide K block's partial product is accumulated in float32 with its scales applied as it is added
("promotion"), so one block's scale never rounds another's contribution. The scales come in as
``sa_t [k/128, m]`` and ``sb_t [k/128, n]`` (one per row and K block, transposed so a program
loads a contiguous vector per K block); 128x128 weight blocks reach the kernel as per-row scales
repeated over the block's rows (`mtjax.ops.block_fp8_gemm` expands them).

Each program computes one ``[block_m, block_n]`` output tile over all of K in one loop that Triton
software-pipelines (``num_stages``). ``block_k`` is the scales' block, 128. The launcher pads m, n
to the tile and k to 128 (zeros contribute nothing). Operands of two FP8 dtypes (E4M3 x E5M2, the
HYBRID format's gradient GEMMs) run as bfloat16 dots: exact, at the bf16 tensor-core rate.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mtjax.kernels.common import (
    MAX_ELEMENTS,
    Launchers,
    interpret,
    next_power_of_2,
    pallas_call,
    unsupported_fp8_dtype,
)
from mtjax.kernels.common import (
    pallas_triton as plgpu,
)

BLOCK_K = 128  # the scales' K block: one promotion per block


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Launch parameters: the output tile, warps and pipeline stages.

    Attributes:
      block_m, block_n: the output tile of one program (powers of two >= 16).
      num_warps: warps per program.
      num_stages: K blocks Triton keeps in flight (software pipelining).
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or next_power_of_2(value) != value:
                raise ValueError(f"GemmConfig({name}={value!r}): expected a power of two >= 16")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GemmConfig({name}={value!r}): expected an int >= 1")

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}x{BLOCK_K} w{self.num_warps} s{self.num_stages}"


DEFAULT_CONFIG = GemmConfig()
# What `mtjax bench gemm --sweep` tries for the block-scaled rows.
SWEEP_CONFIGS = (
    GemmConfig(128, 128, 8, 3), GemmConfig(128, 128, 8, 4), GemmConfig(128, 256, 8, 3),
    GemmConfig(128, 256, 8, 4), GemmConfig(64, 256, 4, 4), GemmConfig(256, 128, 8, 3),
)


def unsupported(a_shape, a_dtype, b_shape, b_dtype) -> str | None:
    """``None`` if the kernel takes ``a [m, k]`` and ``b [n, k]`` of these shapes and dtypes, else why not."""
    if len(a_shape) != 2 or len(b_shape) != 2:
        return f"a of rank {len(a_shape)}, b of rank {len(b_shape)} (2-D only)"
    for name, dtype in (("a", a_dtype), ("b", b_dtype)):
        reason = unsupported_fp8_dtype(dtype)
        if reason is not None:
            return f"{name}: {reason}"
    for name, shape in (("a", a_shape), ("b", b_shape)):
        if not 0 < shape[0] * shape[1] <= MAX_ELEMENTS:
            return f"{name} of {shape[0] * shape[1]} elements (1..{MAX_ELEMENTS})"
    return None


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, num_k_blocks):
    # Triton's FP8 dot takes one FP8 dtype for both operands; mixed E4M3 x E5M2 blocks (HYBRID's
    # gradients) are widened to bfloat16, which holds every value of both exactly.
    mixed = a_ref.dtype != b_ref.dtype

    def body(kb, acc):
        a = a_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
        b = b_ref[:, pl.ds(kb * BLOCK_K, BLOCK_K)]
        if mixed:
            a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        partial = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + partial * (sa_ref[kb, :][:, None] * sb_ref[kb, :][None, :])

    acc = lax.fori_loop(0, num_k_blocks, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad(x: jax.Array, rows: int, cols: int, value: float = 0.0) -> jax.Array:
    pad = ((0, rows - x.shape[0]), (0, cols - x.shape[1]))
    return jnp.pad(x, pad, constant_values=value) if pad[0][1] or pad[1][1] else x


def _launch(a: jax.Array, sa_t: jax.Array, b: jax.Array, sb_t: jax.Array, out_dtype, config: GemmConfig) -> jax.Array:
    """The kernel on operands padded to whole tiles: ``a [mp, kp]``, ``sa_t [kp/128, mp]``, ``b [np, kp]``,
    ``sb_t [kp/128, np]``; returns ``[mp, np]`` in ``out_dtype``."""
    (mp, kp), np_ = a.shape, b.shape[0]
    kb = kp // BLOCK_K
    bm, bn = config.block_m, config.block_n
    return pallas_call(
        functools.partial(_kernel, num_k_blocks=kb),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)), pl.BlockSpec((kb, bm), lambda i, j: (0, i)),
                  pl.BlockSpec((bn, kp), lambda i, j: (j, 0)), pl.BlockSpec((kb, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret(),
        name="mtjax_block_fp8_gemm",
    )(a, sa_t, b, sb_t)


# forward(a, sa_t, b, sb_t, out_dtype, config) -> out on operands padded to whole tiles, as `_launch`.
PALLAS = Launchers(forward=_launch)


def block_fp8_gemm(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, out_dtype, *,
                   config: GemmConfig = DEFAULT_CONFIG, launchers: Launchers = PALLAS) -> jax.Array:
    """``out [m, n]`` (see the module docstring) for ``a [m, k]``, ``sa [m, ceil(k/128)]``, ``b [n, k]``,
    ``sb [n, ceil(k/128)]`` (float32 dequantization scales per row and K block). Forward only: the
    block-scaled matmul's custom_vjp (`mtjax.fp8`) runs this for its three GEMMs."""
    why = unsupported(a.shape, a.dtype, b.shape, b.dtype)
    if why is not None:
        raise ValueError(f"block_fp8_gemm: unsupported input: {why}")
    (m, k), n = a.shape, b.shape[0]
    kb = pl.cdiv(k, BLOCK_K)
    bm, bn = config.block_m, config.block_n
    mp, np_, kp = pl.cdiv(m, bm) * bm, pl.cdiv(n, bn) * bn, kb * BLOCK_K
    a, b = _pad(a, mp, kp), _pad(b, np_, kp)
    # Scales of padded rows are 1, so a padded row stays a row of zeros (never 0 * Inf).
    sa_t, sb_t = _pad(sa.T.astype(jnp.float32), kb, mp, 1.0), _pad(sb.T.astype(jnp.float32), kb, np_, 1.0)
    out = launchers.forward(a, sa_t, b, sb_t, out_dtype, config)
    return out[:m, :n] if (mp, np_) != (m, n) else out
