"""The stock-Flax ViT and T5 of the train benchmark: the same models as mtjax's (parameter for
parameter), their train steps trace, and the benchmark's workloads have the documented shapes."""

import jax
import numpy as np
import optax
import pytest

from mtjax.bench import peers, train
from mtjax.models import model_config

pytestmark = pytest.mark.usefixtures("fast_compiles")


def test_workloads_have_the_documented_shapes():
    vit = train.workload("vit-l16", quick=False)
    assert vit.batches[0]["images"].shape == (64, 224, 224, 3) and vit.tokens_per_step == 64 * 197
    t5 = train.workload("t5-base", quick=False)
    assert t5.batches[0]["encoder_inputs"].shape == (32, 512) and t5.batches[0]["inputs"].shape == (32, 128)
    assert t5.flops == pytest.approx(32 * model_config("t5-base").flops_per_example(512, 128))
    with pytest.raises(ValueError, match="preset 'vlm-tiny' is a VLMConfig; the train suite runs GPT, ViT and T5"):
        train.workload("vlm-tiny", quick=True)


@pytest.mark.parametrize("preset", ["vit-tiny", "t5-tiny"])
def test_peer_has_the_presets_parameters_and_its_step_traces(preset):
    work = train.workload(preset, quick=True)
    model = work.peer(False)
    example = work.example
    variables = jax.eval_shape(lambda *x: model.init(jax.random.key(0), *x), *work.peer_inputs(example))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables["params"])) == work.config.num_params()
    opt = optax.adamw(1e-4)
    step = peers.train_step(model, opt, work.peer_inputs, work.peer_labels)
    state = (variables["params"], {}, jax.eval_shape(opt.init, variables["params"]))
    _, metrics = jax.eval_shape(step, state, example)
    assert metrics["loss"].shape == ()


def test_relative_position_buckets_of_the_peer():
    buckets = np.asarray(jax.jit(peers.relative_position_buckets, static_argnums=(0, 1, 2, 3, 4))(3, 40, True, 32, 128))
    assert buckets[0, 0] == 0 and buckets[0, 1] == 17 and buckets[2, 0] == 2  # after: second half; before: first
    assert buckets.max() < 32 and (np.diff(buckets[0, 16:]) >= 0).all()


def test_train_rows_are_selectable_and_a_failing_row_lets_the_next_run(monkeypatch):
    with pytest.raises(ValueError, match=r"rows \['nope'\] are not among"):
        train.run(True, ["vit-tiny"], only=["mtjax", "nope"])
    compile_step = train._compile

    def failing_for_flax(variant, *args, **kwargs):
        if variant.implementation == "flax":
            raise RuntimeError("no memory")
        return compile_step(variant, *args, **kwargs)

    monkeypatch.setattr(train, "_compile", failing_for_flax)
    rows = train.run(True, ["vit-tiny"], only=["flax", "mtjax"])
    assert [r["implementation"] for r in rows] == ["mtjax", "flax FAILED: RuntimeError: no memory"]
    assert rows[0]["time_ms"] > 0 and rows[1]["time_ms"] is None
