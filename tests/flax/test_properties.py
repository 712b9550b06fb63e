"""Hypothesis over shapes and options: rotary embeddings, MultiHeadAttention against the reference op,
LayerNormMLP against its composition. Shapes come from small sets: modules run eagerly, and eager ops
compile once per shape, so examples that share shapes share compilations; MultiHeadAttention's examples
share few (each draws its own options), so each runs as jitted programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from hypothesis import example, given
from hypothesis import strategies as st

from mtjax import ops
from mtjax.flax import LayerNormMLP, MultiHeadAttention, apply_rotary_pos_emb
from mtjax.flax.attention import _rotate_pairs

pytestmark = pytest.mark.usefixtures("fast_compiles")


def rand(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale)


@given(half=st.sampled_from([1, 4]), method=st.sampled_from(["consecutive", "alternate"]), shift=st.integers(-50, 50),
       seed=st.integers(0, 100))
def test_rotary_is_a_rotation_by_relative_position(half, method, shift, seed):
    head_dim = 2 * half
    q, k = rand(seed, (1, 5, 2, head_dim)), rand(seed + 1, (1, 5, 2, head_dim))
    pos = jnp.array([[0, 3, 7, 60, 61]])

    def rope(x, p):
        return apply_rotary_pos_emb(x, p, windows=(1.0, 10000.0), group_method=method)

    # norms are kept, and q.k depends only on the distance between positions
    np.testing.assert_allclose(jnp.linalg.norm(rope(q, pos), axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    scores = jnp.einsum("bqnd,bknd->bnqk", rope(q, pos), rope(k, pos))
    shifted = jnp.einsum("bqnd,bknd->bnqk", rope(q, pos + 100 + shift), rope(k, pos + 100 + shift))
    np.testing.assert_allclose(scores, shifted, rtol=2e-4, atol=2e-4)
    # "consecutive" pairs (2i, 2i+1), "alternate" pairs (i, i + d/2): the same rotation, permuted
    perm = np.arange(head_dim).reshape(2, half).T.reshape(-1)  # alternate layout -> consecutive layout
    other = "alternate" if method == "consecutive" else "consecutive"
    if method == "alternate":
        np.testing.assert_allclose(rope(q, pos)[..., perm],
                                   apply_rotary_pos_emb(q[..., perm], pos, group_method=other), rtol=1e-5, atol=1e-6)


@given(method=st.sampled_from(["consecutive", "alternate"]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       seed=st.integers(0, 100))
def test_rotary_gradient_is_the_opposite_rotation(method, dtype, seed):
    """The custom VJP (rotate the cotangent back) equals autodiff of the rotation, in the input's dtype."""
    x, g = rand(seed, (2, 5, 3, 8)).astype(dtype), rand(seed + 1, (2, 5, 3, 8)).astype(dtype)
    pos = jnp.array([[0, 3, 7, 60, 61], [5, 6, 7, 8, 9]])
    angle = pos.astype(jnp.float32)[:, :, None, None] / 10000.0 ** (jnp.arange(4, dtype=jnp.float32) / 4)
    want = jax.vjp(lambda x: _rotate_pairs(x, jnp.sin(angle), jnp.cos(angle), method), x)[1](g)[0]
    got = jax.vjp(lambda x: apply_rotary_pos_emb(x, pos, group_method=method), x)[1](g)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=1e-6, atol=1e-6)


def test_fused_qkv_gradient_is_one_concatenate():
    """MultiHeadAttention's backward assembles the fused QKV gradient with a concatenate, no zero pads."""
    layer = MultiHeadAttention(head_dim=8, num_attention_heads=2, enable_rotary_pos_emb=True,
                               rotary_pos_emb_group_method="alternate")
    x = rand(0, (2, 6, 16))
    variables = layer.init(jax.random.key(0), x, deterministic=True)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True)[0])))
    hlo = grad.lower(variables).as_text()  # StableHLO, before XLA's simplifications
    assert "stablehlo.pad" not in hlo and "stablehlo.concatenate" in hlo


