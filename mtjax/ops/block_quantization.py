"""Block-scaled FP8 quantization: `tile_quantize` (1x128 row tiles) and `block_quantize` (128x128 blocks).

What a block-scaled FP8 GEMM (`mtjax.ops.block_fp8_gemm`) needs of its operands: the FP8 values and
one float32 dequantization scale (``scale_inv``, ``x ≈ q * scale_inv``) per tile or block, each
from that tile's own amax (`mtjax.kernels.block_quantize.tile_scales`). Tiles at the end of an axis
that is not a multiple of 128 are shorter; the GEMM pads them with zeros.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mtjax import backend
from mtjax.dtypes import check_fp8_dtype, fp8_max, widen_fp8
from mtjax.kernels import block_quantize as block_kernels
from mtjax.kernels.common import too_small
from mtjax.ops.checks import check_float, check_rank, check_tile_options

TILE = block_kernels.TILE


def _pad_to_tiles(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    pad = [(0, (-x.shape[a]) % TILE if a in axes else 0) for a in range(x.ndim)]
    return jnp.pad(x, pad) if any(p for _, p in pad) else x


def _row_tiles(x, out_dtype, power_of_two, amax_epsilon):
    m, k = x.shape
    tiles = _pad_to_tiles(x.astype(jnp.float32), (1,)).reshape(m, -1, TILE)
    scale, scale_inv = block_kernels.tile_scales(jnp.max(jnp.abs(tiles), axis=2), fp8_max(out_dtype),
                                                 power_of_two, amax_epsilon)
    limit = fp8_max(out_dtype)
    q = jnp.clip(tiles * scale[..., None], -limit, limit).astype(out_dtype).reshape(m, -1)[:, :k]
    return q, scale_inv


@backend.register("tile_quantize", backend.REFERENCE)
def tile_quantize_reference(x: jax.Array, *, out_dtype: Any, transpose: bool, power_of_two: bool,
                            amax_epsilon: float) -> tuple[jax.Array, ...]:
    """The ``"xla"`` implementation of `tile_quantize`."""
    q, scale_inv = _row_tiles(x, out_dtype, power_of_two, amax_epsilon)
    if not transpose:
        return q, scale_inv
    return (q, scale_inv, *_row_tiles(x.T, out_dtype, power_of_two, amax_epsilon))


@backend.register("tile_quantize", "pallas_triton", requires=(backend.PALLAS_TRITON,), priority=10,
                  single_device=True, prefer=too_small,
                  unsupported=lambda x, **kw: block_kernels.unsupported(x.shape, x.dtype, kw["out_dtype"]))
def _tile_quantize_pallas(x, *, out_dtype, transpose, power_of_two, amax_epsilon):
    return block_kernels.tile_quantize(x, out_dtype, transpose=transpose, fp8_max=fp8_max(out_dtype),
                                       power_of_two=power_of_two, amax_epsilon=amax_epsilon)


@backend.register("tile_quantize", "triton", requires=(backend.TRITON,), priority=9, single_device=True,
                  prefer=too_small,
                  unsupported=lambda x, **kw: block_kernels.unsupported(x.shape, x.dtype, kw["out_dtype"]))
def _tile_quantize_triton(x, *, out_dtype, transpose, power_of_two, amax_epsilon):
    from mtjax.kernels.triton import block_fp8 as native

    return native.tile_quantize(x, out_dtype, transpose=transpose, fp8_max=fp8_max(out_dtype),
                                power_of_two=power_of_two, amax_epsilon=amax_epsilon)


def _check(op: str, x: jax.Array, dtype: Any, power_of_two: bool, amax_epsilon: float, transpose: bool = False) -> Any:
    check_float(op, "x", x)
    check_rank(op, "x", x, 2)
    return check_tile_options(op, dtype, power_of_two, amax_epsilon, transpose, dtype_name="dtype")


def tile_quantize(x: jax.Array, dtype: Any, *, transpose: bool = False, power_of_two: bool = False,
                  amax_epsilon: float = 0.0, implementation: str | None = None) -> tuple[jax.Array, ...]:
    """``x [m, k]`` cast to the FP8 ``dtype`` in 1x128 row tiles, each with its own scale.

    Returns ``(q [m, k], scale_inv [m, ceil(k/128)])`` with ``x[r, c] ≈ q[r, c] * scale_inv[r, c // 128]``;
    with ``transpose=True`` also ``(q_t [k, m], scale_inv_t [k, ceil(m/128)])``: ``x.T`` cast in row
    tiles along ``m`` (tiles re-cut along the other axis, for the GEMM contracting over ``m``).
    ``power_of_two`` rounds scales down to powers of two; ``amax_epsilon`` floors each tile's amax.
    Values beyond the FP8 range saturate; NaN stays NaN.
    """
    dtype = _check("tile_quantize", x, dtype, power_of_two, amax_epsilon, transpose)
    return backend.dispatch("tile_quantize", x, implementation=implementation, out_dtype=dtype, transpose=transpose,
                            power_of_two=power_of_two, amax_epsilon=float(amax_epsilon))


@backend.register("block_quantize", backend.REFERENCE)
def block_quantize_reference(w: jax.Array, *, out_dtype: Any, power_of_two: bool,
                             amax_epsilon: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``"xla"`` implementation of `block_quantize`."""
    k, n = w.shape
    blocks = _pad_to_tiles(w.astype(jnp.float32), (0, 1))
    kb, nb = blocks.shape[0] // TILE, blocks.shape[1] // TILE
    blocks = blocks.reshape(kb, TILE, nb, TILE)
    scale, scale_inv = block_kernels.tile_scales(jnp.max(jnp.abs(blocks), axis=(1, 3)), fp8_max(out_dtype),
                                                 power_of_two, amax_epsilon)
    limit = fp8_max(out_dtype)
    q = jnp.clip(blocks * scale[:, None, :, None], -limit, limit).astype(out_dtype)
    q = q.reshape(kb * TILE, nb * TILE)[:k, :n]
    return q, q.T, scale_inv


@backend.register("block_quantize", "pallas_triton", requires=(backend.PALLAS_TRITON,), priority=10,
                  single_device=True, prefer=too_small,
                  unsupported=lambda w, **kw: block_kernels.unsupported(w.shape, w.dtype, kw["out_dtype"]))
def _block_quantize_pallas(w, *, out_dtype, power_of_two, amax_epsilon):
    return block_kernels.block_quantize(w, out_dtype, fp8_max=fp8_max(out_dtype), power_of_two=power_of_two,
                                        amax_epsilon=amax_epsilon)


@backend.register("block_quantize", "triton", requires=(backend.TRITON,), priority=9, single_device=True,
                  prefer=too_small,
                  unsupported=lambda w, **kw: block_kernels.unsupported(w.shape, w.dtype, kw["out_dtype"]))
def _block_quantize_triton(w, *, out_dtype, power_of_two, amax_epsilon):
    from mtjax.kernels.triton import block_fp8 as native

    return native.block_quantize(w, out_dtype, fp8_max=fp8_max(out_dtype), power_of_two=power_of_two,
                                 amax_epsilon=amax_epsilon)


def block_quantize(w: jax.Array, dtype: Any, *, power_of_two: bool = False, amax_epsilon: float = 0.0,
                   implementation: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``w [k, n]`` cast to the FP8 ``dtype`` in 128x128 blocks, each with its own scale.

    Returns ``(q [k, n], q.T [n, k], scale_inv [ceil(k/128), ceil(n/128)])`` with
    ``w[r, c] ≈ q[r, c] * scale_inv[r // 128, c // 128]``; ``q.T``'s block scales are ``scale_inv.T``.
    """
    dtype = _check("block_quantize", w, dtype, power_of_two, amax_epsilon)
    return backend.dispatch("block_quantize", w, implementation=implementation, out_dtype=dtype,
                            power_of_two=power_of_two, amax_epsilon=float(amax_epsilon))


def tile_dequantize(q: jax.Array, scale_inv: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """The inverse of `tile_quantize` (up to FP8 rounding) for ``q [m, k]``, ``scale_inv [m, ceil(k/128)]``."""
    check_fp8_dtype("tile_dequantize", q.dtype, "q.dtype")
    return (widen_fp8(q) * jnp.repeat(scale_inv, TILE, axis=1)[:, :q.shape[1]]).astype(dtype)


def block_dequantize(q: jax.Array, scale_inv: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """The inverse of `block_quantize` (up to FP8 rounding) for ``q [k, n]`` and
    ``scale_inv [ceil(k/128), ceil(n/128)]``."""
    check_fp8_dtype("block_dequantize", q.dtype, "q.dtype")
    expanded = jnp.repeat(jnp.repeat(scale_inv, TILE, axis=0), TILE, axis=1)[:q.shape[0], :q.shape[1]]
    return (widen_fp8(q) * expanded).astype(dtype)
