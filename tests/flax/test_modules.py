"""mtjax.flax modules against stock Flax (same parameters -> same outputs and gradients) and the ops."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from mtjax import ops
from mtjax.flax import (
    DenseGeneral,
    DotProductAttention,
    Embed,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
)
from mtjax.flax.attention import diagonals_to_matrix

pytestmark = pytest.mark.usefixtures("fast_compiles")

RTOL = ATOL = 1e-5


def rand(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale)


def init_params(module, *args, **kwargs):
    return meta.unbox(module.init(jax.random.key(0), *args, **kwargs)["params"])


def perturbed(params, seed=0):
    """``params`` plus noise, so norm scales are not ones and biases not zeros."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([a + rand(seed * 1000 + i, a.shape, 0.1) for i, a in enumerate(leaves)])


def close(a, b, rtol=RTOL, atol=ATOL):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


def check_parity(f_ours, our_params, f_theirs, their_params, grads_to_theirs, x):
    """``f(params, x)`` of both sides: same outputs, and the same gradients w.r.t. the input and the
    parameters (ours mapped by ``grads_to_theirs`` onto the other side's names)."""
    y = jax.jit(f_theirs)(their_params, x)
    w = rand(99, y.shape)
    close(jax.jit(f_ours)(our_params, x), y)
    g_ours = jax.jit(jax.grad(lambda p, x: jnp.sum(f_ours(p, x) * w), argnums=(0, 1)))(our_params, x)
    g_theirs = jax.jit(jax.grad(lambda p, x: jnp.sum(f_theirs(p, x) * w), argnums=(0, 1)))(their_params, x)
    close(grads_to_theirs(g_ours[0]), g_theirs[0])
    close(g_ours[1], g_theirs[1])


def applied(module, **kwargs):
    return lambda p, x: module.apply({"params": p}, x, **kwargs)


# ---------------------------------------------------------------------------- norms and dense


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layernorm_matches_flax(zero_centered_gamma):
    x = rand(0, (3, 5, 16), 2.0) + 1.0
    ours = LayerNorm(epsilon=1e-5, zero_centered_gamma=zero_centered_gamma)
    p = {"scale": rand(1, (16,), 0.3) + (0.0 if zero_centered_gamma else 1.0), "ln_bias": rand(2, (16,))}
    theirs = {"scale": p["scale"] + (1.0 if zero_centered_gamma else 0.0), "bias": p["ln_bias"]}
    check_parity(applied(ours), p, applied(nn.LayerNorm(epsilon=1e-5)), theirs,
                 lambda g: {"scale": g["scale"], "bias": g["ln_bias"]}, x)


def test_rmsnorm_matches_flax():
    x = rand(0, (4, 16), 2.0)
    p = {"scale": rand(1, (16,), 0.3) + 1.0}
    check_parity(applied(LayerNorm(layernorm_type="rmsnorm", epsilon=1e-5)), p, applied(nn.RMSNorm(epsilon=1e-5)), p,
                 lambda g: g, x)


def test_layernorm_params_and_dtype():
    params = init_params(LayerNorm(layernorm_type="rmsnorm"), jnp.ones((2, 8)))
    assert set(params) == {"scale"}
    y = LayerNorm(dtype=jnp.bfloat16).apply({"params": init_params(LayerNorm(), jnp.ones((2, 8)))}, rand(0, (2, 8)))
    assert y.dtype == jnp.bfloat16


@pytest.mark.parametrize("features,axis", [(6, -1), ((2, 3), (-2, -1))])
def test_dense_general_matches_flax(features, axis):
    x = rand(0, (2, 4, 5))
    ours = DenseGeneral(features, axis=axis)
    p = init_params(ours, x)
    p = {"kernel": rand(1, p["kernel"].shape), "bias": rand(2, p["bias"].shape)}
    check_parity(applied(ours), p, applied(nn.DenseGeneral(features, axis=axis)), p, lambda g: g, x)


def test_dense_general_matches_flax_dense():
    x = rand(0, (3, 7))
    p = {"kernel": rand(1, (7, 5)), "bias": rand(2, (5,))}
    check_parity(applied(DenseGeneral(5)), p, applied(nn.Dense(5)), p, lambda g: g, x)


def test_dense_kernel_init_uses_flat_fans():
    # fan-in of [64, 3, 4, 8] is 64 (not 3 * 4 * 64): std of lecun_normal is 1/8
    kernel = init_params(DenseGeneral((3, 4, 8), use_bias=False), jnp.ones((1, 64)))["kernel"]
    assert 0.1 < float(jnp.std(kernel)) < 0.15


