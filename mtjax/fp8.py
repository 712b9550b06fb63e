"""FP8 training: formats, recipes, delayed-scaling state as Flax variables, FP8 GEMM.

Contract used by every mtjax GEMM (the modules call it; the FP8 work fills it in):
`DotGeneral` is a linen module called like ``lax.dot_general(lhs, rhs, dimension_numbers)``;
outside `fp8_autocast` it is exactly that, inside it runs the GEMM in FP8 and keeps its scaling
state in the ``FP8_COLLECTION`` variable collection.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax import lax

FP8_COLLECTION = "fp8_meta"


class DotGeneral(nn.Module):
    """``lax.dot_general`` as a linen module (FP8 under `fp8_autocast`)."""

    @nn.compact
    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                 preferred_element_type=None) -> jax.Array:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
