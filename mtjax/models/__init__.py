"""Reference models built only from `mtjax.flax`: a GPT/Llama-style decoder, a BERT-style encoder, a
Vision Transformer, a T5-style encoder-decoder and a vision-language model."""

from mtjax.models._stack import REMAT_POLICIES, unstack_layers
from mtjax.models.bert import BertConfig, BertEncoder
from mtjax.models.decoding import (
    greedy_decode,
    jitted_t5_generate,
    jitted_vlm_generate,
    t5_generate,
    until_eos,
    vlm_generate,
)
from mtjax.models.gpt import GPT, POSITION_EMBEDDINGS, PRESETS, GPTConfig, gpt_config
from mtjax.models.registry import MODEL_PRESETS, abstract_params, build_model, example_inputs, model_config
from mtjax.models.t5 import T5, T5_PRESETS, T5Config, T5Decoder, T5Encoder, t5_config
from mtjax.models.vit import VIT_PRESETS, ViT, ViTConfig, ViTEncoder, vit_config
from mtjax.models.vlm import VLM, VLM_PRESETS, VLMConfig, vlm_config

__all__ = [
    "GPT", "MODEL_PRESETS", "POSITION_EMBEDDINGS", "PRESETS", "REMAT_POLICIES", "T5", "T5_PRESETS", "VIT_PRESETS",
    "VLM", "VLM_PRESETS", "BertConfig", "BertEncoder", "GPTConfig", "T5Config", "T5Decoder", "T5Encoder", "ViT",
    "ViTConfig", "ViTEncoder", "VLMConfig", "abstract_params", "build_model", "example_inputs", "gpt_config",
    "greedy_decode", "jitted_t5_generate", "jitted_vlm_generate", "model_config", "t5_config", "t5_generate",
    "unstack_layers", "until_eos", "vit_config", "vlm_config", "vlm_generate",
]
