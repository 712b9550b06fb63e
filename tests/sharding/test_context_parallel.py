"""Context parallelism on 8 virtual CPU devices: the per-block attention with its log-sum-exp (the
reference and the flash kernel in interpret mode), ring and all-gather attention against the
unsharded op (forward and gradients, causal / full / segment-id masks, load-balanced or not), and a
whole GPT's loss and gradients with ``cp`` combined with dp, fsdp and tp+sp."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtjax import ops
from mtjax.config import override
from mtjax.flax import DotProductAttention
from mtjax.models import GPT, GPTConfig, gpt_config
from mtjax.sharding import (
    MeshConfig,
    context_parallel_size,
    inverse_reorder_causal_load_balancing,
    jit_sharded,
    load_balanced_chunks,
    logical_axis_rules,
    logical_shardings,
    named_sharding,
    reorder_causal_load_balancing,
    shard_variables,
    use_mesh,
)

pytestmark = pytest.mark.usefixtures("fast_compiles")

B, S, H, KH, D = 2, 16, 4, 2, 16
SEGMENTS = jnp.array([[1] * 5 + [2] * 9 + [0] * 2, [3] * 16], jnp.int32)


def _qkv(seed=0, length=S):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, length, H, D))
    k = jax.random.normal(keys[1], (B, length, KH, D))
    v = jax.random.normal(keys[2], (B, length, KH, D))
    do = jax.random.normal(keys[3], (B, length, H, D))
    return q, k, v, do


def _close(got, want, rtol=1e-5, name=""):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(1.0, np.abs(want).max()), err_msg=name)


# Interpret-mode kernels are large CPU programs: the tests need them compiled, not optimised.
_CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(_CPU_COMPILE_OPTIONS)(*args)


# -------------------------------------------------------------------------------------------------- layout helpers


def test_load_balanced_layout_round_trip():
    assert load_balanced_chunks(2) == (0, 3, 1, 2)
    assert load_balanced_chunks(4) == (0, 7, 1, 6, 2, 5, 3, 4)
    x = jnp.arange(2 * 16).reshape(2, 16)
    y = reorder_causal_load_balancing(x, 4)
    np.testing.assert_array_equal(y[0, :4], [0, 1, 14, 15])  # device 0: chunks 0 and 7
    np.testing.assert_array_equal(inverse_reorder_causal_load_balancing(y, 4), x)
    with pytest.raises(ValueError, match="multiple of 2 \\* cp = 8"):
        reorder_causal_load_balancing(jnp.zeros((1, 12)), 4)
    with pytest.raises(ValueError, match="cp=0"):
        load_balanced_chunks(0)


def test_context_parallel_size_reads_the_mesh():
    assert context_parallel_size() == 1
    config = MeshConfig(dp=2, cp=4)
    with use_mesh(config.make_mesh(), logical_axis_rules(config)):
        assert context_parallel_size() == 4


def test_rules_split_the_sequence_over_cp():
    rules = logical_axis_rules(MeshConfig(dp=2, cp=2, tp=2, sp=True))
    to_mesh = lambda *names: nn.logical_to_mesh_axes(names, rules)  # noqa: E731
    assert to_mesh("activation_batch", "activation_length", "activation_embed") == P(("dp", "fsdp"), ("cp", "tp"), None)
    assert to_mesh("activation_batch", "activation_length", "activation_heads", "activation_head_dim") == P(
        ("dp", "fsdp"), "cp", "tp", None)
    assert to_mesh("activation_batch", "activation_length", "activation_mlp") == P(("dp", "fsdp"), "cp", "tp")
    no_sp = logical_axis_rules(MeshConfig(dp=4, cp=2))
    assert nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"), no_sp) == P(
        ("dp", "fsdp"), "cp", None)


# -------------------------------------------------------------------------------------------------- one block


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segments", [False, True])
def test_attention_with_lse_reference(causal, segments):
    q, k, v, _ = _qkv()
    seg = SEGMENTS if segments else None
    mask_type = ("padding_" if segments else "") + ("causal" if causal else "no_mask")
    mask_type = {"padding_no_mask": "padding"}.get(mask_type, mask_type)
    out, lse = ops.attention_with_lse(q, k, v, seg, seg, causal=causal, scale=D ** -0.5, implementation="xla")
    _close(out, ops.attention(q, k, v, mask_type=mask_type, q_segment_ids=seg, kv_segment_ids=seg), name="out")
    logits = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, H // KH, axis=2)) * D ** -0.5
    keep = jnp.ones((B, 1, S, S), bool)
    if causal:
        keep &= jnp.tril(jnp.ones((S, S), bool))
    if segments:
        keep &= ((seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0))[:, None]
    want = jax.nn.logsumexp(jnp.where(keep, logits, -jnp.inf), axis=-1)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)  # padding rows: -inf
    _close(np.asarray(lse)[finite], np.asarray(want)[finite], name="lse")


def test_merged_blocks_and_their_gradients_equal_whole_attention():
    """Two key blocks merged by their log-sum-exp, and the sum of the blocks' backward passes given
    the merged result, are the attention over all keys and its gradients (reference and kernel)."""
    q, k, v, do = _qkv(1)
    want, vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, mask_type="padding", q_segment_ids=SEGMENTS,
                                                      kv_segment_ids=SEGMENTS, logits_soft_cap=5.0), q, k, v)
    want_grads = vjp(do)
    h = S // 2

    def blockwise(impl):
        kw = dict(causal=False, scale=D ** -0.5, logits_soft_cap=5.0, implementation=impl)

        def f(q, k, v, do):
            halves = [(k[:, :h], v[:, :h], SEGMENTS[:, :h]), (k[:, h:], v[:, h:], SEGMENTS[:, h:])]
            out, lse = ops.merge_attention(*(x for k_, v_, s_ in halves
                                             for x in ops.attention_with_lse(q, k_, v_, SEGMENTS, s_, **kw)))
            grads = [ops.attention_with_lse_backward(q, k_, v_, SEGMENTS, s_, out, lse, do, **kw)
                     for k_, v_, s_ in halves]
            return (out, grads[0][0] + grads[1][0], jnp.concatenate([grads[0][1], grads[1][1]], 1),
                    jnp.concatenate([grads[0][2], grads[1][2]], 1))
        return f

    with override(pallas_interpret=True):
        for impl in ("xla", "pallas_triton"):
            got = _compiled(blockwise(impl), q, k, v, do)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, (want, *want_grads)):
                _close(a, b, name=f"{impl} {name}")


def test_flash_kernel_lse_matches_reference_causal():
    q, k, v, do = _qkv(2)
    kw = dict(causal=True, scale=0.3)

    def both(impl):
        def f(q, k, v, do):
            out = ops.attention_with_lse(q, k, v, **kw, implementation=impl)
            return out, ops.attention_with_lse_backward(q, k, v, None, None, *out, do, **kw, implementation=impl)
        return f

    with override(pallas_interpret=True):
        got, grads = _compiled(both("pallas_triton"), q, k, v, do)
    want, want_grads = _compiled(both("xla"), q, k, v, do)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got + grads, want + want_grads):
        _close(a, b, name=name)


def test_blockwise_kernels_lower_for_cuda():
    """`flash_attention_forward` / `flash_attention_backward` lower through Triton for an H200 (on the CPU)."""
    from mtjax import backend
    from mtjax.kernels import flash_attention as fa

    q = jax.ShapeDtypeStruct((2, 300, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 300), jnp.int32)

    def f(q, k, v, ids):
        out, lse = fa.flash_attention_forward(q, k, v, ids, ids, scale=0.1, causal=True)
        return fa.flash_attention_backward(q, k, v, ids, ids, out, lse, out, scale=0.1, causal=True)

    with backend.abstract_gpu():
        text = jax.jit(f).trace(q, k, k, ids).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("mtjax_flash_attention_fwd", "mtjax_flash_attention_dkdv", "mtjax_flash_attention_dq"):
        assert name in text


# -------------------------------------------------------------------------------------------------- ring / all-gather


def _sharded_attention(strategy, mesh_config, q, k, v, *, mask_type, segment_ids, load_balanced,
                       implementation=None):
    cp = mesh_config.cp
    reorder = load_balanced and mask_type in ("causal", "padding_causal")
    to_layout = (lambda x: reorder_causal_load_balancing(x, cp)) if reorder else (lambda x: x)
    from_layout = (lambda x: inverse_reorder_causal_load_balancing(x, cp)) if reorder else (lambda x: x)
    spec = P(("dp", "fsdp"), "cp", "tp")

    def attend(q, k, v):
        seg = None if segment_ids is None else to_layout(segment_ids)
        out = ops.context_parallel_attention(
            to_layout(q), to_layout(k), to_layout(v), strategy=strategy, q_spec=spec, kv_spec=spec,
            mask_type=mask_type, q_segment_ids=seg, kv_segment_ids=seg, load_balanced=load_balanced,
            implementation=implementation)
        return from_layout(out)

    return jax.jit(attend)


CP_CASES = [
    # (strategy, mesh, mask_type, segments, load_balanced)
    ("ring", MeshConfig(dp=2, cp=4), "causal", False, True),
    ("ring", MeshConfig(dp=2, cp=4), "causal", False, False),
    ("ring", MeshConfig(cp=8), "padding_causal", True, True),
    ("ring", MeshConfig(dp=2, cp=2, tp=2), "padding", True, True),
    ("all_gather", MeshConfig(dp=2, cp=4), "causal", False, True),
    ("all_gather", MeshConfig(cp=4, tp=2), "padding_causal", True, False),
    ("all_gather", MeshConfig(dp=2, cp=4), "no_mask", False, True),
]


@pytest.mark.parametrize("strategy,mesh_config,mask_type,segments,load_balanced", CP_CASES,
                         ids=lambda x: x if isinstance(x, str) else
                         (f"cp{x.cp}" if isinstance(x, MeshConfig) else str(x)))
def test_context_parallel_attention_equals_unsharded(strategy, mesh_config, mask_type, segments, load_balanced):
    q, k, v, do = _qkv(3)
    seg = SEGMENTS if segments else None
    want, vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, mask_type=mask_type, q_segment_ids=seg,
                                                      kv_segment_ids=seg), q, k, v)
    want_grads = vjp(do)
    attend = _sharded_attention(strategy, mesh_config, q, k, v, mask_type=mask_type, segment_ids=seg,
                                load_balanced=load_balanced)
    with jax.set_mesh(mesh_config.make_mesh()):
        got, vjp = jax.vjp(attend, q, k, v)
        got_grads = vjp(do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        _close(a, b, name=name)


POSITIONAL_CASES = [
    # (strategy, mesh, mask_type, window_size, dropout_rate, bias shape)
    ("ring", MeshConfig(dp=2, cp=4), "causal", (5, 0), 0.3, (1, H, S, S)),
    ("all_gather", MeshConfig(cp=2, tp=2, dp=2), "padding_causal", (3, -1), 0.2, None),
    ("ring", MeshConfig(cp=2, tp=2, dp=2), "no_mask", (2, 3), 0.0, (B, 1, S, S)),
]


@pytest.mark.parametrize("strategy,mesh_config,mask_type,window_size,dropout_rate,bias_shape", POSITIONAL_CASES,
                         ids=["ring-window-dropout-bias", "all_gather-window-dropout-segments", "ring-window-bias"])
def test_context_parallel_window_dropout_and_bias_equal_unsharded(strategy, mesh_config, mask_type, window_size,
                                                                  dropout_rate, bias_shape):
    """The same mask, dropout draw and bias gradient as the unsharded op, forward and backward."""
    q, k, v, do = _qkv(5)
    seg = SEGMENTS if mask_type.startswith("padding") else None
    bias = None if bias_shape is None else jax.random.normal(jax.random.key(6), bias_shape)
    rng = jax.random.key(7)
    kwargs = dict(mask_type=mask_type, window_size=window_size, dropout_rate=dropout_rate, dropout_rng=rng)

    def unsharded(q, k, v, bias):
        return ops.attention(q, k, v, bias=bias, q_segment_ids=seg, kv_segment_ids=seg, **kwargs)

    want, vjp = jax.vjp(unsharded, q, k, v, bias)
    want_grads = vjp(do)
    cp, causal = mesh_config.cp, mask_type.endswith("causal")
    to_layout = (lambda x, axis=1: reorder_causal_load_balancing(x, cp, axis)) if causal else (lambda x, axis=1: x)
    spec = P(("dp", "fsdp"), "cp", "tp")

    def sharded(q, k, v, bias):
        seg_layout = None if seg is None else to_layout(seg)
        out = ops.context_parallel_attention(
            to_layout(q), to_layout(k), to_layout(v), strategy=strategy, q_spec=spec, kv_spec=spec,
            q_segment_ids=seg_layout, kv_segment_ids=seg_layout,
            bias=None if bias is None else to_layout(to_layout(bias, 2), 3), **kwargs)
        return inverse_reorder_causal_load_balancing(out, cp) if causal else out

    with jax.set_mesh(mesh_config.make_mesh()):
        got, vjp = jax.vjp(jax.jit(sharded), q, k, v, bias)
        got_grads = vjp(do)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), (got, *got_grads), (want, *want_grads)):
        if b is not None:
            _close(a, b, name=name)


def test_ring_through_the_flash_kernel():
    """The ring with every block through the Pallas kernel (interpret mode), forward and backward."""
    q, k, v, do = _qkv(4)
    mesh_config = MeshConfig(cp=2)
    want, vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, mask_type="causal"), q, k, v)
    want_grads = vjp(do)
    with override(pallas_interpret=True):
        attend = _sharded_attention("ring", mesh_config, q, k, v, mask_type="causal", segment_ids=None,
                                    load_balanced=True, implementation="pallas_triton")
        with jax.set_mesh(mesh_config.make_mesh(jax.devices()[:2])):
            got, *got_grads = _compiled(lambda q, k, v, do: _value_and_vjp(attend, q, k, v, do), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        _close(a, b, name=name)


def _value_and_vjp(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


def test_ring_hlo_passes_kv_with_collective_permutes():
    q, k, v, _ = _qkv()
    mesh_config = MeshConfig(cp=2)
    attend = _sharded_attention("ring", mesh_config, q, k, v, mask_type="causal", segment_ids=None,
                                load_balanced=True)
    with jax.set_mesh(mesh_config.make_mesh(jax.devices()[:2])):
        grad = jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2))
        hlo = jax.jit(grad).lower(q, k, v).compile().as_text()
    assert "collective-permute" in hlo
    assert " all-gather(" not in hlo.replace("all-gather-start(", "")


def test_context_parallel_errors():
    q, k, v, _ = _qkv()
    spec = P(None, "cp")
    with jax.set_mesh(MeshConfig(cp=8).make_mesh()):
        with pytest.raises(ValueError, match="strategy"):
            ops.context_parallel_attention(q, k, v, strategy="ulysses", q_spec=spec, kv_spec=spec)
        with pytest.raises(ValueError, match="q_spec=.*must split the length"):
            ops.context_parallel_attention(q, k, v, q_spec=P("cp"), kv_spec=spec)
        with pytest.raises(ValueError, match="even shard length"):  # 16 / 8 = 2 per shard: fine; 8 / 8 = 1 is not
            ops.context_parallel_attention(q[:, :8], k[:, :8], v[:, :8], q_spec=spec, kv_spec=spec)
        with pytest.raises(ValueError, match="needs q/kv_segment_ids"):
            ops.context_parallel_attention(q, k, v, q_spec=spec, kv_spec=spec, mask_type="padding")
        with pytest.raises(ValueError, match="bias has shape \\(1, 4, 16\\); expected"):
            ops.context_parallel_attention(q, k, v, q_spec=spec, kv_spec=spec, bias=jnp.zeros((1, H, S)))
        with pytest.raises(ValueError, match="needs dropout_rng"):
            jax.jit(lambda q: ops.context_parallel_attention(q, k, v, q_spec=spec, kv_spec=spec, dropout_rate=0.1))(q)
        with pytest.raises(ValueError, match="implementation='pallas_triton': with a window"):
            jax.jit(lambda q: ops.context_parallel_attention(q, k, v, q_spec=spec, kv_spec=spec, window_size=(2, 0),
                                                             implementation="pallas_triton"))(q)
    attend = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=KH, context_parallel="ring")
    config = MeshConfig(cp=8)
    with use_mesh(config.make_mesh(), logical_axis_rules(config)), pytest.raises(ValueError, match="explicit mask"):
        attend.apply({}, q, k, v, jnp.ones((1, 1, S, S), bool))


# -------------------------------------------------------------------------------------------------- a whole GPT


CONFIG = gpt_config("tiny", vocab_size=64, hidden_size=32, mlp_dim=64, max_seq_len=16)  # 4 heads, 2 kv heads
TOKENS = jax.random.randint(jax.random.key(1), (4, 17), 0, CONFIG.vocab_size)
GPT_SEGMENTS = jnp.concatenate([jnp.ones((4, 6), jnp.int32), 2 * jnp.ones((4, 8), jnp.int32),
                                jnp.zeros((4, 2), jnp.int32)], axis=1)


def _loss_fn(model, with_segments):
    def loss_fn(variables, tokens):
        segment_ids = GPT_SEGMENTS if with_segments else None
        logits = model.apply(variables, tokens[:, :-1], segment_ids=segment_ids)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return loss_fn


@pytest.fixture(scope="module")
def boxed():
    return jax.jit(GPT(CONFIG).init)(jax.random.key(0), TOKENS[:, :-1])


@pytest.fixture(scope="module")
def references(boxed):
    """Single-device loss and gradients, without and with segment ids."""
    return {segments: jax.jit(jax.value_and_grad(_loss_fn(GPT(CONFIG), segments)))(nn.meta.unbox(boxed), TOKENS)
            for segments in (False, True)}


@pytest.mark.parametrize("strategy,mesh_config,with_segments", [
    ("ring", MeshConfig(dp=2, cp=4), False),
    ("ring", MeshConfig(fsdp=2, cp=2, tp=2, sp=True), True),
    ("all_gather", MeshConfig(dp=2, cp=2, tp=2), True),
], ids=["ring-dp2-cp4", "ring-fsdp2-cp2-tp2-sp-segments", "all_gather-dp2-cp2-tp2-segments"])
def test_gpt_loss_and_grads_equal_single_device(boxed, references, strategy, mesh_config, with_segments):
    model = GPT(GPTConfig(**{**CONFIG.__dict__, "context_parallel": strategy}))
    mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
    shardings = logical_shardings(boxed, mesh, rules)
    tokens_sharding = named_sharding(mesh, rules, ("activation_batch", None))
    step = jit_sharded(jax.value_and_grad(_loss_fn(model, with_segments)), mesh=mesh, rules=rules,
                       in_shardings=(shardings, tokens_sharding), out_shardings=(None, shardings))
    loss, grads = step(shard_variables(boxed, mesh, rules), jax.device_put(TOKENS, tokens_sharding))
    want_loss, want_grads = references[with_segments]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)



def test_gpt_with_window_and_attention_dropout_equals_single_device(boxed):
    """A sliding window and attention dropout under cp: the same loss and gradients (the same dropout draw)."""
    config = GPTConfig(**{**CONFIG.__dict__, "window_size": (5, 0), "attention_dropout": 0.2})
    rngs = {"dropout": jax.random.key(3)}

    def loss_fn(model):
        def loss(variables, tokens):
            logits = model.apply(variables, tokens[:, :-1], deterministic=False, rngs=rngs)
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
        return jax.value_and_grad(loss)

    want_loss, want_grads = jax.jit(loss_fn(GPT(config)))(nn.meta.unbox(boxed), TOKENS)
    mesh_config = MeshConfig(dp=2, cp=4)
    mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
    shardings = logical_shardings(boxed, mesh, rules)
    tokens_sharding = named_sharding(mesh, rules, ("activation_batch", None))
    step = jit_sharded(loss_fn(GPT(GPTConfig(**{**config.__dict__, "context_parallel": "ring"}))), mesh=mesh,
                       rules=rules, in_shardings=(shardings, tokens_sharding), out_shardings=(None, shardings))
    loss, grads = step(shard_variables(boxed, mesh, rules), jax.device_put(TOKENS, tokens_sharding))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_gpt_config_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="context_parallel='ulysses'"):
        gpt_config("tiny", context_parallel="ulysses")
