"""mtjax.models: ViT, T5 and the vision-language model (shapes, masks by perturbation, cached decoding,
FP8, bad input). (T5's relative-position buckets against the published formula: tests/flax.)"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from mtjax import fp8
from mtjax.config import override
from mtjax.flax import TransformerLayer
from mtjax.inference import Engine
from mtjax.models import (
    T5,
    VLM,
    BertConfig,
    BertEncoder,
    GPTConfig,
    T5Config,
    ViT,
    ViTConfig,
    VLMConfig,
    abstract_params,
    build_model,
    greedy_decode,
    jitted_t5_generate,
    jitted_vlm_generate,
    model_config,
    t5_generate,
    until_eos,
    vlm_generate,
)
from mtjax.models.vit import patchify, sincos_2d_positions

pytestmark = pytest.mark.usefixtures("fast_compiles")

VIT = ViTConfig(image_size=8, patch_size=4, num_classes=5, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32)
T5_TINY = T5Config(vocab_size=40, hidden_size=16, num_encoder_layers=1, num_decoder_layers=2, num_heads=2, mlp_dim=32,
                   relative_buckets=8, relative_max_distance=16)
TEXT = GPTConfig(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32, max_seq_len=32)


def vlm_tiny(fusion):
    return VLMConfig(vision=dataclasses.replace(VIT, pooling="mean"), text=TEXT, fusion=fusion)


# Inputs and parameters come from numpy: eager jax.random would compile a kernel per shape.
def images(seed, batch=2, size=8):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, size, size, 3)), jnp.float32)


def tokens(seed, shape, vocab=40):
    return jnp.asarray(np.random.default_rng(seed).integers(1, vocab, shape), jnp.int32)


def param_count(variables):
    return sum(x.size for x in jax.tree.leaves(meta.unbox(variables["params"])))


def random_params(model, *args, scale=0.1, **kwargs):
    """Random parameters of ``model`` (no compiled init; every parameter non-zero, zero-initialised heads
    included, so every one passes gradient on)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    leaves, tree = jax.tree.flatten(meta.unbox(shapes))
    rng = np.random.default_rng(1)
    return tree.unflatten([jnp.asarray(scale * rng.normal(size=x.shape), x.dtype) for x in leaves])


def test_vit_shapes_parameter_counts_and_bad_input():
    x = images(0)
    for overrides in ({}, dict(pooling="mean", position_embedding="sincos", activations=("gelu", "linear"))):
        cfg = dataclasses.replace(VIT, **overrides)
        shapes = jax.eval_shape(ViT(cfg).init, jax.random.key(0), x)
        assert param_count(shapes) == cfg.num_params()
        logits = jax.eval_shape(ViT(cfg).apply, shapes, x)
        assert logits.shape == (2, 5) and logits.dtype == jnp.float32
    with pytest.raises(ValueError, match=r"ViT: images must be float \[batch, 8, 8, 3\]; got float32 \(2, 8, 6, 3\)"):
        jax.eval_shape(ViT(VIT).init, jax.random.key(0), x[:, :, :6])
    with pytest.raises(ValueError, match="images must be float"):
        jax.eval_shape(ViT(VIT).init, jax.random.key(0), x.astype(jnp.int32))


@pytest.mark.parametrize("kwargs,match", [
    (dict(patch_size=3), "patch_size=3 must divide image_size=8"),
    (dict(position_embedding="sincos", hidden_size=18, num_heads=2), "divisible by 4"),
    (dict(pooling="max"), "pooling='max' is not supported; accepted: cls, mean"),
    (dict(num_layers=0), "num_layers=0"),
])
def test_vit_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(VIT, **kwargs)