def test_layernorm_dense_general_is_layernorm_then_dense():
    x = rand(0, (2, 3, 8), 3.0)
    ours = LayerNormDenseGeneral(features=(2, 4), use_bias=True, return_layernorm_output=True, epsilon=1e-5)
    p = {"scale": rand(1, (8,)), "ln_bias": rand(2, (8,)), "kernel": rand(3, (8, 2, 4)), "bias": rand(4, (2, 4))}

    class Theirs(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.LayerNorm(epsilon=1e-5, name="ln")(x)
            return nn.DenseGeneral((2, 4), name="dense")(y), y

    def to_theirs(p):
        return {"ln": {"scale": p["scale"], "bias": p["ln_bias"]}, "dense": {"kernel": p["kernel"], "bias": p["bias"]}}

    def summed(module):  # both outputs enter the loss
        return lambda p, x: (lambda y, ln: y + jnp.sum(ln))(*module.apply({"params": p}, x))

    check_parity(summed(ours), p, summed(Theirs()), to_theirs(p), to_theirs, x)


# ---------------------------------------------------------------------------- MLP


@pytest.mark.parametrize("activations,gated", [(("gelu",), False), (("silu", "linear"), True)])
def test_layernorm_mlp_matches_composition(activations, gated):
    x = rand(0, (2, 3, 8))
    ours = LayerNormMLP(intermediate_dim=16, activations=activations, use_bias=True, layernorm_type="rmsnorm",
                        intermediate_dropout_rate=0.0)
    p = init_params(ours, x, deterministic=True)
    p = {k: rand(i, v.shape, 0.5) for i, (k, v) in enumerate(sorted(p.items()))}
    y, ln_out = ours.apply({"params": p}, x, deterministic=True)
    assert ln_out is None
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["scale"]
    pre = jnp.einsum("bsh,hkm->bskm", h, p["wi_kernel"]) + p["wi_bias"]
    act = jax.nn.silu(pre[..., 0, :]) * pre[..., 1, :] if gated else jax.nn.gelu(pre[..., 0, :], approximate=True)
    close(y, act @ p["wo_kernel"] + p["wo_bias"], rtol=1e-4, atol=1e-4)


def test_layernorm_mlp_intermediate_dropout():
    x = rand(0, (2, 4, 8))
    mlp = LayerNormMLP(intermediate_dim=32, intermediate_dropout_rate=0.5)
    v = mlp.init(jax.random.key(0), x, deterministic=True)
    det, _ = mlp.apply(v, x, deterministic=True)
    a, _ = mlp.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    b, _ = mlp.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(a, det) and not np.allclose(a, b)
    with pytest.raises(Exception, match="dropout"):
        mlp.apply(v, x, deterministic=False)


# ---------------------------------------------------------------------------- attention


@pytest.mark.parametrize("masked", [False, True])
def test_mha_matches_flax_multi_head_dot_product_attention(masked):
    batch, length, hidden, heads = 2, 5, 16, 4
    x = rand(0, (batch, length, hidden))
    mask = nn.make_causal_mask(jnp.ones((batch, length)), dtype=bool) if masked else None
    theirs = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=hidden, deterministic=True)
    tp = init_params(theirs, x, x, mask=mask)
    tp = jax.tree.map(lambda a: rand(a.size, a.shape, 0.5), tp)
    ours = MultiHeadAttention(head_dim=hidden // heads, num_attention_heads=heads, input_layernorm=False,
                              fuse_qkv_params=False, use_bias=True, attn_mask_type="no_mask", scale_attn_logits=True)

    def to_theirs(p):
        return {name: p[name] for name in ("query", "key", "value", "out")}

    check_parity(lambda p, x: ours.apply({"params": p}, x, None, mask, deterministic=True)[0], tp,
                 lambda p, x: theirs.apply({"params": p}, x, x, mask=mask), tp, to_theirs, x)


@pytest.fixture(scope="module")
def gqa_case():
    batch, length, hidden, heads, groups, head_dim = 2, 6, 16, 4, 2, 8
    x = rand(0, (batch, length, hidden))
    mha = MultiHeadAttention(head_dim=head_dim, num_attention_heads=heads, num_gqa_groups=groups,
                             layernorm_type="rmsnorm", attn_mask_type="padding_causal", scale_attn_logits=True)
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    p = init_params(mha, x, q_segment_ids=seg, deterministic=True)
    return mha, p, x, seg


def test_mha_gqa_against_reference_attention(gqa_case):
    mha, p, x, seg = gqa_case
    out, _ = mha.apply({"params": p}, x, q_segment_ids=seg, deterministic=True)
    assert set(p) == {"query", "kv", "out"} and p["kv"]["kernel"].shape == (16, 2, 2, 8)
    h = ops.rmsnorm(x, p["query"]["scale"])
    q = jnp.einsum("bsh,hnd->bsnd", h, p["query"]["kernel"])
    kv = jnp.einsum("bsh,hknd->bsknd", h, p["kv"]["kernel"])
    ref = ops.attention(q, kv[:, :, 0], kv[:, :, 1], mask_type="padding_causal", q_segment_ids=seg,
                        kv_segment_ids=seg, implementation="xla")
    close(out, jnp.einsum("bsnd,ndh->bsh", ref, p["out"]["kernel"]), rtol=1e-4, atol=1e-5)


