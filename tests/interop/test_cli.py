"""``mtjax convert`` / ``train --init-from`` / ``generate`` end to end on a tiny Llama-3-shaped Hugging Face folder
(the transformers-made fixture plus a BPE tokenizer trained in the test)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from mtjax.cli import build_parser, main  # noqa: E402
from mtjax.generate import load_checkpoint  # noqa: E402
from mtjax.interop import config_to_hf, infer_model_type, load_hf_checkpoint, param_shardings, read_hf_config  # noqa: E402
from mtjax.models import model_config  # noqa: E402
from mtjax.sharding import MeshConfig, logical_axis_rules  # noqa: E402
from mtjax.train import cli as train_cli  # noqa: E402
from mtjax.train.checkpoint import Checkpointer  # noqa: E402
from mtjax.train.pretrained import copy_tokenizer, open_pretrained  # noqa: E402
from tests.train.tiny_tokenizers import CORPUS, write_bpe_tokenizer, write_sentencepiece  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compiles")

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "hf"


@pytest.fixture
def hf_folder(tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(DATA / "llama3", folder)
    write_bpe_tokenizer(folder)  # 64 ids: the fixture's vocabulary
    (tmp_path / "corpus.txt").write_text("".join(CORPUS) * 2)
    return folder


@pytest.mark.slow
def test_convert_fine_tune_resume_generate_and_convert_back(hf_folder, tmp_path, capsys):
    ckpt, run, out = tmp_path / "ckpt", tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(hf_folder), "--to", str(ckpt)]) == 0
    assert (ckpt / "checkpoints" / "0").is_dir() and (ckpt / "tokenizer" / "tokenizer.json").is_file()
    # The converted checkpoint and the folder itself load to the same model, parameters and tokenizer.
    model, params, tokenizer = load_checkpoint(str(ckpt))
    hf_model, hf_params, hf_tokenizer = load_checkpoint(str(hf_folder))
    assert model.config == hf_model.config and model.config.rope_scaling.kind == "llama3"
    jax.tree.map(np.testing.assert_array_equal, params, hf_params)
    assert tokenizer.encode("def add").tolist() == hf_tokenizer.encode("def add").tolist()

    train = ["train", "--init-from", str(ckpt), "--data", str(tmp_path / "corpus.txt"), "--batch-size", "8",
             "--seq-len", "16", "--eval-batches", "0", "--workdir", str(run), "--no-progress", "--lr", "1e-3",
             "--warmup-steps", "1", "--log-every", "1"]
    assert main([*train, "--steps", "2"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    # Fine-tuned from the converted weights: AdamW moved each by about the learning rate per step.
    _, tuned, _ = load_checkpoint(str(run))
    change = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(tuned), jax.tree.leaves(params)))
    assert 0 < change < 5e-3
    # The run records the whole model, so it resumes without --init-from (set up here; tests/train runs resumes).
    args = build_parser().parse_args(["train", "--resume", "--workdir", str(run), "--eval-batches", "0",
                                      "--data", str(tmp_path / "corpus.txt")])
    setup = train_cli._setup(args)
    setup.checkpointer.close()
    assert setup.resume_candidates == [2] and setup.pretrained is None
    assert setup.config.model_config() == dataclasses.replace(model.config, param_dtype=jnp.float32)
    assert setup.config.tokenizer == tokenizer.spec and setup.config.init_from == str(ckpt)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run), "--prompt", "def add", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def add")

    assert main(["convert", "--from", str(run), "--to-hf", str(out)]) == 0
    assert (out / "tokenizer.json").is_file()
    source, written = read_hf_config(hf_folder), read_hf_config(out)
    assert all(written[k] == source[k] for k in ("model_type", "architectures", "bos_token_id", "eos_token_id"))
    config, out_params = load_hf_checkpoint(out)
    assert config == dataclasses.replace(hf_model.config, max_seq_len=config.max_seq_len)
    assert jax.tree.structure(out_params) == jax.tree.structure(params)


def test_init_from_loads_either_kind_of_folder_onto_the_training_mesh(hf_folder, tmp_path):
    """What ``train --init-from`` does with a Hugging Face folder or a converted checkpoint: the same float32
    parameters, each in its sharding on the run's mesh."""
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(hf_folder), "--to", str(ckpt)]) == 0
    from_hf, from_ckpt = open_pretrained(hf_folder), open_pretrained(ckpt)
    assert (from_hf.kind, from_ckpt.kind) == ("hf", "mtjax") and from_hf.config == from_ckpt.config
    assert from_ckpt.tokenizer == f"hf:{ckpt / 'tokenizer' / 'tokenizer.json'}"
    mesh_config = MeshConfig(dp=1, fsdp=4, tp=2)
    mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
    config = dataclasses.replace(from_hf.config, param_dtype=jnp.float32, remat_policy="full", max_seq_len=4096)
    expected = param_shardings(config, mesh, rules)
    a, b = (p.load_params(config, mesh=mesh, rules=rules) for p in (from_hf, from_ckpt))
    for x, y, sharding in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(expected)):
        assert x.sharding.is_equivalent_to(sharding, x.ndim) and y.sharding.is_equivalent_to(sharding, y.ndim)
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="differs from .* in more than"):
        from_hf.load_params(dataclasses.replace(config, num_layers=1))


