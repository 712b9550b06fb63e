"""`TransformerLayer`: one encoder or decoder block built from `MultiHeadAttention` and `LayerNormMLP`."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import ops
from mtjax.axes import BATCH_LENGTH_EMBED
from mtjax.flax.attention import (
    MHA_KERNEL_INIT,
    RELPOS_EMBEDDING_INIT,
    ROTARY_GROUP_METHODS,
    MultiHeadAttention,
    PagedKV,
    RelativePositionBiases,
    RopeScaling,
    check_heads,
)
from mtjax.flax.mlp import LayerNormMLP
from mtjax.flax.normalization import LayerNorm, check_layernorm_type
from mtjax.flax.params import Dtype, Initializer
from mtjax.ops.checks import check_choice


class TransformerLayerType(enum.Enum):
    """ENCODER: self-attention + MLP. DECODER: self-attention + cross-attention to ``encoded`` + MLP.
    (A GPT block is an ENCODER layer with ``self_attn_mask_type="causal"``, as in TransformerEngine.)"""

    ENCODER = "encoder"
    DECODER = "decoder"


class TransformerLayer(nn.Module):
    """A Transformer block, pre-LN by default.

    The defaults are TransformerEngine-JAX's, which are T5's: relative position biases
    (``enable_relative_embedding``), unscaled attention logits with the ``1 / sqrt(head_dim)`` folded
    into the query kernel's initialisation (``scale_attn_logits=False, scaled_query_init=True``),
    GELU, no intermediate dropout. A GPT/BERT/Llama block sets ``enable_relative_embedding=False,
    scale_attn_logits=True, scaled_query_init=False`` (as `mtjax.models` does) and its activation.

    Pre-LN (default): ``x = x + attn(norm(x)); x = x + mlp(norm(x))``, norms fused into the next GEMM.
    ``output_layernorm=True`` moves the attention's norm to the output: ``out = norm(x + mlp(norm(x + attn(x))))``;
    with ``apply_residual_connection_post_layernorm=True`` as well, the residual is taken after the norm,
    which gives the original (BERT) post-LN block ``y = norm(x + attn(x)); out = norm(y + mlp(y))``.

    ``__call__(inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None, *, segment_ids=None,
    encoder_segment_ids=None, positions=None, deterministic=False, decode=False, residual=None, paged_kv=None,
    attention_bias=None)``: ``inputs [batch, length, hidden_size]``; masks ``[batch|1, heads|1, q_len, kv_len]``
    are bool keep-masks (True = attend) or TransformerEngine's integer masks (1 = masked out,
    `mtjax.flax.attention.keep_mask`);
    ``segment_ids [batch, length]`` (0 = padding) restrict attention to the own segment (packing);
    ``positions [batch, length]`` feed the rotary embedding; ``paged_kv`` (a `PagedKV`) runs the
    self-attention on a paged key/value cache; ``attention_bias [batch|1, heads|1, q_len, kv_len]`` is
    added to the self-attention logits (after scaling): T5's relative position biases computed once
    per stack and shared by its layers (with ``decode=True`` it spans the whole cache, see
    `MultiHeadAttention`; the cross-attention keeps its projected ``encoded`` in the cache). Returns
    ``[batch, length, hidden_size]``.

    ``parallel_attention_mlp=True`` (GPT-NeoX, GPT-J; pre-LN only) runs the attention and the MLP side
    by side on the block's input, each behind its own norm: ``x = x + attn(norm1(x)) + mlp(norm2(x))``.

    Residual adds across blocks (pre-LN only): with ``defer_residual_add`` a block returns
    ``(branch, stream)``, its output being ``branch + stream``; the next block takes them as
    ``(inputs=branch, residual=stream)`` and forms the sum in its attention's norm kernel
    (`mtjax.ops.residual_norm`), as a final ``LayerNorm(...)(branch, residual=stream)`` does.

    Sub-modules: ``self_attention``, ``encoder_decoder_attention`` (DECODER), ``mlp``, ``relpos_bias``
    (``enable_relative_embedding``), ``output_layernorm``.

    Attributes:
      hidden_size: model width.
      mlp_hidden_size: width of the MLP's hidden layer.
      num_attention_heads: query heads.
      num_gqa_groups: key/value heads (None: ``num_attention_heads``).
      head_dim: None: ``hidden_size // num_attention_heads`` (which must then divide evenly).
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      layernorm_epsilon: epsilon of every norm.
      zero_centered_gamma: norms store ``gamma - 1``.
      hidden_dropout: dropout on each sub-block's output before the residual add.
      hidden_dropout_dims: axes sharing one hidden-dropout mask.
      attention_dropout: dropout on attention probabilities.
      intermediate_dropout: dropout after the MLP activation.
      intermediate_dropout_dims: axes sharing one intermediate-dropout mask.
      dropout_rng_name: rng collection of all dropouts.
      mha_kernel_init, mlp_kernel_init: initializers of the attention and MLP kernels
        (TransformerEngine's: ``variance_scaling(1.0, "fan_in", "normal")`` and ``lecun_normal()``,
        i.e. ``variance_scaling(1.0, "fan_in", "truncated_normal")``).
      mlp_activations: TransformerEngine-style tuple or name (`mtjax.ops.activation`).
      use_bias: biases in every projection.
      bias_init: their initializer.
      apply_residual_connection_post_layernorm: the residual is the normed input.
      output_layernorm: norm at the block's output instead of the attention input (post-LN).
      float32_attention_logits: run attention in float32.
      layer_type: `TransformerLayerType`.
      self_attn_mask_type: one of `mtjax.ops.MASK_TYPES`.
      self_attn_bias_type: as `DotProductAttention.attn_bias_type`.
      enable_relative_embedding: add T5 relative position biases to self-attention: bidirectional
        in an ENCODER layer, unidirectional in a DECODER layer, whatever the mask (as TransformerEngine).
      relative_embedding: the `RelativePositionBiases` to use (None: 32 buckets, max distance 128,
        `RELPOS_EMBEDDING_INIT`).
      enable_rotary_pos_emb: rotary embeddings in self-attention.
      rotary_pos_emb_windows: ``(min_timescale, max_timescale)``.
      rotary_pos_emb_group_method: ``"consecutive"`` or ``"alternate"``.
      rotary_pos_emb_fraction, rotary_pos_emb_scaling: partial rotary and frequency scaling
        (`MultiHeadAttention`).
      qkv_bias: biases on the query, key and value projections, also without ``use_bias``.
      qk_norm: per-head query/key norms (`MultiHeadAttention.qk_norm`).
      parallel_attention_mlp: the parallel block above (self-attention only, ENCODER layers).
      fuse_qkv_params: fused QKV / KV kernels.
      fuse_residual_norm: add the attention output to the residual stream in the MLP's norm kernel
        (`mtjax.ops.residual_norm`) instead of a separate add (not with
        ``apply_residual_connection_post_layernorm``, whose residual is the normed input).
      defer_residual_add: return ``(branch, stream)`` instead of their sum (see above; pre-LN only).
      scale_attn_logits: scale logits by ``1 / sqrt(head_dim)``.
      scaled_query_init: divide the query kernel's initial values by ``sqrt(head_dim)``.
      window_size: sliding-window self-attention ``(left, right)``.
      logits_soft_cap: attention logit soft cap.
      context_parallel, context_parallel_load_balanced: self-attention over a sequence split on the
        ``cp`` mesh axis (`DotProductAttention`).
      collective_matmul: the attention projections' and the MLP's GEMMs overlap their
        sequence-parallel collectives (`MultiHeadAttention.collective_matmul`,
        `LayerNormMLP.collective_matmul`).
      dtype: compute and output dtype.
      param_dtype: parameter dtype.
    """

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: int | None = None
    head_dim: int | None = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.0
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Initializer = MHA_KERNEL_INIT
    mlp_kernel_init: Initializer = nn.initializers.lecun_normal()
    mlp_activations: str | Sequence[str] = ("gelu",)
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: str | None = None
    enable_relative_embedding: bool = True
    relative_embedding: nn.Module | None = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[float, float] = (1.0, 10000.0)
    rotary_pos_emb_group_method: str = "consecutive"
    rotary_pos_emb_fraction: float = 1.0
    rotary_pos_emb_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    parallel_attention_mlp: bool = False
    fuse_qkv_params: bool = True
    fuse_residual_norm: bool = True
    defer_residual_add: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    context_parallel: str | None = None
    context_parallel_load_balanced: bool = True
    collective_matmul: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def resolved_head_dim(self) -> int:
        """The head size, after validating how heads divide ``hidden_size``."""
        if self.head_dim is not None:
            return self.head_dim
        if self.num_attention_heads < 1 or self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"TransformerLayer: hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads} (or pass head_dim)"
            )
        return self.hidden_size // self.num_attention_heads

    def _validate(self) -> int:
        owner = "TransformerLayer"
        head_dim = self.resolved_head_dim()
        check_heads(owner, head_dim, self.num_attention_heads, self.num_gqa_groups)
        check_layernorm_type(owner, self.layernorm_type)
        check_choice(owner, "self_attn_mask_type", self.self_attn_mask_type, ops.MASK_TYPES)
        check_choice(owner, "layer_type", self.layer_type, tuple(TransformerLayerType))
        check_choice(owner, "rotary_pos_emb_group_method", self.rotary_pos_emb_group_method, ROTARY_GROUP_METHODS)
        ops.canonical_activation(self.mlp_activations)
        for name in ("hidden_dropout", "attention_dropout", "intermediate_dropout"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{owner}: {name}={rate}; expected 0 <= rate < 1")
        return head_dim

    def make_mlp(self) -> nn.Module:
        """The MLP sub-block (named ``"mlp"``): a `LayerNormMLP` built from this layer's attributes.

        Called from the compact ``__call__``; a subclass returns another module with `LayerNormMLP`'s
        call signature and results (e.g. `mtjax.flax.MoETransformerLayer`'s `MoEBlock`)."""
        return LayerNormMLP(**self.mlp_norm_kwargs(), intermediate_dim=self.mlp_hidden_size,
                            activations=self.mlp_activations, intermediate_dropout_rate=self.intermediate_dropout,
                            intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims),
                            intermediate_dropout_rng_name=self.dropout_rng_name, use_bias=self.use_bias,
                            bias_init=self.bias_init, collective_matmul=self.collective_matmul, name="mlp")

    def mlp_norm_kwargs(self) -> dict:
        """The attributes every MLP sub-block takes from the layer: its input norm, kernel init,
        ``return_layernorm_output`` and dtypes."""
        return dict(layernorm_type=self.layernorm_type, epsilon=self.layernorm_epsilon,
                    zero_centered_gamma=self.zero_centered_gamma, kernel_init=self.mlp_kernel_init,
                    return_layernorm_output=self.apply_residual_connection_post_layernorm,
                    dtype=self.dtype, param_dtype=self.param_dtype)

    @nn.compact
    def __call__(self, inputs: jax.Array, encoded: jax.Array | None = None, attention_mask: jax.Array | None = None,
                 encoder_decoder_mask: jax.Array | None = None, *, segment_ids: jax.Array | None = None,
                 encoder_segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                 deterministic: bool = False, decode: bool = False, residual: jax.Array | None = None,
                 paged_kv: PagedKV | None = None,
                 attention_bias: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
        head_dim = self._validate()
        if inputs.ndim != 3 or inputs.shape[-1] != self.hidden_size:
            raise ValueError(f"TransformerLayer: inputs has shape {inputs.shape}; expected [batch, length, "
                             f"{self.hidden_size}]")
        if (residual is not None or self.defer_residual_add) and (
                self.output_layernorm or self.apply_residual_connection_post_layernorm):
            raise ValueError("TransformerLayer: residual= and defer_residual_add need a pre-LN block "
                             "(output_layernorm=False, apply_residual_connection_post_layernorm=False)")
        is_decoder = self.layer_type == TransformerLayerType.DECODER
        if self.parallel_attention_mlp and (is_decoder or self.output_layernorm
                                            or self.apply_residual_connection_post_layernorm):
            raise ValueError("TransformerLayer: parallel_attention_mlp needs a pre-LN ENCODER layer "
                             "(layer_type=ENCODER, output_layernorm=False, "
                             "apply_residual_connection_post_layernorm=False)")
        if is_decoder and encoded is None:
            raise ValueError("TransformerLayer: layer_type=DECODER needs `encoded` (the encoder output)")
        inputs = nn.with_logical_constraint(inputs.astype(self.dtype), BATCH_LENGTH_EMBED)
        if residual is not None:
            residual = nn.with_logical_constraint(residual.astype(self.dtype), BATCH_LENGTH_EMBED)
        attention = dict(
            head_dim=head_dim, num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
            attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
            layernorm_type=self.layernorm_type, layernorm_epsilon=self.layernorm_epsilon,
            zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            use_bias=self.use_bias, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, kernel_init=self.mha_kernel_init,
            bias_init=self.bias_init,
            fuse_qkv_params=self.fuse_qkv_params, scale_attn_logits=self.scale_attn_logits,
            scaled_query_init=self.scaled_query_init, float32_logits=self.float32_attention_logits,
            collective_matmul=self.collective_matmul, dtype=self.dtype, param_dtype=self.param_dtype,
        )
        hidden_dropout = nn.Dropout(rate=self.hidden_dropout, broadcast_dims=tuple(self.hidden_dropout_dims),
                                    rng_collection=self.dropout_rng_name)

        def residual_add(branch, residual, ln_out):
            residual = ln_out if self.apply_residual_connection_post_layernorm and ln_out is not None else residual
            out = hidden_dropout(branch, deterministic=deterministic) + residual
            return nn.with_logical_constraint(out, BATCH_LENGTH_EMBED)

        bias = attention_bias
        if self.enable_relative_embedding:
            if attention_bias is not None:
                raise ValueError("TransformerLayer: pass attention_bias or set enable_relative_embedding, not both")
            if decode or paged_kv is not None:
                raise ValueError("TransformerLayer: decode=True and paged_kv do not support enable_relative_embedding "
                                 "(compute the biases over the cache and pass them as attention_bias)")
            relpos = self.relative_embedding or RelativePositionBiases(
                num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads,
                embedding_init=RELPOS_EMBEDDING_INIT, dtype=self.dtype, param_dtype=self.param_dtype,
                name="relpos_bias")
            bias = relpos(inputs.shape[1], inputs.shape[1], not is_decoder)

        # With a residual, the block's input stream is inputs + residual, formed in the attention's norm.
        x, ln_out, *stream = MultiHeadAttention(
            input_layernorm=not self.output_layernorm, attn_mask_type=self.self_attn_mask_type,
            attn_bias_type=self.self_attn_bias_type, enable_rotary_pos_emb=self.enable_rotary_pos_emb,
            rotary_pos_emb_windows=self.rotary_pos_emb_windows,
            rotary_pos_emb_group_method=self.rotary_pos_emb_group_method,
            rotary_pos_emb_fraction=self.rotary_pos_emb_fraction, rotary_pos_emb_scaling=self.rotary_pos_emb_scaling,
            window_size=self.window_size,
            logits_soft_cap=self.logits_soft_cap, context_parallel=self.context_parallel,
            context_parallel_load_balanced=self.context_parallel_load_balanced, name="self_attention", **attention,
        )(inputs, None, attention_mask, bias, q_segment_ids=segment_ids, q_positions=positions,
          decode=decode, deterministic=deterministic, residual=residual, paged_kv=paged_kv)
        if stream:
            inputs = nn.with_logical_constraint(stream[0], BATCH_LENGTH_EMBED)
        if self.parallel_attention_mlp:  # the MLP reads the block's input stream, through its own norm
            z, _ = self.make_mlp()(inputs, deterministic=deterministic)
            branch = hidden_dropout(x, deterministic=deterministic) + hidden_dropout(z, deterministic=deterministic)
            branch = nn.with_logical_constraint(branch, BATCH_LENGTH_EMBED)
            if self.defer_residual_add:
                return branch, inputs
            return nn.with_logical_constraint(branch + inputs, BATCH_LENGTH_EMBED)
        branch, residual = x, inputs  # the stream is inputs + dropout(x) from here
        if is_decoder:
            x = residual_add(branch, residual, ln_out)
            has_padding = encoder_decoder_mask is not None or encoder_segment_ids is not None
            if (segment_ids is None) != (encoder_segment_ids is None):
                raise ValueError("TransformerLayer: pass segment_ids and encoder_segment_ids together")
            y, ln_out = MultiHeadAttention(
                input_layernorm=True, attn_mask_type="padding" if has_padding else "no_mask",
                name="encoder_decoder_attention", **attention,
            )(x, encoded, encoder_decoder_mask, q_segment_ids=segment_ids, kv_segment_ids=encoder_segment_ids,
              deterministic=deterministic, decode=decode)
            branch, residual = y, x

        fuse = self.fuse_residual_norm and not self.apply_residual_connection_post_layernorm
        if not fuse:
            x = residual_add(branch, residual, ln_out)
        mlp = self.make_mlp()
        if fuse:  # the add happens in the MLP's norm kernel, which returns the new stream
            z, ln_out, x = mlp(hidden_dropout(branch, deterministic=deterministic), deterministic=deterministic,
                               residual=residual)
            x = nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)
        else:
            z, ln_out = mlp(x, deterministic=deterministic)
        if self.defer_residual_add:
            return nn.with_logical_constraint(hidden_dropout(z, deterministic=deterministic), BATCH_LENGTH_EMBED), x
        z = residual_add(z, x, ln_out)

        if self.output_layernorm:
            z = LayerNorm(epsilon=self.layernorm_epsilon, layernorm_type=self.layernorm_type,
                          zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype,
                          param_dtype=self.param_dtype, name="output_layernorm")(z)
        return z
