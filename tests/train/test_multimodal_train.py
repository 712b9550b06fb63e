"""Generated scenes and shuffled lines (deterministic, held out, well-formed), the weighted loss, and
``mtjax train`` / ``mtjax generate`` end to end for the ViT, T5 and vision-language presets (shrunk)."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from mtjax.cli import main
from mtjax.models import t5 as t5_module
from mtjax.models import vit as vit_module
from mtjax.models import vlm as vlm_module
from mtjax.train import cli as train_cli
from mtjax.train import next_token_loss
from mtjax.train.lines import ShuffledLines
from mtjax.train.scenes import CELLS, CLASSES, COLORS, SHAPES, SceneDataset, render_scene
from mtjax.train.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("fast_compiles")

TOKENIZER = ByteTokenizer()


def test_scenes_are_deterministic_held_out_and_well_formed():
    train = SceneDataset("captioning", "train", tokenizer=TOKENIZER, seq_len=64)
    again, held_out = (SceneDataset("captioning", split, tokenizer=TOKENIZER, seq_len=64)
                       for split in ("train", "eval"))
    batch = train.batches(4)[3]
    np.testing.assert_array_equal(batch["images"], again.batches(4)[3]["images"])
    np.testing.assert_array_equal(batch["images"][2:], train.batches(4, rows=slice(2, 4))[3]["images"])
    assert not np.allclose(batch["images"], held_out.batches(4)[3]["images"])
    assert batch["images"].shape == (4, 32, 32, 3) and batch["images"].dtype == np.float32
    assert -1.0 <= batch["images"].min() and batch["images"].max() <= 1.0
    for row in range(4):
        scene = train.scene(12 + row)
        ids = batch["targets"][row][batch["weights"][row] > 0]
        assert TOKENIZER.decode(ids[:-1]) == scene.caption and ids[-1] == TOKENIZER.eos_id
        assert batch["inputs"][row, 0] == TOKENIZER.eos_id
        np.testing.assert_array_equal(batch["inputs"][row, 1:len(ids)], ids[:-1])
        for color, shape, cell in scene.objects:
            assert color in COLORS and shape in SHAPES and cell in CELLS
    labels = SceneDataset("classification", "train").batches(32)[0]["labels"]
    assert labels.dtype == np.int32 and 0 <= labels.min() and labels.max() < len(CLASSES)


def test_scene_pixels_follow_the_objects():
    scene = render_scene(np.random.default_rng(0), num_objects=1)
    (color, _, cell), = scene.objects
    rgb = (scene.image + 1) / 2
    bright = rgb.max(axis=-1) > 0.5
    rows, cols = np.nonzero(bright)
    assert (rows.mean() < 16) == cell.startswith("top") and (cols.mean() < 16) == cell.endswith("left")
    np.testing.assert_allclose(rgb[bright].mean(axis=0), COLORS[color], atol=0.1)


def test_scene_errors():
    with pytest.raises(ValueError, match="task='detection'; accepted: classification, captioning"):
        SceneDataset("detection", "train")
    with pytest.raises(ValueError, match="seq_len=20 cannot hold the longest caption of 2 objects"):
        SceneDataset("captioning", "train", tokenizer=TOKENIZER, seq_len=20)
    with pytest.raises(ValueError, match="Scene.label: a scene of 2 objects has no class"):
        _ = render_scene(np.random.default_rng(0), num_objects=2).label


def test_shuffled_lines(tmp_path):
    text = "".join(f"value_{i} = compute(alpha, beta_{i}) + {i}\n" for i in range(300)) + "too short\n"
    (tmp_path / "a.py").write_text(text)
    train, held_out = ShuffledLines.from_paths([str(tmp_path)], TOKENIZER, 48, eval_percent=10)
    assert not set(train.lines) & set(held_out.lines) and len(train.lines) + len(held_out.lines) == 300
    shuffled, line = held_out.example(0)
    assert sorted(shuffled.split()) == sorted(line.split()) and shuffled != line
    assert held_out.example(0) == held_out.example(len(held_out.lines))  # the held-out split never changes
    batch = train.batches(4)[0]
    assert {k: v.shape for k, v in batch.items()} == dict.fromkeys(
        ("encoder_inputs", "encoder_segment_ids", "inputs", "targets", "weights"), (4, 48))
    source = batch["encoder_inputs"][0][batch["encoder_segment_ids"][0] == 1]
    target = batch["targets"][0][batch["weights"][0] > 0]
    assert sorted(TOKENIZER.decode(source).split()) == sorted(TOKENIZER.decode(target[:-1]).split())
    with pytest.raises(ValueError, match="no lines"):
        ShuffledLines([], TOKENIZER, 48)


def test_t5_data_without_held_out_lines_trains_without_evaluation(tmp_path):
    """Lines none of which the hash holds out: the T5 task trains on them with --eval-batches 0, and asking
    for an evaluation says how many held-out lines there are."""
    from mtjax.models import model_config
    from mtjax.train.tasks import DataSpec, task_for

    (tmp_path / "a.py").write_text("".join(f"x_{i} = f(a, b)\n" for i in range(3)))
    train, held_out = ShuffledLines.from_paths([str(tmp_path)], TOKENIZER, 24)
    assert len(train.lines) == 3 and held_out is None
    config = model_config("t5-tiny")
    spec = DataSpec(paths=[str(tmp_path)], errors="strict", tokenizer=TOKENIZER, seq_len=24, seed=0,
                    eval_sequences=0, model_config=config)
    train, held_out = task_for(config).datasets(spec)
    assert len(train.lines) == 3 and held_out is None
    with pytest.raises(ValueError, match="--data holds 0 held-out lines, fewer than the 8 one evaluation reads"):
        task_for(config).datasets(dataclasses.replace(spec, eval_sequences=8))


def test_next_token_loss_weights_out_padding():
    logits = np.log(np.array([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]], np.float32))
    batch = {"targets": np.zeros((1, 3), np.int32)}
    plain, weighted = jax.jit(lambda b, w: (next_token_loss(logits, b), next_token_loss(logits, {**b, "weights": w})))(
        batch, np.array([[1.0, 1.0, 0.0]], np.float32))
    assert float(plain) == pytest.approx(-np.log([0.5, 0.9, 0.2]).mean(), rel=1e-5)
    assert float(weighted) == pytest.approx(-np.log([0.5, 0.9]).mean(), rel=1e-5)


@pytest.fixture
def small_presets(monkeypatch):
    """The CPU presets shrunk to one small layer, and two samples per evaluation."""
    small = dict(hidden_size=16, num_heads=2, mlp_dim=32)
    monkeypatch.setitem(vit_module._PRESETS, "vit-tiny", dict(image_size=16, patch_size=8, num_classes=16,
                                                                num_layers=1, pooling="mean", **small))
    monkeypatch.setitem(t5_module._PRESETS, "t5-tiny", dict(vocab_size=384, num_encoder_layers=1,
                                                              num_decoder_layers=1, **small))
    monkeypatch.setitem(vlm_module._PRESETS, "vlm-tiny", dict(
        vision=("vit-tiny", dict(pooling="mean")), text=("tiny", dict(num_layers=1, num_kv_heads=None, **small))))
    monkeypatch.setattr(train_cli, "SAMPLES", 2)


def _train(workdir, preset, *extra):
    args = ["train", "--preset", preset, "--workdir", workdir, "--steps", "2", "--batch-size", "8", "--eval-batches",
            "1", "--eval-every", "2", "--save-every", "2", "--no-progress", *extra]
    assert main(args) == 0
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_image_classification_task_fits_the_trainer():
    """What ``mtjax train --preset vit-tiny`` builds, without compiling: scenes of the model's size, the
    train state from the task's example batch, and rank-1 labels laid out over the 8 devices."""
    from mtjax.models import ViT, model_config
    from mtjax.sharding import MeshConfig, logical_axis_rules
    from mtjax.train import abstract_train_state, batch_sharding, global_batch, make_optimizer
    from mtjax.train.tasks import DataSpec, task_for

    config = model_config("vit-tiny", image_size=16, hidden_size=16, num_layers=1)
    task = task_for(config)
    spec = DataSpec(paths=None, errors="strict", tokenizer=TOKENIZER, seq_len=config.seq_len, seed=0,
                    eval_sequences=8, model_config=config)
    train, held_out = task.datasets(spec)
    batch = train.batches(8)[0]
    assert batch["images"].shape == (8, 16, 16, 3) and batch["labels"].shape == (8,)
    state = abstract_train_state(ViT(config), make_optimizer(1e-3, total_steps=2)[0], task.example_batch(8, 0, config),
                                 model_inputs=task.model_inputs)
    assert state.params["head"]["kernel"].shape == (16, len(CLASSES))
    mesh_config = MeshConfig(dp=8)
    placed = global_batch(batch, batch_sharding(mesh_config.make_mesh(), logical_axis_rules(mesh_config)), 8)
    assert placed["labels"].sharding.shard_shape((8,)) == (1,)
    with pytest.raises(ValueError, match="the image presets train on generated scenes"):
        task.datasets(dataclasses.replace(spec, paths=["x"]))


