"""MoEBlock against a dense jax.numpy mixture of experts (every expert on every token, masked by the top-k)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import fp8
from mtjax.flax import MOE_LOSSES, MOE_METRICS, MoEBlock, MoETransformerLayer, moe_aux_loss, moe_metrics
from mtjax.flax.moe import expert_kernel_init

pytestmark = pytest.mark.usefixtures("fast_compiles")

ACTIVATIONS = {("silu", "linear"): lambda h: jax.nn.silu(h[..., 0, :]) * h[..., 1, :],
               ("gelu",): lambda h: jax.nn.gelu(h[..., 0, :])}


def dense_moe(params, x, *, top_k, activations, score_function="softmax", num_shared=0):
    """Every expert on every token; the top-k (by score) weights combine them. No permutation."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ params["router_kernel"]
    scores = jax.nn.softmax(logits, -1) if score_function == "softmax" else jax.nn.sigmoid(logits)
    chosen = jnp.argsort(-jax.lax.stop_gradient(scores), axis=-1)[:, :top_k]
    mask = jnp.zeros_like(scores).at[jnp.arange(tokens.shape[0])[:, None], chosen].set(1.0)
    weights = scores * mask
    weights = weights / weights.sum(-1, keepdims=True)
    act = ACTIVATIONS[activations]
    h = jnp.einsum("th,ehaf->etaf", tokens, params["wi_kernel"])
    y = jnp.einsum("etf,efh->eth", act(h), params["wo_kernel"])
    out = jnp.einsum("te,eth->th", weights, y)
    if num_shared:
        shared = params["shared_experts"]
        hs = jnp.einsum("th,haf->taf", tokens, shared["wi_kernel"])
        out = out + act(hs) @ shared["wo_kernel"]
    return out.reshape(x.shape)


def _init(block, x):
    init = jax.jit(lambda x: block.init(jax.random.PRNGKey(1), x, deterministic=True)["params"])
    return nn.meta.unbox(init(x))


def _apply(block, params, x, mutable=(MOE_LOSSES, MOE_METRICS)):
    """``block.apply`` jitted (eager op-by-op dispatch is slow on the CPU): ``((y, ln_out), sown)``."""
    return jax.jit(lambda p, x: block.apply({"params": p}, x, deterministic=True, mutable=list(mutable)))(params, x)


@pytest.mark.parametrize("activations,num_shared,score,alignment", [(("silu", "linear"), 0, "softmax", 1),
                                                                    (("gelu",), 2, "sigmoid", 1),
                                                                    (("silu", "linear"), 0, "softmax", 16)])
