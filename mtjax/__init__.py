"""mtjax: fused Transformer layers, Pallas kernels, FP8 training and parallelism for JAX/Flax.

``import mtjax as te`` serves code written for ``import transformer_engine.jax as te``: ``te.autocast``,
``te.MeshResource``, ``te.flax`` and ``te.sharding`` are mtjax's (`mtjax.fp8.autocast`,
`mtjax.sharding.MeshResource`, `mtjax.flax`, `mtjax.sharding`); docs/migrating-from-transformer-engine.md
lists what differs.
"""

__version__ = "0.1.0"

import importlib

from mtjax import backend as backend
from mtjax import config as config

# Before anything can initialise jax's backends: a plugin registered after that would be ignored.
backend.load_plugins_from_env()

# Importing the ops registers their implementations (references and kernels) with the backend.
import mtjax.ops  # noqa: E402,F401

# Loaded on first use (``mtjax.flax``, ``mtjax.sharding``...), so ``import mtjax`` stays light.
_SUBPACKAGES = ("axes", "dtypes", "fp8", "flax", "sharding", "models", "train", "inference", "kernels")


def __getattr__(name: str):
    if name == "autocast":
        from mtjax.fp8 import autocast

        return autocast
    if name == "MeshResource":
        from mtjax.axes import MeshResource

        return MeshResource
    if name in _SUBPACKAGES:
        return importlib.import_module(f"mtjax.{name}")
    raise AttributeError(f"module 'mtjax' has no attribute {name!r}")
