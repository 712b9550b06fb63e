"""The kernels inside ``jax.shard_map`` with its type checks on (``check_vma=True``, the default):
their outputs vary over the mesh axes their operands vary over, and a replicated operand's gradient
(a norm's gamma) is summed over the mesh, as autodiff of the references does."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mtjax import fp8, ops


def _mesh():
    return jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))


def test_every_kernel_traces_inside_shard_map(caplog):
    """Each op's CUDA branch (a kernel, at these sizes) is traced inside shard_map; one that failed
    would be replaced by the reference with a warning (and fail outright on a GPU)."""

    def body(x, g, w):
        q = x.reshape(x.shape[0] // 512, 512, 16, 128)
        dense = (((1,), (0,)), ((), ()))
        out = [
            jax.grad(lambda x, g: jnp.sum(ops.layernorm(x, g, g).astype(jnp.float32)), argnums=(0, 1))(x, g),
            jax.grad(lambda x, g: jnp.sum(ops.rmsnorm(x, g).astype(jnp.float32)), argnums=(0, 1))(x, g),
            jax.grad(lambda x: jnp.sum(ops.activation(x, "gelu").astype(jnp.float32)))(x),
            jax.grad(lambda x: jnp.sum(ops.softmax(x).astype(jnp.float32) ** 2))(x),
            jax.grad(lambda q: jnp.sum(ops.attention(q, q, q, mask_type="causal").astype(jnp.float32)))(q),
            ops.cast_transpose(x, jnp.float32(1.0), jnp.float8_e4m3fn),
            ops.tile_quantize(x, jnp.float8_e4m3fn, transpose=True),
            ops.block_quantize(w, jnp.float8_e4m3fn),
            jax.grad(lambda x, w: jnp.sum(fp8.fp8_dot_general(x, w, dense, recipe=fp8.BlockScaling())
                                          .astype(jnp.float32)), argnums=(0, 1))(x, w),
        ]
        return jax.tree.map(lambda a: jnp.sum(a.astype(jnp.float32))[None], out)

    f = jax.shard_map(body, mesh=_mesh(), in_specs=(P("dp"), P(), P()), out_specs=P("dp"))
    shapes = (jax.ShapeDtypeStruct((8 * 4096, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048,), jnp.bfloat16),
              jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16))
    with caplog.at_level(logging.WARNING, logger="mtjax"):
        jax.jit(f).trace(*shapes)
    # cuDNN's attention cannot be traced without cuDNN (this machine), whatever the mesh
    # (The kernels cannot run interpreted there: Pallas' interpreter mixes the operands' types.)
    failed = [m for m in (r.getMessage() for r in caplog.records) if "cannot be traced" in m and "cudnn" not in m]
    assert not failed, failed
