"""The ``layer`` suite: one GPT block forward + backward, `mtjax.flax.TransformerLayer` against stock Flax.

The block of the ``gpt-1.3b`` preset (hidden 2048, 16 heads, MLP 8192, LayerNorm, GELU, biases,
causal self-attention) on ``[8, 2048, 2048]`` bf16 activations; ``--quick`` shrinks it to a toy.
Timed: the gradient of ``sum(block(x) * dy)`` with respect to the variables and ``x``, which for
FP8 variants includes the next scaling state. Variants as in the train suite: ``mtjax``,
``mtjax fp8`` (under ``fp8_autocast``), ``mtjax [op=impl,...]`` for each ``--variant`` setting, ``flax``
and ``flax fp8`` (`mtjax.bench.peers`).
FLOPs: 6 per parameter per token plus causal attention (6·seq·hidden per token), as for MFU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.bench import peers, timing
from mtjax.bench.variants import Setting, label, mtjax_context, mtjax_variants, mtjax_xla_options

FULL = dict(batch=8, seq=2048, hidden=2048, heads=16, mlp=8192)
QUICK = dict(batch=2, seq=32, hidden=64, heads=4, mlp=256)


def _mtjax_layer(shape: dict) -> nn.Module:
    from mtjax.flax import TransformerLayer

    return TransformerLayer(
        hidden_size=shape["hidden"], mlp_hidden_size=shape["mlp"], num_attention_heads=shape["heads"],
        layernorm_type="layernorm", mlp_activations=("gelu",), use_bias=True, self_attn_mask_type="causal",
        hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0, enable_relative_embedding=False,
        scale_attn_logits=True, scaled_query_init=False, dtype=jnp.bfloat16,
    )


def _grad_fn(apply):
    """jitted ``(variables, x, dy) -> d/d(variables, x) sum(apply(variables, x) * dy)``."""

    def objective(variables, x, dy):
        return jnp.sum(apply(variables, x).astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.jit(jax.grad(objective, argnums=(0, 1)))


def _variants(shape: dict, settings: Sequence[Setting]) -> list[tuple[str, str | None, str, nn.Module, Any, Any, dict]]:
    """``(implementation, peer, ceiling, module, apply, context, xla_options)`` per variant, ordered as in
    the train suite."""
    mtjax_rows = []
    # Model and train-state settings have no meaning for one layer.
    for fp8, setting in mtjax_variants([s for s in settings if not (s.model or s.train)]):
        layer = _mtjax_layer(shape)
        mtjax_rows.append((label(fp8, setting), peers.FP8_PEER if fp8 else "flax",
                           "fp8_gemm_tflops" if fp8 else "bf16_gemm_tflops", layer,
                           lambda v, x, layer=layer: layer.apply(v, x, deterministic=True),
                           lambda fp8=fp8, setting=setting: mtjax_context(fp8, setting),
                           mtjax_xla_options(fp8, setting)))
    flax_rows = []
    for fp8 in (False, True) if peers.HAS_FLAX_FP8 else (False,):
        layer = peers.FlaxTransformerLayer(shape["hidden"], shape["heads"], shape["mlp"], fp8=fp8)
        flax_rows.append(("flax fp8" if fp8 else "flax", "flax" if fp8 else None,
                          "fp8_gemm_tflops" if fp8 else "bf16_gemm_tflops", layer,
                          lambda v, x, layer=layer: layer.apply(v, x)[0], contextlib.nullcontext, {}))
    return [mtjax_rows[0], flax_rows[0], mtjax_rows[1], *flax_rows[1:], *mtjax_rows[2:]]


def run(quick: bool, settings: Sequence[Setting] = ()) -> list[dict]:
    """Rows of every variant; ``settings`` add mtjax rows (`mtjax.bench.variants`)."""
    shape = QUICK if quick else FULL
    b, s, h, f = shape["batch"], shape["seq"], shape["hidden"], shape["mlp"]
    keys = jax.random.split(jax.random.key(3), 16)
    inputs = timing.rotating(lambda i: (timing.random_array(keys[2 * i], (b, s, h), jnp.bfloat16),
                                        timing.random_array(keys[2 * i + 1], (b, s, h), jnp.bfloat16)), max_sets=8)
    flops = b * s * (6 * (4 * h * h + 2 * h * f) + 6 * s * h)
    name = f"block fwd+bwd b{b} s{s} h{h} ffn{f}"
    rows = []
    for implementation, peer, ceiling, layer, apply, context, xla_options in _variants(shape, settings):
        with context():
            variables = jax.jit(layer.init)(jax.random.key(0), inputs[0][0])
            fn, compile_s = timing.compile_lowered(_grad_fn(apply).lower(variables, *inputs[0]), xla_options)
        t = timing.measure(lambda x, dy, fn=fn, variables=variables: fn(variables, x, dy), inputs,
                           runs=5 if quick else 20)
        rows.append(timing.row("layer", name, implementation, t, flops=flops, peer=peer, ceiling=ceiling,
                               compile_s=compile_s))
    return rows
