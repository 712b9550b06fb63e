"""The GPT model on 8 virtual CPU devices: data, FSDP, tensor and sequence parallelism give the
single-device loss and gradients, and the collectives are the expected ones. (FP8 on a mesh, with
the meta the same on every device, is tested with the pipelined GPT in test_pipeline_gpt.py.)"""

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.models import GPT, gpt_config
from mtjax.sharding import (
    MeshConfig,
    jit_sharded,
    logical_axis_rules,
    logical_shardings,
    named_sharding,
    shard_variables,
)

pytestmark = pytest.mark.usefixtures("fast_compiles")

CONFIG = gpt_config("tiny", vocab_size=64, hidden_size=32, mlp_dim=64, max_seq_len=16)  # 4 heads, 2 kv heads
MODEL = GPT(CONFIG)
TOKENS = jax.random.randint(jax.random.key(1), (8, 9), 0, CONFIG.vocab_size)


def loss_fn(variables, tokens, model=MODEL):
    logits = model.apply(variables, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@pytest.fixture(scope="module")
def boxed():
    return jax.jit(MODEL.init)(jax.random.key(0), TOKENS[:, :-1])


@pytest.fixture(scope="module")
def reference(boxed):
    """Single-device loss and gradients."""
    return jax.jit(jax.value_and_grad(loss_fn))(nn.meta.unbox(boxed), TOKENS)


def sharded_value_and_grad(mesh_config, boxed, model=MODEL):
    mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
    variables = shard_variables(boxed, mesh, rules)
    shardings = logical_shardings(boxed, mesh, rules)
    tokens_sharding = named_sharding(mesh, rules, ("activation_batch", None))
    step = jit_sharded(jax.value_and_grad(functools.partial(loss_fn, model=model)), mesh=mesh, rules=rules,
                       in_shardings=(shardings, tokens_sharding), out_shardings=(None, shardings))
    return step(variables, jax.device_put(TOKENS, tokens_sharding)), shardings


@pytest.mark.parametrize("mesh_config,collective_matmul", [
    (MeshConfig(dp=2, fsdp=4), False),
    (MeshConfig(dp=4, tp=2), False),
    (MeshConfig(dp=2, fsdp=2, tp=2, sp=True), False),
    (MeshConfig(dp=2, fsdp=2, tp=2, sp=True), True),
], ids=["dp2-fsdp4", "dp4-tp2", "dp2-fsdp2-tp2-sp", "dp2-fsdp2-tp2-sp-collective-matmul"])
def test_loss_and_grads_equal_single_device(boxed, reference, mesh_config, collective_matmul):
    model = GPT(dataclasses.replace(CONFIG, collective_matmul=collective_matmul))
    (loss, grads), shardings = sharded_value_and_grad(mesh_config, boxed, model)
    want_loss, want_grads = reference
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # Gradients come back sharded like their parameters (FSDP: reduce-scattered, not replicated).
    assert jax.tree.map(lambda g: g.sharding.spec, grads) == jax.tree.map(lambda s: s.spec, shardings)


def _collectives(mesh_config, boxed):
    mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
    forward = jit_sharded(lambda v, t: MODEL.apply(v, t), mesh=mesh, rules=rules)
    hlo = forward.lower(shard_variables(boxed, mesh, rules), TOKENS[:, :-1]).compile().as_text()
    collective = re.compile(r"= \S+ (all-reduce|reduce-scatter|all-gather)(-start)?\(")
    return [line for line in hlo.splitlines() if collective.search(line)]


def test_sequence_parallel_collectives(boxed):
    """Forward pass, dp=4 x tp=2. Without sp the row-parallel outputs are all-reduced over tp and
    nothing is gathered; with sp the residual stream is sequence-split: its [batch/4, seq/2, hidden]
    pieces are all-gathered over tp before the column-parallel GEMMs. (XLA's CPU pipeline has no
    reduce-scatter creator: the reduce-scatter after a row-parallel GEMM shows as an all-reduce and
    a slice here and becomes one reduce-scatter on GPU.)"""
    batch, seq, hidden = 2, 8, CONFIG.hidden_size  # per dp shard
    plain = _collectives(MeshConfig(dp=4, tp=2), boxed)
    assert not [line for line in plain if "all-gather" in line]
    assert [line for line in plain if f"f32[{batch},{seq},{hidden}]" in line and "all-reduce" in line]
    sequence_parallel = _collectives(MeshConfig(dp=4, tp=2, sp=True), boxed)
    gathers = [line for line in sequence_parallel
               if "all-gather" in line and f"f32[{batch},{seq},{hidden}]" in line and "dimensions={1}" in line]
    # In the scanned layer body (once in the HLO): before the QKV and the fc1 GEMMs; and before the logits.
    assert len(gathers) >= 3, sequence_parallel
