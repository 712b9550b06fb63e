"""A small model whose GEMMs all run in `mtjax.fp8.DotGeneral` (shared by the FP8 tests)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax import fp8


class Dense(nn.Module):
    """x [..., in] @ kernel [in, features] through a DotGeneral; f32 params, compute in ``dtype``."""

    features: int
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return fp8.DotGeneral()(x.astype(self.dtype), kernel.astype(self.dtype), dims)


class MLP(nn.Module):
    """Dense -> GELU -> Dense."""

    hidden: int
    out: int
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        h = jax.nn.gelu(Dense(self.hidden, self.dtype)(x))
        return Dense(self.out, self.dtype)(h)