def test_mha_fused_qkv_equals_separate_projections():
    x = rand(0, (2, 5, 16))
    fused = MultiHeadAttention(head_dim=4, num_attention_heads=4, use_bias=True)
    split = fused.clone(fuse_qkv_params=False)
    p = init_params(fused, x, deterministic=True)
    qkv = p["qkv"]
    sp = {"query": {"kernel": qkv["kernel"][:, 0], "bias": qkv["bias"][0], "scale": qkv["scale"],
                    "ln_bias": qkv["ln_bias"]},
          "key": {"kernel": qkv["kernel"][:, 1], "bias": qkv["bias"][1]},
          "value": {"kernel": qkv["kernel"][:, 2], "bias": qkv["bias"][2]}, "out": p["out"]}
    close(fused.apply({"params": p}, x, deterministic=True)[0], split.apply({"params": sp}, x, deterministic=True)[0])


def test_mha_cross_attention_uses_query_and_kv():
    q_in, kv_in = rand(0, (2, 3, 16)), rand(1, (2, 7, 16))
    mha = MultiHeadAttention(head_dim=4, num_attention_heads=4, attn_mask_type="no_mask", return_layernorm_output=True)
    p = init_params(mha, q_in, kv_in, deterministic=True)
    assert set(p) == {"query", "kv", "out"}
    out, ln_out = mha.apply({"params": p}, q_in, kv_in, deterministic=True)
    assert out.shape == (2, 3, 16) and ln_out.shape == (2, 3, 16)


def test_scaled_query_init():
    """TransformerEngine's default: the query kernel starts divided by sqrt(head_dim), keys and values not."""
    x = jnp.ones((1, 2, 64))
    base = MultiHeadAttention(head_dim=16, num_attention_heads=4)
    assert base.scaled_query_init and not base.scale_attn_logits
    k1, k0 = (jax.jit(lambda m=m: init_params(m, x, deterministic=True))()["qkv"]["kernel"]
              for m in (base, base.clone(scaled_query_init=False)))
    close(k1[:, 0], k0[:, 0] / 4.0)
    close(k1[:, 1:], k0[:, 1:])


def test_dot_product_attention_options_match_op():
    q, k, v = rand(0, (2, 5, 4, 8)), rand(1, (2, 5, 2, 8)), rand(2, (2, 5, 2, 8))
    bias = rand(3, (1, 4, 5, 5))
    dpa = DotProductAttention(head_dim=8, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="causal",
                              attn_bias_type="pre_scale_bias", scale_factor=0.5, window_size=(2, 0),
                              logits_soft_cap=3.0)
    out = dpa.apply({}, q, k, v, None, bias, deterministic=True)
    ref = ops.attention(q, k, v, bias=bias * 0.5, mask_type="causal", scale=0.5, window_size=(2, 0),
                        logits_soft_cap=3.0)
    close(out, ref)
    sbhd = dpa.clone(transpose_batch_sequence=True).apply(
        {}, *(jnp.swapaxes(t, 0, 1) for t in (q, k, v)), None, bias, deterministic=True)
    close(jnp.swapaxes(sbhd, 0, 1), out)


def test_attention_dropout_needs_rng_and_changes_output():
    q = rand(0, (1, 6, 2, 4))
    dpa = DotProductAttention(head_dim=4, num_attention_heads=2, attention_dropout=0.5)
    det = dpa.apply({}, q, q, q, deterministic=True)
    drop = dpa.apply({}, q, q, q, deterministic=False, rngs={"dropout": jax.random.key(0)})
    assert not np.allclose(det, drop)


def test_relative_position_biases_buckets():
    def t5_bucket(rel, bidirectional, num_buckets, max_distance):  # plain-Python T5 bucketing
        n, ret = -rel, 0
        if bidirectional:
            num_buckets //= 2
            ret = num_buckets if n < 0 else 0
            n = abs(n)
        else:
            n = max(n, 0)
        exact = num_buckets // 2
        if n < exact:
            return ret + n
        large = exact + int(np.log(n / exact) / np.log(max_distance / exact) * (num_buckets - exact))
        return ret + min(large, num_buckets - 1)

    rpb = RelativePositionBiases(num_buckets=8, max_distance=20, num_attention_heads=3)
    p = init_params(rpb, 30, 30)
    for bidirectional in (True, False):
        out = rpb.apply({"params": p}, 30, 30, bidirectional)
        assert out.shape == (1, 3, 30, 30)
        expected = np.array([[t5_bucket(j - i, bidirectional, 8, 20) for j in range(30)] for i in range(30)])
        close(out[0], p["rel_embedding"][:, expected])
    # A decoding step: its 2 queries sit at positions 7 and 8 of a 30-key cache.
    out = rpb.apply({"params": p}, 2, 30, False, q_offset=jnp.int32(7))
    expected = np.array([[t5_bucket(j - (7 + i), False, 8, 20) for j in range(30)] for i in range(2)])
    close(out[0], p["rel_embedding"][:, expected])


