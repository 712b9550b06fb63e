"""Vision Transformer (ViT) built from `mtjax.flax` modules.

``ViT(config)(images [batch, height, width, channels] float, *, deterministic=True) -> logits
[batch, num_classes]`` in float32. `ViTEncoder` is the part before pooling: it returns the token
sequence ``[batch, seq_len, hidden_size]`` a vision-language model reads (`mtjax.models.VLM`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtjax import axes
from mtjax.flax import DenseGeneral, LayerNorm, TransformerLayerType
from mtjax.flax.attention import check_heads
from mtjax.flax.normalization import LAYERNORM_TYPES
from mtjax.flax.params import check_float_dtype, param_with_axes
from mtjax.models._stack import apply_layers, check_stack_config

VIT_POSITION_EMBEDDINGS = ("learned", "sincos")
POOLINGS = ("cls", "mean")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Size and options of a `ViT` (presets: `vit_config`).

    Attributes:
      image_size: height and width of the (square) input images.
      patch_size: side of the square patches; must divide ``image_size``.
      num_channels: input channels.
      num_classes: outputs of the classification head.
      hidden_size: model width.
      num_layers: Transformer blocks.
      num_heads: attention heads (``hidden_size`` divisible by it).
      mlp_dim: MLP hidden width.
      activations: MLP activation (`mtjax.ops.activation` names; ViT: ``("gelu",)``).
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      layernorm_epsilon: epsilon of every norm.
      position_embedding: ``"learned"`` (a trained table) or ``"sincos"`` (fixed 2-D sine-cosine
        embedding of the patch row and column; ``hidden_size`` divisible by 4).
      pooling: ``"cls"`` (a learned class token prepended; the head reads its output) or ``"mean"``
        (the head reads the mean of the patch outputs; no class token).
      dropout_rate: embedding, hidden and MLP-intermediate dropout.
      attention_dropout: attention-probability dropout.
      init_std: standard deviation of the normal initializer of kernels and the position table.
      scan_layers: ``nn.scan`` over the layers.
      remat_policy: one of `mtjax.models.REMAT_POLICIES`.
      dtype: compute dtype.
      param_dtype: parameter dtype.
    """

    image_size: int = 32
    patch_size: int = 4
    num_channels: int = 3
    num_classes: int = 10
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 128
    activations: tuple[str, ...] = ("gelu",)
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    position_embedding: str = "learned"
    pooling: str = "cls"
    dropout_rate: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    scan_layers: bool = True
    remat_policy: str = "none"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        owner = type(self).__name__
        check_stack_config(self, ("image_size", "patch_size", "num_channels", "num_classes", "hidden_size",
                                  "num_layers", "num_heads", "mlp_dim"))
        if self.image_size % self.patch_size:
            raise ValueError(f"{owner}: patch_size={self.patch_size} must divide image_size={self.image_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{owner}: hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        check_heads(owner, self.hidden_size // self.num_heads, self.num_heads, None)
        check_float_dtype(owner, "dtype", self.dtype)
        check_float_dtype(owner, "param_dtype", self.param_dtype)
        for name, accepted in (("layernorm_type", LAYERNORM_TYPES), ("position_embedding", VIT_POSITION_EMBEDDINGS),
                               ("pooling", POOLINGS)):
            if getattr(self, name) not in accepted:
                raise ValueError(f"{owner}: {name}={getattr(self, name)!r} is not supported; accepted: "
                                 f"{', '.join(accepted)}")
        if self.position_embedding == "sincos" and self.hidden_size % 4:
            raise ValueError(f"{owner}: position_embedding='sincos' needs hidden_size divisible by 4; got "
                             f"{self.hidden_size}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens per image in the encoder: the patches, plus the class token with ``pooling="cls"``."""
        return self.num_patches + (self.pooling == "cls")

    def encoder_params(self) -> int:
        """Parameters of `ViTEncoder` (everything but the head)."""
        h, patch = self.hidden_size, self.patch_size ** 2 * self.num_channels
        norm = h if self.layernorm_type == "rmsnorm" else 2 * h
        gates = 2 if len(self.activations) == 2 else 1
        attention = 4 * h * h + 4 * h
        mlp = h * gates * self.mlp_dim + gates * self.mlp_dim + self.mlp_dim * h + h
        layers = self.num_layers * (attention + mlp + 2 * norm)
        positions = self.seq_len * h if self.position_embedding == "learned" else 0
        return patch * h + h + positions + (h if self.pooling == "cls" else 0) + layers + norm

    def num_params(self) -> int:
        """Number of parameters (what `ViT.init` creates)."""
        return self.encoder_params() + self.hidden_size * self.num_classes + self.num_classes

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per encoder token (forward + backward): ``6 *`` the parameters of the encoder's
        GEMMs plus bidirectional attention ``12 * layers * seq_len * hidden`` (the head, run once per
        image, is left out). ``seq_len`` defaults to the config's."""
        seq_len = self.seq_len if seq_len is None else seq_len
        lookup_only = self.seq_len * self.hidden_size if self.position_embedding == "learned" else 0
        return 6.0 * (self.encoder_params() - lookup_only) + 12.0 * self.num_layers * seq_len * self.hidden_size


_PRESETS: dict[str, dict[str, Any]] = {
    # CPU: 32x32 images of the procedural scenes (`mtjax.train.scenes`), 16 patches of 8x8, mean pooling:
    # the layout that learns the scenes' shapes fastest on a CPU (docs/performance.md compares others).
    "vit-tiny": dict(image_size=32, patch_size=8, num_classes=16, hidden_size=64, num_layers=4, num_heads=4,
                     mlp_dim=128, pooling="mean"),
    # ViT-L/16 at 224x224 (ImageNet-1k head): 304M parameters.
    "vit-l16": dict(image_size=224, patch_size=16, num_classes=1000, hidden_size=1024, num_layers=24, num_heads=16,
                    mlp_dim=4096, dtype=jnp.bfloat16),
    # ViT-B/16 at 224x224: 86M parameters.
    "vit-b16": dict(image_size=224, patch_size=16, num_classes=1000, hidden_size=768, num_layers=12, num_heads=12,
                    mlp_dim=3072, dtype=jnp.bfloat16),
}
VIT_PRESETS = tuple(_PRESETS)


def vit_config(name: str, **overrides: Any) -> ViTConfig:
    """A preset (`VIT_PRESETS`: ``"vit-tiny"``, ``"vit-b16"``, ``"vit-l16"``) with fields overridden."""
    if name not in _PRESETS:
        raise ValueError(f"vit_config: name={name!r} is not a preset; accepted: {', '.join(VIT_PRESETS)}")
    return ViTConfig(**{**_PRESETS[name], **overrides})


def sincos_2d_positions(grid: int, hidden_size: int) -> np.ndarray:
    """The fixed 2-D sine-cosine embedding ``[grid * grid, hidden_size]`` of a square patch grid (row-major):
    the first half of the features encodes the row, the second the column, each as ``sin`` then ``cos``
    of the coordinate times ``1 / 10000 ** (k / (hidden_size / 4))``."""
    quarter = hidden_size // 4
    omega = 1.0 / 10000.0 ** (np.arange(quarter, dtype=np.float64) / quarter)
    rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")

    def encode(coordinate: np.ndarray) -> np.ndarray:
        angle = coordinate.reshape(-1, 1) * omega[None, :]
        return np.concatenate([np.sin(angle), np.cos(angle)], axis=1)

    return np.concatenate([encode(rows), encode(cols)], axis=1).astype(np.float32)


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
    """``[batch, height, width, channels] -> [batch, patches, patch_size * patch_size * channels]``,
    patches in row-major order, each flattened (row, column, channel)."""
    batch, height, width, channels = images.shape
    rows, cols = height // patch_size, width // patch_size
    x = images.reshape(batch, rows, patch_size, cols, patch_size, channels)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, rows * cols, patch_size * patch_size * channels)


class ViTEncoder(nn.Module):
    """Patch embedding (a `mtjax.flax.DenseGeneral` over flattened patches), class token, positions,
    ``num_layers`` pre-LN bidirectional `mtjax.flax.TransformerLayer` s and a final norm.

    ``__call__(images, *, deterministic=True)``: ``images [batch, image_size, image_size,
    num_channels]`` float -> ``[batch, seq_len, hidden_size]`` in ``dtype`` (the class token first
    with ``pooling="cls"``).

    Attributes:
      config: a `ViTConfig`.
    """

    config: ViTConfig

    @nn.compact
    def __call__(self, images: jax.Array, *, deterministic: bool = True) -> jax.Array:
        cfg = self.config
        expected = (cfg.image_size, cfg.image_size, cfg.num_channels)
        if images.ndim != 4 or images.shape[1:] != expected or not jnp.issubdtype(images.dtype, jnp.floating):
            raise ValueError(f"ViT: images must be float [batch, {', '.join(map(str, expected))}]; got "
                             f"{images.dtype} {images.shape}")
        init = nn.initializers.normal(cfg.init_std)
        patches = patchify(images.astype(cfg.dtype), cfg.patch_size)
        x = DenseGeneral(cfg.hidden_size, kernel_init=nn.initializers.lecun_normal(), kernel_axes=(None, axes.EMBED),
                         bias_axes=(axes.EMBED,), dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                         name="patch_embed")(patches)
        batch = x.shape[0]
        if cfg.pooling == "cls":
            cls = param_with_axes(self, "cls_token", nn.initializers.zeros, (1, 1, cfg.hidden_size), cfg.param_dtype,
                                  (None, None, axes.EMBED))
            x = jnp.concatenate([jnp.broadcast_to(cls.astype(cfg.dtype), (batch, 1, cfg.hidden_size)), x], axis=1)
        if cfg.position_embedding == "learned":
            table = param_with_axes(self, "position_embed", init, (cfg.seq_len, cfg.hidden_size), cfg.param_dtype,
                                    (None, axes.EMBED))
        else:
            table = sincos_2d_positions(cfg.image_size // cfg.patch_size, cfg.hidden_size)
            if cfg.pooling == "cls":  # the class token has no place in the grid
                table = np.concatenate([np.zeros((1, cfg.hidden_size), np.float32), table])
        x = x + jnp.asarray(table).astype(cfg.dtype)[None]
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, axes.BATCH_LENGTH_EMBED)
        layer = dict(
            hidden_size=cfg.hidden_size, mlp_hidden_size=cfg.mlp_dim, num_attention_heads=cfg.num_heads,
            layernorm_type=cfg.layernorm_type, layernorm_epsilon=cfg.layernorm_epsilon,
            hidden_dropout=cfg.dropout_rate, attention_dropout=cfg.attention_dropout,
            intermediate_dropout=cfg.dropout_rate, mha_kernel_init=init, mlp_kernel_init=init,
            mlp_activations=cfg.activations, use_bias=True, layer_type=TransformerLayerType.ENCODER,
            self_attn_mask_type="no_mask", dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            # Standard scaled attention, no relative biases (TransformerLayer's defaults are T5's).
            enable_relative_embedding=False, scale_attn_logits=True, scaled_query_init=False,
        )
        x = apply_layers(x, layer=layer, num_layers=cfg.num_layers, scan_layers=cfg.scan_layers,
                         remat_policy=cfg.remat_policy, segment_ids=None, positions=None,
                         deterministic=deterministic, decode=False)
        return LayerNorm(epsilon=cfg.layernorm_epsilon, layernorm_type=cfg.layernorm_type, dtype=cfg.dtype,
                         param_dtype=cfg.param_dtype, name="encoder_norm")(x)


class ViT(nn.Module):
    """Image classifier: `ViTEncoder`, pooling (class token or mean of the patches), a linear head.

    ``__call__(images, *, deterministic=True)`` -> float32 logits ``[batch, num_classes]``.

    Example::

        config = vit_config("vit-tiny")
        model = ViT(config)
        images = jnp.zeros((8, 32, 32, 3))
        variables = model.init(jax.random.key(0), images)
        logits = model.apply(variables, images)          # [8, 16]

    Attributes:
      config: a `ViTConfig`.
    """

    config: ViTConfig

    @nn.compact
    def __call__(self, images: jax.Array, *, deterministic: bool = True) -> jax.Array:
        cfg = self.config
        x = ViTEncoder(cfg, name="encoder")(images, deterministic=deterministic)
        pooled = x[:, 0] if cfg.pooling == "cls" else jnp.mean(x.astype(jnp.float32), axis=1).astype(cfg.dtype)
        logits = DenseGeneral(cfg.num_classes, kernel_init=nn.initializers.zeros, kernel_axes=(axes.EMBED, None),
                              bias_axes=(None,), dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="head")(pooled)
        return nn.with_logical_constraint(logits.astype(jnp.float32), (axes.ACTIVATION_BATCH, None))
