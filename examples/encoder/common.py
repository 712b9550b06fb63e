# Adapted from NVIDIA TransformerEngine's examples/jax/encoder/common.py
# (Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES; Apache License 2.0,
# https://github.com/NVIDIA/TransformerEngine). Changes: mtjax's recipes instead of
# transformer_engine.common.recipe; the dataset-cache helpers are gone (the examples make their data).
"""Shared functions for the encoder and MNIST examples."""

from mtjax import fp8

# TransformerEngine's recipe names and mtjax's recipes; MXFP8 and NVFP4 have none in mtjax.
RECIPES = {
    "DelayedScaling": fp8.DelayedScaling,
    "Float8CurrentScaling": fp8.CurrentScaling,
    "Float8BlockScaling": fp8.BlockScaling,
}


def get_quantization_recipe_from_name_string(name: str):
    """The FP8 recipe of TransformerEngine's name ``name``."""
    if name not in RECIPES:
        raise ValueError(f"Invalid quantization_recipe, got {name}; mtjax has {sorted(RECIPES)}")
    return RECIPES[name]()
