"""T5-style encoder-decoder built from `mtjax.flax` modules (T5.1.1 layout: pre-RMSNorm blocks without
biases, gated-GELU MLPs, relative position biases shared by the layers of each stack).

``T5(config)(encoder_tokens [batch, enc_len] int, decoder_tokens [batch, dec_len] int, *,
encoder_segment_ids=None, deterministic=True) -> logits [batch, dec_len, vocab_size]`` in float32;
`T5.encode` and `T5.decode` run the halves (decoding with a key/value cache: `mtjax.models.greedy_decode`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import axes
from mtjax.flax import DenseGeneral, Embed, LayerNorm, RelativePositionBiases, TransformerLayerType
from mtjax.flax.attention import CACHE_COLLECTION, RELPOS_EMBEDDING_INIT, check_heads
from mtjax.flax.normalization import LAYERNORM_TYPES
from mtjax.flax.params import check_float_dtype
from mtjax.models._stack import apply_layers, check_stack_config
from mtjax.models.gpt import LOGITS_AXES


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Size and options of a `T5` (presets: `t5_config`).

    Attributes:
      vocab_size: tokens (shared by encoder and decoder).
      hidden_size: model width.
      num_encoder_layers: encoder blocks.
      num_decoder_layers: decoder blocks (self-attention, cross-attention, MLP).
      num_heads: attention heads.
      head_dim: None: ``hidden_size // num_heads``.
      mlp_dim: MLP hidden width.
      activations: MLP activation; T5.1.1: gated GELU ``("gelu", "linear")``.
      layernorm_type: ``"rmsnorm"`` (T5) or ``"layernorm"``.
      layernorm_epsilon: epsilon of every norm.
      relative_buckets: buckets of the relative position biases (half per direction in the encoder).
      relative_max_distance: distances at or beyond it share the last bucket.
      tie_embeddings: the output layer is the transposed token embedding, applied to the decoder
        output scaled by ``hidden_size ** -0.5`` (as T5); False: a separate ``logits_dense``.
      dropout_rate: embedding, hidden and MLP-intermediate dropout.
      attention_dropout: attention-probability dropout.
      scan_layers: ``nn.scan`` over the layers of each stack.
      remat_policy: one of `mtjax.models.REMAT_POLICIES`.
      dtype: compute dtype.
      param_dtype: parameter dtype.
    """

    vocab_size: int = 384
    hidden_size: int = 64
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    num_heads: int = 4
    head_dim: int | None = None
    mlp_dim: int = 128
    activations: tuple[str, ...] = ("gelu", "linear")
    layernorm_type: str = "rmsnorm"
    layernorm_epsilon: float = 1e-6
    relative_buckets: int = 32
    relative_max_distance: int = 128
    tie_embeddings: bool = True
    dropout_rate: float = 0.0
    attention_dropout: float = 0.0
    scan_layers: bool = True
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        owner = type(self).__name__
        check_stack_config(self, ("vocab_size", "hidden_size", "num_encoder_layers", "num_decoder_layers",
                                  "num_heads", "mlp_dim", "relative_buckets", "relative_max_distance"))
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"{owner}: hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads} "
                             f"(or set head_dim)")
        check_heads(owner, self.resolved_head_dim, self.num_heads, None)
        check_float_dtype(owner, "dtype", self.dtype)
        check_float_dtype(owner, "param_dtype", self.param_dtype)
        if self.layernorm_type not in LAYERNORM_TYPES:
            raise ValueError(f"{owner}: layernorm_type={self.layernorm_type!r} is not supported; accepted: "
                             f"{', '.join(LAYERNORM_TYPES)}")
        if self.relative_buckets < 4 or self.relative_max_distance <= self.relative_buckets // 2:
            raise ValueError(f"{owner}: relative_buckets={self.relative_buckets} must be >= 4 and "
                             f"relative_max_distance={self.relative_max_distance} > relative_buckets // 2")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def _block_params(self) -> tuple[int, int, int]:
        """(self-attention, MLP, norm) parameters of one block."""
        h, q = self.hidden_size, self.num_heads * self.resolved_head_dim
        norm = h if self.layernorm_type == "rmsnorm" else 2 * h
        gates = 2 if len(self.activations) == 2 else 1
        return 4 * h * q, h * gates * self.mlp_dim + self.mlp_dim * h, norm

    def num_params(self) -> int:
        """Number of parameters (what `T5.init` creates)."""
        attention, mlp, norm = self._block_params()
        encoder = self.num_encoder_layers * (attention + mlp + 2 * norm) + norm
        decoder = self.num_decoder_layers * (2 * attention + mlp + 3 * norm) + norm
        relpos = 2 * self.num_heads * self.relative_buckets
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return encoder + decoder + relpos + embeddings

    def flops_per_example(self, encoder_len: int, decoder_len: int) -> float:
        """Training FLOPs (forward + backward) of one example: ``6 *`` each GEMM's parameters times the
        tokens through it (cross-attention's keys and values project the encoder's tokens) plus
        attention: bidirectional in the encoder (``12 * len**2 * heads * head_dim`` per layer), causal
        self-attention (half that) and full cross-attention in the decoder."""
        attention, mlp, _ = self._block_params()
        h, q = self.hidden_size, self.num_heads * self.resolved_head_dim
        encoder = encoder_len * self.num_encoder_layers * (attention + mlp)
        decoder = decoder_len * (self.num_decoder_layers * (attention + 2 * h * q + mlp) + self.vocab_size * h)
        cross_kv = encoder_len * self.num_decoder_layers * 2 * h * q
        attend = q * (12 * self.num_encoder_layers * encoder_len ** 2 + self.num_decoder_layers * (
            6 * decoder_len ** 2 + 12 * decoder_len * encoder_len))
        return 6.0 * (encoder + decoder + cross_kv) + attend

    def flops_per_token(self, seq_len: int) -> float:
        """`flops_per_example` of a ``seq_len``-token input and target, per token pair."""
        return self.flops_per_example(seq_len, seq_len) / seq_len


