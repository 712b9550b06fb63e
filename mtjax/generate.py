"""``mtjax generate``: continue prompts with a model trained by ``mtjax train``, converted by ``mtjax convert``
or read from a Hugging Face model folder, on `mtjax.inference.Engine`.

    mtjax generate --checkpoint runs/tiny --prompt "def main(" --max-new-tokens 200
    mtjax generate --checkpoint runs/tiny --prompt "def a(" --prompt "class B" --temperature 0.8 --top-p 0.95
    mtjax generate --checkpoint Qwen3-0.6B --prompt "The capital of France is" --temperature 0

A checkpoint's meta names the model and tokenizer, a Hugging Face folder holds both, so nothing else is
needed (``--tokenizer`` overrides). Several ``--prompt`` run as one batch; each continuation is printed
after its prompt.

A command module on top of the layers: it joins `mtjax.train`'s checkpoints and tokenizers
(`load_checkpoint`, also what ``mtjax serve`` loads) with `mtjax.inference`, which import neither.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mtjax.cli_args import non_negative_int, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="the --workdir of a training run (or its checkpoints/ folder), mtjax convert's output, "
                             "or a Hugging Face model folder")
    parser.add_argument("--tokenizer", help="a tokenizer spec or path (default: the checkpoint's)")
    parser.add_argument("--prompt", required=True, action="append", help="text to continue (repeat for a batch)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=100,
                        help="new tokens per prompt, up to the model's context (default 100)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token (default 0.8)")
    parser.add_argument("--top-k", type=non_negative_int, default=40, help="sample among the k likeliest (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--kv-dtype", default=None, help="cache dtype: bfloat16, float16, float32 or fp8 "
                        "(default: the model's compute dtype)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per cache page (default 16)")


def load_checkpoint(checkpoint: str, step: int | None = None, tokenizer: str | None = None) -> tuple[Any, Any, Any]:
    """``(model, params, tokenizer)`` of a ``mtjax train`` run (its --workdir or checkpoints/ folder), of
    ``mtjax convert``'s output, or of a Hugging Face model folder; ``tokenizer``: a spec replacing the
    one the checkpoint names.

    Raises:
      FileNotFoundError: no such folder, or no checkpoint in it.
      ValueError: a damaged checkpoint, one without a model configuration or tokenizer, an unsupported
        model, NaN/Inf parameters, or a tokenizer with more ids than the model's vocabulary.
    """
    import jax
    import jax.numpy as jnp

    from mtjax.models import GPT
    from mtjax.train import load_tokenizer
    from mtjax.train.pretrained import open_pretrained

    pretrained = open_pretrained(checkpoint, step)
    spec = tokenizer or pretrained.tokenizer
    if spec is None:
        raise ValueError(f"{checkpoint} names no tokenizer; pass --tokenizer")
    loaded_tokenizer = load_tokenizer(spec)
    if loaded_tokenizer.vocab_size > pretrained.config.vocab_size:
        raise ValueError(f"the tokenizer {spec} has {loaded_tokenizer.vocab_size} token ids, more than the model's "
                         f"vocab_size={pretrained.config.vocab_size}")
    params = pretrained.load_params()
    if not all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(params)):
        raise ValueError(f"the checkpoint in {checkpoint} holds NaN or Inf parameters")
    return GPT(pretrained.config), params, loaded_tokenizer


def run(args: argparse.Namespace) -> int:
    from mtjax.inference import Engine, SamplingParams

    def fail(message: Any) -> int:
        print(f"mtjax generate: error: {message}", file=sys.stderr)
        return 2

    try:
        model, params, tokenizer = load_checkpoint(args.checkpoint, args.step, args.tokenizer)
    except (FileNotFoundError, ValueError) as err:
        return fail(err)
    prompts = [tokenizer.encode(text) for text in args.prompt]
    if any(len(p) == 0 for p in prompts):
        return fail("--prompt: expected some text to continue")
    try:
        sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        engine = Engine(model, params, max_slots=len(prompts), page_size=args.page_size, kv_dtype=args.kv_dtype,
                        prefill_chunk=min(512, model.config.max_seq_len),
                        num_pages=1 + len(prompts) * -(-longest // args.page_size))
        outputs = engine.generate(prompts, sampling)
    except ValueError as err:
        return fail(str(err).replace("max_tokens", "--max-new-tokens"))
    for text, ids in zip(args.prompt, outputs):
        print(text + tokenizer.decode(ids))
    return 0
