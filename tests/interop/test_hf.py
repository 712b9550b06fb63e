"""mtjax.interop: Hugging Face checkpoints against transformers' own models.

The references in tests/data/hf were computed by transformers (tests/interop/make_hf_fixtures.py, run
with torch; nothing here needs torch): tiny random models of every supported architecture, their float32
logits for fixed inputs and the gradients of ``sum(logits * cotangent)`` with respect to every tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core.meta import unbox

pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from mtjax.interop import (  # noqa: E402
    SUPPORTED_MODEL_TYPES,
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    read_hf_config,
    save_hf_checkpoint,
    to_hf_tensors,
)
from mtjax.models import GPT, BertConfig, BertEncoder, gpt_config, unstack_layers  # noqa: E402
from mtjax.sharding import MeshConfig, logical_axis_rules, logical_shardings  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compiles")

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "hf"
FIXTURES = ("llama3", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "bert")


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name}.npz") as arrays:
        return dict(arrays)


@functools.cache
def loaded(name: str):
    return load_hf_checkpoint(DATA / name)


def forward(config, name: str):
    ref = reference(name)
    tokens = jnp.asarray(ref["input_ids"], jnp.int32)
    if isinstance(config, BertConfig):
        types = jnp.asarray(ref["token_type_ids"], jnp.int32)
        return lambda params: BertEncoder(config).apply({"params": params}, tokens, token_type_ids=types)
    return lambda params: GPT(config).apply({"params": params}, tokens)


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(ours, np.float64) - theirs) / np.linalg.norm(theirs))


def read_tensors(folder: pathlib.Path | str) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def test_the_fixtures_cover_every_supported_architecture():
    assert {read_hf_config(DATA / name)["model_type"] for name in FIXTURES} == set(SUPPORTED_MODEL_TYPES)
    assert (DATA / "llama3" / "model.safetensors.index.json").is_file()  # the sharded layout is covered
    assert sum(f.stat().st_size for f in DATA.rglob("*") if f.is_file()) < 2 * 2**20


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_and_gradients_match_transformers(name):
    """Float32 outputs and every parameter's gradient within 1e-5 (relative, per tensor) of transformers'.

    A gradient that is zero in exact arithmetic (attention key biases: the softmax ignores a per-query
    constant) is held to an absolute floor of 1e-6 of the typical gradient's norm instead."""
    config, params = loaded(name)
    ref = reference(name)
    apply = forward(config, name)

    @jax.jit
    def output_and_grads(params):
        output, vjp = jax.vjp(apply, params)
        return output, vjp(jnp.asarray(ref["cotangent"]))[0]

    output, grads = output_and_grads(params)
    assert relative_error(output, ref["output"]) < 1e-5
    expected = {key[len("grad/"):]: value for key, value in ref.items() if key.startswith("grad/")}
    ours = dict(to_hf_tensors(config, grads, read_hf_config(DATA / name)["model_type"]))
    assert set(ours) == set(expected)
    floor = 1e-6 * float(np.median([np.linalg.norm(g) for g in expected.values()]))
    for tensor, theirs in expected.items():
        error = np.linalg.norm(ours[tensor].astype(np.float64) - theirs)
        assert error <= 1e-5 * np.linalg.norm(theirs) + floor, (tensor, error, np.linalg.norm(theirs))


@pytest.mark.parametrize("name", FIXTURES)
def test_save_round_trips_bit_for_bit(name, tmp_path):
    """load -> save gives the same tensors (names, dtypes, bytes), a config.json that loads to the same
    config and keeps the architecture and token ids; a small shard size writes shards and their index."""
    config, params = loaded(name)
    source = read_hf_config(DATA / name)
    sharded = (DATA / name / "model.safetensors.index.json").exists()
    files = save_hf_checkpoint(config, params, tmp_path, model_type=source["model_type"], extra_config=source,
                               max_shard_size="40KB" if sharded else "5GB")
    original, written = read_tensors(DATA / name), read_tensors(tmp_path)
    assert sorted(written) == sorted(original)
    for tensor, array in original.items():
        assert written[tensor].dtype == array.dtype and written[tensor].tobytes() == array.tobytes(), tensor
    saved = read_hf_config(tmp_path)
    assert config_from_hf(saved) == config_from_hf(source)
    fields = ("model_type", "architectures", "bos_token_id", "eos_token_id", "pad_token_id")
    for field in fields + (() if name == "bert" else ("tie_word_embeddings",)):
        assert saved.get(field) == source.get(field), field
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists() == sharded and (str(index) in files) == sharded
    if sharded:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert sorted(weight_map) == sorted(original) and len(set(weight_map.values())) > 1
        assert all((tmp_path / file).is_file() for file in weight_map.values())