@pytest.mark.parametrize("q_len,k_len,bidirectional,offset", [(9, 9, True, 0), (1, 12, False, 5), (4, 11, False, 3),
                                                              (16, 5, True, 0)])
def test_relative_position_biases_gradient_is_the_gathers(q_len, k_len, bidirectional, offset):
    """The diagonal layout gives the table the gradient of a plain gather of its buckets."""
    rpb = RelativePositionBiases(num_buckets=8, max_distance=20, num_attention_heads=3)
    table = init_params(rpb, q_len, k_len)["rel_embedding"]
    relative = jnp.arange(k_len)[None, :] - (offset + jnp.arange(q_len)[:, None])
    bucket = rpb._bucket(relative, bidirectional)
    cotangent = rand(1, (1, 3, q_len, k_len))

    def loss(table, gather):
        out = (jnp.take(table, bucket, axis=1)[None] if gather else
               rpb.apply({"params": {"rel_embedding": table}}, q_len, k_len, bidirectional, q_offset=offset))
        return (out * cotangent).sum()

    close(loss(table, False), loss(table, True))
    close(jax.grad(loss)(table, False), jax.grad(loss)(table, True))


def test_diagonals_to_matrix():
    per_distance = jnp.arange(2 * 6, dtype=jnp.float32).reshape(2, 6)  # q=3, k=4
    out = diagonals_to_matrix(per_distance, 3, 4)
    expected = np.array([[[per_distance[h, j - i + 2] for j in range(4)] for i in range(3)] for h in range(2)])
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="q_seqlen \\+ k_seqlen - 1"):
        diagonals_to_matrix(per_distance, 3, 3)


# ---------------------------------------------------------------------------- Transformer layer


def _sub(params, name):
    return {"params": params[name]}


@pytest.mark.parametrize("post_ln", [False, True])
def test_transformer_layer_wiring(post_ln):
    """The layer is the documented composition of its sub-modules (pre-LN, or BERT's post-LN)."""
    x = rand(0, (2, 5, 16))
    layer = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, intermediate_dropout=0.0, mlp_activations=("gelu",),
                             output_layernorm=post_ln, apply_residual_connection_post_layernorm=post_ln,
                             self_attn_mask_type="padding" if post_ln else "causal", use_bias=post_ln,
                             enable_relative_embedding=False)
    seg = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    p = init_params(layer, x, segment_ids=seg, deterministic=True)
    p = jax.tree.map(lambda a: a + rand(a.size, a.shape, 0.1), p)
    out = layer.apply({"params": p}, x, segment_ids=seg, deterministic=True)
    mha = MultiHeadAttention(head_dim=4, num_attention_heads=4, input_layernorm=not post_ln, use_bias=post_ln,
                             attn_mask_type="padding" if post_ln else "causal")
    mlp = LayerNormMLP(intermediate_dim=32, intermediate_dropout_rate=0.0, use_bias=post_ln,
                       return_layernorm_output=True)
    a, _ = mha.apply(_sub(p, "self_attention"), x, q_segment_ids=seg, deterministic=True)
    x1 = x + a
    m, ln = mlp.apply(_sub(p, "mlp"), x1, deterministic=True)
    if post_ln:
        expected = LayerNorm().apply(_sub(p, "output_layernorm"), ln + m)
    else:
        expected = x1 + m
    close(out, expected, rtol=1e-4, atol=1e-5)


