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
in bf16; its backward is its own, recomputed from its input. `block_fp8_mlp` runs an MLP's two GEMMs
in one ``custom_vjp``, so the activation's backward also writes fc1's output gradient in FP8 tiles
(`mtjax.ops.activation_grad_tile_fp8`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from mtjax.fp8.recipes import BlockScaling
from mtjax.ops import Activation, Norm, block_fp8_gemm, block_quantize, is_gated, tile_quantize
from mtjax.ops.block_quantization import TILE


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


def _forward_gemm(x, prologue, w, spec):
    """``(prologue(x) @ w, the residuals its backward GEMMs read)``: x's row tiles (and their
    transpose) written by the prologue's kernel or `tile_quantize`, w's blocks."""
    options = _options(spec.recipe)
    if prologue is None:
        x_q, x_s, x_q_t, x_s_t = tile_quantize(x, spec.fwd_dtype, transpose=True, **options)
    else:
        x_q, x_s, x_q_t, x_s_t = prologue.tile_fp8(x, spec.fwd_dtype, transpose=True, **options)
    w_q, w_q_t, w_s = block_quantize(w, spec.fwd_dtype, **options)
    out = block_fp8_gemm(x_q, x_s, w_q_t, w_s.T, out_dtype=spec.out_dtype, implementation=spec.implementation)
    # FP8 residuals (and small scales): x^T tiled along M for wgrad, w for dgrad.
    return out, (x_q_t, x_s_t, w_q, w_s)


def _backward_gemms(spec, gemm, g_tiles):
    """``(d operand, dw)`` from the output gradient's tiles ``(g_q, g_s, g_q_t, g_s_t)``: dgrad
    ``g [M, N] . w [K, N]`` over N (w's 128x128 block scales), wgrad ``x^T [K, M] . g^T [N, M]`` over M."""
    x_q_t, x_s_t, w_q, w_s = gemm
    g_q, g_s, g_q_t, g_s_t = g_tiles
    d_operand = block_fp8_gemm(g_q, g_s, w_q, w_s, out_dtype=spec.x_dtype, implementation=spec.implementation)
    dw = block_fp8_gemm(x_q_t, x_s_t, g_q_t, g_s_t, out_dtype=spec.w_dtype, implementation=spec.implementation)
    return d_operand, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _block_matmul(x, prologue, w, spec):
    return _block_matmul_fwd(x, prologue, w, spec)[0]


def _block_matmul_fwd(x, prologue, w, spec):
    out, gemm = _forward_gemm(x, prologue, w, spec)
    # With a prologue, its input too: its backward recomputes what it needs.
    return out, (None if prologue is None else x, prologue, gemm)


def _block_matmul_bwd(spec, residuals, g):
    x, prologue, gemm = residuals
    g_tiles = tile_quantize(g, spec.bwd_dtype, transpose=True, **_options(spec.recipe))
    d_operand, dw = _backward_gemms(spec, gemm, g_tiles)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _block_mlp(x, norm, w1, activation, w2, spec1, spec2):
    return _block_mlp_fwd(x, norm, w1, activation, w2, spec1, spec2)[0]


def _block_mlp_fwd(x, norm, w1, activation, w2, spec1, spec2):
    h, gemm1 = _forward_gemm(x, norm, w1.reshape(w1.shape[0], -1), spec1)
    h = h.reshape((x.shape[0],) + w1.shape[1:])  # [M, mlp] or, gated, [M, 2, mlp]
    y, gemm2 = _forward_gemm(h, activation, w2, spec2)
    return y, (None if norm is None else x, norm, w1.shape, gemm1, h, activation, gemm2)


def _block_mlp_bwd(spec1, spec2, residuals, g):
    x, norm, w1_shape, gemm1, h, activation, gemm2 = residuals
    g_tiles = tile_quantize(g, spec2.bwd_dtype, transpose=True, **_options(spec2.recipe))
    d_activation_out, dw2 = _backward_gemms(spec2, gemm2, g_tiles)
    options = _options(spec1.recipe)
    if is_gated(activation.activation_type) and h.shape[-1] % TILE:
        # The fused kernel cuts each gated half in whole tiles; here the two kernels it fuses.
        d_h, d_activation = prologue_backward(h, activation, d_activation_out)
        h_tiles = tile_quantize(d_h.reshape(h.shape[0], -1), spec1.bwd_dtype, transpose=True, **options)
    else:  # fc1's output gradient, written in FP8 tiles (both layouts) by the activation's backward
        *h_tiles, d_activation = activation.tile_fp8_grad(h, d_activation_out, spec1.bwd_dtype, **options)
    d_fc1_input, dw1 = _backward_gemms(spec1, gemm1, h_tiles)
    dx, d_norm = prologue_backward(x, norm, d_fc1_input)
    return dx, d_norm, dw1.reshape(w1_shape), d_activation, dw2


_block_mlp.defvjp(_block_mlp_fwd, _block_mlp_bwd)


def block_fp8_mlp(x: jax.Array, norm: Norm | None, w1: jax.Array, activation: Activation, w2: jax.Array,
                  spec1: Any, spec2: Any) -> jax.Array:
    """``activation(norm(x) @ w1) @ w2`` under `BlockScaling` (``x [M, hidden]``, ``w1 [hidden, mlp]``
    or ``[hidden, 2, mlp]``, ``w2 [mlp, out]``; ``spec1``, ``spec2``: the two GEMMs' specs, as for
    `block_fp8_matmul`), in one ``custom_vjp``: the norm and the activation write their GEMM's FP8
    tiles, and the activation's backward writes fc1's output gradient as FP8 tiles in both layouts
    (`mtjax.ops.activation_grad_tile_fp8`) instead of in bf16 to be cast again."""
    for spec in (spec1, spec2):
        if not isinstance(spec.recipe, BlockScaling):
            raise TypeError(f"block_fp8_mlp: spec.recipe is {spec.recipe!r}; expected a BlockScaling")
    return _block_mlp(x, norm, w1, activation, w2, spec1, spec2)
