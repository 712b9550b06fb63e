"""Writes the Hugging Face fixtures of tests/interop: tiny random-initialized `transformers` models of each
architecture `mtjax.interop` converts, saved with ``save_pretrained`` (safetensors) under
``tests/data/hf/<name>/``, and ``tests/data/hf/<name>.npz`` holding float32 references computed by
transformers on the CPU:

- ``input_ids`` (and ``token_type_ids`` for BERT): fixed ``[2, 8]`` inputs;
- ``output``: the logits (the last hidden state for BERT);
- ``cotangent``: fixed random weights; the scalar loss is ``sum(output * cotangent)``;
- ``grad/<tensor name>``: the loss's gradient with respect to every parameter, by its safetensors name.

Needs torch and transformers (not mtjax), e.g. the CPU wheel of torch in a separate virtual environment:

    python make_hf_fixtures.py [--out tests/data/hf]

Nothing is downloaded; every model is built from a config with a fixed seed, so reruns give the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil

import numpy as np
import safetensors
import torch
import transformers

BATCH, SEQ = 2, 8
COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)

# name -> (config class, model class, config kwargs, save_pretrained kwargs)
FIXTURES = {
    # Llama 3.1 rope scaling with its three frequency bands at head_dim 8 (wavelengths 6, 63, 628, 6283 against
    # edges 32 and 128); GQA; untied output; the only sharded save (model.safetensors.index.json).
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(COMMON, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_theta=10000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=128)),
               dict(max_shard_size="40KB")),
    # Sliding-window attention over 4 of the 8 positions; GQA; tied embeddings.
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(COMMON, num_key_value_heads=2, head_dim=8, sliding_window=4, tie_word_embeddings=True,
                     rope_theta=10000.0), {}),
    # Biases on Q/K/V only, no GQA (fused QKV in mtjax), untied output, linear rope scaling.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(COMMON, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=10000.0,
                   rope_scaling=dict(rope_type="linear", factor=2.0)), {}),
    # Per-head q/k RMSNorm, head_dim 16 (not hidden / heads), GQA, tied embeddings.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(COMMON, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0), {}),
    # Learned positions, LayerNorm, biases everywhere, tanh GELU, tied embeddings.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=32, n_layer=2, n_head=4, n_inner=48, n_positions=16, vocab_size=64,
                  activation_function="gelu_new", bos_token_id=63, eos_token_id=63), {}),
    # Parallel attention/MLP residual, partial rotary (half of each head), exact GELU, untied output.
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(COMMON, rotary_pct=0.5, rope_theta=10000.0, use_parallel_residual=True,
                      tie_word_embeddings=False, hidden_act="gelu"), {}),
    # Post-LN encoder with token types (BertModel without the pooler).
    "bert": ("BertConfig", "BertModel", dict(COMMON, max_position_embeddings=16, type_vocab_size=2), {}),
}


def build(name: str) -> torch.nn.Module:
    config_class, model_class, kwargs, _ = FIXTURES[name]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    extra = {"add_pooling_layer": False} if name == "bert" else {}
    model = getattr(transformers, model_class)._from_config(config, attn_implementation="eager", **extra)
    with torch.no_grad():  # random, never zero: norm scales near 1, biases and matrices around 0
        for param_name, param in model.named_parameters():
            is_norm_scale = param.ndim == 1 and ("norm" in param_name.lower() or ".ln_" in param_name) and (
                param_name.endswith("weight"))
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if is_norm_scale else 0.2 * torch.randn_like(param))
    return model.float().eval()


def references(name: str, model: torch.nn.Module, saved_names: dict[str, str]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sum(map(ord, name)))
    vocab = model.config.vocab_size
    # Not id 0: transformers' BERT (and any model with a pad_token_id) gives the padding row no gradient.
    ids = rng.integers(1, vocab, (BATCH, SEQ), dtype=np.int64)
    inputs = {"input_ids": torch.from_numpy(ids)}
    if name == "bert":
        inputs["token_type_ids"] = torch.from_numpy(rng.integers(0, 2, (BATCH, SEQ), dtype=np.int64))
    out = model(**inputs)
    output = out.last_hidden_state if name == "bert" else out.logits
    cotangent = rng.standard_normal(tuple(output.shape)).astype(np.float32)
    loss = (output * torch.from_numpy(cotangent)).sum()
    loss.backward()
    arrays = {key: value.numpy() for key, value in inputs.items()}
    arrays.update(output=output.detach().numpy().astype(np.float32), cotangent=cotangent)
    for param_name, param in model.named_parameters():
        arrays[f"grad/{saved_names[param_name]}"] = param.grad.numpy().astype(np.float32)
    return arrays


def saved_names(model: torch.nn.Module, folder: str) -> dict[str, str]:
    """Parameter name -> the name ``save_pretrained`` wrote it under (transformers may rename on save, e.g.
    GPT-NeoX's ``lm_head`` is written as ``embed_out``), matched by value."""
    saved = {}
    for file in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safetensors.safe_open(str(file), framework="numpy") as f:
            saved.update({key: f.get_tensor(key) for key in f.keys()})
    names = {}
    for param_name, param in model.named_parameters():
        value = param.detach().numpy()
        matches = [key for key, array in saved.items() if array.shape == value.shape and np.array_equal(array, value)]
        if len(matches) != 1:
            raise RuntimeError(f"{folder}: parameter {param_name} matches saved tensors {matches}")
        names[param_name] = matches[0]
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1] / "data" / "hf"))
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES))
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    for name in args.only or FIXTURES:
        model = build(name)
        folder = os.path.join(args.out, name)
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder, safe_serialization=True, **FIXTURES[name][3])
        for extra in ("generation_config.json",):  # not part of the model
            if os.path.exists(os.path.join(folder, extra)):
                os.remove(os.path.join(folder, extra))
        arrays = references(name, model, saved_names(model, folder))
        np.savez(os.path.join(args.out, f"{name}.npz"), **arrays)
        size = sum(f.stat().st_size for f in pathlib.Path(folder).iterdir()) + os.path.getsize(
            os.path.join(args.out, f"{name}.npz"))
        print(f"{name}: {sorted(os.listdir(folder))}, {size / 1024:.0f} KiB, "
              f"transformers {transformers.__version__}, torch {torch.__version__}")
    with open(os.path.join(args.out, "VERSIONS.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