def test_residual_fused_into_the_mlp_norm():
    """``LayerNormMLP(branch, residual=r)`` is the MLP of ``branch + r`` and returns that sum; a pre-LN
    layer fusing its attention residual there matches the unfused layer, values and gradients."""
    branch, stream = rand(0, (2, 5, 16)), rand(1, (2, 5, 16))
    mlp = LayerNormMLP(intermediate_dim=32, intermediate_dropout_rate=0.0, return_layernorm_output=True)
    p = perturbed(init_params(mlp, stream))
    y, ln, new_stream = mlp.apply({"params": p}, branch, residual=stream, deterministic=True)
    y_ref, ln_ref = mlp.apply({"params": p}, branch + stream, deterministic=True)
    close(new_stream, branch + stream, rtol=1e-6)
    close(y, y_ref, rtol=1e-5, atol=1e-6)
    close(ln, ln_ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="enable_layernorm"):
        LayerNormMLP(intermediate_dim=32, enable_layernorm=False).init(jax.random.key(0), branch, residual=stream)

    x = rand(2, (2, 5, 16))
    fused = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, intermediate_dropout=0.0, mlp_activations=("gelu",))
    unfused = fused.clone(fuse_residual_norm=False)
    p = perturbed(init_params(fused, x, deterministic=True))

    def loss(layer, p, x):
        return jnp.sum(jnp.sin(layer.apply({"params": p}, x, deterministic=True)))

    close(fused.apply({"params": p}, x, deterministic=True), unfused.apply({"params": p}, x, deterministic=True),
          rtol=1e-5, atol=1e-6)
    grads = jax.grad(loss, argnums=(1, 2))(fused, p, x)
    grads_ref = jax.grad(loss, argnums=(1, 2))(unfused, p, x)
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-4, atol=1e-5), grads, grads_ref)


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_rmsnorm_folds_into_gemms_of_few_rows(monkeypatch, zero_centered_gamma):
    """An RMSNorm in front of a GEMM of at most ``FOLD_MAX_ROWS`` rows is applied as its row scale after
    the product (`Norm.folded_dot`), a residual added in front included: the same values and
    gradients as the norm applied first; LayerNorm and more rows keep the norm in front. (On with
    `FOLD_INTO_GEMM`.)"""
    from mtjax.ops import normalization

    monkeypatch.setattr(normalization, "FOLD_INTO_GEMM", True)
    folded = []
    original = ops.Norm.folded_dot
    monkeypatch.setattr(ops.Norm, "folded_dot", lambda self, x, dot: folded.append(x.shape) or original(self, x, dot))
    kw = dict(layernorm_type="rmsnorm", zero_centered_gamma=zero_centered_gamma)
    dense = LayerNormDenseGeneral(features=(4, 8), **kw)
    mlp = LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"), intermediate_dropout_rate=0.0, **kw)
    for rows in (1, normalization.FOLD_MAX_ROWS, normalization.FOLD_MAX_ROWS + 1):
        branch, stream = rand(rows, (rows, 1, 16)), rand(rows + 1, (rows, 1, 16), 3.0)
        for module, kwargs in ((dense, {}), (mlp, {"deterministic": True})):
            p = perturbed(init_params(module, stream))

            def loss(p, branch, stream, module=module, kwargs=kwargs):
                y, _, new_stream = module.apply({"params": p}, branch, residual=stream, **kwargs)
                return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(new_stream)), (y, new_stream)

            folded.clear()
            got = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(p, branch, stream)
            assert len(folded) == (rows <= normalization.FOLD_MAX_ROWS), (rows, folded)
            with monkeypatch.context() as m:
                m.setattr(normalization, "FOLD_INTO_GEMM", False)
                want = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(p, branch, stream)
            close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"LayerNormMLP: residual has shape \(1, 1, 8\); expected \(1, 1, 16\)"):
        mlp.apply({"params": p}, rand(0, (1, 1, 16)), residual=rand(1, (1, 1, 8)), deterministic=True)
    folded.clear()
    x = rand(0, (1, 16))
    norm = ops.Norm(rand(1, (16,)), rand(2, (16,)), layernorm_type="layernorm")
    p = init_params(LayerNormDenseGeneral(features=8), x)
    LayerNormDenseGeneral(features=8).apply({"params": p}, x)
    assert not folded and not norm.folds_into_gemm(x)
    with pytest.raises(ValueError, match="rmsnorm"):
        norm.folded_dot(x, lambda a: a)
    # bfloat16: the product rounds before its row scale
    x, w = rand(3, (2, 64), 4.0).astype(jnp.bfloat16), rand(4, (64, 32)).astype(jnp.bfloat16)
    norm = ops.Norm(1.0 + rand(5, (64,), 0.1), layernorm_type="rmsnorm", epsilon=1e-6)
    close(norm.folded_dot(x, lambda a: a @ w).astype(jnp.float32), (norm(x) @ w).astype(jnp.float32),
          rtol=2e-2, atol=2e-2)


