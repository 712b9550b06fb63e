"""The stock-Flax peers mtjax is measured against: what a user would write without mtjax.

Only ``flax.linen`` building blocks (``nn.LayerNorm``/``nn.RMSNorm``, ``nn.Dense``, ``nn.gelu``/``nn.silu``,
``nn.Embed``, ``nn.scan``) and ``jax.nn.dot_product_attention`` (cuDNN on the GPU, XLA elsewhere), bf16 compute and
f32 parameters; with ``fp8=True`` every ``nn.Dense`` gets Flax's own FP8 op,
``flax.linen.fp8_ops.Fp8DirectDotGeneralOp``, whose delayed-scaling state lives in Flax's
``"_overwrite_with_gradient"`` collection (its gradient is the next state).

`FlaxGPT` is the stock-Flax model of the whole-training-step benchmark (docs/performance.md); `train_step`
is its AdamW step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

FP8_COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT
# Flax's FP8 op for Dense; older Flax releases lack it and then the suites run no "flax fp8" rows.
HAS_FLAX_FP8 = hasattr(fp8_ops, "Fp8DirectDotGeneralOp")
# The peer of mtjax's FP8 rows.
FP8_PEER = "flax fp8" if HAS_FLAX_FP8 else "flax"


def _attention_implementation(dtype: Any) -> str:
    """cuDNN flash attention where it runs (a GPU, 16-bit inputs), else XLA."""
    return "cudnn" if jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16) else "xla"


_ACTIVATIONS = {"gelu": nn.gelu, "silu": nn.silu, "relu": nn.relu}


def _check_activations(owner: str, activations: tuple[str, ...]) -> None:
    names = tuple(activations)
    if not (len(names) == 1 and names[0] in _ACTIVATIONS) and not (
            len(names) == 2 and names[0] in _ACTIVATIONS and names[1] == "linear"):
        raise ValueError(f"{owner}: activations={activations!r}; accepted: (act,) or (act, 'linear') "
                         f"with act one of {sorted(_ACTIVATIONS)}")


class FlaxTransformerLayer(nn.Module):
    """A pre-norm GPT block of stock Flax modules: causal self-attention and an MLP.

    Attributes:
      hidden_size: model width.
      num_heads: query heads (head_dim = hidden_size // num_heads).
      mlp_dim: MLP hidden width.
      num_kv_heads: key/value heads (None: num_heads; fewer: GQA, as jax.nn.dot_product_attention takes it).
      layernorm_type: ``"layernorm"`` (``nn.LayerNorm``) or ``"rmsnorm"`` (``nn.RMSNorm``).
      activations: ``("gelu",)``, or gated as ``("silu", "linear")`` (SwiGLU), mtjax's notation.
      dtype: compute dtype (parameters stay f32).
      fp8: run every Dense through Flax's ``Fp8DirectDotGeneralOp``.

    Called as ``(x [batch, seq, hidden], _) -> (x, None)`` so `nn.scan` can stack it.
    """

    hidden_size: int
    num_heads: int
    mlp_dim: int
    num_kv_heads: int | None = None
    layernorm_type: str = "layernorm"
    activations: tuple[str, ...] = ("gelu",)
    dtype: Any = jnp.bfloat16
    fp8: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        _check_activations("FlaxTransformerLayer", self.activations)
        if self.fp8 and not HAS_FLAX_FP8:
            raise ValueError("FlaxTransformerLayer(fp8=True): this Flax has no fp8_ops.Fp8DirectDotGeneralOp")
        if self.layernorm_type not in ("layernorm", "rmsnorm"):
            raise ValueError(f"FlaxTransformerLayer: layernorm_type={self.layernorm_type!r}; accepted: layernorm, "
                             "rmsnorm")
        dense = functools.partial(
            nn.Dense, dtype=self.dtype, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp if self.fp8 else None
        )
        norm = functools.partial(nn.LayerNorm if self.layernorm_type == "layernorm" else nn.RMSNorm, dtype=self.dtype)
        x = attention_residual(x, self.num_heads, self.num_kv_heads or self.num_heads, norm, dense)
        h = norm(name="ln_mlp")(x)
        act = _ACTIVATIONS[self.activations[0]]
        if len(self.activations) == 2:
            gate, up = jnp.split(dense(2 * self.mlp_dim, name="mlp_in")(h), 2, axis=-1)
            h = act(gate) * up
        else:
            h = act(dense(self.mlp_dim, name="mlp_in")(h))
        x = x + dense(self.hidden_size, name="mlp_out")(h)
        return x, None


def attention_residual(x: jax.Array, heads: int, kv_heads: int, norm: Callable[..., nn.Module],
                       dense: Callable[..., nn.Module]) -> jax.Array:
    """``x + attention_out(causal_attention(qkv(norm(x))))`` as a stock-Flax user writes it: one fused
    Q/K/V ``nn.Dense``, `jax.nn.dot_product_attention` (cuDNN on a GPU). Called inside a compact
    module's ``__call__``, which then owns the ``ln_attention``, ``qkv`` and ``attention_out`` modules."""
    batch, seq, hidden = x.shape
    head_dim = hidden // heads
    qkv = dense((heads + 2 * kv_heads) * head_dim, name="qkv")(norm(name="ln_attention")(x))
    qkv = qkv.reshape(batch, seq, heads + 2 * kv_heads, head_dim)
    q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=2)
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=_attention_implementation(q.dtype))
    return x + dense(hidden, name="attention_out")(attended.reshape(batch, seq, hidden))


class FlaxGPT(nn.Module):
    """A decoder-only GPT of stock Flax modules: tied embedding, scanned `FlaxTransformerLayer` s.

    No position encoding (as the anchors' peer; mtjax presets with RoPE do that extra work).

    Attributes:
      vocab_size, hidden_size, num_layers, num_heads, mlp_dim: the model's sizes.
      num_kv_heads, layernorm_type, activations: as `FlaxTransformerLayer`.
      dtype: compute dtype (parameters stay f32).
      fp8: Flax FP8 (``Fp8DirectDotGeneralOp``) in every Dense of the layers.

    ``tokens [batch, seq] int32 -> logits [batch, seq, vocab]`` in ``dtype``.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    num_kv_heads: int | None = None
    layernorm_type: str = "layernorm"
    activations: tuple[str, ...] = ("gelu",)
    dtype: Any = jnp.bfloat16
    fp8: bool = False

    @classmethod
    def like(cls, config: Any, *, fp8: bool = False) -> FlaxGPT:
        """The stock-Flax model of the same sizes, norm and MLP as an `mtjax.models.GPTConfig`."""
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_layers,
                   num_heads=config.num_heads, mlp_dim=config.mlp_dim, num_kv_heads=config.num_kv_heads,
                   layernorm_type=config.layernorm_type, activations=tuple(config.activations),
                   dtype=config.dtype, fp8=fp8)

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
        x, _ = layers(self.hidden_size, self.num_heads, self.mlp_dim, self.num_kv_heads, self.layernorm_type,
                      self.activations, self.dtype, self.fp8, name="layers")(x, None)
        norm = nn.LayerNorm if self.layernorm_type == "layernorm" else nn.RMSNorm
        x = norm(dtype=self.dtype, name="ln_final")(x)
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
