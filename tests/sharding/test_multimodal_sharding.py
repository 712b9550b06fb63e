"""T5 and the vision-language model (with its ViT encoder) on 8 virtual CPU devices (data, FSDP and
tensor parallelism at once) give the single-device losses and gradients, which reach every parameter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from mtjax.models import T5, VLM, GPTConfig, T5Config, ViTConfig, VLMConfig
from mtjax.sharding import (
    MeshConfig,
    jit_sharded,
    logical_axis_rules,
    logical_shardings,
    named_sharding,
    shard_variables,
)

pytestmark = pytest.mark.usefixtures("fast_compiles")

T5_MODEL = T5(T5Config(vocab_size=40, hidden_size=16, num_encoder_layers=1, num_decoder_layers=1, num_heads=2,
                       mlp_dim=32, relative_buckets=8, relative_max_distance=16, tie_embeddings=False))
VLM_MODEL = VLM(VLMConfig(
    vision=ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32, pooling="cls"),
    text=GPTConfig(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32, max_seq_len=16),
    fusion="cross_attention"))
RNG = np.random.default_rng(0)
ENC, DEC, TEXT = (jnp.asarray(RNG.integers(1, 40, shape), jnp.int32) for shape in ((8, 7), (8, 7), (8, 6)))
SEGMENT_IDS = jnp.asarray(np.arange(7)[None, :] < np.arange(4, 8).repeat(2)[:, None], jnp.int32)
IMAGES = jnp.asarray(RNG.normal(size=(8, 8, 8, 3)), jnp.float32)


def losses(variables, enc, dec, segment_ids, images, text):
    t5_logits = T5_MODEL.apply(variables["t5"], enc, dec[:, :-1], encoder_segment_ids=segment_ids)
    vlm_logits = VLM_MODEL.apply(variables["vlm"], images, text[:, :-1])

    def cross_entropy(logits, targets):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))

    return cross_entropy(t5_logits, dec[:, 1:]) + cross_entropy(vlm_logits, text[:, 1:])


def test_t5_and_vlm_loss_and_grads_equal_single_device():
    boxed = jax.jit(lambda key: {"t5": T5_MODEL.init(key, ENC, DEC[:, :-1], encoder_segment_ids=SEGMENT_IDS),
                                 "vlm": VLM_MODEL.init(key, IMAGES, TEXT[:, :-1])})(jax.random.key(0))
    inputs = (ENC, DEC, SEGMENT_IDS, IMAGES, TEXT)
    want_loss, want_grads = jax.jit(jax.value_and_grad(losses))(meta.unbox(boxed), *inputs)
    config = MeshConfig(dp=2, fsdp=2, tp=2)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    shardings = logical_shardings(boxed, mesh, rules)
    batch = named_sharding(mesh, rules, ("activation_batch",))
    step = jit_sharded(jax.value_and_grad(losses), mesh=mesh, rules=rules,
                       in_shardings=(shardings, *[batch] * len(inputs)), out_shardings=(None, shardings))
    loss, grads = step(shard_variables(boxed, mesh, rules), *(jax.device_put(x, batch) for x in inputs))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # Every parameter gets a gradient (the image encoder's through the projector and cross-attention).
    norms = {jax.tree_util.keystr(p): float(jnp.linalg.norm(g)) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    assert all(np.isfinite(n) and n > 0 for n in norms.values()), norms
    # Tensor parallelism really splits the layers (the heads of T5's fused attention kernels).
    specs = jax.tree.map(lambda s: s.spec, shardings)
    assert "tp" in str(specs["t5"]["params"]["encoder"]["layers"]["self_attention"]["qkv"]["kernel"])