def test_residual_added_in_the_attention_norm_and_deferred():
    """``LayerNorm``, ``LayerNormDenseGeneral`` and ``MultiHeadAttention`` take ``residual=`` (their norm
    adds it and they return the sum); a layer with ``defer_residual_add`` returns (branch, stream)
    summing to the plain layer's output, and the next layer takes them as (inputs, residual)."""
    branch, stream = rand(0, (2, 5, 16)), rand(1, (2, 5, 16))
    norm = LayerNorm()
    p = perturbed(init_params(norm, stream))
    y, new_stream = norm.apply({"params": p}, branch, residual=stream)
    close(new_stream, branch + stream, rtol=1e-6)
    close(y, norm.apply({"params": p}, branch + stream), rtol=1e-5, atol=1e-6)
    dense = LayerNormDenseGeneral(features=(4, 8), return_layernorm_output=True)
    p = perturbed(init_params(dense, stream))
    y, ln, new_stream = dense.apply({"params": p}, branch, stream)
    y_ref, ln_ref = dense.apply({"params": p}, branch + stream)
    close(y, y_ref, rtol=1e-5, atol=1e-6)
    close(ln, ln_ref, rtol=1e-5, atol=1e-6)
    close(new_stream, branch + stream, rtol=1e-6)
    for groups in (4, 2):  # the fused QKV projection, and GQA's query + kv projections
        mha = MultiHeadAttention(head_dim=4, num_attention_heads=4, num_gqa_groups=groups, attn_mask_type="causal")
        p = perturbed(init_params(mha, stream, deterministic=True))
        out, _, new_stream = mha.apply({"params": p}, branch, deterministic=True, residual=stream)
        close(out, mha.apply({"params": p}, branch + stream, deterministic=True)[0], rtol=1e-5, atol=1e-6)
        close(new_stream, branch + stream, rtol=1e-6)
    with pytest.raises(ValueError, match="input_layernorm"):
        MultiHeadAttention(head_dim=4, num_attention_heads=4, input_layernorm=False).init(
            jax.random.key(0), branch, residual=stream)

    kwargs = dict(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  intermediate_dropout=0.0, mlp_activations=("gelu",))
    plain, deferred = TransformerLayer(**kwargs), TransformerLayer(**kwargs, defer_residual_add=True)
    x = rand(2, (2, 5, 16))
    p1, p2 = (perturbed(meta.unbox(plain.init(jax.random.key(seed), x, deterministic=True)["params"]), seed)
              for seed in (1, 2))
    expected = plain.apply({"params": p2}, plain.apply({"params": p1}, x, deterministic=True), deterministic=True)
    b1, s1 = deferred.apply({"params": p1}, x, deterministic=True)
    close(b1 + s1, plain.apply({"params": p1}, x, deterministic=True), rtol=1e-5, atol=1e-6)
    b2, s2 = deferred.apply({"params": p2}, b1, deterministic=True, residual=s1)
    close(b2 + s2, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual"):  # the stream must match the branch's shape
        deferred.apply({"params": p2}, b1, deterministic=True, residual=s1[:, :3])
    with pytest.raises(ValueError, match="pre-LN"):
        TransformerLayer(**kwargs, output_layernorm=True, defer_residual_add=True).init(
            jax.random.key(0), x, deterministic=True)


# TransformerEngine-JAX 2.x's defaults of the arguments mtjax shares (transformer_engine/jax/flax/).
TE_DEFAULTS = {
    TransformerLayer: dict(hidden_size=512, mlp_hidden_size=2048, num_attention_heads=8, layernorm_type="layernorm",
                           layernorm_epsilon=1e-6, hidden_dropout=0.1, attention_dropout=0.1, intermediate_dropout=0.0,
                           mlp_activations=("gelu",), use_bias=False, layer_type=TransformerLayerType.ENCODER,
                           self_attn_mask_type="causal", enable_relative_embedding=True, enable_rotary_pos_emb=False,
                           rotary_pos_emb_windows=(1, 10000), rotary_pos_emb_group_method="consecutive",
                           fuse_qkv_params=True, scale_attn_logits=False, scaled_query_init=True),
    MultiHeadAttention: dict(attention_dropout=0.0, input_layernorm=True, layernorm_type="layernorm",
                             return_layernorm_output=False, use_bias=False, attn_mask_type="causal",
                             fuse_qkv_params=True, scale_attn_logits=False, scaled_query_init=True,
                             float32_logits=False),
    LayerNormMLP: dict(intermediate_dim=2048, activations=("gelu",), intermediate_dropout_rate=0.0, use_bias=False,
                       layernorm_type="layernorm", epsilon=1e-6, return_layernorm_output=False),
    DotProductAttention: dict(attention_dropout=0.0, attn_mask_type="causal", float32_logits=False, scale_factor=None),
    DenseGeneral: dict(use_bias=True),
}


@pytest.mark.parametrize("module", list(TE_DEFAULTS), ids=lambda m: m.__name__)
def test_defaults_are_transformer_engines(module):
    defaults = {f.name: f.default for f in __import__("dataclasses").fields(module)}
    assert {name: defaults[name] for name in TE_DEFAULTS[module]} == TE_DEFAULTS[module]


@pytest.mark.parametrize("layer_type", list(TransformerLayerType))
def test_relative_position_bias_direction_follows_the_layer_type(layer_type):
    """As TransformerEngine: an ENCODER layer's T5 bias is bidirectional, a DECODER layer's unidirectional,
    whatever the mask (here causal in both)."""
    x, enc = rand(0, (2, 5, 16)), rand(1, (2, 3, 16))
    decoder = layer_type == TransformerLayerType.DECODER
    layer = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, layer_type=layer_type)
    args = (x, enc) if decoder else (x,)
    p = perturbed(meta.unbox(jax.jit(functools.partial(layer.init, deterministic=True))(jax.random.key(0), *args)
                             ["params"]))

    @jax.jit
    def self_attention_bias(p, *args):
        captured = {}

        def capture(next_fun, args, kwargs, context):
            if context.module.name == "self_attention" and context.method_name == "__call__":
                captured["bias"] = args[3]
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(capture):
            layer.apply({"params": p}, *args, deterministic=True)
        return captured["bias"]

    bias = self_attention_bias(p, *args)
    relpos = RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=4)
    close(bias, relpos.apply(_sub(p, "relpos_bias"), 5, 5, not decoder))
    assert not np.allclose(bias, relpos.apply(_sub(p, "relpos_bias"), 5, 5, decoder))


