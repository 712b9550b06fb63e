"""``mtjax serve``: serve a ``mtjax train`` or ``mtjax convert`` checkpoint, or a Hugging Face model folder, over
HTTP (`mtjax.inference.server`).

    mtjax serve --checkpoint runs/tiny --port 8000 [--max-slots 16] [--weights fp8] [--kv-dtype fp8]

Loads the checkpoint (`mtjax.generate.load_checkpoint`), builds an `mtjax.inference.Engine`, compiles it
(unless ``--no-warmup``) and answers OpenAI-compatible ``/v1/completions`` and, with a chat template
(``--chat-template``, else the one beside the tokenizer or in the checkpoint folder),
``/v1/chat/completions`` requests until interrupted. Needs the ``serve`` extra (aiohttp, jinja2).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtjax.inference.chat import ChatTemplate

logger = logging.getLogger("mtjax.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="the --workdir of a `mtjax train` run (or its checkpoints/), mtjax convert's output, or "
                             "a Hugging Face model folder")
    parser.add_argument("--tokenizer", help="a tokenizer spec or path (default: the checkpoint's)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--model-name", help="the 'model' of responses (default: the checkpoint folder's name)")
    parser.add_argument("--chat-template",
                        help="the Jinja chat template of /v1/chat/completions: a file, a tokenizer_config.json or a "
                             "model folder (default: the tokenizer's or the checkpoint's, if it has one)")
    engine = parser.add_argument_group("engine (mtjax.inference.Engine)")
    engine.add_argument("--max-slots", type=int, default=16, help="requests decoded together (default 16)")
    engine.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (default 16)")
    engine.add_argument("--num-pages", type=int, help="KV-cache pages (default: max-slots full-length sequences)")
    engine.add_argument("--max-seq-len", type=int, help="longest prompt + completion (default: the model's)")
    engine.add_argument("--kv-dtype", choices=("bfloat16", "float16", "float32", "fp8"), help="KV-cache dtype")
    engine.add_argument("--weights", choices=("fp8",), help="store the GEMM weights in FP8")
    engine.add_argument("--decode-steps", type=int, default=4, help="tokens decoded per dispatch (default 4)")
    engine.add_argument("--max-logprobs", type=int, default=20,
                        help="most alternatives per token a request may ask for with logprobs (default 20; 0: none)")
    engine.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="prefill every prompt whole (default: reuse the cached pages of shared prompt prefixes)")
    engine.add_argument("--penalties", action="store_true",
                        help="accept presence_penalty, frequency_penalty and repetition_penalty (the engine keeps "
                             "each slot's token counts on the device)")
    engine.add_argument("--no-warmup", action="store_true", help="compile on first use instead of before serving")


def run(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401  (the server's library: fail here, before loading a model, if it is missing)
    except ImportError:
        print("mtjax serve: error: needs aiohttp (pip install 'mtjax[serve]')", file=sys.stderr)
        return 2
    from mtjax.generate import load_checkpoint
    from mtjax.inference import Engine
    from mtjax.inference.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        model, params, tokenizer = load_checkpoint(args.checkpoint, args.step, args.tokenizer)
        engine = Engine(model, params, max_slots=args.max_slots, page_size=args.page_size, num_pages=args.num_pages,
                        max_seq_len=args.max_seq_len, kv_dtype=args.kv_dtype, weights=args.weights,
                        decode_steps=args.decode_steps, max_logprobs=args.max_logprobs,
                        prefix_caching=args.prefix_caching, penalties=args.penalties)
        chat_template = find_chat_template(args.chat_template, tokenizer, args.checkpoint)
    except (FileNotFoundError, ValueError, TypeError) as err:
        print(f"mtjax serve: error: {err}", file=sys.stderr)
        return 2
    del params  # the engine holds its own copy of the kernels (stored output first)
    if chat_template is None:
        logger.info("no chat template: /v1/chat/completions answers 400 (see --chat-template)")
    if not args.no_warmup:
        logger.info("compiling (warm-up)")
        engine.warmup()
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    serve(engine, tokenizer, host=args.host, port=args.port, model_name=name, chat_template=chat_template)
    return 0


def find_chat_template(path: str | None, tokenizer: Any, checkpoint: str) -> ChatTemplate | None:
    """``path``'s `mtjax.inference.chat.ChatTemplate`, else the one in the tokenizer's folder or the
    checkpoint folder, else None (also when jinja2 is missing and no ``path`` asked for one)."""
    try:
        import jinja2  # noqa: F401

        from mtjax.inference.chat import ChatTemplate
    except ImportError:
        if path is not None:
            raise ValueError("--chat-template needs jinja2 (pip install 'mtjax[serve]')") from None
        return None
    if path is not None:
        return ChatTemplate.from_path(path)
    folders = [os.path.dirname(tokenizer.path)] if getattr(tokenizer, "path", None) else []
    for folder in folders + ([checkpoint] if os.path.isdir(checkpoint) else []):
        template = ChatTemplate.find(folder)
        if template is not None:
            return template
    return None