_PRESETS: dict[str, dict[str, Any]] = {
    # CPU: the byte tokenizer's 257 ids (padded to 384), 2 + 2 layers.
    "t5-tiny": dict(vocab_size=384, hidden_size=128, num_encoder_layers=2, num_decoder_layers=2, num_heads=4,
                    mlp_dim=256),
    # T5.1.1-base's shape with a 32768 vocabulary: 12 + 12 layers, hidden 768, gated-GELU MLP 2048.
    "t5-base": dict(vocab_size=32768, hidden_size=768, num_encoder_layers=12, num_decoder_layers=12, num_heads=12,
                    mlp_dim=2048, tie_embeddings=False, dtype=jnp.bfloat16),
}
T5_PRESETS = tuple(_PRESETS)


def t5_config(name: str, **overrides: Any) -> T5Config:
    """A preset (`T5_PRESETS`: ``"t5-tiny"``, ``"t5-base"``) with fields overridden."""
    if name not in _PRESETS:
        raise ValueError(f"t5_config: name={name!r} is not a preset; accepted: {', '.join(T5_PRESETS)}")
    return T5Config(**{**_PRESETS[name], **overrides})


def _check_tokens(name: str, tokens: jax.Array) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"T5: {name} must be int [batch, length]; got {tokens.dtype} {tokens.shape}")


# T5's initialisation (Mesh TensorFlow): every kernel normal with variance 1 / fan-in, the embedding
# standard normal. Attention logits then start at unit scale, so cross-attention can align its queries
# with the encoder's tokens early rather than staying near uniform (docs/performance.md).
KERNEL_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def _layer_kwargs(cfg: T5Config) -> dict[str, Any]:
    init = KERNEL_INIT
    return dict(hidden_size=cfg.hidden_size, mlp_hidden_size=cfg.mlp_dim, num_attention_heads=cfg.num_heads,
                head_dim=cfg.resolved_head_dim, layernorm_type=cfg.layernorm_type,
                layernorm_epsilon=cfg.layernorm_epsilon, hidden_dropout=cfg.dropout_rate,
                attention_dropout=cfg.attention_dropout, intermediate_dropout=cfg.dropout_rate,
                mha_kernel_init=init, mlp_kernel_init=init, mlp_activations=cfg.activations, use_bias=False,
                dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                # The stack computes the relative biases once and passes them to every layer
                # (attention_bias); scaled logits, unscaled query initialization.
                enable_relative_embedding=False, scale_attn_logits=True, scaled_query_init=False)


