"""The stock-Flax peers mtjax is measured against: what a user would write without mtjax.

Only ``flax.linen`` building blocks (``nn.LayerNorm``/``nn.RMSNorm``, ``nn.Dense``, ``nn.gelu``/``nn.silu``,
``nn.Embed``, ``nn.scan``) and ``jax.nn.dot_product_attention`` (cuDNN on the GPU, XLA elsewhere), bf16 compute and
f32 parameters; with ``fp8=True`` every ``nn.Dense`` gets Flax's own FP8 op,
``flax.linen.fp8_ops.Fp8DirectDotGeneralOp``, whose delayed-scaling state lives in Flax's
``"_overwrite_with_gradient"`` collection (its gradient is the next state).

`FlaxGPT`, `FlaxViT` and `FlaxT5` are the stock-Flax models of the whole-training-step benchmark
(docs/performance.md); `train_step` is their AdamW step.
"""

from __future__ import annotations

import functools
import math
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


def _attention_implementation(q: jax.Array, k: jax.Array) -> str:
    """cuDNN flash attention where it runs (a GPU, 16-bit inputs, even lengths: jax's cuDNN check
    rejects odd ones when training, e.g. a ViT's 197 tokens), else XLA."""
    on_cudnn = (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
                and q.shape[1] % 2 == 0 and k.shape[1] % 2 == 0)
    return "cudnn" if on_cudnn else "xla"


_ACTIVATIONS = {"gelu": nn.gelu, "silu": nn.silu, "relu": nn.relu}


def _check_activations(owner: str, activations: tuple[str, ...]) -> None:
    names = tuple(activations)
    if not (len(names) == 1 and names[0] in _ACTIVATIONS) and not (
            len(names) == 2 and names[0] in _ACTIVATIONS and names[1] == "linear"):
        raise ValueError(f"{owner}: activations={activations!r}; accepted: (act,) or (act, 'linear') "
                         f"with act one of {sorted(_ACTIVATIONS)}")


def _mlp(dense: Callable[..., nn.Module], h: jax.Array, hidden_size: int, mlp_dim: int,
         activations: tuple[str, ...]) -> jax.Array:
    """The MLP of every peer block: one Dense in (two halves when gated), the activation, one Dense out."""
    act = _ACTIVATIONS[activations[0]]
    if len(activations) == 2:
        gate, up = jnp.split(dense(2 * mlp_dim, name="mlp_in")(h), 2, axis=-1)
        h = act(gate) * up
    else:
        h = act(dense(mlp_dim, name="mlp_in")(h))
    return dense(hidden_size, name="mlp_out")(h)


def _dense_factory(dtype: Any, fp8: bool, **kwargs: Any) -> Callable[..., nn.Module]:
    if fp8 and not HAS_FLAX_FP8:
        raise ValueError("fp8=True: this Flax has no fp8_ops.Fp8DirectDotGeneralOp")
    return functools.partial(nn.Dense, dtype=dtype, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp if fp8 else None,
                             **kwargs)


