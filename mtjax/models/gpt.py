"""GPT/Llama-style decoder-only language model built from `mtjax.flax` modules.

`GPTConfig` describes the model (presets via `gpt_config`), `GPT` is the linen module:
``GPT(config)(tokens [batch, seq] int32, *, positions=None, segment_ids=None, deterministic=True,
decode=False, paged_kv=None, logits_index=None) -> logits [batch, seq, vocab]`` in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import axes, ops
from mtjax.flax import DenseGeneral, Embed, LayerNorm, MoEBlock, RopeScaling, TransformerLayerType
from mtjax.flax.attention import CACHE_COLLECTION, ROTARY_GROUP_METHODS, PagedKV, check_heads, rotary_dim
from mtjax.flax.normalization import LAYERNORM_TYPES
from mtjax.flax.params import check_float_dtype
from mtjax.models._stack import apply_layers, check_stack_config
from mtjax.ops import CONTEXT_PARALLEL_STRATEGIES
from mtjax.sharding.context import (
    context_parallel_size,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)

POSITION_EMBEDDINGS = ("rope", "learned", "none")
LOGITS_AXES = (axes.ACTIVATION_BATCH, axes.ACTIVATION_LENGTH, axes.ACTIVATION_VOCAB)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Size and options of a `GPT`.

    Attributes:
      vocab_size: tokens.
      hidden_size: model width.
      num_layers: Transformer blocks.
      num_heads: query heads.
      num_kv_heads: key/value heads (None: ``num_heads``; fewer: GQA; 1: MQA).
      head_dim: None: ``hidden_size // num_heads``.
      mlp_dim: MLP hidden width.
      max_seq_len: longest sequence (size of the learned position table; longest decode cache).
      activations: MLP activation, TransformerEngine-style (``("gelu",)``, ``("silu", "linear")`` = SwiGLU).
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      layernorm_epsilon: epsilon of every norm.
      zero_centered_gamma: norms store ``gamma - 1``.
      position_embedding: ``"rope"``, ``"learned"`` or ``"none"``.
      rope_max_timescale: RoPE base (theta).
      rope_group_method: ``"alternate"`` (half-split, Llama/NeoX) or ``"consecutive"`` (interleaved, GPT-J).
      rope_fraction: the share of each head's coordinates that rotate (GPT-NeoX's ``rotary_pct``; 1: all).
      rope_scaling: a `mtjax.flax.RopeScaling` of the rotary frequencies (Llama 3.1's ``"llama3"``,
        ``"linear"``); None: none.
      scale_embeddings: multiply the token embeddings by ``sqrt(hidden_size)`` (Gemma).
      parallel_residual: attention and MLP side by side on each block's input, each behind its own
        norm (GPT-NeoX; `mtjax.flax.TransformerLayer.parallel_attention_mlp`).
      qkv_bias: biases on the query, key and value projections only (Qwen2); ``use_bias`` puts them
        on every projection.
      qk_norm: per-head norms of the queries and keys (Qwen3; `mtjax.flax.MultiHeadAttention.qk_norm`).
      tie_embeddings: the output layer is the transposed token embedding.
      use_bias: biases in the projections.
      fuse_qkv_params: one Q/K/V kernel (one GEMM) instead of three (three GEMMs, no split of their
        output and no concatenate of its gradient).
      fuse_residual_norm: add each attention output to the residual stream in the MLP's norm kernel
        (`mtjax.flax.TransformerLayer.fuse_residual_norm`).
      fuse_residual_across_layers: add each MLP output to the stream in the next layer's attention
        norm kernel (and the last one in the final norm's): the layers pass ``(branch, stream)``
        (`mtjax.flax.TransformerLayer.defer_residual_add`); with remat each layer
        saves both as its input (one more activation per layer). Off by default: its gain on the
        train benchmark is within noise (docs/performance.md).
      dropout_rate: embedding, hidden and MLP-intermediate dropout.
      attention_dropout: attention-probability dropout.
      window_size: sliding-window attention ``(left, right)``; None: full causal.
      logits_soft_cap: attention logit soft cap.
      context_parallel: ``"ring"`` or ``"all_gather"``: under a mesh with a ``cp`` axis of size > 1
        (`mtjax.sharding.MeshConfig(cp=...)`) the sequence of every activation is split over it and
        attention runs across the shards (`mtjax.ops.context_parallel_attention`); the model
        permutes tokens, positions and segment ids into the causal load-balanced layout and its
        final hidden states back, so inputs and logits stay in natural order. None: off.
      cross_attention: every layer also attends to ``encoded`` (`GPT`'s argument: a vision-language
        model's image tokens), a `mtjax.flax.TransformerLayer` of type DECODER.
      collective_matmul: with sequence parallelism (``MeshConfig(tp=..., sp=True)``), the
        all-gathers before the QKV projections and fc1 and the reduce-scatters after the output
        projections and fc2 run as ``ppermute`` steps overlapped with partial GEMMs
        (`mtjax.flax.TransformerLayer.collective_matmul`; not with FP8).
      init_std: standard deviation of the normal initializer of kernels and embeddings.
      scan_layers: ``nn.scan`` over the layers (one compiled layer; parameters stacked on ``"layers"``).
      remat_policy: one of `mtjax.models.REMAT_POLICIES` (``"none"``, ``"full"``, ``"dots"``, ...).
      dtype: compute dtype.
      param_dtype: parameter dtype.

    Mixture of experts (``num_experts > 0``): the layers after the first ``first_k_dense`` use a
    `mtjax.flax.MoEBlock` MLP instead of the dense one (a scanned stack scans the dense and the MoE
    layers as two stacks, ``layers`` and ``moe_layers``).

    Attributes:
      num_experts: routed experts per MoE layer (0: a dense model).
      experts_per_token: experts each token goes to (top-k).
      moe_mlp_dim: hidden width of one routed expert (None: ``mlp_dim``).
      num_shared_experts: shared experts every token passes through (DeepSeek).
      shared_expert_dim: width of one shared expert (None: ``moe_mlp_dim``).
      first_k_dense: leading layers that keep the dense MLP (``mlp_dim`` wide).
      router_score_function: ``"softmax"`` or ``"sigmoid"``.
      num_expert_groups, expert_group_top_k: group-limited routing (None: plain top-k).
      normalize_router_weights: renormalize each token's top-k weights to sum to 1.
      routed_scaling_factor: multiplies the top-k weights.
      use_expert_bias: auxiliary-loss-free balancing with a per-expert routing bias, moved after
        each step by ``expert_bias_update_rate`` towards equal loads (`mtjax.train.make_train_step`).
      expert_bias_update_rate: that step size (DeepSeek-V3's gamma).
      load_balancing_loss_weight: coefficient of the load-balancing loss added to the training loss.
      router_z_loss_weight: coefficient of the router z-loss.
      capacity_factor: None: dropless; else each expert takes at most ``capacity_factor`` times its
        even share of a device's tokens (`mtjax.flax.MoEBlock.capacity_factor`).
      expert_row_alignment: each expert's rows padded to a multiple of this
        (`mtjax.flax.MoEBlock.expert_row_alignment`; 16 for FP8 grouped GEMMs on cuBLASLt).
      moe_dispatch_dtype: None, or the FP8 dtype the expert-parallel dispatch sends tokens in
        (`mtjax.flax.MoEBlock.dispatch_dtype`).
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_dim: int = 256
    max_seq_len: int = 128
    activations: tuple[str, ...] = ("gelu",)
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-5
    zero_centered_gamma: bool = False
    position_embedding: str = "rope"
    rope_max_timescale: float = 10000.0
    rope_group_method: str = "alternate"
    rope_fraction: float = 1.0
    rope_scaling: RopeScaling | None = None
    scale_embeddings: bool = False
    parallel_residual: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = True
    use_bias: bool = False
    fuse_qkv_params: bool = True
    fuse_residual_norm: bool = True
    fuse_residual_across_layers: bool = False
    dropout_rate: float = 0.0
    attention_dropout: float = 0.0
    window_size: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    context_parallel: str | None = None
    cross_attention: bool = False
    collective_matmul: bool = False
    init_std: float = 0.02
    scan_layers: bool = True
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    num_experts: int = 0
    experts_per_token: int = 2
    moe_mlp_dim: int | None = None
    num_shared_experts: int = 0
    shared_expert_dim: int | None = None
    first_k_dense: int = 0
    router_score_function: str = "softmax"
    num_expert_groups: int | None = None
    expert_group_top_k: int | None = None
    normalize_router_weights: bool = True
    routed_scaling_factor: float = 1.0
    use_expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    load_balancing_loss_weight: float = 0.01
    router_z_loss_weight: float = 0.0
    capacity_factor: float | None = None
    expert_row_alignment: int = 1
    moe_dispatch_dtype: Any = None

    def __post_init__(self):
        owner = type(self).__name__
        check_stack_config(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "mlp_dim", "max_seq_len"))
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"{owner}: num_experts={self.num_experts!r}; expected an int >= 0 (0: dense)")
        if not isinstance(self.first_k_dense, int) or not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"{owner}: first_k_dense={self.first_k_dense!r}; expected 0 <= it <= "
                             f"num_layers={self.num_layers}")
        if self.num_experts:
            if self.first_k_dense == self.num_layers:
                raise ValueError(f"{owner}: first_k_dense={self.first_k_dense} leaves no MoE layer of "
                                 f"num_layers={self.num_layers}")
            if not self.expert_bias_update_rate >= 0:
                raise ValueError(f"{owner}: expert_bias_update_rate={self.expert_bias_update_rate!r}; expected >= 0")
            MoEBlock(**self.moe_block_kwargs())._validate()  # the MoE fields, with MoEBlock's messages
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"{owner}: hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads} "
                             f"(or set head_dim)")
        check_heads(owner, self.resolved_head_dim, self.num_heads, self.num_kv_heads)
        check_float_dtype(owner, "dtype", self.dtype)
        check_float_dtype(owner, "param_dtype", self.param_dtype)
        for name, accepted in (("layernorm_type", LAYERNORM_TYPES), ("position_embedding", POSITION_EMBEDDINGS),
                               ("rope_group_method", ROTARY_GROUP_METHODS)):
            if getattr(self, name) not in accepted:
                raise ValueError(f"{owner}: {name}={getattr(self, name)!r} is not supported; accepted: "
                                 f"{', '.join(accepted)}")
        if self.position_embedding == "rope":
            try:
                rotary_dim(self.resolved_head_dim, self.rope_fraction)
            except ValueError as err:
                raise ValueError(f"{owner}: rope_fraction: {err}") from None
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"{owner}: rope_scaling={self.rope_scaling!r}; expected None or a "
                             "mtjax.flax.RopeScaling")
        if self.context_parallel is not None and self.context_parallel not in CONTEXT_PARALLEL_STRATEGIES:
            raise ValueError(f"{owner}: context_parallel={self.context_parallel!r} is not supported; accepted: None, "
                             f"{', '.join(CONTEXT_PARALLEL_STRATEGIES)}")

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-serialisable values (dtypes by name, tuples as lists, `rope_scaling` as a
        dict): what a checkpoint stores; `from_dict` rebuilds the same config."""
        fields = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("dtype", "param_dtype", "moe_dispatch_dtype") and value is not None:
                value = jnp.dtype(value).name
            elif isinstance(value, RopeScaling):
                value = dataclasses.asdict(value)
            elif isinstance(value, tuple):
                value = list(value)
            fields[field.name] = value
        return fields

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> GPTConfig:
        """The config `to_dict` described (fields left out take their defaults).

        Raises:
          ValueError: a name that is not a field, or a field the config refuses."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{cls.__name__}.from_dict: unknown fields {unknown}")
        fields = dict(fields)
        for name in ("dtype", "param_dtype", "moe_dispatch_dtype"):
            if isinstance(fields.get(name), str):
                fields[name] = getattr(jnp, jnp.dtype(fields[name]).name)
        if isinstance(fields.get("rope_scaling"), dict):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        for name in ("activations", "window_size"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        return cls(**fields)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def resolved_num_kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.num_experts else 0

    def moe_block_kwargs(self) -> dict[str, Any]:
        """The `mtjax.flax.MoEBlock` fields these settings give (its norm and dtypes come from the layer)."""
        expert_dim = self.moe_mlp_dim or self.mlp_dim
        return dict(num_experts=self.num_experts, experts_per_token=self.experts_per_token, expert_dim=expert_dim,
                    num_shared_experts=self.num_shared_experts, shared_expert_dim=self.shared_expert_dim,
                    score_function=self.router_score_function, num_expert_groups=self.num_expert_groups,
                    expert_group_top_k=self.expert_group_top_k, normalize_weights=self.normalize_router_weights,
                    routed_scaling_factor=self.routed_scaling_factor, use_expert_bias=self.use_expert_bias,
                    load_balancing_loss_weight=self.load_balancing_loss_weight,
                    router_z_loss_weight=self.router_z_loss_weight, capacity_factor=self.capacity_factor,
                    expert_row_alignment=self.expert_row_alignment, dispatch_dtype=self.moe_dispatch_dtype)

    def _moe_mlp_params(self, experts: int) -> int:
        """Parameters of one MoE layer's MLP counting ``experts`` routed experts (router and shared included)."""
        h, gates = self.hidden_size, 2 if ops.is_gated(self.activations) else 1
        expert_dim = self.moe_mlp_dim or self.mlp_dim
        shared_dim = self.num_shared_experts * (self.shared_expert_dim or expert_dim)
        bias = self.num_experts if self.use_expert_bias else 0
        return (h * self.num_experts + bias + experts * (h * gates * expert_dim + expert_dim * h)
                + h * gates * shared_dim + shared_dim * h)

    def num_params(self) -> int:
        """Number of parameters (what `GPT.init` creates)."""
        return self._count_params(self.num_experts)

    def num_active_params(self) -> int:
        """Parameters one token passes through: `num_params` with ``experts_per_token`` of the routed
        experts of each MoE layer (equal to `num_params` for a dense model)."""
        return self._count_params(self.experts_per_token if self.num_experts else 0)

    def _count_params(self, routed_experts: int) -> int:
        h, d = self.hidden_size, self.resolved_head_dim
        q, kv = self.num_heads * d, self.resolved_num_kv_heads * d
        norm = h if self.layernorm_type == "rmsnorm" else 2 * h
        gates = 2 if ops.is_gated(self.activations) else 1
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv + h if self.use_bias else 0)
        attention += q + 2 * kv if self.qkv_bias and not self.use_bias else 0
        attention += 2 * (d if self.layernorm_type == "rmsnorm" else 2 * d) if self.qk_norm else 0
        if self.cross_attention:  # a second attention and its norm in every layer
            attention, norm_count = 2 * attention, 3
        else:
            norm_count = 2
        mlp = h * gates * self.mlp_dim + self.mlp_dim * h + (gates * self.mlp_dim + h if self.use_bias else 0)
        layers = (self.num_layers - self.num_moe_layers) * (attention + mlp + norm_count * norm)
        layers += self.num_moe_layers * (attention + self._moe_mlp_params(routed_experts) + norm_count * norm)
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        positions = self.max_seq_len * h if self.position_embedding == "learned" else 0
        return layers + embeddings + positions + norm

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): ``6 * N`` for the weight GEMMs plus causal
        attention ``6 * layers * seq_len * heads * head_dim`` (half of the full ``12 * ...``).

        ``N`` counts the parameters that take part in a token's GEMMs: the active ones
        (`num_active_params`: ``experts_per_token`` routed experts per MoE layer) but the lookup-only
        tables (the position table, and the input embedding when it is not tied to the output layer)."""
        lookup_only = (self.max_seq_len * self.hidden_size if self.position_embedding == "learned" else 0) + (
            0 if self.tie_embeddings else self.vocab_size * self.hidden_size)
        attention = 6 * self.num_layers * seq_len * self.num_heads * self.resolved_head_dim
        return 6.0 * (self.num_active_params() - lookup_only) + attention * (1 + self.cross_attention)


_PRESETS: dict[str, dict[str, Any]] = {
    # For CPU tests and `mtjax train`: every Llama feature (RMSNorm, SwiGLU, RoPE, GQA) at toy size; the
    # vocabulary holds the byte tokenizer's 257 ids, padded to a multiple of 128 (splits over tp).
    "tiny": dict(vocab_size=384, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128,
                 max_seq_len=128, activations=("silu", "linear"), layernorm_type="rmsnorm"),
    "gpt-125m": dict(vocab_size=32768, hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072,
                     max_seq_len=2048, dtype=jnp.bfloat16),
    # The shape of the stock-Flax peer (`mtjax.bench.peers`): LayerNorm + GELU, tied embedding, 1.275B parameters.
    # The 1B-class presets unroll their layers: a scanned stack stores each layer's residuals into
    # (and reads them back from) [layers, ...] buffers, copies an unrolled stack does not make; the
    # unrolled step is faster and uses less memory, at a longer compile
    # (`mtjax bench train --variant scan_layers=true` compares).
    "gpt-1.3b": dict(vocab_size=32768, hidden_size=2048, num_layers=24, num_heads=16, mlp_dim=8192,
                     max_seq_len=2048, dtype=jnp.bfloat16, scan_layers=False),
    # Llama-3.2-1B's shape (RMSNorm, SwiGLU, RoPE theta 500k, GQA 32/8, tied) with a 32768 vocabulary.
    "llama-1b": dict(vocab_size=32768, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, mlp_dim=8192,
                     max_seq_len=8192, activations=("silu", "linear"), layernorm_type="rmsnorm",
                     rope_max_timescale=500000.0, dtype=jnp.bfloat16, scan_layers=False),
    # Mixture of experts. For CPU tests and `mtjax train --preset moe-tiny`: 8 routed experts (top-2),
    # one shared expert, the first layer dense.
    "moe-tiny": dict(vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=128,
                     max_seq_len=128, activations=("silu", "linear"), layernorm_type="rmsnorm",
                     num_experts=8, experts_per_token=2, moe_mlp_dim=64, num_shared_experts=1, first_k_dense=1),
    # Mixtral-style: every layer 8 SwiGLU experts, top-2, softmax router with the load-balancing loss;
    # 3.4B parameters, 1.0B active per token.
    "moe-mixtral-1b": dict(vocab_size=32768, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4,
                           mlp_dim=4096, max_seq_len=4096, activations=("silu", "linear"), layernorm_type="rmsnorm",
                           rope_max_timescale=1000000.0, dtype=jnp.bfloat16, num_experts=8, experts_per_token=2,
                           router_z_loss_weight=1e-3),
    # DeepSeek-V3-style (DeepSeek-V2-Lite's MoE shape, standard attention): 64 fine-grained experts
    # (1408 wide), top-6, 2 shared experts, the first layer dense; sigmoid scores, group-limited routing
    # (8 groups, best 4) and auxiliary-loss-free balancing (expert bias) with a small balancing loss.
    # 4.2B parameters, 0.8B active; 8 layers, so one H200 holds the f32 Adam state.
    "moe-deepseek-1b": dict(vocab_size=32768, hidden_size=2048, num_layers=8, num_heads=16, mlp_dim=10944,
                            max_seq_len=4096, activations=("silu", "linear"), layernorm_type="rmsnorm",
                            dtype=jnp.bfloat16, num_experts=64, experts_per_token=6, moe_mlp_dim=1408,
                            num_shared_experts=2, first_k_dense=1, router_score_function="sigmoid",
                            num_expert_groups=8, expert_group_top_k=4, use_expert_bias=True,
                            load_balancing_loss_weight=1e-4),
}
PRESETS = tuple(_PRESETS)


def gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """A preset (`PRESETS`: ``"tiny"``, ``"gpt-125m"``, ``"gpt-1.3b"``, ``"llama-1b"``, and the mixtures of
    experts ``"moe-tiny"``, ``"moe-mixtral-1b"``, ``"moe-deepseek-1b"``) with fields overridden."""
    if name not in _PRESETS:
        raise ValueError(f"gpt_config: name={name!r} is not a preset; accepted: {', '.join(PRESETS)}")
    return GPTConfig(**{**_PRESETS[name], **overrides})


class GPT(nn.Module):
    """Decoder-only language model: token (+ learned position) embedding, ``num_layers`` pre-LN causal
    `TransformerLayer`s, final norm, output layer (tied to the embedding by default).

    ``__call__(tokens, *, positions=None, segment_ids=None, deterministic=True, decode=False)``:
    ``tokens [batch, seq]`` int; ``positions [batch, seq]`` (default ``0..seq-1``; with packing, restart
    them per segment); ``segment_ids [batch, seq]`` (0 = padding) keep attention within a segment;
    ``deterministic=False`` enables dropout (rng collection ``"dropout"``). Returns float32 logits
    ``[batch, seq, vocab_size]``.

    ``decode=True`` uses the ``"cache"`` collection: create it with ``init(..., decode=True)`` on tokens
    ``[batch, max_length]``, then call with ``mutable=["cache"]`` on one (or a few) tokens at a time.

    ``prefix [batch, prefix_len, hidden_size]``: embeddings placed before the tokens' (a
    vision-language model's image tokens), at positions ``0..prefix_len-1``; the logits are the
    tokens' only. With ``decode=True`` the first call (the prompt) carries the prefix and later
    steps none. ``encoded [batch, kv_len, hidden_size]`` (needs ``config.cross_attention``): what
    every layer cross-attends to.

    ``paged_kv=PagedKV(...)`` runs on a paged key/value cache instead (the `PAGED_KV_COLLECTION`
    collection, ``mutable=[PAGED_KV_COLLECTION]``; `mtjax.inference` builds and drives it):
    ``positions`` are then the tokens' positions in their sequences (needed unless
    ``paged_kv.prefill``). ``logits_index [batch]`` returns the logits of that one position of each
    row only, ``[batch, 1, vocab_size]`` (the last prompt token of a padded prefill).

    Attributes:
      config: a `GPTConfig`.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 deterministic: bool = True, decode: bool = False, paged_kv: PagedKV | None = None,
                 logits_index: jax.Array | None = None, prefix: jax.Array | None = None,
                 encoded: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"GPT: tokens must be int [batch, seq]; got {tokens.dtype} {tokens.shape}")
        self._check_prefix_and_encoded(tokens, prefix, encoded, segment_ids, positions, paged_kv, logits_index)
        batch, num_tokens = tokens.shape
        seq = num_tokens if prefix is None else num_tokens + prefix.shape[1]
        if logits_index is not None and logits_index.shape != (batch,):
            raise ValueError(f"GPT: logits_index has shape {logits_index.shape}; expected [batch] = ({batch},)")
        if paged_kv is not None and not paged_kv.prefill and positions is None:
            raise ValueError("GPT: paged_kv with prefill=False needs positions (each token's position in its sequence)")
        if cfg.position_embedding == "learned" and seq > cfg.max_seq_len:
            raise ValueError(f"GPT: tokens has {seq} positions, more than max_seq_len={cfg.max_seq_len} of the "
                             "learned position table; use at most max_seq_len tokens or a larger max_seq_len")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
            if decode:
                positions = positions + self._decode_offset(seq)
        cp = context_parallel_size() if cfg.context_parallel is not None else 1
        if cp > 1:
            if decode:
                raise ValueError("GPT: decode=True does not support context_parallel")
            tokens, positions = (reorder_causal_load_balancing(t, cp) for t in (tokens, positions))
            if segment_ids is not None:
                segment_ids = reorder_causal_load_balancing(segment_ids, cp)
        init = nn.initializers.normal(cfg.init_std)
        embed = Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=init, dtype=cfg.dtype,
                      param_dtype=cfg.param_dtype, name="token_embed")
        x = embed(tokens)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
        if prefix is not None:
            x = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
        if cfg.position_embedding == "learned":
            x = x + Embed(cfg.max_seq_len, cfg.hidden_size, embedding_init=init, embedding_axes=(None, axes.EMBED),
                          dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="position_embed")(positions)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
        layer = dict(
            hidden_size=cfg.hidden_size, mlp_hidden_size=cfg.mlp_dim, num_attention_heads=cfg.num_heads,
            num_gqa_groups=cfg.num_kv_heads, head_dim=cfg.resolved_head_dim, layernorm_type=cfg.layernorm_type,
            layernorm_epsilon=cfg.layernorm_epsilon, zero_centered_gamma=cfg.zero_centered_gamma,
            hidden_dropout=cfg.dropout_rate, attention_dropout=cfg.attention_dropout,
            intermediate_dropout=cfg.dropout_rate, mha_kernel_init=init, mlp_kernel_init=init,
            mlp_activations=cfg.activations, use_bias=cfg.use_bias, fuse_qkv_params=cfg.fuse_qkv_params,
            fuse_residual_norm=cfg.fuse_residual_norm, defer_residual_add=cfg.fuse_residual_across_layers,
            # Standard scaled attention, no relative biases (TransformerLayer's defaults are T5's).
            enable_relative_embedding=False, scale_attn_logits=True, scaled_query_init=False,
            layer_type=TransformerLayerType.DECODER if cfg.cross_attention else TransformerLayerType.ENCODER,
            self_attn_mask_type="causal", enable_rotary_pos_emb=cfg.position_embedding == "rope",
            rotary_pos_emb_windows=(1.0, cfg.rope_max_timescale), rotary_pos_emb_group_method=cfg.rope_group_method,
            rotary_pos_emb_fraction=cfg.rope_fraction, rotary_pos_emb_scaling=cfg.rope_scaling,
            qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, parallel_attention_mlp=cfg.parallel_residual,
            window_size=cfg.window_size, logits_soft_cap=cfg.logits_soft_cap, context_parallel=cfg.context_parallel,
            collective_matmul=cfg.collective_matmul, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        )
        stack = dict(scan_layers=cfg.scan_layers, remat_policy=cfg.remat_policy, segment_ids=segment_ids,
                     positions=positions, deterministic=deterministic, decode=decode, paged_kv=paged_kv,
                     encoded=encoded)
        num_dense = cfg.num_layers - cfg.num_moe_layers
        if num_dense:
            x = apply_layers(x, layer=layer, num_layers=num_dense, **stack)
        if cfg.num_moe_layers:
            x = apply_layers(x, layer=layer, num_layers=cfg.num_moe_layers, moe=cfg.moe_block_kwargs(),
                             name="moe_layers", first_index=num_dense, **stack)
        if prefix is not None:  # the logits are the tokens': the final norm and output layer skip the prefix
            x = jax.tree.map(lambda t: t[:, prefix.shape[1]:], x)
        if logits_index is not None:  # one position per row: the final norm and output layer skip the rest
            x = jax.tree.map(lambda t: jnp.take_along_axis(t, logits_index[:, None, None].astype(jnp.int32), axis=1), x)
        final_norm = LayerNorm(epsilon=cfg.layernorm_epsilon, layernorm_type=cfg.layernorm_type,
                               zero_centered_gamma=cfg.zero_centered_gamma, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype, name="final_norm")
        if cfg.fuse_residual_across_layers:
            branch, stream = x
            x, _ = final_norm(branch, residual=stream)
        else:
            x = final_norm(x)
        if cp > 1:
            x = inverse_reorder_causal_load_balancing(x, cp)
        if cfg.tie_embeddings:
            # In the compute dtype, as the Dense branch: a float32 result would make both backward GEMMs
            # of this (tokens x hidden x vocab) product run in float32 on float32 copies.
            logits = embed.attend(x)
        else:
            logits = DenseGeneral(cfg.vocab_size, use_bias=False, kernel_init=init,
                                  kernel_axes=(axes.EMBED, axes.VOCAB), dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                  name="logits_dense")(x)
        return nn.with_logical_constraint(logits.astype(jnp.float32), LOGITS_AXES)

    def _check_prefix_and_encoded(self, tokens, prefix, encoded, segment_ids, positions, paged_kv, logits_index):
        cfg = self.config
        if cfg.cross_attention != (encoded is not None):
            raise ValueError("GPT: encoded (what the layers cross-attend to) goes with config.cross_attention=True; "
                             f"got cross_attention={cfg.cross_attention} and encoded "
                             f"{'None' if encoded is None else encoded.shape}")
        batch = tokens.shape[0]
        for name, x in (("prefix", prefix), ("encoded", encoded)):
            if x is not None and (x.ndim != 3 or x.shape[0] != batch or x.shape[2] != cfg.hidden_size):
                raise ValueError(f"GPT: {name} has shape {x.shape}; expected [batch={batch}, length, "
                                 f"hidden_size={cfg.hidden_size}]")
        if prefix is not None:
            others = {"segment_ids": segment_ids, "positions": positions, "paged_kv": paged_kv,
                      "logits_index": logits_index, "context_parallel": cfg.context_parallel}
            given = [name for name, value in others.items() if value is not None]
            if given:
                raise ValueError(f"GPT: prefix does not combine with {', '.join(given)}")
        if encoded is not None and (paged_kv is not None or cfg.context_parallel is not None):
            raise ValueError("GPT: cross_attention does not combine with paged_kv or context_parallel")

    def _decode_offset(self, seq: int) -> jax.Array:
        """Position of the first token of this decode step (0 while `init` creates the cache)."""
        initialized = self.has_variable(CACHE_COLLECTION, "position")
        position = self.variable(CACHE_COLLECTION, "position", lambda: jnp.zeros((), jnp.int32))
        if not initialized:
            return jnp.zeros((), jnp.int32)
        start = position.value
        position.value = start + seq
        return start