def _relative_biases(cfg: T5Config) -> RelativePositionBiases:
    return RelativePositionBiases(num_buckets=cfg.relative_buckets, max_distance=cfg.relative_max_distance,
                                  num_attention_heads=cfg.num_heads, embedding_init=RELPOS_EMBEDDING_INIT,
                                  dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="relpos_bias")


class T5Encoder(nn.Module):
    """Embedding (the shared ``embed``), bidirectional relative position biases, pre-LN blocks, final norm.

    Attributes:
      config: a `T5Config`.
      embed: the token `mtjax.flax.Embed` shared with the decoder.
    """

    config: T5Config
    embed: nn.Module

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None, deterministic: bool) -> jax.Array:
        cfg = self.config
        seq = tokens.shape[1]
        x = nn.Dropout(rate=cfg.dropout_rate)(self.embed(tokens), deterministic=deterministic)
        bias = _relative_biases(cfg)(seq, seq, bidirectional=True)
        layer = dict(_layer_kwargs(cfg), layer_type=TransformerLayerType.ENCODER,
                     self_attn_mask_type="no_mask" if segment_ids is None else "padding")
        x = apply_layers(x, layer=layer, num_layers=cfg.num_encoder_layers, scan_layers=cfg.scan_layers,
                         remat_policy=cfg.remat_policy, segment_ids=segment_ids, positions=None,
                         deterministic=deterministic, decode=False, attention_bias=bias)
        x = LayerNorm(epsilon=cfg.layernorm_epsilon, layernorm_type=cfg.layernorm_type, dtype=cfg.dtype,
                      param_dtype=cfg.param_dtype, name="final_norm")(x)
        return nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)


class T5Decoder(nn.Module):
    """Embedding (the shared ``embed``), causal relative position biases, pre-LN blocks with
    cross-attention to the encoder output, final norm, output layer.

    With ``decode=True`` the ``"cache"`` collection holds every layer's keys and values and the
    decoder's ``position``; its ``key_positions [max_length]`` tell the biases how long the cache is.

    Attributes:
      config: a `T5Config`.
      embed: the token `mtjax.flax.Embed` shared with the encoder.
    """

    config: T5Config
    embed: nn.Module

    @nn.compact
    def __call__(self, tokens: jax.Array, encoded: jax.Array, encoder_mask: jax.Array | None, deterministic: bool,
                 decode: bool) -> jax.Array:
        cfg = self.config
        seq = tokens.shape[1]
        x = nn.Dropout(rate=cfg.dropout_rate)(self.embed(tokens), deterministic=deterministic)
        relpos = _relative_biases(cfg)
        if decode and self.has_variable(CACHE_COLLECTION, "position"):
            position = self.variable(CACHE_COLLECTION, "position", lambda: jnp.zeros((), jnp.int32))
            max_length = self.get_variable(CACHE_COLLECTION, "key_positions").shape[0]
            bias = relpos(seq, max_length, bidirectional=False, q_offset=position.value)
            position.value = position.value + seq
        else:
            if decode:  # creating the cache: a plain causal pass over [batch, max_length]
                self.variable(CACHE_COLLECTION, "position", lambda: jnp.zeros((), jnp.int32))
                self.variable(CACHE_COLLECTION, "key_positions", lambda: jnp.arange(seq, dtype=jnp.int32))
            bias = relpos(seq, seq, bidirectional=False)
        layer = dict(_layer_kwargs(cfg), layer_type=TransformerLayerType.DECODER,
                     self_attn_mask_type="causal")
        x = apply_layers(x, layer=layer, num_layers=cfg.num_decoder_layers, scan_layers=cfg.scan_layers,
                         remat_policy=cfg.remat_policy, segment_ids=None, positions=None,
                         deterministic=deterministic, decode=decode, encoded=encoded, encoder_mask=encoder_mask,
                         attention_bias=bias)
        x = LayerNorm(epsilon=cfg.layernorm_epsilon, layernorm_type=cfg.layernorm_type, dtype=cfg.dtype,
                      param_dtype=cfg.param_dtype, name="final_norm")(x)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
        if cfg.tie_embeddings:
            logits = self.embed.attend(x * (cfg.hidden_size ** -0.5))
        else:
            logits = DenseGeneral(cfg.vocab_size, use_bias=False, kernel_init=KERNEL_INIT,
                                  kernel_axes=(axes.EMBED, axes.VOCAB), dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                  name="logits_dense")(x)
        return nn.with_logical_constraint(logits.astype(jnp.float32), LOGITS_AXES)