class FlaxTransformerLayer(nn.Module):
    """A pre-norm block of stock Flax modules: self-attention (causal: GPT; not: ViT) and an MLP.

    Attributes:
      hidden_size: model width.
      num_heads: query heads (head_dim = hidden_size // num_heads).
      mlp_dim: MLP hidden width.
      num_kv_heads: key/value heads (None: num_heads; fewer: GQA, as jax.nn.dot_product_attention takes it).
      layernorm_type: ``"layernorm"`` (``nn.LayerNorm``) or ``"rmsnorm"`` (``nn.RMSNorm``).
      activations: ``("gelu",)``, or gated as ``("silu", "linear")`` (SwiGLU), mtjax's notation.
      dtype: compute dtype (parameters stay f32).
      fp8: run every Dense through Flax's ``Fp8DirectDotGeneralOp``.
      causal: causal attention (GPT) or bidirectional (ViT).

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
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        _check_activations("FlaxTransformerLayer", self.activations)
        if self.layernorm_type not in ("layernorm", "rmsnorm"):
            raise ValueError(f"FlaxTransformerLayer: layernorm_type={self.layernorm_type!r}; accepted: layernorm, "
                             "rmsnorm")
        dense = _dense_factory(self.dtype, self.fp8)
        norm = functools.partial(nn.LayerNorm if self.layernorm_type == "layernorm" else nn.RMSNorm, dtype=self.dtype)
        x = attention_residual(x, self.num_heads, self.num_kv_heads or self.num_heads, norm, dense, causal=self.causal)
        x = x + _mlp(dense, norm(name="ln_mlp")(x), self.hidden_size, self.mlp_dim, self.activations)
        return x, None


def attention_residual(x: jax.Array, heads: int, kv_heads: int, norm: Callable[..., nn.Module],
                       dense: Callable[..., nn.Module], causal: bool = True) -> jax.Array:
    """``x + attention_out(attention(qkv(norm(x))))`` as a stock-Flax user writes it: one fused
    Q/K/V ``nn.Dense``, `jax.nn.dot_product_attention` (cuDNN on a GPU), causal or not. Called inside a
    compact module's ``__call__``, which then owns the ``ln_attention``, ``qkv`` and ``attention_out``
    modules."""
    batch, seq, hidden = x.shape
    head_dim = hidden // heads
    qkv = dense((heads + 2 * kv_heads) * head_dim, name="qkv")(norm(name="ln_attention")(x))
    qkv = qkv.reshape(batch, seq, heads + 2 * kv_heads, head_dim)
    q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=2)
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                            implementation=_attention_implementation(q, k))
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


class FlaxViT(nn.Module):
    """A ViT of stock Flax modules: ``nn.Conv`` patch embedding (stride = patch), class token (or mean
    pooling), learned positions, scanned bidirectional `FlaxTransformerLayer` s (LayerNorm, GELU),
    final norm, head.

    Attributes:
      image_size, patch_size, num_channels, num_classes, hidden_size, num_layers, num_heads, mlp_dim:
        the model's sizes.
      pooling: ``"cls"`` or ``"mean"``.
      dtype: compute dtype (parameters stay f32).
      fp8: Flax FP8 in every Dense of the layers.

    ``images [batch, H, W, C] -> logits [batch, num_classes]`` in ``dtype``.
    """

    image_size: int
    patch_size: int
    num_channels: int
    num_classes: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    pooling: str = "cls"
    dtype: Any = jnp.bfloat16
    fp8: bool = False

    @classmethod
    def like(cls, config: Any, *, fp8: bool = False) -> FlaxViT:
        """The stock-Flax model of an `mtjax.models.ViTConfig` with learned positions and GELU."""
        if config.position_embedding != "learned" or tuple(config.activations) != ("gelu",):
            raise ValueError("FlaxViT.like: the peer has learned positions and a GELU MLP; got position_embedding="
                             f"{config.position_embedding!r}, activations={config.activations!r}")
        return cls(image_size=config.image_size, patch_size=config.patch_size, num_channels=config.num_channels,
                   num_classes=config.num_classes, hidden_size=config.hidden_size, num_layers=config.num_layers,
                   num_heads=config.num_heads, mlp_dim=config.mlp_dim, pooling=config.pooling, dtype=config.dtype,
                   fp8=fp8)

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        p, h = self.patch_size, self.hidden_size
        x = nn.Conv(h, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype, name="patch_embed")(images)
        x = x.reshape(x.shape[0], -1, h)
        if self.pooling == "cls":
            cls_token = self.param("cls_token", nn.initializers.zeros, (1, 1, h))
            x = jnp.concatenate([jnp.broadcast_to(cls_token, (x.shape[0], 1, h)).astype(x.dtype), x], axis=1)
        x = x + self.param("position_embed", nn.initializers.normal(0.02), (1, x.shape[1], h)).astype(x.dtype)
        layers = nn.scan(FlaxTransformerLayer, variable_axes={"params": 0, FP8_COLLECTION: 0},
                         split_rngs={"params": True}, length=self.num_layers)
        x, _ = layers(h, self.num_heads, self.mlp_dim, None, "layernorm", ("gelu",), self.dtype, self.fp8, False,
                      name="layers")(x, None)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x[:, 0] if self.pooling == "cls" else
                                                                          x.mean(axis=1))


def relative_position_buckets(q_len: int, k_len: int, bidirectional: bool, num_buckets: int,
                              max_distance: int) -> jax.Array:
    """T5's bucket of each (query, key) distance (Raffel et al., the mesh-tensorflow formula), ``[q, k]``."""
    n = jnp.arange(q_len)[:, None] - jnp.arange(k_len)[None, :]  # > 0: the key is before the query
    bucket = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    exact = num_buckets // 2
    scaled = jnp.log(jnp.maximum(n, 1) / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    large = jnp.minimum(exact + scaled.astype(jnp.int32), num_buckets - 1)
    return bucket + jnp.where(n < exact, n, large)


class FlaxT5Layer(nn.Module):
    """A T5.1.1 block of stock Flax modules: RMSNorm, self-attention with the stack's position bias,
    (decoder) cross-attention, gated-GELU MLP, no biases. ``(x, bias, encoded) -> (x, None)`` for `nn.scan`.

    Attributes:
      hidden_size, num_heads, mlp_dim: sizes (head_dim = hidden_size // num_heads).
      decoder: causal self-attention and cross-attention to ``encoded``.
      dtype: compute dtype.
      fp8: Flax FP8 in every Dense.
    """

    hidden_size: int
    num_heads: int
    mlp_dim: int
    decoder: bool = False
    dtype: Any = jnp.bfloat16
    fp8: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array, encoded: jax.Array | None) -> tuple[jax.Array, None]:
        dense = _dense_factory(self.dtype, self.fp8, use_bias=False)
        heads, head_dim = self.num_heads, self.hidden_size // self.num_heads

        def attend(q_in, kv_in, name, bias=None, causal=False):
            q = dense(self.hidden_size, name=f"{name}_q")(q_in).reshape(*q_in.shape[:2], heads, head_dim)
            kv = dense(2 * self.hidden_size, name=f"{name}_kv")(kv_in).reshape(*kv_in.shape[:2], 2, heads, head_dim)
            # A bias goes through XLA, as jax.nn.dot_product_attention's default; cuDNN takes the rest.
            implementation = None if bias is not None else _attention_implementation(q, kv)
            out = jax.nn.dot_product_attention(q, kv[:, :, 0], kv[:, :, 1], bias=bias, is_causal=causal,
                                               implementation=implementation)
            return dense(self.hidden_size, name=f"{name}_out")(out.reshape(*q_in.shape[:2], self.hidden_size))

        h = nn.RMSNorm(dtype=self.dtype, name="ln_self")(x)
        x = x + attend(h, h, "self", bias=bias, causal=self.decoder)
        if self.decoder:
            x = x + attend(nn.RMSNorm(dtype=self.dtype, name="ln_cross")(x), encoded, "cross")
        x = x + _mlp(dense, nn.RMSNorm(dtype=self.dtype, name="ln_mlp")(x), self.hidden_size, self.mlp_dim,
                     ("gelu", "linear"))
        return x, None