def _reference_mha(p, x, *, heads, groups, head_dim, layernorm_type, input_layernorm, rope, mask_type, seg):
    """The projections, rotary embedding and ops.attention reference, written out."""
    if input_layernorm:
        norm_params = p["qkv"] if "qkv" in p else p["query"]
        h = (ops.rmsnorm(x, norm_params["scale"]) if layernorm_type == "rmsnorm"
             else ops.layernorm(x, norm_params["scale"], norm_params["ln_bias"]))
    else:
        h = x
    if "qkv" in p:
        qkv = jnp.einsum("bsh,hcnd->bscnd", h, p["qkv"]["kernel"])
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q = jnp.einsum("bsh,hnd->bsnd", h, p["query"]["kernel"])
        if "kv" in p:
            kv = jnp.einsum("bsh,hcnd->bscnd", h, p["kv"]["kernel"])
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k = jnp.einsum("bsh,hnd->bsnd", h, p["key"]["kernel"])
            v = jnp.einsum("bsh,hnd->bsnd", h, p["value"]["kernel"])
    if rope:
        pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        q, k = apply_rotary_pos_emb(q, pos, group_method=rope), apply_rotary_pos_emb(k, pos, group_method=rope)
    # scale 1: MultiHeadAttention's default (TransformerEngine's) leaves the logits unscaled.
    o = ops.attention(q, k, v, mask_type=mask_type, q_segment_ids=seg, kv_segment_ids=seg, scale=1.0,
                      implementation="xla")
    return jnp.einsum("bsnd,ndh->bsh", o, p["out"]["kernel"])


@given(
    batch=st.integers(1, 2), length=st.sampled_from([1, 5]), groups=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([2, 4]), mask_type=st.sampled_from(["no_mask", "causal", "padding", "padding_causal"]),
    fuse=st.booleans(), input_layernorm=st.booleans(), layernorm_type=st.sampled_from(["layernorm", "rmsnorm"]),
    rope=st.sampled_from([None, "consecutive", "alternate"]), seed=st.integers(0, 100),
)
@example(batch=2, length=5, groups=2, ratio=1, head_dim=4, mask_type="padding_causal", fuse=True, input_layernorm=True,
         layernorm_type="layernorm", rope="alternate", seed=0)  # fused QKV with its norm and RoPE
def test_mha_against_reference(batch, length, groups, ratio, head_dim, mask_type, fuse, input_layernorm,
                               layernorm_type, rope, seed):
    heads, hidden = groups * ratio, 8
    x = rand(seed, (batch, length, hidden))
    seg = None
    if mask_type.startswith("padding"):
        seg = jnp.ones((batch, length), jnp.int32).at[0, length - 1:].set(0 if length > 1 else 1)
    mha = MultiHeadAttention(
        head_dim=head_dim, num_attention_heads=heads, num_gqa_groups=groups, attn_mask_type=mask_type,
        fuse_qkv_params=fuse, input_layernorm=input_layernorm, layernorm_type=layernorm_type,
        enable_rotary_pos_emb=rope is not None, rotary_pos_emb_group_method=rope or "consecutive",
    )
    p = meta.unbox(jax.jit(lambda x, seg: mha.init(jax.random.key(seed), x, q_segment_ids=seg,
                                                   deterministic=True)["params"])(x, seg))
    p = jax.tree.map(lambda a: a + rand(a.size + seed, a.shape, 0.1), p)
    out, _ = jax.jit(lambda p, x, seg: mha.apply({"params": p}, x, q_segment_ids=seg, deterministic=True))(p, x, seg)
    ref = jax.jit(lambda p, x, seg: _reference_mha(p, x, heads=heads, groups=groups, head_dim=head_dim,
                                                   layernorm_type=layernorm_type, input_layernorm=input_layernorm,
                                                   rope=rope, mask_type=mask_type, seg=seg))(p, x, seg)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


@given(activation=st.sampled_from(sorted(ops.ACTIVATIONS)), hidden=st.sampled_from([1, 4]), dim=st.sampled_from([2, 3]),
       use_bias=st.booleans(), seed=st.integers(0, 100))
def test_layernorm_mlp_against_composition(activation, hidden, dim, use_bias, seed):
    x = rand(seed, (2, 3, hidden))
    mlp = LayerNormMLP(intermediate_dim=dim, activations=activation, use_bias=use_bias, intermediate_dropout_rate=0.5)
    p = meta.unbox(mlp.init(jax.random.key(seed), x, deterministic=True)["params"])
    p = jax.tree.map(lambda a: a + rand(a.size + seed, a.shape, 0.3), p)
    y, _ = mlp.apply({"params": p}, x, deterministic=True)
    h = ops.layernorm(x, p["scale"], p["ln_bias"], implementation="xla")
    pre = jnp.einsum("bsh,hkm->bskm", h, p["wi_kernel"])  # [..., 2, dim] gated, [..., 1, dim] otherwise
    bias = p["wi_bias"] if use_bias else None
    if not ops.is_gated(activation):
        pre, bias = pre[..., 0, :], None if bias is None else bias[0]
    a = ops.activation(pre, activation, bias, implementation="xla")
    expected = a @ p["wo_kernel"] + (p["wo_bias"] if use_bias else 0.0)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