def test_patchify_and_sincos_positions_against_loops():
    x = np.arange(2 * 8 * 8 * 3, dtype=np.float32).reshape(2, 8, 8, 3)
    got = np.asarray(patchify(jnp.asarray(x), 4))
    for r in range(2):
        for c in range(2):
            np.testing.assert_array_equal(got[:, r * 2 + c], x[:, 4 * r:4 * r + 4, 4 * c:4 * c + 4].reshape(2, -1))
    table, hidden = sincos_2d_positions(3, 8), 8
    for index in range(9):
        row, col = divmod(index, 3)
        for k in range(2):  # quarter = 2 frequencies
            omega = 10000.0 ** (-k / 2)
            want = [math.sin(row * omega), math.cos(row * omega), math.sin(col * omega), math.cos(col * omega)]
            got_k = [table[index, k], table[index, 2 + k], table[index, hidden // 2 + k], table[index, 6 + k]]
            np.testing.assert_allclose(got_k, want, atol=1e-6)


def test_t5_masks_and_cached_decoding():
    """Encoder padding and future decoder tokens are never attended (perturbing them changes no other
    logit); decoding token by token on the cache (relative biases at the cache offset, the encoder
    output projected once) gives the full forward's logits, and greedy generation on a cache of exactly
    its length the full forward's argmax."""
    model = T5(T5_TINY)
    enc, dec = tokens(2, (2, 7)), tokens(3, (2, 6))
    segment_ids = jnp.array([[1] * 7, [1] * 4 + [0] * 3])
    variables = random_params(model, enc, dec)
    assert param_count(variables) == T5_TINY.num_params()
    forward = jax.jit(functools.partial(model.apply, variables, encoder_segment_ids=segment_ids))

    @functools.partial(jax.jit, static_argnames="step_encoded")
    def cached(dec, step_encoded=1.0):
        encoded = model.apply(variables, enc, encoder_segment_ids=segment_ids, method=T5.encode)
        step = functools.partial(model.apply, encoder_segment_ids=segment_ids, decode=True, method=T5.decode,
                                 mutable=["cache"])
        _, cache = step(variables, dec, encoded)

        def one(cache, token):
            logits, cache = step({**variables, **cache}, token[:, None], step_encoded * encoded)
            return cache, logits[:, 0]

        return jnp.swapaxes(jax.lax.scan(one, cache, dec.T)[1], 0, 1)

    base = forward(enc, dec)
    assert base.shape == (2, 6, 40) and base.dtype == jnp.float32
    # Row 1's encoder padding and every decoder token from position 3 on change: earlier logits do not.
    np.testing.assert_allclose(forward(enc.at[1, 4:].set(7), dec.at[:, 3:].set(5))[:, :3], base[:, :3], rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(forward(enc.at[1, 2].set(7), dec)[1], base[1], atol=1e-4)  # a real token does count
    np.testing.assert_allclose(cached(dec), base, rtol=1e-4, atol=1e-5)
    # The cross-attention keys and values come from the cache once it exists: the steps never read
    # `encoded` again (a scaled one changes nothing).
    np.testing.assert_array_equal(cached(dec, step_encoded=3.0), cached(dec))
    out = jitted_t5_generate(model, variables, enc, encoder_segment_ids=segment_ids, max_new_tokens=6, start_id=1)
    forced = forward(enc, jnp.concatenate([jnp.ones((2, 1), jnp.int32), out[:, :-1]], axis=1))
    np.testing.assert_array_equal(out, jnp.argmax(forced, axis=-1))


def test_t5_gradient_has_no_scatter():
    """The relative position biases train through a GEMM and sums: a scatter-add of every (query, key)
    pair into the bucket table serializes on GPUs and was most of a T5-base step there. The only
    scatters left are the token embedding's (a few rows into the whole vocabulary, float32)."""
    model = T5(T5_TINY)
    enc, dec = tokens(2, (2, 7)), tokens(3, (2, 6))
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), enc, dec))
    grad = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, enc, dec))))
    lines = grad.trace(variables).lower().as_text().splitlines()
    scatters = [i for i, line in enumerate(lines) if "stablehlo.scatter" in line]
    assert scatters
    for i in scatters:  # the function holding each scatter returns the embedding table's gradient
        signature = next(line for line in reversed(lines[:i]) if line.lstrip().startswith("func."))
        assert signature.endswith(f"-> tensor<{T5_TINY.vocab_size}x{T5_TINY.hidden_size}xf32> {{"), signature


def test_greedy_decode_steps_once_per_token_after_the_first():
    """A step per emitted token but the first (the last is not fed back), and rows stop at EOS."""
    vocab, calls = 8, []

    def step(cache, token):  # the next token is token + 1; the cache counts the steps
        jax.debug.callback(lambda: calls.append(1))
        return jax.nn.one_hot((token + 1) % vocab, vocab), cache + 1

    first = jax.nn.one_hot(jnp.array([3, 6]), vocab)
    for num_steps in (1, 5):
        calls.clear()
        out = greedy_decode(step, jnp.zeros(()), first, num_steps, eos_id=5)
        jax.effects_barrier()
        assert len(calls) == num_steps - 1
        np.testing.assert_array_equal(out, np.array([[3, 4, 5, 5, 5], [6, 7, 0, 1, 2]])[:, :num_steps])