class FlaxT5(nn.Module):
    """A T5.1.1 encoder-decoder of stock Flax modules: shared embedding, per-stack relative position
    biases, scanned `FlaxT5Layer` s, final RMSNorms, untied (or tied, scaled) logits.

    Attributes:
      vocab_size, hidden_size, num_encoder_layers, num_decoder_layers, num_heads, mlp_dim: sizes.
      relative_buckets, relative_max_distance: the position biases' buckets.
      tie_embeddings: logits from the embedding (decoder output scaled by ``hidden_size ** -0.5``).
      dtype: compute dtype (parameters stay f32).
      fp8: Flax FP8 in every Dense of the layers.

    ``(encoder_tokens [batch, enc], decoder_tokens [batch, dec]) -> logits [batch, dec, vocab]``.
    """

    vocab_size: int
    hidden_size: int
    num_encoder_layers: int
    num_decoder_layers: int
    num_heads: int
    mlp_dim: int
    relative_buckets: int = 32
    relative_max_distance: int = 128
    tie_embeddings: bool = False
    dtype: Any = jnp.bfloat16
    fp8: bool = False

    @classmethod
    def like(cls, config: Any, *, fp8: bool = False) -> FlaxT5:
        """The stock-Flax model of an `mtjax.models.T5Config` (its gated-GELU, RMSNorm layout)."""
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   num_encoder_layers=config.num_encoder_layers, num_decoder_layers=config.num_decoder_layers,
                   num_heads=config.num_heads, mlp_dim=config.mlp_dim, relative_buckets=config.relative_buckets,
                   relative_max_distance=config.relative_max_distance, tie_embeddings=config.tie_embeddings,
                   dtype=config.dtype, fp8=fp8)

    def _stack(self, x, encoded, decoder, name):
        seq = x.shape[1]
        buckets = relative_position_buckets(seq, seq, not decoder, self.relative_buckets, self.relative_max_distance)
        table = nn.Embed(self.relative_buckets, self.num_heads, name=f"{name}_relpos")
        bias = jnp.transpose(table(buckets), (2, 0, 1))[None].astype(self.dtype)  # [1, heads, q, k]
        layers = nn.scan(FlaxT5Layer, variable_axes={"params": 0, FP8_COLLECTION: 0}, split_rngs={"params": True},
                         in_axes=(nn.broadcast, nn.broadcast),
                         length=self.num_decoder_layers if decoder else self.num_encoder_layers)
        x, _ = layers(self.hidden_size, self.num_heads, self.mlp_dim, decoder, self.dtype, self.fp8,
                      name=f"{name}_layers")(x, bias, encoded)
        return nn.RMSNorm(dtype=self.dtype, name=f"{name}_norm")(x)

    @nn.compact
    def __call__(self, encoder_tokens: jax.Array, decoder_tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab_size, self.hidden_size, dtype=self.dtype, name="embed")
        encoded = self._stack(embed(encoder_tokens), None, False, "encoder")
        x = self._stack(embed(decoder_tokens), encoded, True, "decoder")
        if self.tie_embeddings:
            return embed.attend(x * self.hidden_size ** -0.5)
        return nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype, name="logits")(x)


