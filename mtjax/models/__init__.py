"""Reference models built only from `mtjax.flax`: a GPT/Llama-style decoder and a BERT-style encoder."""

from mtjax.models._stack import REMAT_POLICIES
from mtjax.models.bert import BertConfig, BertEncoder
from mtjax.models.gpt import GPT, POSITION_EMBEDDINGS, PRESETS, GPTConfig, gpt_config

__all__ = [
    "GPT", "POSITION_EMBEDDINGS", "PRESETS", "REMAT_POLICIES", "BertConfig", "BertEncoder", "GPTConfig", "gpt_config",
]