def test_t5_bad_input():
    model = T5(T5_TINY)
    with pytest.raises(ValueError, match=r"T5: decoder_tokens must be int \[batch, length\]"):
        jax.eval_shape(model.init, jax.random.key(0), tokens(0, (2, 7)), jnp.zeros((2, 6)))
    with pytest.raises(ValueError, match=r"encoder_segment_ids has shape \(2, 5\); expected encoder_tokens' \(2, 7\)"):
        jax.eval_shape(functools.partial(model.init, encoder_segment_ids=jnp.ones((2, 5), jnp.int32)),
                       jax.random.key(0), tokens(0, (2, 7)), tokens(1, (2, 6)))
    with pytest.raises(ValueError, match="relative_max_distance=4 > relative_buckets // 2"):
        dataclasses.replace(T5_TINY, relative_max_distance=4)
    layer = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, enable_relative_embedding=True)
    with pytest.raises(ValueError, match="pass attention_bias or set enable_relative_embedding, not both"):
        jax.eval_shape(functools.partial(layer.init, attention_bias=jnp.zeros((1, 2, 3, 3))), jax.random.key(0),
                       jnp.zeros((1, 3, 16)))
    with pytest.raises(ValueError, match=r"greedy_decode: logits has shape \(2, 1, 40\); expected \[batch, vocab\]"):
        greedy_decode(None, None, jnp.zeros((2, 1, 40)), 3)
    with pytest.raises(ValueError, match=r"t5_generate: encoder_tokens has shape \(7,\); expected \[batch, length\]"):
        t5_generate(model, {}, tokens(0, (7,)), max_new_tokens=3, start_id=1)
    with pytest.raises(ValueError, match="t5_generate: max_new_tokens=0; expected an int >= 1"):
        t5_generate(model, {}, tokens(0, (2, 7)), max_new_tokens=0, start_id=1)
    for ids in (dict(start_id=40), dict(start_id=1, eos_id=-1)):
        with pytest.raises(ValueError, match=rf"t5_generate: {list(ids)[-1]}=-?\d+; expected a token id in \[0, 40\)"):
            t5_generate(model, {}, tokens(0, (2, 7)), max_new_tokens=3, **ids)
    with pytest.raises(ValueError, match=r"until_eos: ids has shape \(2, 3\); expected one row"):
        until_eos(np.zeros((2, 3), int), 0)
    # Decoding on a cache: another encoder length than the cached keys', or more tokens than it holds.
    enc, dec = tokens(2, (2, 7)), tokens(3, (2, 4))
    variables = random_params(model, enc, dec)
    encoded = jax.jit(functools.partial(model.apply, method=T5.encode))(variables, enc)
    step = jax.jit(functools.partial(model.apply, decode=True, method=T5.decode, mutable=["cache"]))
    _, cache = step(variables, dec, encoded)
    with pytest.raises(ValueError, match=r"keys cached from an input of \[batch, kv_len\] = \(2, 7\); inputs_kv is "
                                         r"\(2, 5\)"):
        step({**variables, **cache}, dec[:, :1], encoded[:, :5])
    with pytest.raises(ValueError, match="5 tokens in one decode call; the cache holds 4"):
        step({**variables, **cache}, tokens(4, (2, 5)), encoded)


def test_vlm_reads_the_image_never_future_text_and_decodes_with_a_cache():
    """With the image as a prefix (cross-attention fusion: tests/sharding/test_multimodal_sharding.py;
    cross-attention decoding: T5's test)."""
    config = vlm_tiny("prefix")
    model = VLM(config)
    x, text = images(6), tokens(7, (2, 6))
    variables = random_params(model, x, text)
    assert param_count(variables) == config.num_params()
    apply = jax.jit(functools.partial(model.apply, variables))
    base = apply(x, text)
    assert base.shape == (2, 6, 40)  # the text's logits only: a loss on them is a loss on the text
    np.testing.assert_allclose(apply(x, text.at[:, 4:].set(3))[:, :4], base[:, :4], rtol=1e-5, atol=1e-6)
    other_image = apply(x.at[0].multiply(-1.0), text)
    assert not np.allclose(other_image[0], base[0], atol=1e-4)  # row 0 reads its image...
    np.testing.assert_allclose(other_image[1], base[1], rtol=1e-5, atol=1e-6)  # ...and only its own
    out = jitted_vlm_generate(model, variables, x, text[:, :2], max_new_tokens=5)
    forced = apply(x, jnp.concatenate([text[:, :2], out[:, :-1]], axis=1))
    np.testing.assert_array_equal(out, jnp.argmax(forced[:, 1:], axis=-1))