def test_matches_dense_mixture_forward_and_backward(activations, num_shared, score, alignment):
    block = MoEBlock(num_experts=6, experts_per_token=2, expert_dim=12, num_shared_experts=num_shared,
                     shared_expert_dim=8, activations=activations, score_function=score, enable_layernorm=False,
                     kernel_init=nn.initializers.normal(0.3), expert_row_alignment=alignment)
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 16))
    params = _init(block, x)
    cotangent = jax.random.normal(jax.random.PRNGKey(2), x.shape)

    def ours(params, x):
        (y, _), _ = block.apply({"params": params}, x, deterministic=True, mutable=[MOE_LOSSES, MOE_METRICS])
        return y

    def loss(fn):
        return lambda params, x: jnp.sum(fn(params, x) * cotangent)

    ref = lambda p, x: dense_moe(p, x, top_k=2, activations=activations, score_function=score,
                                 num_shared=num_shared)
    np.testing.assert_allclose(jax.jit(ours)(params, x), jax.jit(ref)(params, x), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_sows_weighted_losses_and_load_metrics():
    block = MoEBlock(num_experts=4, experts_per_token=2, expert_dim=8, load_balancing_loss_weight=0.1,
                     router_z_loss_weight=0.01)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
    params = _init(block, x)
    _, sown = _apply(block, params, x)
    metrics, losses = sown[MOE_METRICS], sown[MOE_LOSSES]
    np.testing.assert_allclose(losses["load_balancing_loss"][0], 0.1 * metrics["load_balancing_loss"][0], rtol=1e-6)
    np.testing.assert_allclose(losses["router_z_loss"][0], 0.01 * metrics["router_z_loss"][0], rtol=1e-6)
    np.testing.assert_allclose(metrics["expert_load"][0].sum(), 1.0, rtol=1e-6)
    summary = moe_metrics(metrics, losses)
    assert summary["moe_expert_load"].shape == (4,)
    assert summary["moe_max_load"] >= 1.0 >= summary["moe_min_load"]
    assert float(summary["moe_dropped_fraction"]) == 0.0
    np.testing.assert_allclose(summary["moe_aux_loss"], moe_aux_loss(losses), rtol=1e-6)
    # Zero coefficients: nothing to add to the loss, the metrics are still there.
    quiet = block.clone(load_balancing_loss_weight=0.0, router_z_loss_weight=0.0)
    _, sown = _apply(quiet, params, x)
    assert MOE_LOSSES not in sown and float(moe_aux_loss(sown.get(MOE_LOSSES, {}))) == 0.0


def test_capacity_drops_tokens_and_counts_them():
    block = MoEBlock(num_experts=4, experts_per_token=2, expert_dim=8, capacity_factor=0.5, enable_layernorm=False)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 8))
    params = _init(block, x)
    (y, _), sown = _apply(block, params, x)
    dropped = float(sown[MOE_METRICS]["dropped_fraction"][0])
    # Each expert keeps ceil(0.5 * 32 * 2 / 4) = 8 of the 64 slots' rows: at least half are dropped.
    assert dropped >= 0.5
    dropless = block.clone(capacity_factor=None)
    (y_full, _), _ = _apply(dropless, params, x)
    assert not np.allclose(y, y_full)


FP8_BLOCK = MoEBlock(num_experts=4, experts_per_token=2, expert_dim=32, enable_layernorm=False)


def _fp8_block_run(params, x, recipe=None):
    """FP8_BLOCK's output, parameter gradients and jaxpr, under ``recipe`` (None: no FP8)."""
    def run(params, x):
        (y, _), _ = FP8_BLOCK.apply({"params": params}, x, deterministic=True, mutable=[MOE_METRICS])
        return y

    def loss(params, x):
        y = run(params, x)
        return jnp.sum(y ** 2) / 2, y

    # New functions in each context: jit's trace cache does not key on the autocast context.
    with fp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)
        jaxpr = str(jax.make_jaxpr(run)(params, x))
    return y, grads, jaxpr


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.BlockScaling()], ids=["current", "block"])
def test_fp8_grouped_gemm_under_autocast(recipe):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 32))
    params = _init(FP8_BLOCK, x)
    y, _, _ = _fp8_block_run(params, x)
    y8, grads, jaxpr = _fp8_block_run(params, x, recipe)
    assert "float8_e4m3fn" in jaxpr
    # E4M3 keeps 3 mantissa bits (relative rounding error <= 2^-4 per operand); two GEMMs in a row.
    rel = float(jnp.linalg.norm(y8 - y) / jnp.linalg.norm(y))
    assert 0 < rel < 0.1
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    if isinstance(recipe, fp8.BlockScaling):  # its own grouped GEMM, not current scaling's
        y_current, _, _ = _fp8_block_run(params, x, fp8.CurrentScaling(fp8.Format.E4M3))
        assert not np.array_equal(np.asarray(y8), np.asarray(y_current))