def test_transformer_engine_integer_masks_are_one_where_masked():
    """A uint8 mask is TransformerEngine's (1 = masked out), a bool mask mtjax's (True = attend); other
    dtypes are refused."""
    q, k, v = rand(0, (2, 5, 4, 8)), rand(1, (2, 5, 4, 8)), rand(2, (2, 5, 4, 8))
    lengths = np.array([3, 5])
    te_mask = np.ones((2, 1, 5, 5), np.uint8)
    for row, n in enumerate(lengths):
        te_mask[row, :, :n, :n] = 0  # as TransformerEngine's encoder example builds it
    dpa = DotProductAttention(head_dim=8, num_attention_heads=4, attn_mask_type="padding")
    out = dpa.apply({}, q, k, v, jnp.asarray(te_mask), deterministic=True)
    assert np.isfinite(np.asarray(out)).all()  # the padding queries attend to nothing: zeros, not NaN
    close(out, dpa.apply({}, q, k, v, jnp.asarray(te_mask == 0), deterministic=True))
    seg = jnp.asarray((np.arange(5)[None] < lengths[:, None]).astype(np.int32))
    ref = ops.attention(q, k, v, mask_type="padding", q_segment_ids=seg, kv_segment_ids=seg)
    close(out[0, :3], ref[0, :3])
    close(out[1], ref[1])
    with pytest.raises(TypeError, match="mask has dtype float32.*bool.*integer"):
        dpa.apply({}, q, k, v, jnp.ones((2, 1, 5, 5)), deterministic=True)


def test_decoder_layer_cross_attention():
    x, enc = rand(0, (2, 4, 16)), rand(1, (2, 6, 16))
    layer = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4, num_gqa_groups=2,
                             layer_type=TransformerLayerType.DECODER, enable_relative_embedding=True,
                             layernorm_type="rmsnorm", mlp_activations=("silu", "linear"))
    enc_mask = jnp.ones((2, 1, 4, 6), bool).at[1, :, :, 4:].set(False)
    v = jax.jit(functools.partial(layer.init, deterministic=True))(jax.random.key(0), x, enc, None, enc_mask)
    assert {"self_attention", "encoder_decoder_attention", "mlp", "relpos_bias"} <= set(v["params"])
    apply = jax.jit(functools.partial(layer.apply, deterministic=True))
    out = apply(v, x, enc, None, enc_mask)
    close(out, apply(v, x, enc.at[1, 4:].set(7.0), None, enc_mask))  # masked encoder positions do not matter
    assert not np.allclose(out, apply(v, x, enc * 2.0, None, enc_mask))
    with pytest.raises(ValueError, match="encoded"):
        layer.apply(v, x, deterministic=True)


def test_cross_attention_decoding_projects_the_encoder_output_once():
    """``decode=True`` cross-attention (GQA, QK norm, rotary keys) gives the plain call's output, the
    keys and values coming from the cache its first call filled; the encoder's padding mask still applies."""
    x, enc = rand(0, (2, 3, 16)), rand(1, (2, 6, 16))
    mask = jnp.ones((2, 1, 1, 6), bool).at[1, ..., 4:].set(False)
    mha = MultiHeadAttention(head_dim=4, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="padding",
                             qk_norm=True, enable_rotary_pos_emb=True, layernorm_type="rmsnorm")
    params = perturbed(init_params(mha, x, enc, mask, deterministic=True))
    want = mha.apply({"params": params}, x, enc, mask, deterministic=True)[0]
    _, cache = mha.apply({"params": params}, x, enc, mask, decode=True, deterministic=True, mutable=["cache"])
    assert set(cache["cache"]) == {"cached_cross_key", "cached_cross_value", "cache_index"}
    assert cache["cache"]["cached_cross_key"].shape == (2, 6, 2, 4)
    for i in range(3):  # one query at a time, with the encoder output changed: the cache is what is read
        got, cache = mha.apply({"params": params, **cache}, x[:, i:i + 1], 5.0 * enc, mask, decode=True,
                               deterministic=True, mutable=["cache"])
        close(got[0], want[:, i:i + 1])
    with pytest.raises(ValueError, match="cross-attention without segment ids"):
        mha.apply({"params": params, **cache}, x, enc, decode=True, deterministic=True, mutable=["cache"],
                  q_segment_ids=jnp.ones((2, 3), jnp.int32), kv_segment_ids=jnp.ones((2, 6), jnp.int32))


