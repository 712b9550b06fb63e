"""The block-scaled FP8 matmul of `BlockScaling`: forward, dgrad and wgrad as block-scaled FP8 GEMMs.

``x [M, K] @ w [K, N]``: ``x`` is cast in 1x128 row tiles along K, and again (re-cut) along M for
the weight gradient; ``w`` in 128x128 blocks, its transpose sharing the block scales; the output
gradient ``g [M, N]`` in row tiles along N (dgrad) and along M (wgrad). Every GEMM contracts over
the last axis of both FP8 operands (`mtjax.ops.block_fp8_gemm`), with the scales applied per
128-wide K block in float32. Scales come from the tensors themselves, so there is no state: the
matmul is a pure function of ``x`` and ``w`` and composes with ``jit``, ``grad``, ``vmap``,
``shard_map`` and ``scan`` as a plain dot does (inside ``shard_map`` each device's tiles are those of
its own shard: no collective is needed).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from mtjax.fp8.recipes import BlockScaling
from mtjax.ops import block_fp8_gemm, block_quantize, tile_quantize


def _options(recipe: BlockScaling) -> dict[str, Any]:
    return {"power_of_two": recipe.power_of_two_scales, "amax_epsilon": recipe.amax_epsilon}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _block_matmul(x, w, spec):
    return _block_matmul_fwd(x, w, spec)[0]


def _block_matmul_fwd(x, w, spec):
    options = _options(spec.recipe)
    x_q, x_s, x_q_t, x_s_t = tile_quantize(x, spec.fwd_dtype, transpose=True, **options)
    w_q, w_q_t, w_s = block_quantize(w, spec.fwd_dtype, **options)
    out = block_fp8_gemm(x_q, x_s, w_q_t, w_s.T, out_dtype=spec.out_dtype, implementation=spec.implementation)
    # Residuals are FP8 (and small scales): x^T tiled along M for wgrad, w for dgrad.
    return out, (x_q_t, x_s_t, w_q, w_s)


def _block_matmul_bwd(spec, residuals, g):
    x_q_t, x_s_t, w_q, w_s = residuals
    g_q, g_s, g_q_t, g_s_t = tile_quantize(g, spec.bwd_dtype, transpose=True, **_options(spec.recipe))
    # dgrad: g [M, N] . w [K, N] over N (w's 128x128 block scales);  wgrad: x^T [K, M] . g^T [N, M] over M.
    dx = block_fp8_gemm(g_q, g_s, w_q, w_s, out_dtype=spec.x_dtype, implementation=spec.implementation)
    dw = block_fp8_gemm(x_q_t, x_s_t, g_q_t, g_s_t, out_dtype=spec.w_dtype, implementation=spec.implementation)
    return dx, dw


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def block_fp8_matmul(x: jax.Array, w: jax.Array, spec: Any) -> jax.Array:
    """``x [*b, M, K] @ w [*b, K, N]`` under `BlockScaling` (``spec``: the GEMM's static description,
    hashable, with ``recipe``, ``fwd_dtype``, ``bwd_dtype``, ``x_dtype``, ``w_dtype``, ``out_dtype`` and
    ``implementation``, as `mtjax.fp8.dot_general` builds it). Batch axes are vmapped."""
    if not isinstance(spec.recipe, BlockScaling):
        raise TypeError(f"block_fp8_matmul: spec.recipe is {spec.recipe!r}; expected a BlockScaling")
    def fn(x, w):
        return _block_matmul(x, w, spec)

    for _ in range(x.ndim - 2):
        fn = jax.vmap(fn)
    return fn(x, w)
