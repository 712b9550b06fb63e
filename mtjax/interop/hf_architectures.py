"""How each Hugging Face ``model_type`` maps onto mtjax: its config.json fields to a `GPTConfig` /
`BertConfig` and back, and its tensors to *pieces* (per-layer arrays in mtjax's orientation) and back.
`mtjax.interop.hf` reads and writes the files and packs the pieces into parameter trees."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from mtjax import ops
from mtjax.flax import RopeScaling
from mtjax.models import BertConfig, GPTConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "bert")
Array = np.ndarray


def _fail(path: str, message: str) -> ValueError:
    return ValueError(f"{path}: {message}")


# Hugging Face ``hidden_act`` -> mtjax activation (gated in the Llama family, plain elsewhere); and back.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu_exact", "gelu_new": "gelu", "gelu_fast": "gelu",
                "gelu_pytorch_tanh": "gelu", "relu": "relu", "quick_gelu": "quick_gelu"}
_HF_ACTIVATIONS = {"silu": "silu", "gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu",
                   "quick_gelu": "quick_gelu"}


class Fields:
    """Reads a config.json's fields with the defaults of its model type, naming the field in every error."""

    def __init__(self, hf: Mapping[str, Any], defaults: Mapping[str, Any], where: str):
        self.hf, self.defaults, self.where = hf, defaults, where

    def get(self, name: str, default: Any = ...) -> Any:
        if self.hf.get(name) is not None:
            return self.hf[name]
        if name in self.defaults:
            return self.defaults[name]
        if default is not ...:
            return default
        raise _fail(self.where, f"config.json has no {name!r}")

    def int(self, name: str, default: Any = ...) -> int:
        value = self.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _fail(self.where, f"config.json {name}={value!r}; expected a positive integer")
        return value

    def require(self, name: str, accepted: tuple[Any, ...], default: Any = ...) -> Any:
        value = self.get(name, default)
        if value not in accepted:
            raise _fail(self.where, f"config.json {name}={value!r} is not supported; accepted: "
                                    f"{', '.join(map(repr, accepted))}")
        return value

    def activation(self, name: str, gated: bool) -> tuple[str, ...]:
        value = self.get(name)
        activation = (_ACTIVATIONS.get(value), "linear") if gated else (_ACTIVATIONS.get(value),)
        try:
            if activation[0] is None:
                raise ValueError
            ops.canonical_activation(activation)
        except ValueError:
            accepted = [a for a in _ACTIVATIONS if _valid_activation(_ACTIVATIONS[a], gated)]
            raise _fail(self.where, f"config.json {name}={value!r} is not supported; accepted: "
                                    f"{', '.join(accepted)}") from None
        return activation

    def rope(self) -> tuple[float, RopeScaling | None, float]:
        """(theta, scaling, rotary fraction) from ``rope_parameters`` (transformers 5) or the older
        ``rope_theta`` / ``rope_scaling`` / ``rotary_pct`` / ``partial_rotary_factor`` fields."""
        params = dict(self.hf.get("rope_scaling") or {})
        params.update(self.hf.get("rope_parameters") or {})
        theta = params.get("rope_theta", self.get("rope_theta", self.hf.get("rotary_emb_base", 10000.0)))
        fraction = params.get("partial_rotary_factor", self.get("partial_rotary_factor",
                                                                self.get("rotary_pct", 1.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        accepted = ("default", "linear", "llama3")
        if kind not in accepted:
            raise _fail(self.where, f"config.json rope_scaling rope_type={kind!r} is not supported; accepted: "
                                    f"{', '.join(accepted)}")
        scaling = None
        try:
            if kind == "linear":
                scaling = RopeScaling("linear", factor=float(params["factor"]))
            elif kind == "llama3":
                scaling = RopeScaling("llama3", factor=float(params["factor"]),
                                      low_freq_factor=float(params["low_freq_factor"]),
                                      high_freq_factor=float(params["high_freq_factor"]),
                                      original_max_position=int(params["original_max_position_embeddings"]))
        except KeyError as err:
            raise _fail(self.where, f"config.json rope_scaling ({kind}) has no {err.args[0]!r}") from None
        return float(theta), scaling, float(fraction)


def _valid_activation(name: str, gated: bool) -> bool:
    try:
        ops.canonical_activation((name, "linear") if gated else (name,))
        return True
    except ValueError:
        return False


# The parameter dtypes a config.json names (``dtype`` / ``torch_dtype``) that load and save as themselves.
HF_DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def _rope_to_hf(config: GPTConfig) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` in the field names transformers 4 and 5 both read."""
    fields: dict[str, Any] = {"rope_theta": config.rope_max_timescale}
    scaling = config.rope_scaling
    if scaling is not None:
        rope = {"rope_type": scaling.kind, "type": scaling.kind, "factor": scaling.factor}
        if scaling.kind == "llama3":
            rope.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                        original_max_position_embeddings=scaling.original_max_position)
        fields["rope_scaling"] = rope
    return fields


# ------------------------------------------------------------------------------------------- architectures
#
# Each architecture converts between Hugging Face tensors and *pieces*, the per-layer and global arrays in
# mtjax's orientation (`_layer_to_params` packs them into a layer's parameter tree):
#   attn_norm_scale, attn_norm_bias   [hidden]            mlp_norm_scale, mlp_norm_bias   [hidden]
#   q, k, v                            [hidden, heads, head_dim] (k, v: kv_heads)
#   q_bias, k_bias, v_bias             [heads, head_dim]  q_norm, k_norm                  [head_dim]
#   o                                  [heads, head_dim, hidden]; o_bias [hidden]
#   wi [hidden, 1 or 2, mlp] (slot 0 activated, 1 the gate's other half); wi_bias [1 or 2, mlp]
#   wo [mlp, hidden]; wo_bias [hidden]; out_norm_scale, out_norm_bias [hidden] (BERT's post-MLP norm)
# Global pieces: token_embed [vocab, hidden], position_embed, type_embed, final_norm_scale/bias (embed_norm for
# BERT), lm_head [vocab, hidden] (Hugging Face's orientation; only when the output is not tied).

Reader = Callable[[str, tuple[int, ...]], Array]


def _linear_in(w: Array, *out_shape: int) -> Array:
    """A torch Linear weight ``[out, in]`` as a kernel ``[in, *out_shape]``."""
    return w.T.reshape(w.shape[1], *out_shape)


def _linear_out(kernel: Array) -> Array:
    """A kernel ``[in, *out]`` as a torch Linear weight ``[prod(out), in]``."""
    return np.ascontiguousarray(kernel.reshape(kernel.shape[0], -1).T)


def _heads_in(w: Array, heads: int, head_dim: int) -> Array:
    """The attention output's torch Linear weight ``[hidden, heads * head_dim]`` as the kernel
    ``[heads, head_dim, hidden]`` (its input split by head)."""
    return w.T.reshape(heads, head_dim, w.shape[0])


def _heads_out(kernel: Array) -> Array:
    """The inverse of `_heads_in`: a kernel ``[heads, head_dim, hidden]`` as ``[hidden, heads * head_dim]``."""
    return np.ascontiguousarray(kernel.reshape(-1, kernel.shape[-1]).T)


class Architecture:
    """How one Hugging Face ``model_type`` maps onto mtjax."""

    model_type: str = ""
    architecture: str = ""
    prefixes: tuple[str, ...] = ("",)  # what the base model's names may start with; the first is written
    anchor: str = ""  # a base-model tensor every checkpoint has (finds the prefix in use)
    skipped: tuple[str, ...] = ()  # name prefixes of heads mtjax has no module for (read past, never written)

    def config_from_hf(self, fields: Fields, dtype: Any, compute_dtype: Any) -> Any:
        raise NotImplementedError

    def config_to_hf(self, config: Any) -> dict[str, Any]:
        raise NotImplementedError

    def check(self, config: Any) -> None:
        """ValueError naming each field of ``config`` this architecture cannot express."""

    def global_names(self, config: Any) -> dict[str, str]:
        """Global piece -> Hugging Face tensor name (after the base prefix; a leading ``/``: outside it)."""
        raise NotImplementedError

    def global_to_pieces(self, read: Reader, config: Any) -> dict[str, Array]:
        h = config.hidden_size
        shapes = {"token_embed": (config.vocab_size, h), "lm_head": (config.vocab_size, h),
                  "position_embed": (config.max_seq_len, h), "type_embed": (getattr(config, "type_vocab_size", 0), h),
                  "final_norm_scale": (h,), "final_norm_bias": (h,)}
        return {piece: read(name, shapes[piece]) for piece, name in self.global_names(config).items()}

    def global_from_pieces(self, pieces: Mapping[str, Array], config: Any) -> dict[str, Array]:
        return {name: pieces[piece] for piece, name in self.global_names(config).items()}

    def layer_to_pieces(self, read: Reader, i: int, config: Any) -> dict[str, Array]:
        raise NotImplementedError

    def layer_from_pieces(self, pieces: Mapping[str, Array], i: int, config: Any) -> dict[str, Array]:
        raise NotImplementedError


def _require(config: Any, model_type: str, **expected: Any) -> None:
    for name, accepted in expected.items():
        accepted = accepted if isinstance(accepted, tuple) else (accepted,)
        if getattr(config, name) not in accepted:
            raise ValueError(f"save_hf_checkpoint: model_type={model_type!r} cannot express {name}="
                             f"{getattr(config, name)!r}; accepted: {', '.join(map(repr, accepted))}")


def _check_gpt(config: GPTConfig, model_type: str) -> None:
    _require(config, model_type, num_experts=0, zero_centered_gamma=False, logits_soft_cap=None,
             rope_group_method="alternate", scale_embeddings=False)


def _gated(config: GPTConfig) -> bool:
    return ops.is_gated(config.activations)


def _hf_activation(config: Any, model_type: str) -> str:
    name = config.activations[0]
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"save_hf_checkpoint: model_type={model_type!r} cannot express activations="
                         f"{config.activations!r}; accepted first activations: {', '.join(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[name]


class _Llama(Architecture):
    """Llama, Mistral, Qwen2 and Qwen3: RMSNorm, gated MLP, rotary embeddings, separate Q/K/V/O."""

    prefixes, anchor = ("model.",), "embed_tokens.weight"

    def __init__(self, model_type: str, architecture: str, defaults: dict[str, Any]):
        self.model_type, self.architecture, self.defaults = model_type, architecture, defaults

    def config_from_hf(self, fields: Fields, dtype: Any, compute_dtype: Any) -> GPTConfig:
        heads = fields.int("num_attention_heads")
        hidden = fields.int("hidden_size")
        head_dim = fields.int("head_dim", hidden // heads)
        theta, scaling, fraction = fields.rope()
        qkv_bias, use_bias, window = False, False, None
        if self.model_type == "qwen2":
            qkv_bias = True  # Qwen2's Q/K/V projections always have biases, its output projection none
        if self.model_type in ("llama", "qwen3"):
            attention_bias = fields.get("attention_bias", False)
            mlp_bias = fields.get("mlp_bias", False) if self.model_type == "llama" else False
            if attention_bias != mlp_bias:
                raise _fail(fields.where, f"config.json attention_bias={attention_bias!r} with mlp_bias="
                                          f"{mlp_bias!r} is not supported; accepted: both false or both true")
            use_bias = bool(attention_bias)
        if self.model_type in ("qwen2", "qwen3"):
            fields.require("use_sliding_window", (False,), False)
        if self.model_type == "mistral":
            # null: no window (Mistral v0.2 on); left out: the class default.
            sliding = fields.hf["sliding_window"] if "sliding_window" in fields.hf else fields.get("sliding_window")
            if sliding is not None:
                if not isinstance(sliding, int) or sliding < 1:
                    raise _fail(fields.where, f"config.json sliding_window={sliding!r}; expected null or a "
                                              "positive integer")
                window = (sliding - 1, 0)  # a query sees itself and the sliding_window - 1 tokens before it
        return GPTConfig(
            vocab_size=fields.int("vocab_size"), hidden_size=hidden, num_layers=fields.int("num_hidden_layers"),
            num_heads=heads, num_kv_heads=fields.int("num_key_value_heads", heads),
            head_dim=None if head_dim * heads == hidden else head_dim, mlp_dim=fields.int("intermediate_size"),
            max_seq_len=fields.int("max_position_embeddings"), activations=fields.activation("hidden_act", True),
            layernorm_type="rmsnorm", layernorm_epsilon=float(fields.get("rms_norm_eps")),
            position_embedding="rope", rope_max_timescale=theta, rope_group_method="alternate",
            rope_fraction=fraction, rope_scaling=scaling, tie_embeddings=bool(fields.get("tie_word_embeddings")),
            use_bias=use_bias, qkv_bias=qkv_bias, qk_norm=self.model_type == "qwen3", window_size=window,
            scan_layers=False, dtype=compute_dtype, param_dtype=dtype)

    def check(self, config: GPTConfig) -> None:
        _check_gpt(config, self.model_type)
        _require(config, self.model_type, layernorm_type="rmsnorm", position_embedding="rope", rope_fraction=1.0,
                 parallel_residual=False, qk_norm=self.model_type == "qwen3")
        if not _gated(config):
            raise ValueError(f"save_hf_checkpoint: model_type={self.model_type!r} needs a gated MLP; got "
                             f"activations={config.activations!r}")
        if self.model_type == "qwen2":
            _require(config, self.model_type, qkv_bias=True, use_bias=False)
        else:
            _require(config, self.model_type, qkv_bias=False)
            if self.model_type != "llama" and self.model_type != "qwen3":
                _require(config, self.model_type, use_bias=False)
        if self.model_type != "mistral":
            _require(config, self.model_type, window_size=None)
        elif config.window_size is not None and config.window_size[1] != 0:
            raise ValueError(f"save_hf_checkpoint: model_type='mistral' needs window_size=(left, 0); got "
                             f"{config.window_size!r}")

    def config_to_hf(self, config: GPTConfig) -> dict[str, Any]:
        fields = dict(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, num_key_value_heads=config.resolved_num_kv_heads,
            head_dim=config.resolved_head_dim, intermediate_size=config.mlp_dim,
            max_position_embeddings=config.max_seq_len, hidden_act=_hf_activation(config, self.model_type),
            rms_norm_eps=config.layernorm_epsilon, tie_word_embeddings=config.tie_embeddings, **_rope_to_hf(config))
        if self.model_type == "llama":
            fields.update(attention_bias=config.use_bias, mlp_bias=config.use_bias)
        if self.model_type == "qwen3":
            fields.update(attention_bias=config.use_bias)
        if self.model_type in ("qwen2", "qwen3"):
            fields.update(use_sliding_window=False)
        if self.model_type == "mistral":
            fields.update(sliding_window=None if config.window_size is None else config.window_size[0] + 1)
        return fields

    def global_names(self, config: GPTConfig) -> dict[str, str]:
        names = {"token_embed": "embed_tokens.weight", "final_norm_scale": "norm.weight"}
        return names if config.tie_embeddings else {**names, "lm_head": "/lm_head.weight"}

    def _names(self, i: int) -> dict[str, str]:
        p = f"layers.{i}."
        return dict(attn_norm_scale=p + "input_layernorm.weight", mlp_norm_scale=p + "post_attention_layernorm.weight",
                    q=p + "self_attn.q_proj.weight", k=p + "self_attn.k_proj.weight", v=p + "self_attn.v_proj.weight",
                    o=p + "self_attn.o_proj.weight", q_bias=p + "self_attn.q_proj.bias",
                    k_bias=p + "self_attn.k_proj.bias", v_bias=p + "self_attn.v_proj.bias",
                    o_bias=p + "self_attn.o_proj.bias", q_norm=p + "self_attn.q_norm.weight",
                    k_norm=p + "self_attn.k_norm.weight", gate=p + "mlp.gate_proj.weight", up=p + "mlp.up_proj.weight",
                    down=p + "mlp.down_proj.weight", gate_bias=p + "mlp.gate_proj.bias", up_bias=p + "mlp.up_proj.bias",
                    down_bias=p + "mlp.down_proj.bias")

    def layer_to_pieces(self, read: Reader, i: int, config: GPTConfig) -> dict[str, Array]:
        n = self._names(i)
        h, m, d = config.hidden_size, config.mlp_dim, config.resolved_head_dim
        heads, kv = config.num_heads, config.resolved_num_kv_heads
        pieces = {"attn_norm_scale": read(n["attn_norm_scale"], (h,)),
                  "mlp_norm_scale": read(n["mlp_norm_scale"], (h,)),
                  "q": _linear_in(read(n["q"], (heads * d, h)), heads, d),
                  "k": _linear_in(read(n["k"], (kv * d, h)), kv, d),
                  "v": _linear_in(read(n["v"], (kv * d, h)), kv, d),
                  "o": _heads_in(read(n["o"], (h, heads * d)), heads, d),
                  "wi": np.stack([read(n["gate"], (m, h)).T, read(n["up"], (m, h)).T], axis=1),
                  "wo": read(n["down"], (h, m)).T}
        if config.use_bias or config.qkv_bias:
            for name, count in (("q_bias", heads), ("k_bias", kv), ("v_bias", kv)):
                pieces[name] = read(n[name], (count * d,)).reshape(count, d)
        if config.use_bias:
            pieces["o_bias"] = read(n["o_bias"], (h,))
            pieces["wi_bias"] = np.stack([read(n["gate_bias"], (m,)), read(n["up_bias"], (m,))])
            pieces["wo_bias"] = read(n["down_bias"], (h,))
        if config.qk_norm:
            pieces["q_norm"], pieces["k_norm"] = read(n["q_norm"], (d,)), read(n["k_norm"], (d,))
        return pieces

    def layer_from_pieces(self, pieces: Mapping[str, Array], i: int, config: GPTConfig) -> dict[str, Array]:
        n = self._names(i)
        tensors = {n["attn_norm_scale"]: pieces["attn_norm_scale"], n["mlp_norm_scale"]: pieces["mlp_norm_scale"],
                   n["q"]: _linear_out(pieces["q"]), n["k"]: _linear_out(pieces["k"]), n["v"]: _linear_out(pieces["v"]),
                   n["o"]: _heads_out(pieces["o"]),
                   n["gate"]: _linear_out(pieces["wi"][:, 0]), n["up"]: _linear_out(pieces["wi"][:, 1]),
                   n["down"]: _linear_out(pieces["wo"])}
        for name in ("q_bias", "k_bias", "v_bias"):
            if name in pieces:
                tensors[n[name]] = pieces[name].reshape(-1)
        if "o_bias" in pieces:
            tensors[n["o_bias"]] = pieces["o_bias"]
            tensors[n["gate_bias"]], tensors[n["up_bias"]] = pieces["wi_bias"][0], pieces["wi_bias"][1]
            tensors[n["down_bias"]] = pieces["wo_bias"]
        if "q_norm" in pieces:
            tensors[n["q_norm"]], tensors[n["k_norm"]] = pieces["q_norm"], pieces["k_norm"]
        return tensors


class _GPT2(Architecture):
    """GPT-2: learned positions, LayerNorm, biases, Conv1D weights stored ``[in, out]``, fused ``c_attn``."""

    model_type, architecture = "gpt2", "GPT2LMHeadModel"
    prefixes, anchor = ("transformer.", ""), "wte.weight"

    def config_from_hf(self, fields: Fields, dtype: Any, compute_dtype: Any) -> GPTConfig:
        hidden = fields.int("n_embd")
        fields.require("scale_attn_weights", (True,), True)
        fields.require("scale_attn_by_inverse_layer_idx", (False,), False)
        fields.require("add_cross_attention", (False,), False)
        return GPTConfig(
            vocab_size=fields.int("vocab_size"), hidden_size=hidden, num_layers=fields.int("n_layer"),
            num_heads=fields.int("n_head"), mlp_dim=fields.int("n_inner", 4 * hidden),
            max_seq_len=fields.int("n_positions"), activations=fields.activation("activation_function", False),
            layernorm_type="layernorm", layernorm_epsilon=float(fields.get("layer_norm_epsilon")),
            position_embedding="learned", tie_embeddings=bool(fields.get("tie_word_embeddings")), use_bias=True,
            scan_layers=False, dtype=compute_dtype, param_dtype=dtype)

    def check(self, config: GPTConfig) -> None:
        _check_gpt(config, "gpt2")
        _require(config, "gpt2", layernorm_type="layernorm", position_embedding="learned", use_bias=True,
                 parallel_residual=False, qk_norm=False, window_size=None, num_kv_heads=(None, config.num_heads))
        if config.head_dim not in (None, config.hidden_size // config.num_heads) or _gated(config):
            raise ValueError("save_hf_checkpoint: model_type='gpt2' needs head_dim = hidden_size / num_heads and a "
                             f"plain MLP; got head_dim={config.head_dim!r}, activations={config.activations!r}")

    def config_to_hf(self, config: GPTConfig) -> dict[str, Any]:
        return dict(vocab_size=config.vocab_size, n_embd=config.hidden_size, n_layer=config.num_layers,
                    n_head=config.num_heads, n_inner=config.mlp_dim, n_positions=config.max_seq_len,
                    activation_function=_hf_activation(config, "gpt2"), layer_norm_epsilon=config.layernorm_epsilon,
                    tie_word_embeddings=config.tie_embeddings, scale_attn_weights=True)

    def global_names(self, config: GPTConfig) -> dict[str, str]:
        names = {"token_embed": "wte.weight", "position_embed": "wpe.weight", "final_norm_scale": "ln_f.weight",
                 "final_norm_bias": "ln_f.bias"}
        return names if config.tie_embeddings else {**names, "lm_head": "/lm_head.weight"}

    def layer_to_pieces(self, read: Reader, i: int, config: GPTConfig) -> dict[str, Array]:
        p, h, m, heads = f"h.{i}.", config.hidden_size, config.mlp_dim, config.num_heads
        d = h // heads
        qkv = read(p + "attn.c_attn.weight", (h, 3 * h)).reshape(h, 3, heads, d)
        qkv_bias = read(p + "attn.c_attn.bias", (3 * h,)).reshape(3, heads, d)
        return {"attn_norm_scale": read(p + "ln_1.weight", (h,)), "attn_norm_bias": read(p + "ln_1.bias", (h,)),
                "q": qkv[:, 0], "k": qkv[:, 1], "v": qkv[:, 2],
                "q_bias": qkv_bias[0], "k_bias": qkv_bias[1], "v_bias": qkv_bias[2],
                "o": read(p + "attn.c_proj.weight", (h, h)).reshape(heads, d, h),
                "o_bias": read(p + "attn.c_proj.bias", (h,)),
                "mlp_norm_scale": read(p + "ln_2.weight", (h,)), "mlp_norm_bias": read(p + "ln_2.bias", (h,)),
                "wi": read(p + "mlp.c_fc.weight", (h, m))[:, None], "wi_bias": read(p + "mlp.c_fc.bias", (m,))[None],
                "wo": read(p + "mlp.c_proj.weight", (m, h)), "wo_bias": read(p + "mlp.c_proj.bias", (h,))}

    def layer_from_pieces(self, pieces: Mapping[str, Array], i: int, config: GPTConfig) -> dict[str, Array]:
        p, h = f"h.{i}.", config.hidden_size
        qkv = np.stack([pieces["q"], pieces["k"], pieces["v"]], axis=1).reshape(h, 3 * h)
        qkv_bias = np.stack([pieces["q_bias"], pieces["k_bias"], pieces["v_bias"]]).reshape(-1)
        return {p + "ln_1.weight": pieces["attn_norm_scale"], p + "ln_1.bias": pieces["attn_norm_bias"],
                p + "attn.c_attn.weight": qkv, p + "attn.c_attn.bias": qkv_bias,
                p + "attn.c_proj.weight": pieces["o"].reshape(h, h), p + "attn.c_proj.bias": pieces["o_bias"],
                p + "ln_2.weight": pieces["mlp_norm_scale"], p + "ln_2.bias": pieces["mlp_norm_bias"],
                p + "mlp.c_fc.weight": pieces["wi"][:, 0], p + "mlp.c_fc.bias": pieces["wi_bias"][0],
                p + "mlp.c_proj.weight": pieces["wo"], p + "mlp.c_proj.bias": pieces["wo_bias"]}


class _NeoX(Architecture):
    """GPT-NeoX (Pythia): LayerNorm, biases, per-head fused QKV ``[heads, 3, head_dim]``, partial rotary,
    parallel residual."""

    model_type, architecture = "gpt_neox", "GPTNeoXForCausalLM"
    prefixes, anchor = ("gpt_neox.",), "embed_in.weight"

    def config_from_hf(self, fields: Fields, dtype: Any, compute_dtype: Any) -> GPTConfig:
        theta, scaling, fraction = fields.rope()
        fields.require("attention_bias", (True,), True)
        return GPTConfig(
            vocab_size=fields.int("vocab_size"), hidden_size=fields.int("hidden_size"),
            num_layers=fields.int("num_hidden_layers"), num_heads=fields.int("num_attention_heads"),
            mlp_dim=fields.int("intermediate_size"), max_seq_len=fields.int("max_position_embeddings"),
            activations=fields.activation("hidden_act", False), layernorm_type="layernorm",
            layernorm_epsilon=float(fields.get("layer_norm_eps")), position_embedding="rope",
            rope_max_timescale=theta, rope_group_method="alternate", rope_fraction=fraction, rope_scaling=scaling,
            parallel_residual=bool(fields.get("use_parallel_residual")),
            tie_embeddings=bool(fields.get("tie_word_embeddings")), use_bias=True, scan_layers=False,
            dtype=compute_dtype, param_dtype=dtype)

    def check(self, config: GPTConfig) -> None:
        _check_gpt(config, "gpt_neox")
        _require(config, "gpt_neox", layernorm_type="layernorm", position_embedding="rope", use_bias=True,
                 qk_norm=False, window_size=None, num_kv_heads=(None, config.num_heads))
        if config.head_dim not in (None, config.hidden_size // config.num_heads) or _gated(config):
            raise ValueError("save_hf_checkpoint: model_type='gpt_neox' needs head_dim = hidden_size / num_heads and "
                             f"a plain MLP; got head_dim={config.head_dim!r}, activations={config.activations!r}")

    def config_to_hf(self, config: GPTConfig) -> dict[str, Any]:
        return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                    num_attention_heads=config.num_heads, intermediate_size=config.mlp_dim,
                    max_position_embeddings=config.max_seq_len, hidden_act=_hf_activation(config, "gpt_neox"),
                    layer_norm_eps=config.layernorm_epsilon, rotary_pct=config.rope_fraction,
                    rotary_emb_base=config.rope_max_timescale, use_parallel_residual=config.parallel_residual,
                    attention_bias=True, tie_word_embeddings=config.tie_embeddings, **_rope_to_hf(config))

    def global_names(self, config: GPTConfig) -> dict[str, str]:
        names = {"token_embed": "embed_in.weight", "final_norm_scale": "final_layer_norm.weight",
                 "final_norm_bias": "final_layer_norm.bias"}
        return names if config.tie_embeddings else {**names, "lm_head": "/embed_out.weight"}

    def layer_to_pieces(self, read: Reader, i: int, config: GPTConfig) -> dict[str, Array]:
        p, h, m, heads = f"layers.{i}.", config.hidden_size, config.mlp_dim, config.num_heads
        d = h // heads
        # query_key_value's output rows are [heads, 3, head_dim].
        qkv = read(p + "attention.query_key_value.weight", (3 * h, h)).reshape(heads, 3, d, h).transpose(3, 1, 0, 2)
        qkv_bias = read(p + "attention.query_key_value.bias", (3 * h,)).reshape(heads, 3, d).transpose(1, 0, 2)
        return {"attn_norm_scale": read(p + "input_layernorm.weight", (h,)),
                "attn_norm_bias": read(p + "input_layernorm.bias", (h,)),
                "q": qkv[:, 0], "k": qkv[:, 1], "v": qkv[:, 2],
                "q_bias": qkv_bias[0], "k_bias": qkv_bias[1], "v_bias": qkv_bias[2],
                "o": _heads_in(read(p + "attention.dense.weight", (h, h)), heads, d),
                "o_bias": read(p + "attention.dense.bias", (h,)),
                "mlp_norm_scale": read(p + "post_attention_layernorm.weight", (h,)),
                "mlp_norm_bias": read(p + "post_attention_layernorm.bias", (h,)),
                "wi": read(p + "mlp.dense_h_to_4h.weight", (m, h)).T[:, None],
                "wi_bias": read(p + "mlp.dense_h_to_4h.bias", (m,))[None],
                "wo": read(p + "mlp.dense_4h_to_h.weight", (h, m)).T,
                "wo_bias": read(p + "mlp.dense_4h_to_h.bias", (h,))}

    def layer_from_pieces(self, pieces: Mapping[str, Array], i: int, config: GPTConfig) -> dict[str, Array]:
        p, h = f"layers.{i}.", config.hidden_size
        qkv = np.stack([pieces["q"], pieces["k"], pieces["v"]], axis=1)  # [hidden, 3, heads, head_dim]
        qkv_bias = np.stack([pieces["q_bias"], pieces["k_bias"], pieces["v_bias"]])  # [3, heads, head_dim]
        return {p + "input_layernorm.weight": pieces["attn_norm_scale"],
                p + "input_layernorm.bias": pieces["attn_norm_bias"],
                p + "attention.query_key_value.weight": np.ascontiguousarray(qkv.transpose(2, 1, 3, 0).reshape(-1, h)),
                p + "attention.query_key_value.bias": np.ascontiguousarray(qkv_bias.transpose(1, 0, 2).reshape(-1)),
                p + "attention.dense.weight": _heads_out(pieces["o"]),
                p + "attention.dense.bias": pieces["o_bias"],
                p + "post_attention_layernorm.weight": pieces["mlp_norm_scale"],
                p + "post_attention_layernorm.bias": pieces["mlp_norm_bias"],
                p + "mlp.dense_h_to_4h.weight": _linear_out(pieces["wi"][:, 0]),
                p + "mlp.dense_h_to_4h.bias": pieces["wi_bias"][0],
                p + "mlp.dense_4h_to_h.weight": _linear_out(pieces["wo"]),
                p + "mlp.dense_4h_to_h.bias": pieces["wo_bias"]}


class _Bert(Architecture):
    """BERT's encoder (`mtjax.models.BertEncoder`): post-LN, learned positions and token types."""

    model_type, architecture = "bert", "BertModel"
    prefixes, anchor = ("", "bert."), "embeddings.word_embeddings.weight"
    skipped = ("pooler.", "cls.", "bert.pooler.")

    def config_from_hf(self, fields: Fields, dtype: Any, compute_dtype: Any) -> BertConfig:
        fields.require("position_embedding_type", ("absolute",), "absolute")
        fields.require("is_decoder", (False,), False)
        fields.require("add_cross_attention", (False,), False)
        return BertConfig(
            vocab_size=fields.int("vocab_size"), hidden_size=fields.int("hidden_size"),
            num_layers=fields.int("num_hidden_layers"), num_heads=fields.int("num_attention_heads"),
            mlp_dim=fields.int("intermediate_size"), max_seq_len=fields.int("max_position_embeddings"),
            type_vocab_size=fields.int("type_vocab_size"), activations=fields.activation("hidden_act", False),
            layernorm_epsilon=float(fields.get("layer_norm_eps")), dropout_rate=0.0, attention_dropout=0.0,
            scan_layers=False, dtype=compute_dtype, param_dtype=dtype)

    def config_to_hf(self, config: BertConfig) -> dict[str, Any]:
        return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                    num_attention_heads=config.num_heads, intermediate_size=config.mlp_dim,
                    max_position_embeddings=config.max_seq_len, type_vocab_size=config.type_vocab_size,
                    hidden_act=_hf_activation(config, "bert"), layer_norm_eps=config.layernorm_epsilon,
                    position_embedding_type="absolute")

    def global_names(self, config: BertConfig) -> dict[str, str]:
        return {"token_embed": "embeddings.word_embeddings.weight",
                "position_embed": "embeddings.position_embeddings.weight",
                "type_embed": "embeddings.token_type_embeddings.weight",
                "final_norm_scale": "embeddings.LayerNorm.weight", "final_norm_bias": "embeddings.LayerNorm.bias"}

    def layer_to_pieces(self, read: Reader, i: int, config: BertConfig) -> dict[str, Array]:
        p, h, m, heads = f"encoder.layer.{i}.", config.hidden_size, config.mlp_dim, config.num_heads
        d = h // heads
        pieces = {}
        for name in ("q", "k", "v"):
            hf = {"q": "query", "k": "key", "v": "value"}[name]
            pieces[name] = _linear_in(read(f"{p}attention.self.{hf}.weight", (h, h)), heads, d)
            pieces[name + "_bias"] = read(f"{p}attention.self.{hf}.bias", (h,)).reshape(heads, d)
        pieces.update({
            "o": _heads_in(read(p + "attention.output.dense.weight", (h, h)), heads, d),
            "o_bias": read(p + "attention.output.dense.bias", (h,)),
            "mlp_norm_scale": read(p + "attention.output.LayerNorm.weight", (h,)),
            "mlp_norm_bias": read(p + "attention.output.LayerNorm.bias", (h,)),
            "wi": read(p + "intermediate.dense.weight", (m, h)).T[:, None],
            "wi_bias": read(p + "intermediate.dense.bias", (m,))[None],
            "wo": read(p + "output.dense.weight", (h, m)).T, "wo_bias": read(p + "output.dense.bias", (h,)),
            "out_norm_scale": read(p + "output.LayerNorm.weight", (h,)),
            "out_norm_bias": read(p + "output.LayerNorm.bias", (h,))})
        return pieces

    def layer_from_pieces(self, pieces: Mapping[str, Array], i: int, config: BertConfig) -> dict[str, Array]:
        p = f"encoder.layer.{i}."
        tensors = {}
        for name, hf in (("q", "query"), ("k", "key"), ("v", "value")):
            tensors[f"{p}attention.self.{hf}.weight"] = _linear_out(pieces[name])
            tensors[f"{p}attention.self.{hf}.bias"] = pieces[name + "_bias"].reshape(-1)
        tensors.update({
            p + "attention.output.dense.weight": _heads_out(pieces["o"]),
            p + "attention.output.dense.bias": pieces["o_bias"],
            p + "attention.output.LayerNorm.weight": pieces["mlp_norm_scale"],
            p + "attention.output.LayerNorm.bias": pieces["mlp_norm_bias"],
            p + "intermediate.dense.weight": _linear_out(pieces["wi"][:, 0]),
            p + "intermediate.dense.bias": pieces["wi_bias"][0],
            p + "output.dense.weight": _linear_out(pieces["wo"]), p + "output.dense.bias": pieces["wo_bias"],
            p + "output.LayerNorm.weight": pieces["out_norm_scale"],
            p + "output.LayerNorm.bias": pieces["out_norm_bias"]})
        return tensors


_LLAMA_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")
ARCHITECTURES: dict[str, Architecture] = {
    "llama": _Llama("llama", "LlamaForCausalLM", dict(_LLAMA_DEFAULTS, max_position_embeddings=2048)),
    "mistral": _Llama("mistral", "MistralForCausalLM", dict(_LLAMA_DEFAULTS, sliding_window=4096)),
    "qwen2": _Llama("qwen2", "Qwen2ForCausalLM", dict(_LLAMA_DEFAULTS, max_position_embeddings=32768)),
    "qwen3": _Llama("qwen3", "Qwen3ForCausalLM", dict(_LLAMA_DEFAULTS, max_position_embeddings=32768)),
    "gpt2": _GPT2(),
    "gpt_neox": _NeoX(),
    "bert": _Bert(),
}
_DEFAULTS = {"gpt2": dict(layer_norm_epsilon=1e-5, tie_word_embeddings=True, activation_function="gelu_new",
                          n_positions=1024),
             "gpt_neox": dict(layer_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="gelu", rotary_pct=0.25,
                              use_parallel_residual=True, max_position_embeddings=2048),
             "bert": dict(layer_norm_eps=1e-12, hidden_act="gelu", type_vocab_size=2, max_position_embeddings=512)}


def architecture(model_type: Any, where: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise _fail(where, f"model_type={model_type!r} is not supported; accepted: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return ARCHITECTURES[model_type]


def config_from_hf(hf_config: Mapping[str, Any], *, dtype: Any = jnp.float32, compute_dtype: Any = None,
                   where: str = "config_from_hf") -> GPTConfig | BertConfig:
    """The `GPTConfig` (or `BertConfig` for BERT) of a Hugging Face ``config.json`` dict.

    ``dtype`` is the parameter dtype, ``compute_dtype`` the compute dtype (None: ``dtype``). Dropout is
    off and the layers are unrolled (``scan_layers=False``).

    Raises:
      ValueError: an unsupported ``model_type`` or field value (the message names the field and the
        accepted values), or a missing field.
    """
    arch = architecture(hf_config.get("model_type"), where)
    defaults = {**getattr(arch, "defaults", {}), **_DEFAULTS.get(arch.model_type, {})}
    return arch.config_from_hf(Fields(hf_config, defaults, where), dtype,
                               dtype if compute_dtype is None else compute_dtype)


def _check_config_type(config: Any, where: str) -> None:
    if not isinstance(config, GPTConfig | BertConfig):
        raise TypeError(f"{where}: config is a {type(config).__name__}; accepted: GPTConfig, BertConfig "
                        "(the Hugging Face architectures are decoders and BERT)")


def infer_model_type(config: GPTConfig | BertConfig) -> str:
    """The Hugging Face ``model_type`` that fits ``config`` best (what `save_hf_checkpoint` writes
    without ``model_type=``): ``"bert"`` for a `BertConfig`; else by its features (learned positions:
    GPT-2; parallel residual or partial rotary: GPT-NeoX; q/k norms: Qwen3; Q/K/V-only biases: Qwen2;
    a sliding window: Mistral; otherwise Llama).

    Raises:
      TypeError: ``config`` is neither a `GPTConfig` nor a `BertConfig`.
    """
    _check_config_type(config, "infer_model_type")
    if isinstance(config, BertConfig):
        return "bert"
    if config.position_embedding == "learned":
        return "gpt2"
    if config.parallel_residual or config.rope_fraction != 1.0 or config.layernorm_type == "layernorm":
        return "gpt_neox"
    if config.qk_norm:
        return "qwen3"
    if config.qkv_bias:
        return "qwen2"
    if config.window_size is not None:
        return "mistral"
    return "llama"


def config_to_hf(config: GPTConfig | BertConfig, model_type: str | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as Hugging Face ``model_type`` (default: `infer_model_type`).

    Raises:
      TypeError: ``config`` is neither a `GPTConfig` nor a `BertConfig`.
      ValueError: ``config`` has a feature that ``model_type`` cannot express (the message names the field).
    """
    _check_config_type(config, "config_to_hf")
    model_type = model_type or infer_model_type(config)
    arch = architecture(model_type, "config_to_hf")
    if isinstance(config, BertConfig) != (model_type == "bert"):
        raise ValueError(f"config_to_hf: model_type={model_type!r} does not fit a {type(config).__name__}")
    arch.check(config)
    fields = {"architectures": [arch.architecture], "model_type": model_type, **arch.config_to_hf(config),
              "torch_dtype": dtype_name(config.param_dtype)}
    return fields