def test_a_failed_save_keeps_the_earlier_weights_and_a_new_one_replaces_them(tmp_path, monkeypatch):
    """A save that fails while writing leaves the folder's earlier files as they were and no temporaries;
    one that succeeds removes the earlier weight files it does not overwrite (shards, their index)."""
    import safetensors.numpy

    config, params = loaded("llama3")
    sharded = save_hf_checkpoint(config, params, tmp_path, max_shard_size="40KB")
    assert len(sharded) > 3
    before = {file: pathlib.Path(file).read_bytes() for file in sharded}
    calls = []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(*args, **kwargs)

    monkeypatch.setattr(safetensors.numpy, "save_file", fail_second)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(config, params, tmp_path, max_shard_size="10KB", dtype=jnp.bfloat16)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(f) for f in sharded)
    assert all(pathlib.Path(file).read_bytes() == data for file, data in before.items())
    monkeypatch.undo()
    files = save_hf_checkpoint(config, params, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"] == sorted(map(os.path.basename, files))
    assert sorted(read_tensors(tmp_path)) == sorted(read_tensors(DATA / "llama3"))


def test_bfloat16_round_trip_and_a_scanned_stack(tmp_path):
    """A scanned (stacked) model saves as unrolled layers; bfloat16 tensors load and save back unchanged."""
    config = gpt_config("tiny", vocab_size=64, hidden_size=32, mlp_dim=48)
    assert config.scan_layers
    params = jax.jit(lambda key: unbox(GPT(config).init(key, jnp.zeros((1, 4), jnp.int32))["params"]))(
        jax.random.key(0))
    save_hf_checkpoint(config, params, tmp_path / "f32")
    loaded_config, loaded_params = load_hf_checkpoint(tmp_path / "f32")
    assert loaded_config == dataclasses.replace(config, scan_layers=False)
    jax.tree.map(np.testing.assert_array_equal, loaded_params, unstack_layers(params, config.num_layers))
    save_hf_checkpoint(loaded_config, loaded_params, tmp_path / "bf16", dtype=jnp.bfloat16)
    assert read_hf_config(tmp_path / "bf16")["torch_dtype"] == "bfloat16"
    bf16_config, bf16_params = load_hf_checkpoint(tmp_path / "bf16", dtype=jnp.bfloat16)
    assert bf16_config.param_dtype == jnp.bfloat16 and bf16_config.dtype == jnp.bfloat16
    save_hf_checkpoint(bf16_config, bf16_params, tmp_path / "again")
    first, again = read_tensors(tmp_path / "bf16"), read_tensors(tmp_path / "again")
    assert sorted(first) == sorted(again)
    assert all(again[k].dtype == first[k].dtype == jnp.bfloat16 and again[k].tobytes() == first[k].tobytes()
               for k in first)


def test_loading_onto_a_mesh_places_every_parameter_in_its_sharding():
    mesh_config = MeshConfig(dp=1, fsdp=4, tp=2)
    mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
    config, params = load_hf_checkpoint(DATA / "llama3", mesh=mesh, rules=rules)
    _, host = loaded("llama3")
    from mtjax.interop.hf import abstract_params

    expected = logical_shardings(abstract_params(config), mesh, rules)
    jax.tree.map(lambda p, s: None if p.sharding.is_equivalent_to(s, p.ndim) else pytest.fail(f"{p.sharding} {s}"),
                 params, expected)
    assert any(len(p.sharding.device_set) == 8 and not p.sharding.is_fully_replicated for p in jax.tree.leaves(params))
    jax.tree.map(np.testing.assert_array_equal, params, host)


def legacy_config(config: dict) -> dict:
    """A transformers-5 config.json in the field names transformers 4 writes (rope_theta, rope_scaling,
    rotary_pct, rotary_emb_base, torch_dtype)."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters", {}) or {})
    if "rope_theta" in rope:
        config["rotary_emb_base" if config["model_type"] == "gpt_neox" else "rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        config["rotary_pct"] = rope.pop("partial_rotary_factor")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {"type" if rope["rope_type"] == "linear" else "rope_type": rope.pop("rope_type"),
                                  **rope}
    config["torch_dtype"] = config.pop("dtype", "float32")
    return config


@pytest.mark.parametrize("name", FIXTURES)
def test_transformers_4_config_fields_give_the_same_config(name):
    source = read_hf_config(DATA / name)
    assert config_from_hf(legacy_config(source)) == config_from_hf(source)


def test_field_defaults_of_each_model_type():
    """A config.json leaves out fields at their class defaults; Mistral's null sliding_window means none."""
    mistral = read_hf_config(DATA / "mistral")
    assert config_from_hf(mistral).window_size == (3, 0)
    assert config_from_hf({**mistral, "sliding_window": None}).window_size is None
    assert config_from_hf({k: v for k, v in mistral.items() if k != "sliding_window"}).window_size == (4095, 0)
    gpt2 = {k: v for k, v in read_hf_config(DATA / "gpt2").items() if k not in ("n_inner", "activation_function")}
    assert config_from_hf(gpt2).mlp_dim == 4 * 32 and config_from_hf(gpt2).activations == ("gelu",)


def copy_fixture(name: str, tmp_path: pathlib.Path, **config_changes) -> pathlib.Path:
    folder = tmp_path / name
    shutil.copytree(DATA / name, folder)
    config = read_hf_config(folder)
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return folder


@pytest.mark.parametrize("name,changes,match", [
    ("llama3", dict(model_type="gemma"), r"model_type='gemma' is not supported; accepted: llama, mistral"),
    ("llama3", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)),
     r"rope_type='yarn' is not supported; accepted: default, linear, llama3"),
    ("llama3", dict(rope_parameters=dict(rope_type="llama3", factor=4.0, rope_theta=1e4)),
     r"rope_scaling \(llama3\) has no 'low_freq_factor'"),
    ("qwen2", dict(use_sliding_window=True), r"use_sliding_window=True is not supported; accepted: False"),
    ("mistral", dict(hidden_act="tanh"), r"hidden_act='tanh' is not supported; accepted: silu"),
    ("llama3", dict(attention_bias=True), r"attention_bias=True with mlp_bias=False is not supported"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), r"scale_attn_by_inverse_layer_idx=True is not supported"),
    ("bert", dict(position_embedding_type="relative_key"), r"position_embedding_type='relative_key' is not"),
    ("llama3", dict(hidden_size=48), r"tensor 'model.embed_tokens.weight' has shape \[64, 32\]; config.json "
                                     r"implies \[64, 48\]"),
    ("llama3", dict(num_hidden_layers=3), r"has no tensor 'model.layers.2.input_layernorm.weight'"),
    ("llama3", dict(num_hidden_layers=1), r"holds tensors model_type='llama' has no place for: "
                                          r"model.layers.1.input_layernorm.weight"),
    ("llama3", dict(vocab_size=0), r"vocab_size=0; expected a positive integer"),
    ("llama3", dict(num_attention_heads=...), r"config.json has no 'num_attention_heads'"),
])
def test_unsupported_or_inconsistent_checkpoints_are_refused(name, changes, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(copy_fixture(name, tmp_path, **changes))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_hf_checkpoint(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    folder = copy_fixture("llama3", tmp_path)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="names files that are missing: model-00002-of-00002.safetensors"):
        load_hf_checkpoint(folder)
    folder = copy_fixture("gpt2", tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors file"):
        load_hf_checkpoint(folder)


def test_extra_heads_and_buffers_are_skipped_but_unknown_tensors_refused(tmp_path):
    """BERT's pooler and masked-LM head (with the ``bert.`` prefix of BertForMaskedLM) and the causal-mask
    buffers old GPT-2 checkpoints hold are read past; any other tensor is an error."""
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(read_hf_config(DATA / "bert")))
    tensors = {f"bert.{k}": v for k, v in read_tensors(DATA / "bert").items()}
    tensors.update({"bert.pooler.dense.weight": np.ones((32, 32), np.float32),
                    "cls.predictions.bias": np.ones((64,), np.float32),
                    "bert.embeddings.position_ids": np.arange(16)[None]})
    save_file(tensors, str(folder / "model.safetensors"))
    config, params = load_hf_checkpoint(folder)
    jax.tree.map(np.testing.assert_array_equal, params, loaded("bert")[1])
    gpt2 = copy_fixture("gpt2", tmp_path)
    tensors = read_tensors(gpt2)
    tensors["transformer.h.0.attn.bias"] = np.ones((1, 1, 16, 16), np.float32)
    save_file(tensors, str(gpt2 / "model.safetensors"))
    load_hf_checkpoint(gpt2)
    tensors["transformer.h.0.attn.extra.weight"] = np.ones((2,), np.float32)
    save_file(tensors, str(gpt2 / "model.safetensors"))
    with pytest.raises(ValueError, match="has no place for: transformer.h.0.attn.extra.weight"):
        load_hf_checkpoint(gpt2)


def test_configs_an_architecture_cannot_express_are_refused(tmp_path):
    config, params = loaded("llama3")
    with pytest.raises(ValueError, match=r"model_type='gpt2' cannot express layernorm_type='rmsnorm'"):
        save_hf_checkpoint(config, params, tmp_path, model_type="gpt2")
    with pytest.raises(ValueError, match=r"model_type='llama' cannot express layernorm_type='layernorm'"):
        config_to_hf(gpt_config("gpt-125m"), "llama")
    with pytest.raises(ValueError, match=r"cannot express num_experts=8"):
        config_to_hf(gpt_config("moe-tiny"), "llama")
    with pytest.raises(ValueError, match="model_type='bert' does not fit a GPTConfig"):
        config_to_hf(config, "bert")
    with pytest.raises(ValueError, match="params do not fit the config"):
        save_hf_checkpoint(dataclasses.replace(config, qkv_bias=True), params, tmp_path / "x", model_type="qwen2")
    assert not (tmp_path / "x").exists()  # nothing written
    with pytest.raises(ValueError, match="max_shard_size='big'"):
        save_hf_checkpoint(config, params, tmp_path, max_shard_size="big")
    mesh = MeshConfig(dp=8).make_mesh()
    with pytest.raises(ValueError, match="needs rules="):
        load_hf_checkpoint(DATA / "llama3", mesh=mesh)


def torch_python() -> str | None:
    """An interpreter with torch and transformers: this one, or $MTJAX_TORCH_PYTHON."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        return sys.executable
    except ImportError:
        return os.environ.get("MTJAX_TORCH_PYTHON")


def test_transformers_loads_the_written_folders(tmp_path):
    """transformers loads each folder `save_hf_checkpoint` wrote and computes mtjax's logits. Runs where
    torch and transformers import, or with ``MTJAX_TORCH_PYTHON=/path/to/python`` naming an interpreter
    that has them (e.g. a separate virtual environment with the CPU build of torch)."""
    python = torch_python()
    if python is None:
        pytest.skip("needs torch and transformers (or MTJAX_TORCH_PYTHON)")
    jobs, ours = [], {}
    for name in FIXTURES:
        config, params = loaded(name)
        save_hf_checkpoint(config, params, tmp_path / name)
        ours[name] = np.asarray(jax.jit(forward(config, name))(params))
        jobs.append({"folder": str(tmp_path / name), "npz": str(DATA / f"{name}.npz"),
                     "out": str(tmp_path / f"{name}.out.npy")})
    script = pathlib.Path(__file__).with_name("hf_reference.py")
    result = subprocess.run([python, str(script), json.dumps(jobs)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, job in zip(FIXTURES, jobs):
        assert relative_error(ours[name], np.load(job["out"])) < 1e-5, name
