"""FP8 cast + transpose + amax in one pass, as a Pallas Triton kernel (TransformerEngine's "cast_transpose").

An FP8 GEMM's forward needs the input ``x [m, k]`` in FP8, and its wgrad needs the same values
transposed (``[k, m]``: Hopper's FP8 tensor cores contract over the last axis of both operands);
delayed scaling also records ``max |x|``. XLA runs these as up to three passes over ``x`` (a reduce,
the cast, a transpose of the cast); this kernel reads each ``[block_m, block_k]`` tile of ``x`` once
and writes the tile, its transpose and the tile's amax. The per-tile maxima are reduced outside.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mtjax.kernels.common import (
    interpret,
    pallas_call,
    reduce_tile_maxima,
    saturate_cast,
    unsupported_array,
    unsupported_fp8_dtype,
)
from mtjax.kernels.common import (
    pallas_triton as plgpu,
)

# Square 64x64 tiles, 8 warps: the fastest of 32/64/128 tiles and 4/8 warps on square and on
# tall bf16 inputs in the cast benchmark (docs/kernels.md), and faster than XLA's passes there.
BLOCK = 64
NUM_WARPS = 8


@dataclasses.dataclass(frozen=True)
class CastSpec:
    """Static description of a launch over ``x [m, k]`` in ``block x block`` tiles."""

    m: int
    k: int
    block: int
    num_warps: int

    @property
    def grid(self) -> tuple[int, int]:
        return pl.cdiv(self.m, self.block), pl.cdiv(self.k, self.block)

    @property
    def exact(self) -> bool:
        """Whether tiles cover ``x`` exactly, so loads and stores need no masks."""
        return self.m % self.block == 0 and self.k % self.block == 0


def _kernel(x_ref, scale_ref, q_ref, qt_ref, amax_ref, *, spec: CastSpec):
    rows = pl.program_id(0) * spec.block + jnp.arange(spec.block)
    cols = pl.program_id(1) * spec.block + jnp.arange(spec.block)
    mask = None if spec.exact else (rows < spec.m)[:, None] & (cols < spec.k)[None, :]
    tile = x_ref.at[rows[:, None], cols[None, :]]
    x = (plgpu.load(tile) if mask is None else plgpu.load(tile, mask=mask, other=0.0)).astype(jnp.float32)
    # Masked elements load as 0, which never raises a max of absolute values.
    amax_ref[pl.program_id(0), pl.program_id(1)] = jnp.max(jnp.abs(x))
    q = saturate_cast(x * scale_ref[0], q_ref.dtype)
    plgpu.store(q_ref.at[rows[:, None], cols[None, :]], q, mask=mask)
    plgpu.store(qt_ref.at[cols[:, None], rows[None, :]], q.T, mask=None if mask is None else mask.T)


def unsupported(shape, dtype, out_dtype) -> str | None:
    """``None`` if the kernel takes ``x`` of this shape and dtype, else why not."""
    if len(shape) != 2:
        return f"x of rank {len(shape)} (2-D only)"
    reason = unsupported_fp8_dtype(out_dtype)
    if reason is not None:
        return reason
    return unsupported_array(shape, dtype, max_row=None)  # dtype and int32-indexable size


def cast_transpose(x: jax.Array, scale: jax.Array, out_dtype, *, block: int = BLOCK,
                   num_warps: int = NUM_WARPS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q, q.T, max |x|)`` with ``q = saturate_cast(x * scale, out_dtype)`` for 2-D ``x [m, k]``.

    ``scale`` is a float32 scalar; the amax is float32, of ``x`` before scaling. Forward only (FP8
    casts feed GEMMs whose custom_vjp owns the backward).
    """
    why = unsupported(x.shape, x.dtype, out_dtype)
    if why is not None:
        raise ValueError(f"cast_transpose: unsupported input: {why}")
    m, k = x.shape
    spec = CastSpec(m=m, k=k, block=block, num_warps=num_warps)
    q, qt, tile_amax = pallas_call(
        functools.partial(_kernel, spec=spec),
        out_shape=(jax.ShapeDtypeStruct((m, k), out_dtype), jax.ShapeDtypeStruct((k, m), out_dtype),
                   jax.ShapeDtypeStruct(spec.grid, jnp.float32)),
        grid=spec.grid,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret(),
        name="mtjax_cast_transpose",
    )(x, jnp.reshape(scale, (1,)).astype(jnp.float32))
    return q, qt, reduce_tile_maxima(tile_amax)
