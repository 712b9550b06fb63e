"""mtjax.models: GPT (configs, scan/remat, training on CPU, packing, KV-cache decoding) and BERT."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta

from mtjax import fp8
from mtjax.config import override
from mtjax.flax import RopeScaling
from mtjax.models import GPT, BertConfig, BertEncoder, GPTConfig, gpt_config

pytestmark = pytest.mark.usefixtures("fast_compiles")

TINY = gpt_config("tiny", num_layers=2, vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, mlp_dim=64)


def tokens(seed, shape, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


@pytest.fixture(scope="module")
def tiny():
    model = GPT(TINY)
    params = meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens(0, (2, 8)))["params"])
    return model, params


def _param_count(cfg, seq=8):
    shapes = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(meta.unbox(shapes["params"])))


@pytest.mark.parametrize("overrides", [
    {},
    dict(position_embedding="learned", tie_embeddings=False, use_bias=True, layernorm_type="layernorm",
         activations=("gelu",), num_kv_heads=None, scan_layers=False, fuse_qkv_params=False),
    dict(qkv_bias=True, qk_norm=True, parallel_residual=True, rope_fraction=0.5),
    dict(qk_norm=True, layernorm_type="layernorm", num_kv_heads=None),
])
def test_num_params_matches_init(overrides):
    cfg = dataclasses.replace(TINY, **overrides)
    assert cfg.num_params() == _param_count(cfg)


def test_presets():
    cfg = gpt_config("gpt-1.3b")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.mlp_dim, cfg.vocab_size) == (2048, 24, 16, 8192, 32768)
    assert abs(cfg.num_params() - 1.275e9) < 1e6  # the stock-Flax peer of ANCHORS.md
    assert cfg.flops_per_token(2048) == pytest.approx(6 * cfg.num_params() + 6 * 24 * 2048 * 2048)
    llama = gpt_config("llama-1b")
    assert llama.layernorm_type == "rmsnorm" and llama.activations == ("silu", "linear") and llama.num_kv_heads == 8
    assert gpt_config("gpt-125m", num_layers=2).num_layers == 2
    with pytest.raises(ValueError, match="name"):
        gpt_config("gpt-5")


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=30, num_heads=4), "hidden_size"),
    (dict(num_heads=4, num_kv_heads=3), "num_gqa_groups"),
    (dict(activations=("swish", "cubic")), "activation_type"),
    (dict(layernorm_type="groupnorm"), "layernorm_type"),
    (dict(position_embedding="alibi"), "position_embedding"),
    (dict(remat_policy="everything"), "remat_policy"),
    (dict(num_layers=0), "num_layers"),
    (dict(dropout_rate=1.5), "dropout_rate"),
    (dict(rope_fraction=0.1), "rope_fraction: .* rotates 1 coordinates; expected an even number"),
    (dict(rope_fraction=1.5), "rope_fraction: rotary fraction=1.5; expected 0 < fraction <= 1"),
    (dict(rope_scaling="llama3"), "rope_scaling='llama3'; expected None or a mtjax.flax.RopeScaling"),
])
def test_gpt_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_scan_equals_unrolled_and_remat_keeps_gradients(tiny):
    model, params = tiny
    toks = tokens(1, (2, 8))
    unrolled_params = {k: v for k, v in params.items() if k != "layers"}
    for i in range(TINY.num_layers):
        unrolled_params[f"layers_{i}"] = jax.tree.map(lambda a: a[i], params["layers"])
    unrolled = GPT(dataclasses.replace(TINY, scan_layers=False))
    np.testing.assert_allclose(jax.jit(model.apply)({"params": params}, toks),
                               jax.jit(unrolled.apply)({"params": unrolled_params}, toks), rtol=1e-5, atol=1e-5)

    def loss(m):
        return lambda p: jnp.mean(m.apply({"params": p}, toks) ** 2)

    g = jax.jit(jax.grad(loss(model)))(params)
    g_remat = jax.jit(jax.grad(loss(GPT(dataclasses.replace(TINY, remat_policy="dots")))))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, g_remat)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_residual_adds_across_layers_change_no_result(tiny, scan_layers):
    """``fuse_residual_across_layers``: the layers pass (branch, stream) and each norm adds them; the
    same parameters give the same logits, gradients, and KV-cache decoding."""
    _, params = tiny
    if not scan_layers:
        params = {k: v for k, v in params.items() if k != "layers"} | {
            f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(TINY.num_layers)}
    base = dataclasses.replace(TINY, scan_layers=scan_layers, remat_policy="dots")
    plain, fused = GPT(base), GPT(dataclasses.replace(base, fuse_residual_across_layers=True))
    toks = tokens(2, (2, 8))
    plain_apply = jax.jit(plain.apply)
    np.testing.assert_allclose(jax.jit(fused.apply)({"params": params}, toks), plain_apply({"params": params}, toks),
                               rtol=1e-5, atol=1e-5)

    def loss(m):
        return lambda p: jnp.mean(m.apply({"params": p}, toks) ** 2)

    grads, grads_ref = (jax.jit(jax.grad(loss(m)))(params) for m in (fused, plain))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, grads_ref)
    cache = jax.jit(functools.partial(fused.init, decode=True))(jax.random.key(0),
                                                                jnp.zeros((2, 8), jnp.int32))["cache"]
    step = jax.jit(lambda c, t: fused.apply({"params": params, "cache": c}, t, decode=True, mutable=["cache"]))
    first, mutated = step(cache, toks[:, :4])
    second, _ = step(mutated["cache"], toks[:, 4:5])
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), plain_apply({"params": params}, toks[:, :5]),
                               rtol=1e-4, atol=1e-5)


def test_hugging_face_features_decode_as_the_full_forward_and_defer_residual_adds():
    """Per-head q/k norms, Q/K/V-only biases, partial rotary with llama3 frequency scaling and the parallel
    attention/MLP block: KV-cache decoding gives the full forward's logits, and deferring each layer's
    residual add to the next norm changes nothing."""
    cfg = dataclasses.replace(TINY, scan_layers=False, qk_norm=True, qkv_bias=True, parallel_residual=True,
                              rope_fraction=0.5, rope_scaling=RopeScaling("llama3", 4.0, original_max_position=16))
    model = GPT(cfg)
    toks = tokens(7, (2, 6))
    params = meta.unbox(jax.jit(model.init)(jax.random.key(1), toks)["params"])
    assert params["layers_0"]["self_attention"]["query_norm"]["scale"].shape == (cfg.resolved_head_dim,)
    assert "bias" in params["layers_0"]["self_attention"]["kv"] and "bias" not in params["layers_0"]["mlp"]
    full = jax.jit(model.apply)({"params": params}, toks)
    deferred = jax.jit(GPT(dataclasses.replace(cfg, fuse_residual_across_layers=True)).apply)({"params": params}, toks)
    np.testing.assert_allclose(deferred, full, rtol=1e-5, atol=1e-5)
    cache = jax.jit(functools.partial(model.init, decode=True))(jax.random.key(0),
                                                                jnp.zeros((2, 8), jnp.int32))["cache"]
    step = jax.jit(lambda c, t: model.apply({"params": params, "cache": c}, t, decode=True, mutable=["cache"]))
    first, mutated = step(cache, toks[:, :3])
    outs = [first]
    for i in range(3, 6):
        logits, mutated = step(mutated["cache"], toks[:, i:i + 1])
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-4, atol=1e-5)


def test_scale_embeddings_multiplies_the_token_embeddings_by_sqrt_hidden(tiny):
    _, params = tiny
    cfg = dataclasses.replace(TINY, tie_embeddings=False)
    untied = dict(params, logits_dense={"kernel": params["token_embed"]["embedding"].T})
    scaled = dict(untied, token_embed={"embedding": untied["token_embed"]["embedding"] * cfg.hidden_size ** 0.5})
    toks = tokens(8, (1, 8))
    np.testing.assert_allclose(jax.jit(GPT(dataclasses.replace(cfg, scale_embeddings=True)).apply)(
        {"params": untied}, toks), jax.jit(GPT(cfg).apply)({"params": scaled}, toks), rtol=1e-5, atol=1e-5)


def test_loss_falls_on_a_tiny_batch(tiny):
    model, params = tiny
    toks = tokens(2, (4, 16))
    opt = optax.adam(3e-3)

    def loss_fn(p):
        logits = model.apply({"params": p}, toks[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    state = opt.init(params)
    losses = []
    for _ in range(30):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[0] > np.log(TINY.vocab_size) - 0.5
    assert losses[-1] < 0.5 * losses[0]


def test_packed_sequences_equal_separate_ones(tiny):
    """Row 0 packs two sequences (segment ids 1, 2; positions restart); rows 1 and 2 hold each alone,
    padded (segment id 0). One batch, so one compilation."""
    model, params = tiny
    a, b = tokens(3, (5,)), tokens(4, (3,))
    toks = jnp.stack([jnp.concatenate([a, b]), jnp.pad(a, (0, 3)), jnp.pad(b, (0, 5))])
    seg = jnp.array([[1] * 5 + [2] * 3, [1] * 5 + [0] * 3, [1] * 3 + [0] * 5])
    pos = jnp.array([list(range(5)) + list(range(3)), list(range(8)), list(range(8))])
    out = jax.jit(model.apply)({"params": params}, toks, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(out[0, :5], out[1, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[0, 5:], out[2, :3], rtol=1e-5, atol=1e-5)


def test_kv_cache_decoding_matches_full_forward(tiny):
    _, params = tiny
    model = GPT(dataclasses.replace(TINY, window_size=(3, 0)))  # sliding window: the cache mask keeps it
    toks = tokens(5, (2, 6))
    full = jax.jit(model.apply)({"params": params}, toks)
    cache = jax.jit(functools.partial(model.init, decode=True))(jax.random.key(0),
                                                                jnp.zeros((2, 8), jnp.int32))["cache"]
    step = jax.jit(lambda c, t: model.apply({"params": params, "cache": c}, t, decode=True, mutable=["cache"]))
    logits, mutated = step(cache, toks[:, :2])  # a 2-token prompt, then one token at a time
    outs = [logits]
    for i in range(2, 6):
        logits, mutated = step(mutated["cache"], toks[:, i:i + 1])
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, rtol=1e-4, atol=1e-5)


def test_dropout_is_stochastic_only_when_not_deterministic():
    cfg = dataclasses.replace(TINY, dropout_rate=0.3, attention_dropout=0.3, num_layers=1)
    model = GPT(cfg)
    toks = tokens(6, (1, 8))
    v = jax.jit(model.init)(jax.random.key(0), toks)
    apply = jax.jit(model.apply, static_argnames="deterministic")
    det = apply(v, toks)
    a = apply(v, toks, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert not np.allclose(det, a)
    np.testing.assert_allclose(det, apply(v, toks))


def test_bert_padding_does_not_leak():
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, max_seq_len=16)
    model = BertEncoder(cfg)
    toks = tokens(7, (2, 8), vocab=50)
    seg = jnp.array([[1] * 8, [1] * 5 + [0] * 3])
    v = jax.jit(model.init)(jax.random.key(0), toks, segment_ids=seg)
    assert {"token_embed", "position_embed", "type_embed", "embed_norm", "layers"} <= set(v["params"])
    apply = jax.jit(model.apply)
    out = apply(v, toks, segment_ids=seg)
    out2 = apply(v, toks.at[1, 5:].set(3), segment_ids=seg, token_type_ids=jnp.zeros_like(toks))
    np.testing.assert_allclose(out[1, :5], out2[1, :5], rtol=1e-5, atol=1e-5)
    assert out.shape == (2, 8, 32)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.apply(v, tokens(0, (1, 32), vocab=50))
    with pytest.raises(ValueError, match="num_heads"):
        BertConfig(hidden_size=30, num_heads=4)


def test_fp8_under_scan_and_remat_close_to_bf16():
    """Every GEMM (layers scanned and rematerialised, and the tied logits) runs in FP8 with per-layer meta.

    Tolerance: e4m3 keeps 3 mantissa bits, a relative rounding error of at most 2**-4 per element
    (RMS ~ 2**-4 / sqrt(3) = 3.6 %); with both GEMM operands quantized the per-GEMM error is ~5 % RMS,
    and it does not grow through the normalized residual stack; 10 % of the logits' norm bounds it.
    """
    cfg = dataclasses.replace(TINY, remat_policy="dots", dtype=jnp.bfloat16)
    model, toks = GPT(cfg), tokens(8, (2, 16))
    with override(implementations={"attention": "xla"}):  # the GEMMs are under test, not attention
        _check_fp8(model, cfg, toks)


def _check_fp8(model, cfg, toks):
    params = jax.jit(model.init)(jax.random.key(0), toks)["params"]
    bf16 = jax.jit(model.apply)({"params": params}, toks)
    with fp8.fp8_autocast():
        fp8_meta = jax.jit(model.init)(jax.random.key(0), toks)[fp8.FP8_COLLECTION]
        assert fp8_meta["layers"]["mlp"]["wi_dot_general"]["input_scale"].shape == (cfg.num_layers,)
        assert "attend_dot_general" in fp8_meta["token_embed"]
        variables = {"params": params, fp8.FP8_COLLECTION: fp8_meta}

        def loss(v):
            logits = model.apply(v, toks)
            return jnp.mean(logits.astype(jnp.float32) ** 2), logits

        grad = jax.jit(jax.grad(loss, has_aux=True))
        for _ in range(2):  # the second step quantizes with scales from the first step's amaxes
            grads, out = grad(variables)
            param_grads, new_meta = fp8.split_gradients(grads)
            variables = {"params": params, fp8.FP8_COLLECTION: new_meta}
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(meta.unbox(param_grads)))
    assert float(new_meta["layers"]["mlp"]["wo_dot_general"]["input_scale"][0]) != 1.0
    rel = float(jnp.linalg.norm(out - bf16) / jnp.linalg.norm(bf16))
    assert rel < 0.1, rel


@pytest.mark.parametrize("use_fp8", [False, True])
def test_training_gradient_lowers_for_cuda(use_fp8):
    """On a CPU-only host the model's gradient lowers for an H200 with the GPU kernels inside.

    float32, because bfloat16 attention also stages jax's cuDNN attention, which refuses to trace
    where no CUDA libraries are installed.
    """
    from mtjax import backend

    cfg = dataclasses.replace(TINY, hidden_size=128, num_heads=2, num_kv_heads=1)
    model = GPT(cfg)
    toks = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    with fp8.fp8_autocast(enabled=use_fp8):
        variables = jax.eval_shape(model.init, jax.random.key(0), toks)

        def loss(v, t):
            return jnp.mean(model.apply(v, t))

        with backend.abstract_gpu():
            text = jax.jit(jax.grad(loss)).trace(variables, toks).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
    assert ("f8E4M3FN" in text) == use_fp8


def test_learned_positions_past_max_seq_len_are_an_error():
    """Issue 27 defect 5: a learned-position GPT on a longer sequence gave NaN logits."""
    model = GPT(dataclasses.replace(TINY, position_embedding="learned", max_seq_len=8))
    with pytest.raises(ValueError, match="tokens has 9 positions, more than max_seq_len=8"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 9), jnp.int32))
    jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize("name", ["dtype", "param_dtype"])
def test_integer_dtypes_are_refused(name):
    """Issue 27 defects 5/6: param_dtype=int32 / dtype=int32 gave unclear errors or zeros."""
    with pytest.raises(TypeError, match=f"GPTConfig: {name}=<class 'jax.numpy.int32'> is not supported; accepted: "
                                        "float32, bfloat16"):
        dataclasses.replace(TINY, **{name: jnp.int32})


def test_the_tiny_preset_fits_the_byte_tokenizer():
    """Issue 19 item 6: the byte tokenizer emits ids up to 256."""
    assert gpt_config("tiny").vocab_size >= 257
