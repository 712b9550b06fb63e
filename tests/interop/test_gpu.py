"""A llama-1b-shaped Hugging Face checkpoint through the CLI on a GPU (``JAX_PLATFORMS=cuda pytest -m gpu``):
converted, fine-tuned with ``--init-from``, generated from."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest
from flax.core import meta

from mtjax.cli import main
from mtjax.interop import save_hf_checkpoint
from mtjax.models import GPT, gpt_config


def convert_fine_tune_generate(folder: str, preset: str, steps: int, seq_len: int) -> list[dict]:
    """Writes random ``preset`` weights as a sharded bfloat16 Llama folder, then ``mtjax convert``, ``mtjax train
    --init-from`` (byte tokenizer, the stdlib corpus) and ``mtjax generate``; returns the run's metrics."""
    config = gpt_config(preset, scan_layers=False)
    params = jax.jit(lambda key: meta.unbox(GPT(config).init(key, jnp.zeros((1, 8), jnp.int32))["params"]))(
        jax.random.key(0))
    hf, ckpt, run = (os.path.join(folder, name) for name in ("hf", "ckpt", "run"))
    save_hf_checkpoint(config, params, hf, model_type="llama", dtype=jnp.bfloat16, max_shard_size="1GB")
    del params
    assert main(["convert", "--from-hf", hf, "--to", ckpt]) == 0
    assert main(["train", "--init-from", ckpt, "--preset", preset, "--tokenizer", "byte", "--steps", str(steps),
                 "--seq-len", str(seq_len), "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "2",
                 "--log-every", "5", "--eval-batches", "0", "--no-progress", "--workdir", run]) == 0
    assert main(["generate", "--checkpoint", run, "--prompt", "def ", "--max-new-tokens", "16"]) == 0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.gpu
def test_a_converted_llama_1b_fine_tunes_and_generates(tmp_path):
    records = [r for r in convert_fine_tune_generate(str(tmp_path), "llama-1b", steps=30, seq_len=512) if "loss" in r]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, records
