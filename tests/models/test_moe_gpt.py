"""Mixture-of-experts GPT: config fields and presets, parameter counts, scanned vs unrolled layers, the train
step's auxiliary losses / expert-load metrics / expert-bias updates, expert parallelism, and `mtjax train`."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta

from mtjax.cli import main
from mtjax.flax import MOE_LOSSES, MOE_METRICS
from mtjax.models import GPT, GPTConfig, gpt_config
from mtjax.sharding import MeshConfig, logical_axis_rules
from mtjax.train.state import abstract_train_state, init_train_state
from mtjax.train.step import make_train_step

pytestmark = pytest.mark.usefixtures("fast_compiles")

MOE = gpt_config("moe-tiny", vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, mlp_dim=48, moe_mlp_dim=16,
                 num_experts=4, experts_per_token=2, num_shared_experts=1, first_k_dense=1, num_layers=3)
BATCH, SEQ = 8, 8


def _tokens(seed, shape=(BATCH, SEQ)):
    return jax.random.randint(jax.random.key(seed), shape, 0, MOE.vocab_size)


def _param_count(cfg):
    shapes = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(meta.unbox(shapes["params"])))


@pytest.mark.parametrize("overrides", [{}, dict(scan_layers=False, first_k_dense=0, num_shared_experts=0,
                                                use_expert_bias=True, activations=("gelu",))])
def test_num_params_and_active_params(overrides):
    cfg = dataclasses.replace(MOE, **overrides)
    assert cfg.num_params() == _param_count(cfg)
    dense_experts = dataclasses.replace(cfg, num_experts=cfg.experts_per_token, use_expert_bias=False)
    router_and_bias = cfg.num_moe_layers * cfg.hidden_size * (cfg.num_experts - cfg.experts_per_token) + (
        cfg.num_moe_layers * cfg.num_experts if cfg.use_expert_bias else 0)
    # Active: the routed experts of top-k only (plus the whole router).
    assert cfg.num_active_params() == dense_experts.num_params() + router_and_bias
    attention = 6 * cfg.num_layers * 128 * cfg.num_heads * cfg.resolved_head_dim
    assert cfg.flops_per_token(128) == pytest.approx(6 * cfg.num_active_params() + attention)


def test_presets():
    tiny = gpt_config("moe-tiny")
    assert (tiny.num_experts, tiny.experts_per_token, tiny.first_k_dense) == (8, 2, 1)
    mixtral = gpt_config("moe-mixtral-1b")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.first_k_dense) == (8, 2, 0)
    assert 0.9e9 < mixtral.num_active_params() < 1.2e9 < mixtral.num_params()
    deepseek = gpt_config("moe-deepseek-1b")
    assert (deepseek.num_experts, deepseek.experts_per_token, deepseek.num_shared_experts, deepseek.first_k_dense,
            deepseek.router_score_function) == (64, 6, 2, 1, "sigmoid")
    # One H200 (141 GB) holds f32 master weights, two Adam moments, gradients and the bf16 copy: 18 B/param.
    for cfg in (mixtral, deepseek):
        assert 18 * cfg.num_params() < 100e9


@pytest.mark.parametrize("overrides,match", [
    (dict(first_k_dense=3), "leaves no MoE layer"),
    (dict(first_k_dense=4), "first_k_dense=4"),
    (dict(experts_per_token=5), "experts_per_token=5"),
    (dict(num_experts=-1), "num_experts=-1"),
    (dict(router_score_function="tanh"), "score_function='tanh'"),
])
def test_bad_moe_fields(overrides, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(MOE, **overrides)


def test_scanned_and_unrolled_layers_agree():
    tokens = _tokens(0)
    scanned, unrolled = GPT(MOE), GPT(dataclasses.replace(MOE, scan_layers=False))
    params = meta.unbox(jax.jit(scanned.init)(jax.random.key(0), tokens)["params"])
    # layers (the dense one) and moe_layers (stacked) -> layers_0, layers_1, layers_2.
    flat = {"token_embed": params["token_embed"], "final_norm": params["final_norm"],
            "layers_0": jax.tree.map(lambda x: x[0], params["layers"])}
    for i in range(MOE.num_moe_layers):
        flat[f"layers_{1 + i}"] = jax.tree.map(lambda x, i=i: x[i], params["moe_layers"])
    apply = lambda model, p: model.apply({"params": p}, tokens, mutable=[MOE_LOSSES, MOE_METRICS])  # noqa: E731
    (a, sown_a), (b, sown_b) = jax.jit(lambda p: apply(scanned, p))(params), jax.jit(lambda p: apply(unrolled, p))(flat)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sown_a[MOE_LOSSES]["moe_layers"]["mlp"]["load_balancing_loss"][0][1],
                               sown_b[MOE_LOSSES]["layers_2"]["mlp"]["load_balancing_loss"][0], rtol=1e-5)


def _train(cfg, steps, mesh_config=None, **step_kwargs):
    model = GPT(cfg)
    optimizer = optax.adam(1e-2)
    mesh = rules = None
    if mesh_config is not None:
        mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
        abstract = abstract_train_state(model, optimizer, (BATCH, SEQ), mesh=mesh, rules=rules)
        step_kwargs["state_sharding"] = jax.tree.map(lambda a: a.sharding, abstract)
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ), mesh=mesh, rules=rules)
    step = make_train_step(model, optimizer, mesh=mesh, rules=rules, **step_kwargs)
    metrics = []
    for i in range(steps):
        tokens = _tokens(i % 2, (BATCH, SEQ + 1))
        state, m = step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        metrics.append(jax.device_get(m))
    return state, metrics


@pytest.fixture(scope="module")
def one_device():
    return _train(MOE, 3)


def test_train_step_reports_aux_losses_and_expert_load(one_device):
    _, metrics = one_device
    first = metrics[0]
    assert {"moe_aux_loss", "moe_load_balancing_loss", "moe_router_z_loss", "moe_expert_load", "moe_max_load",
            "moe_min_load", "moe_dropped_fraction"} <= set(first)
    assert first["moe_expert_load"].shape == (MOE.num_experts,)
    np.testing.assert_allclose(first["moe_expert_load"].sum(), 1.0, rtol=1e-5)
    # The aux loss sums the layers' weighted losses; the reported loss is their mean.
    np.testing.assert_allclose(first["moe_aux_loss"], MOE.num_moe_layers * MOE.load_balancing_loss_weight
                               * first["moe_load_balancing_loss"], rtol=1e-5)
    assert first["moe_max_load"] >= 1.0 >= first["moe_min_load"] and first["moe_dropped_fraction"] == 0.0
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_expert_bias_moves_towards_balance():
    cfg = dataclasses.replace(MOE, use_expert_bias=True, expert_bias_update_rate=0.01)
    state, metrics = _train(cfg, 1)  # make_train_step takes the config's rate
    bias = np.asarray(state.params["moe_layers"]["mlp"]["expert_bias"])    # [moe layers, experts]
    assert bias.shape == (cfg.num_moe_layers, cfg.num_experts)
    # sign(even share - load) * rate: the optimizer adds nothing (no gradient reaches the bias).
    assert np.all(np.isclose(np.abs(bias), 0.0) | np.isclose(np.abs(bias), 0.01)) and np.abs(bias).sum() > 0
    load = metrics[0]["moe_expert_load"]
    assert (bias.mean(0) > 0).any() and (load.max() > 1 / cfg.num_experts)


def test_expert_parallel_train_step_matches_one_device(one_device):
    state, metrics = _train(MOE, 3, MeshConfig(dp=2, ep=2, tp=2))
    ref_state, ref_metrics = one_device
    np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics], rtol=1e-5)
    np.testing.assert_allclose(metrics[-1]["moe_expert_load"], ref_metrics[-1]["moe_expert_load"], rtol=1e-5)
    assert state.params["moe_layers"]["mlp"]["wi_kernel"].sharding.spec[1] == "ep"   # [layers, experts, ...]
    # Adam divides by the gradient's RMS, so entries with near-zero gradients amplify summation-order
    # differences: after 3 steps at lr 1e-2 a few entries differ by up to about 1e-4 (a hundredth of lr).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-4), state.params, ref_state.params)


@pytest.mark.slow
def test_mtjax_train_moe_preset_logs_expert_metrics(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300)))
    workdir = str(tmp_path / "run")
    assert main(["train", "--preset", "moe-tiny", "--data", str(corpus), "--workdir", workdir, "--steps", "2",
                 "--seq-len", "32", "--batch-size", "8", "--eval-batches", "1", "--no-progress", "--log-every", "1",
                 "--ep", "2", "--tp", "2", "--save-every", "0"]) == 0
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if "loss" in r]
    assert len(train) == 2 and len(train[0]["moe_expert_load"]) == 8 and "moe_aux_loss" in train[0]
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--workdir", str(tmp_path / "bad"), "--ep", "2",
                 "--no-progress"]) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["moe-mixtral-1b", "moe-deepseek-1b"])
def test_large_preset_trains_on_one_gpu_at_sequence_2048(preset):
    """The two large presets fit one H200 at batch 8 x 2048 (f32 master weights, Adam, bf16 copy)."""
    from mtjax.train.state import compute_dtype_for
    from mtjax.train.step import make_optimizer

    cfg = gpt_config(preset)
    model = GPT(cfg)
    optimizer, _ = make_optimizer(3e-4, total_steps=10, warmup_steps=1)
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (8, 2048),
                             compute_dtype=compute_dtype_for(cfg.dtype, cfg.param_dtype))
    step = make_train_step(model, optimizer)  # the preset's expert_bias_update_rate by default
    tokens = jax.random.randint(jax.random.key(0), (8, 2049), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    for _ in range(2):
        state, metrics = step(state, batch)
    metrics = jax.device_get(metrics)
    assert np.isfinite(metrics["loss"]) and metrics["moe_expert_load"].shape == (cfg.num_experts,)


def test_config_with_fp8_dispatch_round_trips_through_its_dict():
    config = gpt_config("moe-tiny", moe_dispatch_dtype=jnp.float8_e4m3fn)
    fields = json.loads(json.dumps(config.to_dict()))           # what a checkpoint's meta stores
    assert fields["moe_dispatch_dtype"] == "float8_e4m3fn"
    assert GPTConfig.from_dict(fields) == config
    assert GPTConfig.from_dict(gpt_config("moe-tiny").to_dict()).moe_dispatch_dtype is None
    with pytest.raises(TypeError, match="dispatch_dtype"):
        gpt_config("moe-tiny", moe_dispatch_dtype=jnp.bfloat16)
