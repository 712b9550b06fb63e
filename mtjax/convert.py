"""``mtjax convert``: Hugging Face model folders to mtjax checkpoints and back (`mtjax.interop`).

    mtjax convert --from-hf Llama-3.2-1B --to ckpt/llama     # then: mtjax generate --checkpoint ckpt/llama
    mtjax convert --from runs/ft --to-hf out/llama-ft          # a training run (or converted checkpoint) -> HF

``--from-hf`` writes the weights as step 0 of ``TO/checkpoints`` with the model configuration and the
tokenizer (copied to ``TO/tokenizer``), which ``mtjax generate``, ``mtjax serve`` and ``mtjax train
--init-from`` read. ``--to-hf`` writes ``config.json`` and safetensors (sharded past ``--max-shard-size``)
plus the tokenizer's files. docs/interop.md lists the architectures and limits.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mtjax.interop import SUPPORTED_MODEL_TYPES

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="FOLDER", help="a Hugging Face model folder (config.json + safetensors)")
    source.add_argument("--from", dest="from_checkpoint", metavar="FOLDER",
                        help="an mtjax checkpoint: a training run's --workdir or mtjax convert's output")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", metavar="FOLDER", help="with --from-hf: the mtjax checkpoint folder to write")
    target.add_argument("--to-hf", metavar="FOLDER", help="with --from: the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="parameter dtype written (default: --from-hf's config.json dtype; --to-hf: the params')")
    parser.add_argument("--tokenizer", help="with --from-hf: a tokenizer spec or path (default: the folder's)")
    parser.add_argument("--step", type=int, help="with --from: the checkpoint step (default: the latest)")
    parser.add_argument("--model-type", choices=SUPPORTED_MODEL_TYPES,
                        help="with --to-hf: the architecture to write (default: the one converted from, else the "
                             "one the model's features name)")
    parser.add_argument("--max-shard-size", default="5GB", help="with --to-hf: bytes per safetensors file (5GB)")


def _from_hf(args: argparse.Namespace) -> str:
    import dataclasses

    import jax.numpy as jnp

    from mtjax.train.pretrained import open_pretrained, save_converted
    from mtjax.train.tokenizer import load_tokenizer

    pretrained = open_pretrained(args.from_hf)
    if pretrained.kind != "hf":
        raise ValueError(f"--from-hf {args.from_hf}: not a Hugging Face model folder (config.json + *.safetensors)")
    config = pretrained.config
    if args.dtype:
        dtype = getattr(jnp, args.dtype)
        config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
    spec = args.tokenizer or pretrained.tokenizer
    if spec is not None:
        load_tokenizer(spec)  # refuse a bad one before converting
    params = pretrained.load_params(config)
    path = save_converted(args.to, params, config, tokenizer=spec, source=pretrained.source,
                          hf_config=pretrained.hf_config)
    note = "" if spec else " (no tokenizer found: pass --tokenizer to generate)"
    return f"{pretrained.source} -> {path}{note}"


def _to_hf(args: argparse.Namespace) -> str:
    from mtjax.interop import save_hf_checkpoint
    from mtjax.train.pretrained import copy_tokenizer, open_pretrained

    pretrained = open_pretrained(args.from_checkpoint, args.step)
    if pretrained.kind != "mtjax":
        raise ValueError(f"--from {args.from_checkpoint}: a Hugging Face folder already (use --from-hf)")
    hf_config = pretrained.hf_config or {}
    model_type = args.model_type or hf_config.get("model_type")
    files = save_hf_checkpoint(pretrained.config, pretrained.load_params(), args.to_hf, model_type=model_type,
                               dtype=args.dtype, max_shard_size=args.max_shard_size, extra_config=hf_config)
    copied = copy_tokenizer(pretrained.tokenizer, args.to_hf, model_config=False)
    note = "" if copied else f" (the tokenizer {pretrained.tokenizer!r} has no file to copy)"
    return f"{pretrained.source} -> {args.to_hf}: {', '.join(os.path.basename(f) for f in files)}{note}"


def run(args: argparse.Namespace) -> int:
    def fail(message: Any) -> int:
        print(f"mtjax convert: error: {message}", file=sys.stderr)
        return 2

    if args.from_hf and not args.to:
        return fail("--from-hf writes an mtjax checkpoint: pass --to FOLDER")
    if args.from_checkpoint and not args.to_hf:
        return fail("--from reads an mtjax checkpoint: pass --to-hf FOLDER")
    try:
        done = _from_hf(args) if args.from_hf else _to_hf(args)
    except (FileNotFoundError, ValueError, ImportError) as err:
        return fail(err)
    print(f"mtjax convert: {done}")
    return 0
