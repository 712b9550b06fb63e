"""Every model preset by name, for code that takes any of them (``mtjax train``, ``mtjax bench train``).

``model_config(name, **overrides)`` builds the preset's config (`GPTConfig`, `ViTConfig`, `T5Config`
or `VLMConfig`), ``build_model(config)`` the module for a config (those, or a `BertConfig`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.models.bert import BertConfig, BertEncoder
from mtjax.models.gpt import GPT, PRESETS, GPTConfig, gpt_config
from mtjax.models.t5 import T5, T5_PRESETS, T5Config, t5_config
from mtjax.models.vit import VIT_PRESETS, ViT, ViTConfig, vit_config
from mtjax.models.vlm import VLM, VLM_PRESETS, VLMConfig, vlm_config

_CONFIGS = {**{name: gpt_config for name in PRESETS}, **{name: vit_config for name in VIT_PRESETS},
            **{name: t5_config for name in T5_PRESETS}, **{name: vlm_config for name in VLM_PRESETS}}
MODEL_PRESETS = tuple(_CONFIGS)
_MODELS: dict[type, type[nn.Module]] = {GPTConfig: GPT, ViTConfig: ViT, T5Config: T5, VLMConfig: VLM,
                                        BertConfig: BertEncoder}


def model_config(name: str, **overrides: Any) -> GPTConfig | ViTConfig | T5Config | VLMConfig:
    """The config of any preset (`MODEL_PRESETS`) with fields overridden (a `VLMConfig`'s ``vision``
    and ``text`` take dicts of fields, as `vlm_config`)."""
    if name not in _CONFIGS:
        raise ValueError(f"model_config: name={name!r} is not a preset; accepted: {', '.join(MODEL_PRESETS)}")
    return _CONFIGS[name](name, **overrides)


def build_model(config: Any) -> nn.Module:
    """`GPT`, `ViT`, `T5`, `VLM` or `BertEncoder`, whichever ``config`` describes."""
    model = _MODELS.get(type(config))
    if model is None:
        raise TypeError(f"build_model: config is a {type(config).__name__}; accepted: "
                        f"{', '.join(c.__name__ for c in _MODELS)}")
    return model(config)


def example_inputs(config: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The keyword arguments of a one-example call of ``build_model(config)`` (shapes and dtypes)."""
    tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    if isinstance(config, VLMConfig | ViTConfig):
        vision = config.vision if isinstance(config, VLMConfig) else config
        images = jax.ShapeDtypeStruct((1, vision.image_size, vision.image_size, vision.num_channels), jnp.float32)
        return {"images": images, "tokens": tokens} if isinstance(config, VLMConfig) else {"images": images}
    if isinstance(config, T5Config):
        return {"encoder_tokens": tokens, "decoder_tokens": tokens}
    build_model(config)  # a TypeError for an unknown config
    return {"tokens": tokens}


def abstract_params(config: Any) -> Any:
    """The boxed (logical axes) abstract ``"params"`` tree ``build_model(config)`` creates."""
    model = build_model(config)
    inputs = example_inputs(config)
    return jax.eval_shape(lambda **x: model.init(jax.random.PRNGKey(0), **x), **inputs)["params"]
