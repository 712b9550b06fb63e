"""The stock-Flax peers mtjax is measured against: what a user would write without mtjax.

Only ``flax.linen`` building blocks (``nn.LayerNorm``, ``nn.Dense``, ``nn.gelu``, ``nn.Embed``,
``nn.scan``) and ``jax.nn.dot_product_attention`` (cuDNN on the GPU, XLA elsewhere), bf16 compute and
f32 parameters; with ``fp8=True`` every ``nn.Dense`` gets Flax's own FP8 op,
``flax.linen.fp8_ops.Fp8DirectDotGeneralOp``, whose delayed-scaling state lives in Flax's
``"_overwrite_with_gradient"`` collection (its gradient is the next state).

`FlaxGPT` is the model of ANCHORS.md's "whole training step, stock Flax" measurement; `train_step`
is its AdamW step.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

FP8_COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT


def _attention_implementation() -> str:
    return "cudnn" if jax.default_backend() == "gpu" else "xla"


class FlaxTransformerLayer(nn.Module):
    """A pre-LayerNorm GPT block of stock Flax modules, causal self-attention and a GELU MLP.

    Attributes:
      hidden_size: model width.
      num_heads: attention heads (head_dim = hidden_size // num_heads).
      mlp_dim: MLP hidden width.
      dtype: compute dtype (parameters stay f32).
      fp8: run every Dense through Flax's ``Fp8DirectDotGeneralOp``.

    Called as ``(x [batch, seq, hidden], _) -> (x, None)`` so `nn.scan` can stack it.
    """

    hidden_size: int
    num_heads: int
    mlp_dim: int
    dtype: Any = jnp.bfloat16
    fp8: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        dense = functools.partial(
            nn.Dense, dtype=self.dtype, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp if self.fp8 else None
        )
        batch, seq, _hidden = x.shape
        head_dim = self.hidden_size // self.num_heads
        h = nn.LayerNorm(dtype=self.dtype, name="ln_attention")(x)
        qkv = dense(3 * self.hidden_size, name="qkv")(h).reshape(batch, seq, 3, self.num_heads, head_dim)
        attended = jax.nn.dot_product_attention(
            qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True, implementation=_attention_implementation()
        )
        x = x + dense(self.hidden_size, name="attention_out")(attended.reshape(batch, seq, self.hidden_size))
        h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
        h = nn.gelu(dense(self.mlp_dim, name="mlp_in")(h))
        x = x + dense(self.hidden_size, name="mlp_out")(h)
        return x, None


class FlaxGPT(nn.Module):
    """A decoder-only GPT of stock Flax modules: tied embedding, scanned `FlaxTransformerLayer` s.

    Attributes:
      vocab_size, hidden_size, num_layers, num_heads, mlp_dim: the model's sizes.
      dtype: compute dtype (parameters stay f32).
      fp8: Flax FP8 (``Fp8DirectDotGeneralOp``) in every Dense of the layers.

    ``tokens [batch, seq] int32 -> logits [batch, seq, vocab]`` in ``dtype``.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    dtype: Any = jnp.bfloat16
    fp8: bool = False

    @classmethod
    def like(cls, config: Any, *, fp8: bool = False) -> "FlaxGPT":
        """The stock-Flax model of the same sizes as an `mtjax.models.GPTConfig`."""
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_layers,
                   num_heads=config.num_heads, mlp_dim=config.mlp_dim, fp8=fp8)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab_size, self.hidden_size, dtype=self.dtype, name="embed")
        x = embed(tokens)
        layers = nn.scan(
            FlaxTransformerLayer,
            variable_axes={"params": 0, FP8_COLLECTION: 0},
            split_rngs={"params": True},
            length=self.num_layers,
        )
        x, _ = layers(self.hidden_size, self.num_heads, self.mlp_dim, self.dtype, self.fp8, name="layers")(x, None)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
        return embed.attend(x)


def init(model: nn.Module, tokens: jax.Array, seed: int = 0) -> tuple[Any, Any]:
    """``(params, fp8_state)`` of ``model``; ``fp8_state`` is ``{}`` without FP8."""
    variables = jax.jit(model.init)(jax.random.key(seed), tokens)
    params = variables["params"]
    return params, {k: v for k, v in variables.items() if k != "params"}


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, computed in f32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def train_step(model: nn.Module, optimizer: optax.GradientTransformation):
    """A jitted step ``((params, fp8_state, opt_state), batch) -> (state, {"loss": loss})``.

    ``batch`` is ``{"inputs": int32[batch, seq], "targets": int32[batch, seq]}``. The state is donated.
    With FP8 the gradient of the ``"_overwrite_with_gradient"`` collection is the next FP8 state, as
    Flax's FP8 ops define it.
    """

    def loss_fn(params, fp8_state, batch):
        return cross_entropy(model.apply({"params": params, **fp8_state}, batch["inputs"]), batch["targets"])

    def step(state, batch):
        params, fp8_state, opt_state = state
        loss, (grads, new_fp8_state) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8_state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_fp8_state, opt_state), {"loss": loss}

    return jax.jit(step, donate_argnums=0)