def test_embed_lookup_and_attend():
    embed = Embed(10, 4)
    v = embed.init(jax.random.key(0), jnp.zeros((2,), jnp.int32))
    table = meta.unbox(v["params"])["embedding"]
    ids = jnp.array([[1, 9], [0, 3]])
    close(embed.apply(v, ids), table[ids])
    q = rand(0, (2, 3, 4))
    close(embed.apply(v, q, method=Embed.attend), q @ table.T)
    with pytest.raises(TypeError, match="integer"):
        embed.apply(v, q)


def test_every_parameter_has_logical_axes():
    layer = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4, use_bias=True,
                             layer_type=TransformerLayerType.DECODER, enable_relative_embedding=True)
    x = jnp.ones((1, 3, 16))
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), x, x, deterministic=True))["params"]
    leaves = jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, meta.AxisMetadata))
    assert leaves and all(isinstance(a, nn.LogicallyPartitioned) for a in leaves)
    specs = nn.get_partition_spec(params)
    assert specs["self_attention"]["qkv"]["kernel"] == jax.sharding.PartitionSpec("embed", None, "heads", "head_dim")


# ---------------------------------------------------------------------------- bad configuration


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
    (dict(num_attention_heads=4, num_gqa_groups=3), "num_gqa_groups"),
    (dict(mlp_activations=("tanh",)), "activation_type"),
    (dict(self_attn_mask_type="diagonal"), "self_attn_mask_type"),
    (dict(layernorm_type="batchnorm"), "layernorm_type"),
    (dict(rotary_pos_emb_group_method="spiral"), "rotary_pos_emb_group_method"),
    (dict(hidden_dropout=1.0), "hidden_dropout"),
])
def test_transformer_layer_bad_config(kwargs, match):
    layer = TransformerLayer(**{"hidden_size": 16, "num_attention_heads": 4, **kwargs})
    with pytest.raises(ValueError, match=match):
        layer.init(jax.random.key(0), jnp.ones((1, 2, layer.hidden_size)), deterministic=True)


def test_attention_bad_config():
    q = jnp.ones((1, 2, 4, 6))
    with pytest.raises(ValueError, match="attn_mask_type"):
        DotProductAttention(head_dim=6, num_attention_heads=4, attn_mask_type="full").apply({}, q, q, q)
    with pytest.raises(ValueError, match="attn_bias_type"):
        DotProductAttention(head_dim=6, num_attention_heads=4, attn_bias_type="alibi").apply({}, q, q, q)
    with pytest.raises(ValueError, match="query has shape"):
        DotProductAttention(head_dim=8, num_attention_heads=4).apply({}, q, q, q)
    with pytest.raises(ValueError, match="even"):
        MultiHeadAttention(head_dim=3, num_attention_heads=2, enable_rotary_pos_emb=True).init(
            jax.random.key(0), jnp.ones((1, 2, 6)))
    with pytest.raises(ValueError, match="layernorm_type"):
        LayerNorm(layernorm_type="scalenorm").init(jax.random.key(0), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="axis"):
        DenseGeneral(3, axis=2).init(jax.random.key(0), jnp.ones((2, 4)))


def test_embed_ids_outside_the_table_give_nan():
    """Issue 27 defect 5: id -1 wrapped around to the last row."""
    embed = Embed(10, 4)
    v = embed.init(jax.random.key(0), jnp.zeros((2,), jnp.int32))
    out = embed.apply(v, jnp.array([-1, 10, 3]))
    assert np.isnan(out[:2]).all() and np.isfinite(out[2]).all()


@pytest.mark.parametrize("module", [DenseGeneral(4, dtype=jnp.int32), DenseGeneral(4, param_dtype=jnp.int8),
                                    Embed(10, 4, param_dtype=jnp.int32), LayerNorm(dtype=jnp.bool_)])
def test_modules_accept_float_dtypes_only(module):
    """Issue 27 defect 5: DenseGeneral(dtype=int32) returned zeros."""
    x = jnp.zeros((2,), jnp.int32) if isinstance(module, Embed) else jnp.ones((2, 4))
    with pytest.raises(TypeError, match=f"{type(module).__name__}: .*is not supported; accepted: float32"):
        module.init(jax.random.key(0), x)


def test_a_mask_that_does_not_broadcast_is_named():
    """Issue 27 defect 6: 'Incompatible shapes for broadcasting' did not name the mask."""
    q = rand(0, (2, 3, 2, 4))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 1, 3, 5\), which does not broadcast to \[batch, heads, "
                                         r"q_len, kv_len\] = \(2, 2, 3, 3\)"):
        ops.attention(q, q, q, mask=jnp.ones((2, 1, 3, 5), bool))
