"""The ``mtjax`` command: ``mtjax info`` | ``train`` | ``generate`` | ``bench`` | ``serve`` | ``convert``.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("mtjax.info", "versions, platform, devices, capabilities, plugins and the kernel each op uses"),
    "train": ("mtjax.train.cli", "train a model (default: the tiny preset on the CPU)"),
    "generate": ("mtjax.generate", "continue prompts from a checkpoint (the inference engine)"),
    "bench": ("mtjax.bench.cli", "time fused ops and train steps against XLA/Flax peers"),
    "serve": ("mtjax.serve", "serve a checkpoint over HTTP (OpenAI-compatible /v1/completions)"),
    "convert": ("mtjax.convert", "Hugging Face model folders to mtjax checkpoints and back"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtjax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
