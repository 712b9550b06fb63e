"""mtjax: fused Transformer layers, Pallas kernels, FP8 training and parallelism for JAX/Flax."""

__version__ = "0.1.0"

from mtjax import backend as backend  # noqa: E402
from mtjax.config import config as config  # noqa: E402

backend.load_plugins_from_env()
