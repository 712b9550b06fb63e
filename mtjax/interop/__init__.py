"""mtjax.interop: models from elsewhere. Hugging Face checkpoints (`load_hf_checkpoint`, `save_hf_checkpoint`):
a local model folder of config.json and safetensors to an `mtjax.models` config and parameters, and back."""

from mtjax.interop.hf import (
    PASS_THROUGH_FIELDS,
    SUPPORTED_MODEL_TYPES,
    abstract_params,
    config_from_hf,
    config_to_hf,
    infer_model_type,
    is_hf_checkpoint,
    load_hf_checkpoint,
    param_shardings,
    read_hf_config,
    save_hf_checkpoint,
    to_hf_tensors,
)

__all__ = [
    "PASS_THROUGH_FIELDS", "SUPPORTED_MODEL_TYPES", "abstract_params", "config_from_hf", "config_to_hf",
    "infer_model_type", "is_hf_checkpoint", "load_hf_checkpoint", "param_shardings", "read_hf_config",
    "save_hf_checkpoint", "to_hf_tensors",
]
