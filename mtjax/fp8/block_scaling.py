"""The block-scaled FP8 matmul of `BlockScaling`: forward, dgrad and wgrad as block-scaled FP8 GEMMs.

``x [M, K] @ w [K, N]``: ``x`` is cast in 1x128 row tiles along K, and again (re-cut) along M for
the weight gradient; ``w`` in 128x128 blocks, its transpose sharing the block scales; the output
gradient ``g [M, N]`` in row tiles along N (dgrad) and along M (wgrad). Every GEMM contracts over
the last axis of both FP8 operands (`mtjax.ops.block_fp8_gemm`), with the scales applied per
128-wide K block in float32. Scales come from the tensors themselves, so there is no state: the
matmul is a pure function of ``x`` and ``w`` and composes with ``jit``, ``grad``, ``vmap``,
``shard_map`` and ``scan`` as a plain dot does (inside ``shard_map`` each device's tiles are those of
its own shard: no collective is needed).

A norm or an activation in front of the GEMM (``prologue``) writes the FP8 tiles itself
(`mtjax.ops.norm_tile_fp8`, `mtjax.ops.activation_tile_fp8`), so its output never goes through memory
in bf16; its backward is its own, recomputed from its input.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from mtjax.fp8.recipes import BlockScaling
from mtjax.ops import Activation, Norm, block_fp8_gemm, block_quantize, tile_quantize


def _options(recipe: BlockScaling) -> dict[str, Any]:
    return {"power_of_two": recipe.power_of_two_scales, "amax_epsilon": recipe.amax_epsilon}


def prologue_backward(x: jax.Array, prologue: Norm | Activation | None,
                      d_out: jax.Array) -> tuple[jax.Array, Norm | Activation | None]:
    """``(dx, d_prologue)``: the backward of ``prologue(x)`` for the cotangent ``d_out``, from its saved
    input (``prologue`` None: the identity)."""
    if prologue is None:
        return d_out, None
    _, prologue_vjp = jax.vjp(lambda x, prologue: prologue(x), x, prologue)
    return prologue_vjp(d_out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _block_matmul(x, prologue, w, spec):
    return _block_matmul_fwd(x, prologue, w, spec)[0]


def _block_matmul_fwd(x, prologue, w, spec):
    options = _options(spec.recipe)
    if prologue is None:
        x_q, x_s, x_q_t, x_s_t = tile_quantize(x, spec.fwd_dtype, transpose=True, **options)
    else:
        x_q, x_s, x_q_t, x_s_t = prologue.tile_fp8(x, spec.fwd_dtype, transpose=True, **options)
    w_q, w_q_t, w_s = block_quantize(w, spec.fwd_dtype, **options)
    out = block_fp8_gemm(x_q, x_s, w_q_t, w_s.T, out_dtype=spec.out_dtype, implementation=spec.implementation)
    # Residuals are FP8 (and small scales): x^T tiled along M for wgrad, w for dgrad; with a prologue,
    # its input too (its backward recomputes what it needs).
    saved_x = None if prologue is None else x
    return out, (saved_x, prologue, x_q_t, x_s_t, w_q, w_s)


def _block_matmul_bwd(spec, residuals, g):
    x, prologue, x_q_t, x_s_t, w_q, w_s = residuals
    g_q, g_s, g_q_t, g_s_t = tile_quantize(g, spec.bwd_dtype, transpose=True, **_options(spec.recipe))
    # dgrad: g [M, N] . w [K, N] over N (w's 128x128 block scales);  wgrad: x^T [K, M] . g^T [N, M] over M.
    d_operand = block_fp8_gemm(g_q, g_s, w_q, w_s, out_dtype=spec.x_dtype, implementation=spec.implementation)
    dw = block_fp8_gemm(x_q_t, x_s_t, g_q_t, g_s_t, out_dtype=spec.w_dtype, implementation=spec.implementation)
    dx, d_prologue = prologue_backward(x, prologue, d_operand)
    return dx, d_prologue, dw


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def block_fp8_matmul(x: jax.Array, w: jax.Array, spec: Any, prologue: Norm | Activation | None = None) -> jax.Array:
    """``x [*b, M, K] @ w [*b, K, N]`` under `BlockScaling` (``spec``: the GEMM's static description,
    hashable, with ``recipe``, ``fwd_dtype``, ``bwd_dtype``, ``x_dtype``, ``w_dtype``, ``out_dtype`` and
    ``implementation``, as `mtjax.fp8.dot_general` builds it). Batch axes are vmapped.

    With a ``prologue``, ``prologue(x) [M, K] @ w [K, N]`` (no batch axes; ``x [M, 2, K]`` for a gated
    activation): the prologue's kernel writes the FP8 tiles of its output directly."""
    if not isinstance(spec.recipe, BlockScaling):
        raise TypeError(f"block_fp8_matmul: spec.recipe is {spec.recipe!r}; expected a BlockScaling")
    if prologue is not None:
        return _block_matmul(x, prologue, w, spec)

    def fn(x, w):
        return _block_matmul(x, None, w, spec)

    for _ in range(x.ndim - 2):
        fn = jax.vmap(fn)
    return fn(x, w)
