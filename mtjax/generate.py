"""``mtjax generate``: run a model trained by ``mtjax train``, converted by ``mtjax convert`` or read from a
Hugging Face model folder on new inputs.

    mtjax generate --checkpoint runs/tiny --prompt "def main(" --max-new-tokens 200
    mtjax generate --checkpoint runs/tiny --prompt "def a(" --prompt "class B" --temperature 0.8 --top-p 0.95
    mtjax generate --checkpoint Qwen3-0.6B --prompt "The capital of France is" --temperature 0
    mtjax generate --checkpoint runs/t5-tiny --prompt "x = return self" --max-new-tokens 48
    mtjax generate --checkpoint runs/vlm-tiny --image-index 0 --image-index 1
    mtjax generate --checkpoint runs/vit-tiny --image-index 0

A checkpoint's meta names the model and tokenizer, a Hugging Face folder holds both, so nothing else is
needed (``--tokenizer`` overrides). A GPT continues each ``--prompt`` on `mtjax.inference.Engine`
(several run as one batch; each continuation is printed after its prompt); a T5 restores each
``--prompt`` (its encoder input) by greedy decoding on a key/value cache; a vision-language model
captions, and a ViT classifies, held-out generated scene ``--image-index`` (`mtjax.train.scenes`, the
held-out split of seed 0), printed beside the scene's true caption or class.

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
    parser.add_argument("--prompt", action="append",
                        help="text to continue (GPT) or to restore (T5); repeat for a batch")
    parser.add_argument("--image-index", type=non_negative_int, action="append",
                        help="a held-out generated scene to caption (VLM) or classify (ViT); repeat for a batch")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=100,
                        help="new tokens per prompt, up to the model's context (default 100)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="0 picks the most likely token (default 0.8; T5 and VLM decode greedily)")
    parser.add_argument("--top-k", type=non_negative_int, default=40, help="sample among the k likeliest (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide the positive logits of tokens already in the text (default 1: off; GPT models)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="subtract this times each token's count in the continuation (in [-2, 2]; GPT models)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="subtract this from tokens the continuation holds (in [-2, 2]; GPT models)")
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

    from mtjax.models import build_model
    from mtjax.train import load_tokenizer
    from mtjax.train.pretrained import open_pretrained

    pretrained = open_pretrained(checkpoint, step)
    spec = tokenizer or pretrained.tokenizer
    if spec is None:
        raise ValueError(f"{checkpoint} names no tokenizer; pass --tokenizer")
    loaded_tokenizer = load_tokenizer(spec)
    vocab_size = getattr(pretrained.config, "vocab_size", None)  # a ViT has none
    if vocab_size is not None and loaded_tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer {spec} has {loaded_tokenizer.vocab_size} token ids, more than the model's "
                         f"vocab_size={vocab_size}")
    params = pretrained.load_params()
    if not all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(params)):
        raise ValueError(f"the checkpoint in {checkpoint} holds NaN or Inf parameters")
    return build_model(pretrained.config), params, loaded_tokenizer


def run(args: argparse.Namespace) -> int:
    from mtjax.models import GPT, T5, VLM

    try:
        model, params, tokenizer = load_checkpoint(args.checkpoint, args.step, args.tokenizer)
    except (FileNotFoundError, ValueError) as err:
        return _fail(err)
    values = {"--prompt": args.prompt, "--image-index": args.image_index}
    needed = "--prompt" if isinstance(model, GPT | T5) else "--image-index"
    other = next(flag for flag in values if flag != needed)
    if values[other]:
        return _fail(f"{other}: a {type(model).__name__} checkpoint takes {needed}, not {other}")
    if not values[needed]:
        return _fail(f"a {type(model).__name__} checkpoint needs {needed}")
    if isinstance(model, GPT):
        return _continue(args, model, params, tokenizer)
    if isinstance(model, T5):
        return _restore(args, model, params, tokenizer)
    return _caption(args, model, params, tokenizer) if isinstance(model, VLM) else _classify(args, model, params)


def _fail(message: Any) -> int:
    print(f"mtjax generate: error: {message}", file=sys.stderr)
    return 2


def _continue(args: argparse.Namespace, model: Any, params: Any, tokenizer: Any) -> int:
    """A GPT: sample continuations of the prompts on the paged engine."""
    from mtjax.inference import Engine, SamplingParams

    prompts = [tokenizer.encode(text) for text in args.prompt]
    if any(len(p) == 0 for p in prompts):
        return _fail("--prompt: expected some text to continue")
    try:
        sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
                                  frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        engine = Engine(model, params, max_slots=len(prompts), page_size=args.page_size, kv_dtype=args.kv_dtype,
                        prefill_chunk=min(512, model.config.max_seq_len),
                        num_pages=1 + len(prompts) * -(-longest // args.page_size), penalties=sampling.penalized)
        outputs = engine.generate(prompts, sampling)
    except ValueError as err:
        message = str(err).replace("max_tokens", "--max-new-tokens")
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            message = message.replace(name, "--" + name.replace("_", "-"))
        return _fail(message)
    for text, ids in zip(args.prompt, outputs):
        print(text + tokenizer.decode(ids))
    return 0


def _restore(args: argparse.Namespace, model: Any, params: Any, tokenizer: Any) -> int:
    """A T5: the greedy output for each prompt (its encoder input, padded to the longest)."""
    import numpy as np

    from mtjax.models import jitted_t5_generate, until_eos

    encoded = [tokenizer.encode(text) for text in args.prompt]
    if any(len(e) == 0 for e in encoded):
        return _fail("--prompt: expected some text to restore")
    longest = max(len(e) for e in encoded)
    tokens, segment_ids = np.zeros((2, len(encoded), longest), np.int32)
    for row, ids in enumerate(encoded):
        tokens[row, :len(ids)], segment_ids[row, :len(ids)] = ids, 1
    out = jitted_t5_generate(model, {"params": params}, tokens, encoder_segment_ids=segment_ids,
                   max_new_tokens=args.max_new_tokens, start_id=tokenizer.eos_id, eos_id=tokenizer.eos_id)
    for text, ids in zip(args.prompt, np.asarray(out)):
        print(f"{text} -> {tokenizer.decode(until_eos(ids, tokenizer.eos_id))}")
    return 0


def _scenes(args: argparse.Namespace, image_size: int, task: str, tokenizer: Any = None) -> list[Any]:
    from mtjax.train.scenes import SceneDataset
    from mtjax.train.tasks import Captioning

    held_out = SceneDataset(task, "eval", image_size=image_size, max_objects=Captioning.max_objects,
                            tokenizer=tokenizer)
    return [held_out.scene(i) for i in args.image_index]


def _caption(args: argparse.Namespace, model: Any, params: Any, tokenizer: Any) -> int:
    """A VLM: greedy captions of held-out generated scenes, beside their true captions."""
    import numpy as np

    from mtjax.models import jitted_vlm_generate, until_eos

    scenes = _scenes(args, model.config.vision.image_size, "captioning", tokenizer)
    prompt = np.full((len(scenes), 1), tokenizer.eos_id, np.int32)
    out = jitted_vlm_generate(model, {"params": params}, np.stack([s.image for s in scenes]), prompt,
                   max_new_tokens=args.max_new_tokens, eos_id=tokenizer.eos_id)
    for index, scene, ids in zip(args.image_index, scenes, np.asarray(out)):
        print(f"scene {index}: {tokenizer.decode(until_eos(ids, tokenizer.eos_id))} (true: {scene.caption})")
    return 0


def _classify(args: argparse.Namespace, model: Any, params: Any) -> int:
    """A ViT: the class of held-out generated one-object scenes, beside their true class."""
    import numpy as np

    from mtjax.train.scenes import CLASSES

    scenes = _scenes(args, model.config.image_size, "classification")
    logits = model.apply({"params": params}, np.stack([s.image for s in scenes]))
    for index, scene, predicted in zip(args.image_index, scenes, np.argmax(np.asarray(logits), axis=-1)):
        print(f"scene {index}: {CLASSES[int(predicted)]} (true: {CLASSES[scene.label]})")
    return 0