def test_vlm_and_gpt_bad_input():
    with pytest.raises(ValueError, match="fusion='late' is not supported; accepted: prefix, cross_attention"):
        vlm_tiny("late")
    with pytest.raises(TypeError, match="vision must be a ViTConfig and text a GPTConfig"):
        VLMConfig(vision=TEXT, text=TEXT)
    model = VLM(vlm_tiny("cross_attention"))
    with pytest.raises(ValueError, match="needs image_tokens at every decoding step"):
        jax.eval_shape(functools.partial(model.init, method=VLM.decode), jax.random.key(0),
                       jnp.zeros((2, 3), jnp.int32), None)
    gpt = build_model(TEXT)
    with pytest.raises(ValueError, match=r"prefix has shape \(2, 4, 8\); expected \[batch=2, length, hidden_size=16\]"):
        jax.eval_shape(functools.partial(gpt.init, prefix=jnp.zeros((2, 4, 8))), jax.random.key(0),
                       jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="encoded .* goes with config.cross_attention=True"):
        jax.eval_shape(functools.partial(gpt.init, encoded=jnp.zeros((2, 4, 16))), jax.random.key(0),
                       jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="prefix does not combine with segment_ids"):
        jax.eval_shape(functools.partial(gpt.init, prefix=jnp.zeros((2, 4, 16)), segment_ids=jnp.ones((2, 3), int)),
                       jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"vlm_generate: prompt has shape \(2, 0\); expected \[batch, length\]"):
        vlm_generate(model, {}, images(0), jnp.zeros((2, 0), jnp.int32), max_new_tokens=3)
    with pytest.raises(ValueError, match="vlm_generate: max_new_tokens=-1; expected an int >= 1"):
        vlm_generate(model, {}, images(0), tokens(0, (2, 1)), max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"vlm_generate: eos_id=40; expected a token id in \[0, 40\)"):
        vlm_generate(model, {}, images(0), tokens(0, (2, 1)), max_new_tokens=2, eos_id=40)
    decoder = build_model(model.config.text)
    with pytest.raises(ValueError, match="Engine: a GPT with cross_attention"):
        Engine(decoder, {}, max_slots=1)


def test_fp8_under_autocast_close_to_bf16():
    """Every GEMM of the ViT (patch embedding, layers, head) runs in FP8, forward and backward, and
    reaches every parameter; outputs stay within FP8 rounding (see test_gpt's tolerance)."""
    model, x = ViT(dataclasses.replace(VIT, dtype=jnp.bfloat16)), images(13)
    params = random_params(model, x)["params"]
    with override(implementations={"attention": "xla"}):
        reference = jax.jit(model.apply)({"params": params}, x)
        with fp8.fp8_autocast():
            # A new function: a trace of model.init from outside the context would be reused without FP8.
            fp8_meta = jax.jit(lambda key: model.init(key, x))(jax.random.key(0))[fp8.FP8_COLLECTION]
            assert {"patch_embed", "layers"} <= set(fp8_meta["encoder"]) and "head" in fp8_meta
            variables = {"params": params, fp8.FP8_COLLECTION: fp8_meta}

            def loss(v):
                out = model.apply(v, x)
                return jnp.mean(out.astype(jnp.float32) ** 2), out

            grad = jax.jit(jax.grad(loss, has_aux=True))
            for _ in range(2):  # the second step scales by the first step's amaxes
                grads, out = grad(variables)
                param_grads, new_meta = fp8.split_gradients(grads)
                variables = {"params": params, fp8.FP8_COLLECTION: new_meta}
    norms = [float(jnp.linalg.norm(g.astype(jnp.float32))) for g in jax.tree.leaves(param_grads)]
    assert all(np.isfinite(n) and n > 0 for n in norms), norms
    assert float(new_meta["head"]["dot_general"]["input_scale"]) != 1.0
    rel = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    assert rel < 0.1, rel


def test_presets_and_registry():
    vit_l = model_config("vit-l16")
    assert (vit_l.hidden_size, vit_l.num_layers, vit_l.seq_len) == (1024, 24, 197)
    assert abs(vit_l.num_params() - 304.3e6) < 0.5e6  # ViT-L/16's published size
    t5_base = model_config("t5-base")
    assert (t5_base.num_encoder_layers, t5_base.mlp_dim) == (12, 2048) and 200e6 < t5_base.num_params() < 260e6
    assert model_config("vlm-tiny", fusion="cross_attention").text.cross_attention
    assert isinstance(build_model(model_config("t5-tiny")), T5)
    bert = BertConfig(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32, max_seq_len=8)
    assert isinstance(build_model(bert), BertEncoder)
    assert abstract_params(bert)["token_embed"]["embedding"].value.shape == (40, 16)
    with pytest.raises(ValueError, match="name='vit-h14' is not a preset"):
        model_config("vit-h14")
    with pytest.raises(TypeError, match="build_model: config is a dict"):
        build_model({})
