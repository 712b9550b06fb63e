"""FP8 cast + transpose + amax in one pass, in native Triton: the algorithm of `mtjax.kernels.quantize`.

Each program reads one ``block x block`` tile of ``x [m, k]`` once and writes the tile cast to FP8,
its transpose into ``[k, m]`` and the tile's amax; the per-tile maxima are reduced outside.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mtjax.dtypes import fp8_max
from mtjax.kernels import quantize as pallas_quantize
from mtjax.kernels.common import reduce_tile_maxima
from mtjax.kernels.triton.language import saturate
from mtjax.kernels.triton.runtime import launch


@triton.jit
def _kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, M: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
            EXACT: tl.constexpr, FP8_MAX: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    offsets = rows[:, None] * K + cols[None, :]
    t_offsets = cols[:, None] * M + rows[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    if EXACT:
        x = tl.load(x_ptr + offsets).to(tl.float32)
    else:
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # Masked elements load as 0, which never raises a max of absolute values.
    tl.store(amax_ptr + pid_m * tl.num_programs(1) + pid_k, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    q = saturate(x * tl.load(scale_ptr), FP8_MAX).to(q_ptr.dtype.element_ty)
    if EXACT:
        tl.store(q_ptr + offsets, q)
        tl.store(qt_ptr + t_offsets, tl.trans(q))
    else:
        tl.store(q_ptr + offsets, q, mask=mask)
        tl.store(qt_ptr + t_offsets, tl.trans(q), mask=tl.trans(mask))


def cast_transpose(x: jax.Array, scale: jax.Array, out_dtype, *, block: int = pallas_quantize.BLOCK,
                   num_warps: int = pallas_quantize.NUM_WARPS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`mtjax.kernels.quantize.cast_transpose` (same arguments and results) on the native Triton kernel."""
    why = pallas_quantize.unsupported(x.shape, x.dtype, out_dtype)
    if why is not None:
        raise ValueError(f"cast_transpose: unsupported input: {why}")
    m, k = x.shape
    spec = pallas_quantize.CastSpec(m=m, k=k, block=block, num_warps=num_warps)
    q, qt, tile_amax = launch(
        _kernel, x, jnp.reshape(scale, (1,)).astype(jnp.float32),
        out_shape=[jax.ShapeDtypeStruct((m, k), out_dtype), jax.ShapeDtypeStruct((k, m), out_dtype),
                   jax.ShapeDtypeStruct(spec.grid, jnp.float32)],
        grid=spec.grid, name="mtjax_triton_cast_transpose", num_warps=num_warps, num_stages=1,
        M=m, K=k, BLOCK=block, EXACT=spec.exact, FP8_MAX=fp8_max(out_dtype),
    )
    return q, qt, reduce_tile_maxima(tile_amax)