def test_delayed_scaling_keeps_a_state_per_grouped_gemm_with_a_history_per_expert():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 32))
    recipe = fp8.DelayedScaling(amax_history_len=4)

    def loss(variables, x):
        (y, _), _ = FP8_BLOCK.apply(variables, x, deterministic=True, mutable=[MOE_METRICS])
        return jnp.sum(y ** 2) / 2, y

    with fp8.fp8_autocast(recipe=recipe):
        variables = nn.meta.unbox(jax.jit(lambda x: FP8_BLOCK.init(jax.random.PRNGKey(1), x, deterministic=True))(x))
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (_, y1), grads = step(variables, x)
        params_grads, meta = fp8.split_gradients(grads)
        (_, y2), _ = step({**variables, fp8.FP8_COLLECTION: meta}, x)
    assert set(meta) == {"wi_fp8", "wo_fp8"}
    assert meta["wi_fp8"]["kernel_amax_history"].shape == (4, 4) and meta["wo_fp8"]["kernel_scale"].shape == (4,)
    wi = variables["params"]["wi_kernel"]
    np.testing.assert_array_equal(meta["wi_fp8"]["kernel_amax_history"][:, 0], jnp.max(jnp.abs(wi), axis=(1, 2, 3)))
    assert float(meta["wo_fp8"]["output_grad_amax_history"][0]) > 0
    y, _, _ = _fp8_block_run(variables["params"], x)
    # Step 1 quantizes with unit scales (no history yet), step 2 with the amaxes of step 1: E4M3's error.
    assert float(jnp.linalg.norm(y2 - y) / jnp.linalg.norm(y)) < 0.1
    assert not np.array_equal(np.asarray(y1), np.asarray(y2))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(params_grads))


def test_transformer_layer_with_moe_mlp_and_fused_residual():
    layer = MoETransformerLayer(hidden_size=16, num_attention_heads=2, mlp_activations=("silu", "linear"),
                                hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
                                layernorm_type="rmsnorm", moe={"num_experts": 4, "experts_per_token": 2,
                                                               "expert_dim": 8, "num_shared_experts": 1})
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 16))
    variables = jax.jit(lambda x: layer.init(jax.random.PRNGKey(1), x, deterministic=True))(x)
    mlp = variables["params"]["mlp"]
    assert {"router_kernel", "wi_kernel", "wo_kernel", "shared_experts", "scale"} <= set(mlp)
    assert mlp["wi_kernel"].names == ("expert", "embed", None, "mlp")
    y, sown = _apply(layer, nn.meta.unbox(variables["params"]), x, mutable=[MOE_LOSSES])
    assert y.shape == x.shape and np.isfinite(y).all()
    assert "load_balancing_loss" in sown[MOE_LOSSES]["mlp"]


def test_expert_kernel_init_uses_one_experts_fan_in():
    kernel = expert_kernel_init(nn.initializers.lecun_normal())(jax.random.PRNGKey(0), (64, 256, 2, 32))
    # lecun_normal: variance 1 / fan_in with fan_in = 256 (one expert), not 64 * 256.
    np.testing.assert_allclose(float(jnp.var(kernel)), 1 / 256, rtol=0.1)
    assert not np.allclose(kernel[0], kernel[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(experts_per_token=5), "experts_per_token=5 exceeds num_experts=4"),
    (dict(score_function="relu"), "score_function='relu'"),
    (dict(num_expert_groups=3, expert_group_top_k=1), "num_expert_groups=3 must divide"),
    (dict(num_expert_groups=2), "together"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=True), "capacity_factor=True"),
    (dict(load_balancing_loss_weight=float("inf")), "load_balancing_loss_weight=inf"),
    (dict(num_expert_groups=0, expert_group_top_k=1), "num_expert_groups=0; expected None or a positive int"),
    (dict(routed_scaling_factor=float("nan")), "scaling_factor=nan"),
    (dict(expert_dim=0), "expert_dim=0"),
    (dict(expert_row_alignment=0), "expert_row_alignment=0"),
])
def test_bad_settings_raise(kwargs, match):
    block = MoEBlock(**{"num_experts": 4, "experts_per_token": 2, "expert_dim": 8, **kwargs})
    with pytest.raises(ValueError, match=match):
        block.init(jax.random.PRNGKey(0), jnp.ones((1, 2, 8)), deterministic=True)
