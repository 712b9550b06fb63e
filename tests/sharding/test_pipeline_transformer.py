"""The pipeline with real layers: a stack of scanned `mtjax.flax.TransformerLayer`s (causal, RoPE,
GQA) under `fp8_autocast`, pipelined over pp=2 with FSDP and tensor parallelism inside the stages
(the layers' logical constraints resolve against the rules inside ``shard_map``).

One test, FP8 on purpose: it covers the f32 path (the non-GEMM ops and the parameter gradients) and
the FP8 meta riding on the gradient through the schedule; the plain-f32 equality of the executor is
tested tightly on the MLP stack in test_pipeline.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtjax import fp8
from mtjax.flax import TransformerLayer, TransformerLayerType
from mtjax.sharding import MeshConfig, OneFOneB, jit_sharded, logical_axis_rules, named_sharding, pipeline_loss, shard_variables

LAYER = dict(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4, num_gqa_groups=2,
             layer_type=TransformerLayerType.ENCODER, self_attn_mask_type="causal", hidden_dropout=0.0,
             attention_dropout=0.0, intermediate_dropout=0.0, enable_rotary_pos_emb=True)
NUM_LAYERS, BATCH, SEQ = 4, 8, 8


class _Block(TransformerLayer):
    def __call__(self, x):  # noqa: D102 - the (carry, output) pair nn.scan wants
        return super().__call__(x, deterministic=True), None


class Stack(nn.Module):
    """The unpipelined reference: the layers under ``nn.scan``, parameters stacked on "layers"."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_Block, variable_axes={"params": 0, fp8.FP8_COLLECTION: 0}, split_rngs={"params": True},
                       length=NUM_LAYERS, metadata_params={nn.PARTITION_NAME: "layers"})
        return scan(name="layers", **LAYER)(x)[0]


def layer_fn(variables, h):
    return TransformerLayer(**LAYER).apply(variables, h, deterministic=True)


def head_loss(head, h, target):
    return jnp.mean((h @ head - target) ** 2)


def stacked(variables):
    """{"params": ..., "fp8_meta": ...} of the scanned layers: what the pipeline takes."""
    return {collection: tree["layers"] for collection, tree in variables.items()}


def test_fp8_transformer_stack_pipelined_with_fsdp_tp_equals_unpipelined():
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (BATCH, SEQ, LAYER["hidden_size"]))
    target = jax.random.normal(k[1], (BATCH, SEQ, 4))
    head = jax.random.normal(k[2], (LAYER["hidden_size"], 4)) / 8
    config = MeshConfig(pp=2, fsdp=2, tp=2)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    with fp8.fp8_autocast():
        boxed = jax.jit(Stack().init)(jax.random.key(1), x)

        def reference(variables, x, head):
            return head_loss(head, Stack().apply(variables, x), target)

        want_loss, want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(nn.meta.unbox(boxed), x, head)

        def pipelined(layers, x, head):
            return pipeline_loss(layer_fn, layers, x, head_loss, head, target, mesh=mesh, schedule=OneFOneB(4))

        variables = shard_variables(boxed, mesh, rules)  # layers split over pp, heads / MLP over tp
        x_sharding = named_sharding(mesh, rules, ("activation_batch", None, None))
        step = jit_sharded(jax.value_and_grad(pipelined, argnums=(0, 1, 2)), mesh=mesh, rules=rules)
        loss, grads = step(stacked(variables), jax.device_put(x, x_sharding), head)
    # Same scales (delayed scaling: from the meta passed in), so the same FP8 values: only the
    # order of the f32 sums differs (micro-batches, tp shards).
    tolerance = dict(rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(loss, want_loss, **tolerance)
    want = (stacked(want[0]), *want[1:])
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, **tolerance)
    # The new meta (compared above): amaxes of the micro-batches combined by max, as one batch gives.
    history = grads[0][fp8.FP8_COLLECTION]["mlp"]["wi_dot_general"]["input_amax_history"]
    assert float(history[:, 0].min()) > 0