def init(model: nn.Module, *inputs: jax.Array, seed: int = 0) -> tuple[Any, Any]:
    """``(params, fp8_state)`` of ``model`` called on ``inputs``; ``fp8_state`` is ``{}`` without FP8."""
    variables = jax.jit(model.init)(jax.random.key(seed), *inputs)
    params = variables["params"]
    return params, {k: v for k, v in variables.items() if k != "params"}


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy against integer targets, computed in f32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def token_inputs(batch: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """A GPT's arguments from a batch: its tokens."""
    return (batch["inputs"],)


def train_step(model: nn.Module, optimizer: optax.GradientTransformation,
               inputs: Callable[[dict[str, jax.Array]], tuple[jax.Array, ...]] = token_inputs,
               labels: str = "targets"):
    """A jitted step ``((params, fp8_state, opt_state), batch) -> (state, {"loss": loss})``.

    ``model.apply`` takes ``inputs(batch)`` (default ``batch["inputs"]``); the loss is the cross-entropy
    against ``batch[labels]``. The state is donated. With FP8 the gradient of the
    ``"_overwrite_with_gradient"`` collection is the next FP8 state, as Flax's FP8 ops define it.
    """

    def loss_fn(params, fp8_state, batch):
        return cross_entropy(model.apply({"params": params, **fp8_state}, *inputs(batch)), batch[labels])

    def step(state, batch):
        params, fp8_state, opt_state = state
        loss, (grads, new_fp8_state) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8_state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_fp8_state, opt_state), {"loss": loss}

    return jax.jit(step, donate_argnums=0)
