"""mtjax: fused Transformer layers, Pallas kernels, FP8 training and parallelism for JAX/Flax."""

__version__ = "0.1.0"

from mtjax import backend as backend
from mtjax import config as config

# Before anything can initialise jax's backends: a plugin registered after that would be ignored.
backend.load_plugins_from_env()

# Importing the ops registers their implementations (references and kernels) with the backend.
import mtjax.ops  # noqa: E402,F401
