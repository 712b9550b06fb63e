"""`mtjax bench moe --quick` on the CPU: every part runs and reports complete rows; the stock-JAX layer
and the stock-Flax MoE model compute what mtjax's do. Speed is never asserted here."""

import argparse
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.bench import cli, moe
from mtjax.flax import MOE_LOSSES, MOE_METRICS, MoEBlock
from mtjax.kernels.grouped_gemm import GemmTiles
from mtjax.models import gpt_config

# XLA's CPU optimizations double the compile time of these toy programs and matter for no assertion here;
# compiled with the quick run's options, the failing-row test's grouped GEMMs can hit the compilation cache.
pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, fast_compiles):
    out = tmp_path_factory.mktemp("bench") / "moe.json"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["moe", "--quick", "--json", str(out), "--block-m", "32"])
    assert cli.run(args) == 0
    return json.loads(out.read_text())


def test_every_part_reports_rows(quick_run):
    rows = [r for r in quick_run["results"] if r["suite"] == "moe"]
    gemm = [r for r in rows if r["name"].startswith("grouped gemm")]
    # 1 quick shape x (balanced, skewed) x (fwd, fwd+bwd) x (dense, mtjax, ragged_dot, mtjax fp8, mtjax fp8 block
    # [, tokamax]).
    assert len({r["name"] for r in gemm}) == 4
    assert {"dense", "mtjax", "ragged_dot", "mtjax fp8", "mtjax fp8 block"} <= {r["implementation"] for r in gemm}
    for r in rows:
        assert "error" not in r["extra"], (r["name"], r["implementation"], r["extra"].get("error"))
        assert r["time_ms"] > 0 and r["tflops"] > 0
    assert all(r["extra"]["fraction_of_dense"] > 0 for r in gemm)
    layer = {r["implementation"]: r for r in rows if r["name"].startswith("moe layer")}
    assert set(layer) == {"mtjax", "stock jax"} and layer["mtjax"]["speedup_vs_peer"] > 0
    train = {r["implementation"]: r for r in rows if r["name"].startswith("train")}
    assert set(train) == {"mtjax", "mtjax fp8", "flax moe"}
    assert all(math.isfinite(r["extra"]["loss"]) and r["mfu"] > 0 for r in train.values())
    assert train["mtjax"]["extra"]["active_params"] < train["mtjax"]["extra"]["params"]


def test_failing_row_records_its_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(moe, "_dense", broken)
    rows = moe.run_gemm(quick=True, tiles=GemmTiles(block_m=32))
    dense = [r for r in rows if r["implementation"] == "dense"]
    assert dense and all("no kernel here" in r["extra"]["error"] and math.isnan(r["time_ms"]) for r in dense)
    assert all("error" not in r["extra"] for r in rows if r["implementation"] != "dense")


def test_train_batch_is_checked():
    with pytest.raises(ValueError, match="train_batch=0"):
        moe.run(quick=True, parts=("train",), train_batch=0)


def test_group_sizes():
    assert moe.group_sizes(100, 4, skewed=False).tolist() == [25, 25, 25, 25]
    skewed = moe.group_sizes(100, 4, skewed=True)
    assert int(skewed.sum()) == 100 and skewed[0] > skewed[1] > skewed[3] > 0


def test_stock_layer_computes_what_moe_block_does():
    config = gpt_config("moe-tiny")
    stock = moe._layer_params(config, jax.random.key(0))
    stock = jax.tree.map(lambda x: x.astype(jnp.float32), stock)
    block = MoEBlock(**config.moe_block_kwargs(), activations=("silu", "linear"), enable_layernorm=False)
    x = jax.random.normal(jax.random.key(1), (1, 16, config.hidden_size))
    (y, _), _ = jax.jit(lambda p, x: block.apply({"params": p}, x, deterministic=True,
                                                 mutable=[MOE_LOSSES, MOE_METRICS]))(
        moe._mtjax_layer_params(config, stock), x)
    want, aux = jax.jit(lambda p, x: moe.stock_moe_mlp(x, p["router"], p["wi"], p["wo"], top_k=2,
                                                        shared=(p["shared_wi"], p["shared_wo"])))(stock, x[0])
    np.testing.assert_allclose(y[0], want, rtol=1e-4, atol=1e-5)
    assert float(aux) > 0


def test_flax_moe_gpt_runs_and_has_the_presets_parameter_count():
    config = gpt_config("moe-tiny")
    model = moe.FlaxMoEGPT(config)
    tokens = jnp.zeros((2, 8), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.meta.unbox(variables["params"])))
    # The same sizes as the mtjax model, plus the biases of the peer's nn.Dense projections.
    biases = [x for path, x in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(variables["params"]))
              if path[-1].key == "bias"]
    assert count - sum(int(np.prod(x.shape)) for x in biases) == config.num_params()


def test_gemm_experts_are_checked():
    with pytest.raises(ValueError, match="gemm experts .*accepted"):
        moe.run(True, parts=["gemm"], gemm_experts=[3])
