"""Vision-language model built from `mtjax.flax` modules: a `ViTEncoder`, a linear projector and a
`GPT` decoder that reads the image tokens as a prefix of its sequence or attends to them.

``VLM(config)(images [batch, H, W, C] float, tokens [batch, seq] int, *, deterministic=True) ->
logits [batch, seq, vocab_size]`` in float32: the text tokens' logits only, so a loss on them is a
loss on the text alone. `VLM.encode_images` and `VLM.decode` run the two halves (captioning with a
key/value cache: `mtjax.models.greedy_decode`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from mtjax import axes
from mtjax.flax import DenseGeneral
from mtjax.models.gpt import GPT, GPTConfig, gpt_config
from mtjax.models.vit import ViTConfig, ViTEncoder, vit_config

FUSIONS = ("prefix", "cross_attention")


@dataclasses.dataclass(frozen=True)
class VLMConfig:
    """A `VLM`: its image encoder, its text decoder and how they meet (presets: `vlm_config`).

    Attributes:
      vision: the `ViTConfig` of the image encoder (its ``num_classes`` is unused: no head).
      text: the `GPTConfig` of the decoder; ``cross_attention`` is set from ``fusion``.
      fusion: ``"prefix"``: the projected image tokens come before the text in the decoder's causal
        sequence (LLaVA); ``"cross_attention"``: every decoder layer attends to them (Flamingo-like,
        without gating).
    """

    vision: ViTConfig
    text: GPTConfig
    fusion: str = "prefix"

    def __post_init__(self):
        owner = type(self).__name__
        if not isinstance(self.vision, ViTConfig) or not isinstance(self.text, GPTConfig):
            raise TypeError(f"{owner}: vision must be a ViTConfig and text a GPTConfig; got "
                            f"{type(self.vision).__name__} and {type(self.text).__name__}")
        if self.fusion not in FUSIONS:
            raise ValueError(f"{owner}: fusion={self.fusion!r} is not supported; accepted: {', '.join(FUSIONS)}")
        cross = self.fusion == "cross_attention"
        if self.text.cross_attention != cross:
            object.__setattr__(self, "text", dataclasses.replace(self.text, cross_attention=cross))
        if self.text.dtype != self.vision.dtype:
            raise ValueError(f"{owner}: vision.dtype={self.vision.dtype} and text.dtype={self.text.dtype} must agree")

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def dtype(self) -> Any:
        return self.text.dtype

    @property
    def param_dtype(self) -> Any:
        return self.text.param_dtype

    @property
    def num_image_tokens(self) -> int:
        return self.vision.seq_len

    def num_params(self) -> int:
        """Number of parameters (what `VLM.init` creates)."""
        projector = self.vision.hidden_size * self.text.hidden_size + self.text.hidden_size
        return self.vision.encoder_params() + projector + self.text.num_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per text token of a ``seq_len``-token caption: the decoder's, plus the image
        encoder's and the projector's for one image spread over the caption's tokens (with a prefix the
        decoder's sequence is the image tokens and the caption, all of it trained)."""
        image = self.num_image_tokens
        encoder = image * (self.vision.flops_per_token() + 6.0 * self.vision.hidden_size * self.text.hidden_size)
        if self.fusion == "prefix":
            decoder = (image + seq_len) * self.text.flops_per_token(image + seq_len)
        else:
            decoder = seq_len * self.text.flops_per_token(seq_len)
        return (encoder + decoder) / seq_len


_PRESETS: dict[str, dict[str, Any]] = {
    # CPU: vit-tiny's encoder on the 32x32 procedural scenes (16 image tokens) and the tiny GPT's decoder
    # (byte-level, 2 layers).
    "vlm-tiny": dict(vision=("vit-tiny", {}), text=("tiny", {}), fusion="prefix"),
}
VLM_PRESETS = tuple(_PRESETS)


def vlm_config(name: str, *, vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None,
               **overrides: Any) -> VLMConfig:
    """A preset (`VLM_PRESETS`: ``"vlm-tiny"``) with `ViTConfig` fields overridden by ``vision``,
    `GPTConfig` fields by ``text`` and `VLMConfig` fields (``fusion``) by the keywords."""
    if name not in _PRESETS:
        raise ValueError(f"vlm_config: name={name!r} is not a preset; accepted: {', '.join(VLM_PRESETS)}")
    preset = _PRESETS[name]
    (vision_name, vision_fields), (text_name, text_fields) = preset["vision"], preset["text"]
    fields = {k: v for k, v in preset.items() if k not in ("vision", "text")}
    return VLMConfig(vision=vit_config(vision_name, **{**vision_fields, **(vision or {})}),
                     text=gpt_config(text_name, **{**text_fields, **(text or {})}), **{**fields, **overrides})


class VLM(nn.Module):
    """Image encoder + projector + text decoder (see `VLMConfig.fusion`).

    ``__call__(images, tokens, *, deterministic=True)`` -> float32 logits ``[batch, seq, vocab_size]``
    of the text tokens (the decoder sees the image, then ``tokens``; train with targets shifted by
    one and padding weighted out).

    Example::

        model = VLM(vlm_config("vlm-tiny"))
        images, tokens = jnp.zeros((2, 32, 32, 3)), jnp.zeros((2, 16), jnp.int32)
        variables = model.init(jax.random.key(0), images, tokens)
        logits = model.apply(variables, images, tokens)                    # [2, 16, 384]

    Attributes:
      config: a `VLMConfig`.
    """

    config: VLMConfig

    def setup(self):
        cfg = self.config
        self.vision = ViTEncoder(cfg.vision)
        self.projector = DenseGeneral(cfg.text.hidden_size, kernel_init=nn.initializers.lecun_normal(),
                                      kernel_axes=(None, axes.EMBED), bias_axes=(axes.EMBED,), dtype=cfg.text.dtype,
                                      param_dtype=cfg.text.param_dtype)
        self.decoder = GPT(cfg.text)

    def __call__(self, images: jax.Array, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        return self.decode(tokens, self.encode_images(images, deterministic=deterministic),
                           deterministic=deterministic)

    def encode_images(self, images: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """The projected image tokens ``[batch, num_image_tokens, text.hidden_size]``."""
        return self.projector(self.vision(images, deterministic=deterministic))

    def decode(self, tokens: jax.Array, image_tokens: jax.Array | None, *, deterministic: bool = True,
               decode: bool = False) -> jax.Array:
        """The decoder's logits of ``tokens`` given `encode_images`' output.

        ``decode=True`` runs on the ``"cache"`` collection (create it with a first call on
        ``mutable=["cache"]`` with tokens ``[batch, max_text_len]``). With ``fusion="prefix"`` the
        prompt's call passes ``image_tokens`` and the later steps ``None`` (the image sits in the
        cache); with cross-attention every call passes them."""
        if self.config.fusion == "prefix":
            return self.decoder(tokens, prefix=image_tokens, deterministic=deterministic, decode=decode)
        if image_tokens is None:
            raise ValueError("VLM: fusion='cross_attention' needs image_tokens at every decoding step")
        return self.decoder(tokens, encoded=image_tokens, deterministic=deterministic, decode=decode)