def test_train_cli_refuses_a_vit_sequence_length(tmp_path, capsys):
    assert main(["train", "--preset", "vit-tiny", "--workdir", str(tmp_path), "--seq-len", "8"]) == 2
    assert "--seq-len: the vit-tiny preset's sequence is its 16 patch tokens" in capsys.readouterr().err


def test_t5_train_and_restore(tmp_path, small_presets, capsys):
    workdir = str(tmp_path / "t5")
    records = _train(workdir, "t5-tiny", "--seq-len", "24")
    evaluated = [r for r in records if "eval_loss" in r][0]
    assert 0 <= evaluated["eval_accuracy"] <= 1 and 0 <= evaluated["eval_exact_match"] <= 1
    assert len(evaluated["samples"]) == 2 and set(evaluated["samples"][0]) == {"input", "output", "reference"}
    assert "greedy outputs exact" in capsys.readouterr().out
    assert main(["generate", "--checkpoint", workdir, "--prompt", "b = a", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("b = a -> ")
    assert main(["generate", "--checkpoint", workdir]) == 2
    assert "a T5 checkpoint needs --prompt" in capsys.readouterr().err


def test_vlm_train_and_caption(tmp_path, small_presets, capsys):
    workdir = str(tmp_path / "vlm")
    records = _train(workdir, "vlm-tiny")
    assert records[0]["loss"] > 0 and any("eval_exact_match" in r for r in records)
    assert "captioning: generated 16x16 scenes of 1-2 shapes" in capsys.readouterr().out
    assert main(["generate", "--checkpoint", workdir, "--image-index", "5", "--max-new-tokens", "8"]) == 0
    line = capsys.readouterr().out.strip()
    caption = SceneDataset("captioning", "eval", image_size=16, tokenizer=TOKENIZER).scene(5).caption
    assert line.startswith("scene 5: ") and line.endswith(f"(true: {caption})")