def test_convert_takes_every_tokenizer_form(hf_folder, tmp_path, monkeypatch):
    """``--tokenizer`` as ``hf:FOLDER``, a folder, a relative tokenizer.json or .model file: the file and the
    files naming its special tokens are copied, and the checkpoint names the copy by its absolute path."""
    tok, ckpt = tmp_path / "tok", tmp_path / "ckpt"
    write_bpe_tokenizer(tok, eos_in_config="</s>")
    assert main(["convert", "--from-hf", str(hf_folder), "--to", str(ckpt), "--tokenizer", f"hf:{tok}"]) == 0
    copied = ckpt / "tokenizer"
    assert (copied / "tokenizer_config.json").is_file()
    assert open_pretrained(ckpt).tokenizer == f"hf:{copied / 'tokenizer.json'}"
    monkeypatch.chdir(tok)
    forms = [str(tok), "tokenizer.json", "hf:tokenizer.json"]
    if importlib.util.find_spec("sentencepiece"):
        write_sentencepiece(tok)
        forms += ["tokenizer.model", "sentencepiece:tokenizer.model"]
    for i, spec in enumerate(forms):
        folder = tmp_path / f"copy{i}"
        name = "tokenizer.model" if spec.endswith(".model") else "tokenizer.json"
        kind = "sentencepiece" if spec.endswith(".model") else "hf"
        assert copy_tokenizer(spec, str(folder)) == f"{kind}:{folder / name}", spec
        assert (folder / name).read_bytes() == (tok / name).read_bytes()
        assert (folder / "tokenizer_config.json").is_file(), spec


def test_convert_to_bfloat16_and_bad_conversions_and_runs_are_refused(hf_folder, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(hf_folder), "--to", str(ckpt), "--dtype", "bfloat16"]) == 0
    model, params, _ = load_checkpoint(str(ckpt))
    assert model.config.param_dtype == model.config.dtype == jnp.bfloat16
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    capsys.readouterr()
    cases = [
        (["convert", "--from-hf", str(hf_folder), "--to", str(ckpt)], "already holds checkpoints"),
        (["convert", "--from-hf", str(tmp_path / "none"), "--to", str(tmp_path / "x")], "no such folder"),
        (["convert", "--from-hf", str(ckpt), "--to", str(tmp_path / "x")], "not a Hugging Face model folder"),
        (["convert", "--from", str(ckpt), "--to-hf", str(tmp_path / "x"), "--model-type", "gpt2"],
         "model_type='gpt2' cannot express layernorm_type='rmsnorm'"),
        (["convert", "--from-hf", str(hf_folder), "--to-hf", str(tmp_path / "x")], "pass --to FOLDER"),
        (["convert", "--from-hf", str(hf_folder), "--to", str(tmp_path / "x"), "--tokenizer", f"hf:{tmp_path}"],
         "no such file"),
        (["convert", "--from-hf", str(hf_folder), "--to", str(tmp_path / "x"), "--step", "0", "--model-type", "llama"],
         "--step, --model-type apply only with --from, not with --from-hf"),
        (["convert", "--from-hf", str(hf_folder), "--to", str(tmp_path / "x"), "--max-shard-size", "1GB"],
         "--max-shard-size applies only with --from, not with --from-hf"),
        (["convert", "--from", str(ckpt), "--to-hf", str(tmp_path / "x"), "--tokenizer", "byte"],
         "--tokenizer applies only with --from-hf, not with --from"),
        (["train", "--resume", "--workdir", str(ckpt)], "holds converted weights"),
        (["train", "--init-from", str(tmp_path / "none")], "--init-from: .* no such folder"),
        (["train", "--init-from", str(ckpt), "--tokenizer", "byte", "--workdir", str(tmp_path / "w")],
         "257 token ids, more than the pretrained model's vocab_size=64"),
    ]
    (hf_folder / "tokenizer.json").unlink()
    cases.append((["generate", "--checkpoint", str(hf_folder), "--prompt", "x"], "names no tokenizer"))
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err), (argv, err)


def test_init_from_and_to_hf_refuse_other_model_families(tmp_path, capsys):
    """A ViT run's checkpoint is no starting point for ``--init-from`` and has no Hugging Face architecture."""
    run = tmp_path / "vit"
    with Checkpointer(run / "checkpoints") as checkpointer:
        checkpointer.save_params(0, {"w": jnp.ones(2)}, {"run": {"model": "vit-tiny", "model_overrides": {},
                                                                 "tokenizer": "byte"}})
    cases = [(["train", "--init-from", str(run), "--workdir", str(tmp_path / "w")],
              "--init-from .*: a ViTConfig model; --init-from starts from GPT-family models only"),
             (["convert", "--from", str(run), "--to-hf", str(tmp_path / "out")],
              "--from .*: a ViTConfig model; --to-hf writes GPT-family and BERT models only")]
    capsys.readouterr()
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err), (argv, err)
    assert not (tmp_path / "out").exists()
    for name in ("vit-tiny", "t5-tiny"):
        for check in (infer_model_type, config_to_hf):
            with pytest.raises(TypeError, match="accepted: GPTConfig, BertConfig"):
                check(model_config(name))
