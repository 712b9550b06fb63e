"""Attention modules: `DotProductAttention` (the core, through `mtjax.ops.attention`, so fused kernels
plug in underneath), `MultiHeadAttention` (projections, GQA/MQA, rotary embeddings, KV cache) and
T5's `RelativePositionBiases`.

Layout: ``[batch, length, heads, head_dim]`` (``transpose_batch_sequence`` on `DotProductAttention`
takes ``[length, batch, ...]``). Masks (`keep_mask`): a **bool** ``mask`` is True where a query may
attend (`mtjax.ops.attention`'s and flax's convention); an **integer** one (``uint8``) is
TransformerEngine's, 1 where attention is masked out. Segment ids ``[batch, length]`` (0 = padding)
express packing and padding without materialising a mask.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from mtjax import axes, ops
from mtjax.flax.dense import DenseGeneral, LayerNormDenseGeneral
from mtjax.flax.normalization import LayerNorm
from mtjax.flax.params import AxisNames, Dtype, Initializer, param_with_axes
from mtjax.ops.checks import check_choice
from mtjax.sharding.context import context_parallel_size

ATTN_BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias")
ROTARY_GROUP_METHODS = ("consecutive", "alternate")
CACHE_COLLECTION = "cache"
# The cross-attention keys and values a decoding `MultiHeadAttention` keeps in the cache collection.
CROSS_CACHE_NAMES = ("cached_cross_key", "cached_cross_value")
# The variable collection of paged key/value caches (`PagedKV`): ``k_pages``/``v_pages`` per layer
# (and ``k_scale``/``v_scale`` with FP8 pages).
PAGED_KV_COLLECTION = "paged_kv"
# Largest finite float8_e4m3fn value: FP8 pages store ``clip(k / k_scale, -E4M3_MAX, E4M3_MAX)``.
E4M3_MAX = 448.0

# TransformerEngine's initializer of the attention projections (`MultiHeadAttention.kernel_init`,
# `mtjax.flax.TransformerLayer.mha_kernel_init`).
MHA_KERNEL_INIT: Initializer = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
# TransformerEngine's initializer of the relative position biases a `TransformerLayer` creates.
RELPOS_EMBEDDING_INIT: Initializer = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")

Q_AXES: AxisNames = (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_HEADS, axes.ACTIVATION_HEAD_DIM)
KV_AXES: AxisNames = (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_KV_HEADS, axes.ACTIVATION_HEAD_DIM)


def check_heads(owner: str, head_dim: int, num_attention_heads: int, num_gqa_groups: int | None) -> int:
    """Validates the head configuration; returns the number of key/value heads."""
    if head_dim < 1:
        raise ValueError(f"{owner}: head_dim={head_dim}; expected a positive int")
    if num_attention_heads < 1:
        raise ValueError(f"{owner}: num_attention_heads={num_attention_heads}; expected a positive int")
    groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
    if groups < 1 or num_attention_heads % groups:
        raise ValueError(
            f"{owner}: num_attention_heads={num_attention_heads} must be a multiple of num_gqa_groups={num_gqa_groups} "
            f"(the number of key/value heads: 1 for MQA, num_attention_heads for MHA)"
        )
    return groups


def keep_mask(mask: jax.Array | None, owner: str) -> jax.Array | None:
    """The boolean keep-mask (True where a query may attend) of a module's ``mask`` argument.

    A bool mask is mtjax's (and flax's) convention, True = attend, and passes through. An integer mask
    (``uint8``, ``int32``...) is TransformerEngine-JAX's convention, **1 (nonzero) = masked out**, as its
    examples build them: it becomes ``mask == 0``. Any other dtype (e.g. flax's float masks) is a
    TypeError: its meaning would be a guess.
    """
    if mask is None:
        return None
    dtype = jnp.result_type(mask)
    if dtype == jnp.bool_:
        return mask
    if jnp.issubdtype(dtype, jnp.integer):
        return mask == 0
    raise TypeError(f"{owner}: mask has dtype {dtype}; pass a bool mask (True = attend, flax's convention) or an "
                    "integer one (TransformerEngine's convention: 1 = masked out)")


def _rotate_pairs(x: jax.Array, sin: jax.Array, cos: jax.Array, group_method: str) -> jax.Array:
    """Rotate each coordinate pair of ``x`` by the angle whose sine and cosine are given (f32 math)."""
    xf = x.astype(jnp.float32)
    if group_method == "alternate":
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
    return out.astype(x.dtype)


# A rotation's transpose is the rotation by the opposite angle. Saying so keeps the backward pass
# the same shape as the forward (slices and one concatenate): autodiff transposes the slices and
# the concatenate into zero pads and adds, which XLA fused with the Q/K/V gradient assembly into one
# loop far slower than the forward's.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotate(x, sin, cos, group_method):
    return _rotate_pairs(x, sin, cos, group_method)


def _rotate_fwd(x, sin, cos, group_method):
    return _rotate_pairs(x, sin, cos, group_method), (sin, cos)


def _rotate_bwd(group_method, saved, g):
    sin, cos = saved
    return _rotate_pairs(g, -sin, cos, group_method), None, None


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


ROPE_SCALING_KINDS = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A change of the rotary frequencies for contexts longer than the model was trained on.

    ``"linear"`` (position interpolation) divides every frequency by ``factor``. ``"llama3"``
    (Llama 3.1's) divides only the low frequencies, those whose wavelength exceeds
    ``original_max_position / low_freq_factor``, by ``factor``, keeps the high ones (wavelength
    under ``original_max_position / high_freq_factor``) and blends linearly in between.

    Attributes:
      kind: one of `ROPE_SCALING_KINDS`.
      factor: the context extension factor (> 0).
      low_freq_factor, high_freq_factor: ``"llama3"``'s band edges (``high_freq_factor > low_freq_factor > 0``).
      original_max_position: ``"llama3"``'s pre-extension context length.

    Example::

        MultiHeadAttention(..., enable_rotary_pos_emb=True,
                           rotary_pos_emb_scaling=RopeScaling("llama3", factor=32.0, original_max_position=8192))
    """

    kind: str = "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        check_choice("RopeScaling", "kind", self.kind, ROPE_SCALING_KINDS)
        if not self.factor > 0:
            raise ValueError(f"RopeScaling: factor={self.factor!r}; expected > 0")
        if self.kind == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor
                                          and self.original_max_position > 0):
            raise ValueError(f"RopeScaling: low_freq_factor={self.low_freq_factor!r}, high_freq_factor="
                             f"{self.high_freq_factor!r}, original_max_position={self.original_max_position!r}; "
                             "expected 0 < low_freq_factor < high_freq_factor and original_max_position > 0")

    def frequencies(self, inv_freq: jax.Array) -> jax.Array:
        """The scaled angular frequencies (radians per position) of ``inv_freq``."""
        if self.kind == "linear":
            return inv_freq / self.factor
        wavelength = 2 * math.pi / inv_freq
        low = inv_freq / self.factor
        # 0 at the low-frequency edge, 1 at the high-frequency one.
        blend = (self.original_max_position / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        medium = (1 - blend) * low + blend * inv_freq
        return jnp.where(wavelength > self.original_max_position / self.low_freq_factor, low,
                         jnp.where(wavelength < self.original_max_position / self.high_freq_factor, inv_freq, medium))


def rotary_dim(head_dim: int, fraction: float) -> int:
    """The leading coordinates of a head that rotate under ``fraction`` (partial rotary, GPT-NeoX):
    ``int(head_dim * fraction)``; ValueError unless it is even and positive."""
    if not 0 < fraction <= 1:
        raise ValueError(f"rotary fraction={fraction!r}; expected 0 < fraction <= 1")
    dim = int(head_dim * fraction)
    if dim < 2 or dim % 2:
        raise ValueError(f"rotary fraction={fraction!r} of head_dim={head_dim} rotates {dim} coordinates; "
                         "expected an even number >= 2")
    return dim


def apply_rotary_pos_emb(x: jax.Array, positions: jax.Array, *, windows: tuple[float, float] = (1.0, 10000.0),
                         group_method: str = "consecutive", fraction: float = 1.0,
                         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary position embedding of ``x [batch, length, heads, head_dim]`` at integer ``positions [batch, length]``.

    Coordinate pairs rotate by ``position / timescale`` with timescales geometric from ``windows[0]``
    to ``windows[1]``. ``group_method`` (TransformerEngine's names): ``"consecutive"`` pairs ``(2i, 2i+1)``
    (GPT-J), ``"alternate"`` pairs ``(i, i + head_dim/2)`` (GPT-NeoX, Llama in Hugging Face layout).
    ``fraction < 1`` rotates only the first `rotary_dim` coordinates (their timescales spread over
    that width) and passes the rest through (GPT-NeoX's ``rotary_pct``); ``scaling`` changes the
    frequencies (`RopeScaling`). Computed in float32, returned in ``x.dtype``; the gradient is the
    opposite rotation of the cotangent (positions get none).
    """
    check_choice("apply_rotary_pos_emb", "group_method", group_method, ROTARY_GROUP_METHODS)
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"apply_rotary_pos_emb: head_dim={head_dim} must be even")
    dim = rotary_dim(head_dim, fraction)
    min_timescale, max_timescale = windows
    exponent = 2.0 * jnp.arange(dim // 2, dtype=jnp.float32) / dim
    frequency = 1.0 / (min_timescale * (max_timescale / min_timescale) ** exponent)
    if scaling is not None:
        frequency = scaling.frequencies(frequency)
    angle = positions.astype(jnp.float32)[:, :, None, None] * frequency  # [batch, length, 1, dim / 2]
    if dim == head_dim:
        return _rotate(x, jnp.sin(angle), jnp.cos(angle), group_method)
    rotated = _rotate(x[..., :dim], jnp.sin(angle), jnp.cos(angle), group_method)
    return jnp.concatenate([rotated, x[..., dim:]], axis=-1)


@struct.dataclass
class PagedKV:
    """Where the tokens of one call sit in a paged key/value cache (a pytree; pass as ``paged_kv=``).

    The pages themselves are variables of the `PAGED_KV_COLLECTION` collection, per attention layer:
    ``k_pages``/``v_pages [kv_heads, num_pages, page_size, head_dim]`` in ``dtype`` (stacked on a
    leading layer axis by a scanned stack) and, when ``dtype`` is float8, ``k_scale``/``v_scale
    [kv_heads]`` float32 dequantization scales. A call that does not find them creates them (zeros,
    scales 1), which is how a cache's shapes are obtained (`jax.eval_shape` of an ``apply`` with
    ``mutable=[PAGED_KV_COLLECTION]``); every later call passes them in and gets them back updated
    (``mutable=[PAGED_KV_COLLECTION]``).

    Each layer writes the keys and values of the call's tokens ``[batch, q_len]`` at ``slots``, then
    attends: with ``prefill`` the tokens are whole sequences from position 0 (right-padded) and
    attend causally among themselves (`mtjax.ops.attention`); otherwise they are the last ``q_len``
    tokens of each sequence and attend to its pages (`mtjax.ops.paged_attention`: decode with
    ``q_len == 1``, chunked prefill with more).

    Attributes:
      block_tables: ``[batch, max_pages_per_seq]`` int32, the page ids of each sequence in order.
      lengths: ``[batch]`` int32, each sequence's tokens in the cache including this call's (0: an
        empty row, whose output is zeros).
      slots: ``[batch, q_len]`` int32 flat cache slot ``page * page_size + offset`` of each token
        (padding tokens write to a scratch page no sequence reads).
      num_pages: pages per layer (static).
      page_size: tokens per page (static).
      dtype: page dtype (static): a float dtype, or ``float8_e4m3fn`` with per-head scales.
      prefill: the tokens are whole sequences starting at position 0 (static).
    """

    block_tables: jax.Array
    lengths: jax.Array
    slots: jax.Array
    num_pages: int = struct.field(pytree_node=False)
    page_size: int = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False, default=jnp.bfloat16)
    prefill: bool = struct.field(pytree_node=False, default=False)

    @property
    def quantized(self) -> bool:
        """The pages are float8 (with per-head scales)."""
        return jnp.dtype(self.dtype) == jnp.dtype(jnp.float8_e4m3fn)


def quantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [..., kv_heads, head_dim]`` to float8_e4m3fn with per-head ``scale [kv_heads]`` (saturating)."""
    scaled = x.astype(jnp.float32) / scale[:, None]
    return jnp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


class DotProductAttention(nn.Module):
    """Softmax attention of already projected heads: ``mtjax.ops.attention`` with dropout and layout handling.

    ``__call__(query, key, value, mask=None, bias=None, *, q_segment_ids=None, kv_segment_ids=None,
    deterministic=False)``: ``query [batch, q_len, heads, head_dim]``, ``key``/``value
    [batch, kv_len, num_gqa_groups, head_dim]``; ``mask [batch|1, heads|1, q_len, kv_len]``, bool
    True = attend or integer 1 = masked out (`keep_mask`); returns ``[batch, q_len, heads, head_dim]``.

    Attributes:
      head_dim: size of each head.
      num_attention_heads: query heads.
      num_gqa_groups: key/value heads (None: ``num_attention_heads``; 1: MQA).
      attention_dropout: dropout on the attention probabilities (skipped when ``deterministic``).
      attn_mask_type: one of `mtjax.ops.MASK_TYPES` (causal is aligned bottom-right).
      attn_bias_type: ``"no_bias"``, ``"pre_scale_bias"`` or ``"post_scale_bias"``; None: post-scale
        when a bias is passed, else none.
      dropout_rng_name: rng collection of the attention dropout.
      float32_logits: run the whole attention (logits, probabilities, weighted sum) in float32.
      scale_factor: logit scale; None: ``1 / sqrt(head_dim)``.
      transpose_batch_sequence: inputs and output are ``[length, batch, heads, head_dim]``.
      window_size: sliding window ``(left, right)``, ``-1`` unbounded; None: no window.
      logits_soft_cap: ``cap * tanh(logits / cap)``; None: off.
      context_parallel: ``"ring"`` or ``"all_gather"`` (`mtjax.ops.CONTEXT_PARALLEL_STRATEGIES`):
        when the mesh in force has a ``cp`` axis of size > 1 and the logical rules split
        ``activation_length`` over it, attend across the sequence shards by ring attention or
        all-gathered keys/values (`mtjax.ops.context_parallel_attention`); self-attention without an
        explicit mask (a bias, given in the sequence's layout, a window and attention dropout
        work). None: plain attention (XLA gathers what a sharded sequence needs).
      context_parallel_load_balanced: with a causal mask under context parallelism, the sequence
        is in the load-balanced layout (`mtjax.sharding.reorder_causal_load_balancing`; `GPT`
        reorders its inputs itself).
      dtype: compute and output dtype.

    Example::

        attend = DotProductAttention(head_dim=64, num_attention_heads=8, context_parallel="ring")
        with mtjax.sharding.use_mesh(mesh, rules):  # MeshConfig(cp=4, ...)
            out = jax.jit(attend.apply)({}, q, k, v)   # q, k, v in the load-balanced layout
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    scale_factor: float | None = None
    transpose_batch_sequence: bool = False
    window_size: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    context_parallel: str | None = None
    context_parallel_load_balanced: bool = True
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None,
                 bias: jax.Array | None = None, *, q_segment_ids: jax.Array | None = None,
                 kv_segment_ids: jax.Array | None = None, deterministic: bool = False) -> jax.Array:
        owner = "DotProductAttention"
        mask = keep_mask(mask, owner)
        groups = check_heads(owner, self.head_dim, self.num_attention_heads, self.num_gqa_groups)
        check_choice(owner, "attn_mask_type", self.attn_mask_type, ops.MASK_TYPES)
        bias_type = self.attn_bias_type or ("no_bias" if bias is None else "post_scale_bias")
        check_choice(owner, "attn_bias_type", bias_type, ATTN_BIAS_TYPES)
        if (bias_type == "no_bias") != (bias is None):
            raise ValueError(f"{owner}: attn_bias_type={bias_type!r} but bias is {'None' if bias is None else 'given'}")
        if self.transpose_batch_sequence:
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        expected_heads = (("query", query, self.num_attention_heads), ("key", key, groups), ("value", value, groups))
        for name, t, heads in expected_heads:
            if t.ndim != 4 or t.shape[-2:] != (heads, self.head_dim):
                raise ValueError(f"{owner}: {name} has shape {t.shape}; expected [batch, length, {heads}, "
                                 f"{self.head_dim}]")
        scale = self.head_dim ** -0.5 if self.scale_factor is None else self.scale_factor
        if bias_type == "pre_scale_bias":
            bias = bias * scale  # ops.attention adds the bias after scaling: scale(qk + b) = scale*qk + scale*b
        dropout_rate = 0.0 if deterministic else self.attention_dropout
        dropout_rng = self.make_rng(self.dropout_rng_name) if dropout_rate > 0.0 else None
        compute_dtype = jnp.float32 if self.float32_logits else self.dtype
        if self.context_parallel is not None:
            check_choice(owner, "context_parallel", self.context_parallel, ops.CONTEXT_PARALLEL_STRATEGIES)
        if self.context_parallel is not None and context_parallel_size() > 1:
            if mask is not None:  # a [q_len, kv_len] mask is what context parallelism avoids materialising
                raise ValueError(f"{owner}: context_parallel={self.context_parallel!r} does not support an explicit "
                                 "mask; express it as segment ids, a window_size, or a bias of -inf")
            out = ops.context_parallel_attention(
                query.astype(compute_dtype), key.astype(compute_dtype), value.astype(compute_dtype),
                strategy=self.context_parallel, q_spec=nn.logical_to_mesh_axes(Q_AXES),
                kv_spec=nn.logical_to_mesh_axes(KV_AXES), mask_type=self.attn_mask_type,
                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
                logits_soft_cap=self.logits_soft_cap, load_balanced=self.context_parallel_load_balanced,
                bias=bias, window_size=self.window_size, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            ).astype(self.dtype)
            return jnp.swapaxes(out, 0, 1) if self.transpose_batch_sequence else out
        out = ops.attention(
            query.astype(compute_dtype), key.astype(compute_dtype), value.astype(compute_dtype),
            bias=bias, mask=mask, mask_type=self.attn_mask_type, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            window_size=self.window_size, logits_soft_cap=self.logits_soft_cap,
        ).astype(self.dtype)
        return jnp.swapaxes(out, 0, 1) if self.transpose_batch_sequence else out


class MultiHeadAttention(nn.Module):
    """Multi-head attention: (normed) input projections, rotary embeddings, `DotProductAttention`, output projection.

    ``__call__(inputs_q, inputs_kv=None, mask=None, bias=None, *, q_segment_ids=None, kv_segment_ids=None,
    q_positions=None, kv_positions=None, decode=False, deterministic=False, residual=None, paged_kv=None)
    -> (output, layernorm_output)``.
    ``inputs_kv=None`` (or ``inputs_kv is inputs_q``) is self-attention: the input norm feeds Q, K and V;
    otherwise (cross-attention) only the query input is normed. Inputs are ``[batch, length, hidden]``;
    the output ``[batch, q_len, hidden]``; ``layernorm_output`` is the normed query input when
    ``return_layernorm_output`` (else None). ``residual=stream`` (keyword): ``inputs_q`` is a sublayer
    output still to be added to the residual stream; the input norm runs on ``inputs_q + stream``
    with the add in its kernel (`mtjax.ops.residual_norm`; needs ``input_layernorm``), and the call
    returns ``(output, layernorm_output, inputs_q + stream)``.

    Parameters: self-attention without GQA and ``fuse_qkv_params``: ``qkv`` (``kernel [hidden, 3, heads,
    head_dim]``); with GQA or cross-attention: ``query`` + ``kv`` (``[hidden, 2, kv_heads, head_dim]``);
    unfused: ``query``, ``key``, ``value``. Then ``out`` (``[heads, head_dim, hidden]``). The input norm's
    ``scale``/``ln_bias`` sit in ``qkv`` or ``query``.

    Decoding (``decode=True``): the ``"cache"`` collection holds ``cached_key``/``cached_value``
    ``[batch, max_length, kv_heads, head_dim]`` and ``cache_index``. Initialise it by running `init`
    with ``decode=True`` on a ``[batch, max_length, hidden]`` input; each later call appends its keys at
    ``cache_index`` and attends causally to everything cached (positions default to the cache index).
    A ``bias`` then spans the whole cache, ``[batch|1, heads|1, q_len, max_length]`` (e.g. T5's relative
    position biases of the step's queries: `RelativePositionBiases` with ``q_offset``). Cross-attention
    with ``decode=True`` keeps the projected ``inputs_kv`` as ``cached_cross_key``/``cached_cross_value``
    (and its queries' position as ``cache_index``): the call that creates the cache projects them,
    later calls read them and ignore ``inputs_kv`` (pass the same encoder output; a ``mask`` of its
    padding still applies).

    Paged decoding (``paged_kv=PagedKV(...)``, causal self-attention): the keys and values of the
    call's tokens go into the pages of the `PAGED_KV_COLLECTION` collection at ``paged_kv.slots``
    (after the rotary embedding), then the queries attend as `PagedKV` describes; ``q_positions``
    are the tokens' positions in their sequences (needed unless ``paged_kv.prefill``). Call with
    ``mutable=[PAGED_KV_COLLECTION]``.

    Attributes:
      head_dim, num_attention_heads, num_gqa_groups, attention_dropout, attn_mask_type, attn_bias_type,
        dropout_rng_name, float32_logits, window_size, logits_soft_cap, context_parallel,
        context_parallel_load_balanced: as `DotProductAttention`.
      input_layernorm: norm the input (fused into the Q/QKV projection).
      layernorm_type, layernorm_epsilon, zero_centered_gamma: that norm.
      return_layernorm_output: also return the normed input.
      enable_rotary_pos_emb: rotate Q and K (`apply_rotary_pos_emb`).
      rotary_pos_emb_windows: ``(min_timescale, max_timescale)``.
      rotary_pos_emb_group_method: ``"consecutive"`` or ``"alternate"``.
      rotary_pos_emb_fraction: the share of each head's coordinates that rotate (`apply_rotary_pos_emb`'s
        ``fraction``; GPT-NeoX's ``rotary_pct``).
      rotary_pos_emb_scaling: a `RopeScaling` of the rotary frequencies (None: none).
      fuse_qkv_params: one QKV (or KV) kernel instead of separate ones.
      use_bias: biases on all projections.
      qkv_bias: biases on the query, key and value projections, also without ``use_bias`` (Qwen2).
      qk_norm: normalize each query and key head over ``head_dim`` before the rotary embedding
        (``layernorm_type`` with ``layernorm_epsilon``; parameters in ``query_norm`` and
        ``key_norm``; Qwen3).
      kernel_init, bias_init: initializers of the projections (kernels: `MHA_KERNEL_INIT`,
        TransformerEngine's ``variance_scaling(1.0, "fan_in", "normal")``).
      scale_attn_logits: scale logits by ``1 / sqrt(head_dim)``. The defaults are TransformerEngine's
        (T5's): unscaled logits, the ``1 / sqrt(head_dim)`` folded into the query kernel's
        initialisation instead (``scaled_query_init``); standard scaled attention (GPT, BERT,
        Llama and their checkpoints) is ``scale_attn_logits=True, scaled_query_init=False``.
      scaled_query_init: divide the query kernel's initial values by ``sqrt(head_dim)``.
      collective_matmul: under sequence parallelism, the Q/K/V projections (column-parallel) and the
        output projection (row-parallel) run with their all-gather / reduce-scatter decomposed into
        ``ppermute`` steps overlapped with partial GEMMs (`DenseGeneral.collective_matmul`); not
        while decoding, not with FP8.
      dtype: compute and output dtype.
      param_dtype: parameter dtype.
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    return_layernorm_output: bool = False
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[float, float] = (1.0, 10000.0)
    rotary_pos_emb_group_method: str = "consecutive"
    rotary_pos_emb_fraction: float = 1.0
    rotary_pos_emb_scaling: RopeScaling | None = None
    fuse_qkv_params: bool = True
    use_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    kernel_init: Initializer = MHA_KERNEL_INIT
    bias_init: Initializer = nn.initializers.zeros
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    context_parallel: str | None = None
    context_parallel_load_balanced: bool = True
    collective_matmul: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def _query_init(self, fused_qkv: bool) -> Initializer:
        if not self.scaled_query_init:
            return self.kernel_init
        depth_scaling = math.sqrt(self.head_dim)

        def init(key, shape, dtype=jnp.float32):
            kernel = self.kernel_init(key, shape, dtype)
            if not fused_qkv:
                return kernel / depth_scaling
            # Called on the flat [hidden, 3 * heads * head_dim] view: the query is the first third.
            q_width = shape[-1] // 3
            return kernel.at[..., :q_width].divide(depth_scaling)

        return init

    @nn.compact
    def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, mask: jax.Array | None = None,
                 bias: jax.Array | None = None, *, q_segment_ids: jax.Array | None = None,
                 kv_segment_ids: jax.Array | None = None, q_positions: jax.Array | None = None,
                 kv_positions: jax.Array | None = None, decode: bool = False,
                 deterministic: bool = False, residual: jax.Array | None = None,
                 paged_kv: PagedKV | None = None) -> tuple[jax.Array, ...]:
        owner = "MultiHeadAttention"
        if residual is not None and not self.input_layernorm:
            raise ValueError(f"{owner}: residual= needs input_layernorm=True (it is added in the input norm's kernel)")
        groups = check_heads(owner, self.head_dim, self.num_attention_heads, self.num_gqa_groups)
        check_choice(owner, "attn_mask_type", self.attn_mask_type, ops.MASK_TYPES)
        check_choice(owner, "rotary_pos_emb_group_method", self.rotary_pos_emb_group_method, ROTARY_GROUP_METHODS)
        if self.enable_rotary_pos_emb and self.head_dim % 2:
            raise ValueError(f"{owner}: head_dim={self.head_dim} must be even with enable_rotary_pos_emb")
        if self.enable_rotary_pos_emb:
            try:
                rotary_dim(self.head_dim, self.rotary_pos_emb_fraction)
            except ValueError as err:
                raise ValueError(f"{owner}: rotary_pos_emb_fraction: {err}") from None
        self_attention = inputs_kv is None or inputs_kv is inputs_q
        kv_mismatch = not self_attention and (inputs_kv.ndim != 3 or inputs_kv.shape[0] != inputs_q.shape[0])
        if inputs_q.ndim != 3 or kv_mismatch:
            raise ValueError(f"{owner}: inputs must be [batch, length, hidden]; got inputs_q {inputs_q.shape}"
                             + ("" if self_attention else f", inputs_kv {inputs_kv.shape}"))
        hidden = inputs_q.shape[-1]
        heads = self.num_attention_heads
        # Cross-attention while decoding projects the encoder output once, into the cache.
        cross_cached = decode and not self_attention and self.has_variable(CACHE_COLLECTION, CROSS_CACHE_NAMES[0])
        dense = dict(use_bias=self.use_bias, bias_init=self.bias_init, dtype=self.dtype, param_dtype=self.param_dtype,
                     collective_matmul=self.collective_matmul and not decode and paged_kv is None)
        qkv_dense = {**dense, "use_bias": self.use_bias or self.qkv_bias}
        norm = dict(enable_layernorm=self.input_layernorm, layernorm_type=self.layernorm_type,
                    epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma)

        # `stream`: [inputs_q + residual] when a residual is given (the projection's norm adds it), else [].
        if self_attention and self.fuse_qkv_params and groups == heads:
            qkv, ln_out, *stream = LayerNormDenseGeneral(
                features=(3, heads, self.head_dim), kernel_init=self._query_init(fused_qkv=True),
                kernel_axes=(axes.EMBED, None, axes.HEADS, axes.HEAD_DIM), bias_axes=(None, axes.HEADS, axes.HEAD_DIM),
                return_layernorm_output=self.return_layernorm_output, name="qkv", **norm, **qkv_dense,
            )(inputs_q, residual)
            # jnp.split, not indexing: its transpose is one concatenate of the three gradients where
            # three indexings transpose to zero pads and adds.
            query, key, value = (t[:, :, 0] for t in jnp.split(qkv, 3, axis=2))
        else:
            query, ln_out, *stream = LayerNormDenseGeneral(
                features=(heads, self.head_dim), kernel_init=self._query_init(fused_qkv=False),
                kernel_axes=(axes.EMBED, axes.HEADS, axes.HEAD_DIM), bias_axes=(axes.HEADS, axes.HEAD_DIM),
                return_layernorm_output=self.return_layernorm_output or self_attention, name="query", **norm,
                **qkv_dense,
            )(inputs_q, residual)
            kv_inputs = ln_out if self_attention else inputs_kv
            if cross_cached:
                key, value = (self.get_variable(CACHE_COLLECTION, name) for name in CROSS_CACHE_NAMES)
                if inputs_kv.shape[:2] != key.shape[:2]:
                    raise ValueError(f"MultiHeadAttention: decoding with the cross-attention keys cached from an "
                                     f"input of [batch, kv_len] = {tuple(key.shape[:2])}; inputs_kv is "
                                     f"{tuple(inputs_kv.shape[:2])} (a new input needs a new cache)")
            elif self.fuse_qkv_params:
                kv = DenseGeneral(
                    features=(2, groups, self.head_dim), kernel_init=self.kernel_init,
                    kernel_axes=(axes.EMBED, None, axes.KV_HEADS, axes.HEAD_DIM),
                    bias_axes=(None, axes.KV_HEADS, axes.HEAD_DIM),
                    name="kv", **qkv_dense,
                )(kv_inputs)
                key, value = (t[:, :, 0] for t in jnp.split(kv, 2, axis=2))
            else:
                key, value = (
                    DenseGeneral(features=(groups, self.head_dim), kernel_init=self.kernel_init,
                                 kernel_axes=(axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM),
                                 bias_axes=(axes.KV_HEADS, axes.HEAD_DIM),
                                 name=name, **qkv_dense)(kv_inputs)
                    for name in ("key", "value")
                )
        if self.qk_norm:
            head_norm = dict(epsilon=self.layernorm_epsilon, layernorm_type=self.layernorm_type,
                             zero_centered_gamma=self.zero_centered_gamma, scale_axes=(axes.HEAD_DIM,),
                             bias_axes=(axes.HEAD_DIM,), dtype=self.dtype, param_dtype=self.param_dtype)
            query = LayerNorm(name="query_norm", **head_norm)(query)
            if not cross_cached:
                key = LayerNorm(name="key_norm", **head_norm)(key)
        query = nn.with_logical_constraint(query, Q_AXES)
        key = nn.with_logical_constraint(key, KV_AXES)
        value = nn.with_logical_constraint(value, KV_AXES)

        mask_type, window_size = self.attn_mask_type, self.window_size
        cache_index = None
        if decode or paged_kv is not None:
            what = "decode=True" if paged_kv is None else "paged_kv"
            if decode and paged_kv is not None:
                raise ValueError(f"{owner}: pass decode=True (the dense cache) or paged_kv, not both")
            if q_segment_ids is not None or (self_attention and mask is not None) or (
                    paged_kv is not None and not self_attention):
                raise ValueError(f"{owner}: {what} supports causal self-attention without mask or segment ids"
                                 + (" and cross-attention without segment ids" if decode else ""))
            if paged_kv is not None and bias is not None:
                raise ValueError(f"{owner}: paged_kv does not support bias (decode=True does, over the whole cache)")
            if paged_kv is not None and self.attn_mask_type not in ("causal", "padding_causal"):
                raise ValueError(f"{owner}: paged_kv needs attn_mask_type 'causal'; got {self.attn_mask_type!r}")
            if (paged_kv is not None and not paged_kv.prefill and self.enable_rotary_pos_emb
                    and q_positions is None):
                raise ValueError(f"{owner}: paged_kv with prefill=False needs q_positions (the tokens' positions)")
        query_offset = None  # where the call's queries start in the decoded sequence
        if decode and self_attention:
            cache_index = self._cache_index(key)
            query_offset = None if cache_index is None else cache_index.value
        elif decode:
            query_offset = self._cross_query_offset(cross_cached, query.shape[1])
        if self.enable_rotary_pos_emb:
            batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
            if q_positions is None:
                offset = 0 if query_offset is None else query_offset
                q_positions = offset + jnp.broadcast_to(jnp.arange(q_len), (batch, q_len))
            if kv_positions is None:
                kv_positions = q_positions if self_attention else jnp.broadcast_to(jnp.arange(kv_len), (batch, kv_len))
            rope = dict(windows=self.rotary_pos_emb_windows, group_method=self.rotary_pos_emb_group_method,
                        fraction=self.rotary_pos_emb_fraction, scaling=self.rotary_pos_emb_scaling)
            query = apply_rotary_pos_emb(query, q_positions, **rope)
            if not cross_cached:
                key = apply_rotary_pos_emb(key, kv_positions, **rope)
        if decode and not self_attention and not cross_cached:
            for name, x in zip(CROSS_CACHE_NAMES, (key, value)):
                self.put_variable(CACHE_COLLECTION, name, x)
        if cache_index is not None:
            key, value, mask = self._update_cache(cache_index, key, value)
            mask_type, window_size = "no_mask", None  # the cache mask holds causality and the window
        if self_attention and kv_segment_ids is None:
            kv_segment_ids = q_segment_ids

        scale = self.head_dim ** -0.5 if self.scale_attn_logits else 1.0
        pages = None if paged_kv is None else self._write_pages(paged_kv, key, value)
        if pages is not None and not paged_kv.prefill:
            k_pages, v_pages, k_scale, v_scale = pages
            compute_dtype = jnp.float32 if self.float32_logits else self.dtype
            out = ops.paged_attention(
                query.astype(compute_dtype), k_pages, v_pages, paged_kv.block_tables, paged_kv.lengths, scale=scale,
                k_scale=k_scale, v_scale=v_scale, logits_soft_cap=self.logits_soft_cap, window_size=window_size,
            ).astype(self.dtype)
        else:  # with prefill pages the new tokens attend among themselves (their keys are all there is)
            out = DotProductAttention(
                head_dim=self.head_dim, num_attention_heads=heads, num_gqa_groups=groups,
                attention_dropout=self.attention_dropout, attn_mask_type=mask_type, attn_bias_type=self.attn_bias_type,
                dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_logits, scale_factor=scale,
                window_size=window_size, logits_soft_cap=self.logits_soft_cap, context_parallel=self.context_parallel,
                context_parallel_load_balanced=self.context_parallel_load_balanced, dtype=self.dtype,
                name="core_attention",
            )(query, key, value, mask, bias, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
              deterministic=deterministic)
        out = nn.with_logical_constraint(out, Q_AXES)
        out = DenseGeneral(
            features=hidden, axis=(-2, -1), kernel_init=self.kernel_init,
            kernel_axes=(axes.HEADS, axes.HEAD_DIM, axes.EMBED),
            bias_axes=(axes.EMBED,), name="out", **dense,
        )(out)
        out = nn.with_logical_constraint(out, axes.BATCH_LENGTH_EMBED)
        return (out, ln_out if self.return_layernorm_output else None, *stream)

    def _write_pages(self, paged: PagedKV, key: jax.Array, value: jax.Array):
        """Writes ``key``/``value [batch, q_len, kv_heads, head_dim]`` at ``paged.slots``; returns the
        updated ``(k_pages, v_pages, k_scale, v_scale)`` (scales None unless the pages are float8)."""
        batch, q_len, groups, head_dim = key.shape
        if paged.slots.shape != (batch, q_len):
            raise ValueError(f"MultiHeadAttention: paged_kv.slots has shape {paged.slots.shape}; expected "
                             f"[batch, q_len] = {(batch, q_len)}")
        shape = (groups, paged.num_pages, paged.page_size, head_dim)
        pages = [self.variable(PAGED_KV_COLLECTION, name, jnp.zeros, shape, paged.dtype)
                 for name in ("k_pages", "v_pages")]
        for page in pages:
            if page.value.shape != shape or page.value.dtype != jnp.dtype(paged.dtype):
                raise ValueError(f"MultiHeadAttention: {page.name} is {page.value.dtype} {page.value.shape}; paged_kv "
                                 f"describes {jnp.dtype(paged.dtype)} {shape} "
                                 f"(kv_heads, num_pages, page_size, head_dim)")
        new = [key, value]
        scales = [None, None]
        if paged.quantized:
            scale_vars = [self.variable(PAGED_KV_COLLECTION, name, jnp.ones, (groups,), jnp.float32)
                          for name in ("k_scale", "v_scale")]
            scales = [v.value for v in scale_vars]
            new = [quantize_kv(x, sc) for x, sc in zip(new, scales)]
        slots = paged.slots.reshape(-1)
        for page, x in zip(pages, new):
            flat = page.value.reshape(groups, -1, head_dim)
            rows = jnp.swapaxes(x.reshape(batch * q_len, groups, head_dim), 0, 1).astype(flat.dtype)
            page.value = flat.at[:, slots].set(rows).reshape(shape)
        return pages[0].value, pages[1].value, *scales

    def _cache_index(self, key: jax.Array) -> nn.Variable | None:
        """The cache position variable, or None while `init` creates the cache (a plain causal pass)."""
        initialized = self.has_variable(CACHE_COLLECTION, "cached_key")
        self.variable(CACHE_COLLECTION, "cached_key", jnp.zeros, key.shape, key.dtype)
        self.variable(CACHE_COLLECTION, "cached_value", jnp.zeros, key.shape, key.dtype)
        index = self.variable(CACHE_COLLECTION, "cache_index", lambda: jnp.zeros((), jnp.int32))
        return index if initialized else None

    def _cross_query_offset(self, cached: bool, q_len: int) -> jax.Array | None:
        """The decoded position of a cross-attention call's first query (its ``cache_index``, advanced by
        ``q_len``), or None while the cache is being created."""
        index = self.variable(CACHE_COLLECTION, "cache_index", lambda: jnp.zeros((), jnp.int32))
        if not cached:
            return None
        start = index.value
        index.value = start + q_len
        return start

    def _update_cache(self, index: nn.Variable, key: jax.Array, value: jax.Array):
        """Writes ``key``/``value`` at the cache index; returns the whole cache and the keep-mask
        ``[1, 1, step, max_length]`` (causal, and the left edge of ``window_size``)."""
        cached_key = self.get_variable(CACHE_COLLECTION, "cached_key")
        cached_value = self.get_variable(CACHE_COLLECTION, "cached_value")
        step, max_length = key.shape[1], cached_key.shape[1]
        if step > max_length:
            raise ValueError(f"MultiHeadAttention: {step} tokens in one decode call; the cache holds {max_length}")
        start = index.value
        cached_key = lax.dynamic_update_slice(cached_key, key.astype(cached_key.dtype), (0, start, 0, 0))
        cached_value = lax.dynamic_update_slice(cached_value, value.astype(cached_value.dtype), (0, start, 0, 0))
        self.put_variable(CACHE_COLLECTION, "cached_key", cached_key)
        self.put_variable(CACHE_COLLECTION, "cached_value", cached_value)
        index.value = start + step
        # Query i sits at position start + i and sees the cached keys up to it (within the window).
        q_pos, k_pos = start + jnp.arange(step)[:, None], jnp.arange(max_length)[None, :]
        keep = k_pos <= q_pos
        if self.window_size is not None and self.window_size[0] >= 0:
            keep &= k_pos >= q_pos - self.window_size[0]
        return cached_key, cached_value, keep[None, None]


class RelativePositionBiases(nn.Module):
    """T5 relative position biases: a learned scalar per head and log-spaced distance bucket.

    ``__call__(q_seqlen, k_seqlen, bidirectional=True, *, q_offset=0)`` returns ``[1, heads, q_seqlen,
    k_seqlen]``, to pass as the post-scale ``bias`` of attention: query ``i`` sits at position
    ``q_offset + i`` (an int or a traced int32 scalar: a decoding step's place in its cache), key ``j``
    at ``j``.

    Attributes:
      num_buckets: buckets (half per direction when bidirectional); the first half of each direction's
        buckets are exact distances, the rest log-spaced up to ``max_distance``.
      max_distance: distances at or beyond it share the last bucket.
      num_attention_heads: heads.
      embedding_init: initializer of ``rel_embedding [heads, num_buckets]`` (flax's
        ``default_embed_init``, as TransformerEngine's; a `TransformerLayer` passes
        `RELPOS_EMBEDDING_INIT`).
      embedding_axes: its logical axes.
      dtype: output dtype.
      param_dtype: parameter dtype.
    """

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Initializer = nn.linear.default_embed_init
    embedding_axes: AxisNames = (axes.HEADS, axes.RELPOS_BUCKETS)
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def _bucket(self, relative_position: jax.Array, bidirectional: bool) -> jax.Array:
        num_buckets = self.num_buckets
        distance = -relative_position  # > 0: the key is before the query
        bucket = jnp.zeros_like(distance)
        if bidirectional:
            num_buckets //= 2
            bucket = jnp.where(distance < 0, num_buckets, 0)
            distance = jnp.abs(distance)
        else:
            distance = jnp.maximum(distance, 0)
        exact = num_buckets // 2
        log_ratio = jnp.log(jnp.maximum(distance, 1) / exact) / math.log(self.max_distance / exact)
        far = exact + (log_ratio * (num_buckets - exact)).astype(jnp.int32)
        far = jnp.minimum(far, num_buckets - 1)
        return bucket + jnp.where(distance < exact, distance, far)

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True, *,
                 q_offset: int | jax.Array = 0) -> jax.Array:
        if self.num_buckets < 4 or self.max_distance <= self.num_buckets // 2:
            raise ValueError(f"RelativePositionBiases: num_buckets={self.num_buckets} must be >= 4 and "
                             f"max_distance={self.max_distance} > num_buckets // 2")
        table = param_with_axes(self, "rel_embedding", self.embedding_init,
                                (self.num_attention_heads, self.num_buckets), self.param_dtype, self.embedding_axes)
        # The bias depends on the distance j - i only. One value per distance (d = j - i + q_seqlen - 1
        # in [0, q_seqlen + k_seqlen - 1)) comes from a one-hot product with the table, and the
        # [q, k] matrix is laid out from those diagonals by reshapes and slices. Their gradients are
        # a GEMM and a sum over diagonals; a gather from the table would train through a scatter-add
        # of q * k values into a few buckets, which serializes on GPUs.
        width = q_seqlen + k_seqlen - 1
        relative = jnp.arange(width) - (q_seqlen - 1) - q_offset
        one_hot = jax.nn.one_hot(self._bucket(relative, bidirectional), self.num_buckets, dtype=table.dtype)
        per_distance = (table @ one_hot.T).astype(self.dtype)  # [heads, width]
        return diagonals_to_matrix(per_distance, q_seqlen, k_seqlen)[None]


def diagonals_to_matrix(per_distance: jax.Array, q_seqlen: int, k_seqlen: int) -> jax.Array:
    """``out[..., i, j] = per_distance[..., j - i + q_seqlen - 1]`` (a Toeplitz matrix) by reshapes.

    Row ``i`` of ``[..., q, width]`` copies of ``per_distance`` read from flat offset ``i * (width -
    1) + q - 1`` holds the diagonals in order, so slicing the flattened copies with row stride
    ``width - 1`` gives the matrix; the gradient is a sum of the same layout, with no scatter.
    """
    width = q_seqlen + k_seqlen - 1
    if per_distance.shape[-1] != width:
        raise ValueError(f"diagonals_to_matrix: per_distance has {per_distance.shape[-1]} values, "
                         f"needs q_seqlen + k_seqlen - 1 = {width}")
    if q_seqlen == 1:
        return per_distance[..., None, :]
    lead = per_distance.shape[:-1]
    tiled = jnp.broadcast_to(per_distance[..., None, :], (*lead, q_seqlen, width)).reshape(*lead, q_seqlen * width)
    rows = tiled[..., q_seqlen - 1:q_seqlen - 1 + q_seqlen * (width - 1)].reshape(*lead, q_seqlen, width - 1)
    return rows[..., :k_seqlen]
