"""The pipeline on the GPT model itself: its scanned layers pipelined over pp=2 with FSDP and tensor
parallelism inside the stages, under `fp8_autocast`, give GPT's loss, gradients and new FP8 meta,
and that meta is the same on every device.

The model is cut into its embedding, its scanned ``TransformerLayer`` and its head (final norm and
tied output layer) by recording those sub-modules while GPT initialises; each runs on GPT's own
variables. FP8 on purpose: it covers the f32 path (non-GEMM ops, parameter gradients) and the meta
riding on the gradient through the schedule; plain-f32 equality of the executor is checked tightly
on the MLP stack in test_pipeline.py."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import fp8
from mtjax.flax import Embed, LayerNorm, TransformerLayer
from mtjax.models import GPT, gpt_config
from mtjax.sharding import (
    DualPipeV,
    MeshConfig,
    OneFOneB,
    jit_sharded,
    logical_axis_rules,
    pipeline_loss,
    shard_variables,
)

pytestmark = pytest.mark.usefixtures("fast_compiles")

CONFIG = gpt_config("tiny", vocab_size=64, hidden_size=32, mlp_dim=64, max_seq_len=16)  # 2 layers, GQA 4/2
TOKENS = jax.random.randint(jax.random.key(1), (8, 9), 0, CONFIG.vocab_size)


def cross_entropy(logits, targets):
    # One-hot, not take_along_axis: a gather along the tp-split vocabulary inside the pipeline's
    # shard_map (pp manual, tp automatic) crashes XLA's SPMD partitioner (jax 0.11.2).
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * one_hot, axis=-1))


def gpt_parts(model):
    """GPT's embedding, layer and final norm as unbound modules with GPT's settings."""
    found = {}

    def record(next_fun, args, kwargs, context):
        found.setdefault(context.module.name, context.module)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(model.init, jax.random.key(0), TOKENS[:, :-1])

    def unbound(name, cls):
        fields = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")]
        return cls(**{field: getattr(found[name], field) for field in fields})

    return unbound("token_embed", Embed), unbound("layers", TransformerLayer), unbound("final_norm", LayerNorm)


def sub(variables, name):
    """The variables (every collection) of GPT's sub-module ``name``."""
    return {col: tree[name] for col, tree in variables.items() if name in tree}


@pytest.mark.parametrize("num_layers,schedule", [(2, OneFOneB(4)), (4, DualPipeV(4))], ids=["1f1b", "dualpipev"])
def test_fp8_gpt_pipelined_with_fsdp_tp_equals_gpt(num_layers, schedule):
    """pp=2 with fsdp and tp inside the stages; DualPipeV: 4 layers as a V of 4 stages over 2 devices,
    its weight gradients split from the input gradients."""
    model = GPT(dataclasses.replace(CONFIG, num_layers=num_layers))
    embed, layer, final_norm = gpt_parts(model)
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]

    def layer_fn(variables, h):
        return layer.apply(variables, h, deterministic=True)

    def head_loss(head, h, targets):  # final norm, tied output layer, cross-entropy
        logits = embed.apply(sub(head, "token_embed"), final_norm.apply(sub(head, "final_norm"), h), method="attend",
                             preferred_element_type=jnp.float32)
        return cross_entropy(logits, targets)

    def pipelined(variables):
        h = embed.apply(sub(variables, "token_embed"), inputs)
        head = {col: {name: tree[name] for name in ("token_embed", "final_norm") if name in tree}
                for col, tree in variables.items()}
        return pipeline_loss(layer_fn, sub(variables, "layers"), h, head_loss, head, targets, mesh=mesh,
                             schedule=schedule)

    config = MeshConfig(pp=2, fsdp=2, tp=2)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    with fp8.fp8_autocast():
        boxed = jax.jit(model.init)(jax.random.key(0), inputs)
        want_loss, want = jax.jit(jax.value_and_grad(lambda v: cross_entropy(model.apply(v, inputs), targets)))(
            nn.meta.unbox(boxed))
        variables = shard_variables(boxed, mesh, rules)  # layers split over pp, heads / MLP over tp, embed over fsdp
        loss, grads = jit_sharded(jax.value_and_grad(pipelined), mesh=mesh, rules=rules)(variables)
    # Same scales (delayed scaling: from the meta passed in), so the same FP8 values: only the order
    # of the f32 sums differs (micro-batches, shards).
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6)
    # The new meta (compared above) holds the amaxes of all micro-batches, combined by max, and every
    # device holding a piece of it (the layers' meta is split over pp) holds the same values.
    new_meta = grads[fp8.FP8_COLLECTION]
    assert float(new_meta["layers"]["mlp"]["wi_dot_general"]["input_amax_history"][:, 0].min()) > 0
    for leaf in jax.tree.leaves(new_meta):
        pieces = {}
        for shard in leaf.addressable_shards:
            pieces.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        assert sum(map(len, pieces.values())) == 8
        for copies in pieces.values():
            for copy in copies:
                np.testing.assert_array_equal(copy, copies[0])