class T5(nn.Module):
    """Encoder-decoder Transformer (T5.1.1 layout) with a shared token embedding.

    ``__call__(encoder_tokens, decoder_tokens, *, encoder_segment_ids=None, deterministic=True)``:
    ``encoder_segment_ids [batch, enc_len]`` mark real encoder tokens (1) and padding (0), which
    neither the encoder nor the decoder's cross-attention ever attends to; decoder sequences are
    right-padded (causal attention keeps padding out of the real positions; weight the loss to leave
    it out). Returns float32 logits ``[batch, dec_len, vocab_size]``.

    `encode` gives the encoder output, `decode` the decoder's logits on it; ``decode(...,
    decode=True)`` runs one step (or a few tokens) on the ``"cache"`` collection, created by a first
    call with ``mutable=["cache"]`` on ``[batch, max_length]`` tokens. `mtjax.models.greedy_decode`
    drives it.

    Example::

        model = T5(t5_config("t5-tiny"))
        variables = model.init(jax.random.key(0), jnp.ones((2, 16), jnp.int32), jnp.ones((2, 8), jnp.int32))
        logits = model.apply(variables, encoder_tokens, decoder_tokens)        # [2, 8, 384]

    Attributes:
      config: a `T5Config`.
    """

    config: T5Config

    def setup(self):
        cfg = self.config
        self.token_embed = Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=nn.initializers.normal(1.0),
                                 dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.encoder = T5Encoder(cfg, self.token_embed)
        self.decoder = T5Decoder(cfg, self.token_embed)

    def __call__(self, encoder_tokens: jax.Array, decoder_tokens: jax.Array, *,
                 encoder_segment_ids: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
        encoded = self.encode(encoder_tokens, encoder_segment_ids=encoder_segment_ids, deterministic=deterministic)
        return self.decode(decoder_tokens, encoded, encoder_segment_ids=encoder_segment_ids,
                           deterministic=deterministic)

    def encode(self, encoder_tokens: jax.Array, *, encoder_segment_ids: jax.Array | None = None,
               deterministic: bool = True) -> jax.Array:
        """The encoder output ``[batch, enc_len, hidden_size]``."""
        _check_tokens("encoder_tokens", encoder_tokens)
        if encoder_segment_ids is not None and encoder_segment_ids.shape != encoder_tokens.shape:
            raise ValueError(f"T5: encoder_segment_ids has shape {encoder_segment_ids.shape}; expected "
                             f"encoder_tokens' {encoder_tokens.shape}")
        return self.encoder(encoder_tokens, encoder_segment_ids, deterministic)

    def decode(self, decoder_tokens: jax.Array, encoded: jax.Array, *, encoder_segment_ids: jax.Array | None = None,
               deterministic: bool = True, decode: bool = False) -> jax.Array:
        """Logits ``[batch, dec_len, vocab_size]`` of ``decoder_tokens`` reading ``encoded`` (`encode`'s
        output); ``decode=True``: on the key/value cache (see the class docstring)."""
        _check_tokens("decoder_tokens", decoder_tokens)
        if encoded.ndim != 3 or encoded.shape[0] != decoder_tokens.shape[0] or \
                encoded.shape[2] != self.config.hidden_size:
            raise ValueError(f"T5: encoded has shape {encoded.shape}; expected [batch={decoder_tokens.shape[0]}, "
                             f"enc_len, {self.config.hidden_size}]")
        mask = None
        if encoder_segment_ids is not None:
            if encoder_segment_ids.shape != encoded.shape[:2]:
                raise ValueError(f"T5: encoder_segment_ids has shape {encoder_segment_ids.shape}; expected "
                                 f"{encoded.shape[:2]}")
            mask = (encoder_segment_ids != 0)[:, None, None, :]
        return self.decoder(decoder_tokens, encoded, mask, deterministic, decode)

