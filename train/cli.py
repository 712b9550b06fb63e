"""``mtjax train``: train a preset (default: the tiny GPT on Python's stdlib).

    mtjax train                                   # tiny GPT, CPU, a few minutes, loss curve at the end
    mtjax train --preset gpt-1.3b --fp8 --steps 200
    mtjax train --resume                          # continue from the latest checkpoint in --workdir
    mtjax train --init-from Llama-3.2-1B --lr 2e-5 --data notes/ --workdir runs/ft   # fine-tune (docs/interop.md)
    mtjax train --preset vit-tiny                 # ViT on generated scenes, held-out accuracy
    mtjax train --preset t5-tiny                  # T5 restoring shuffled stdlib lines, samples in the log
    mtjax train --preset vlm-tiny                 # vision-language model captioning generated scenes

What each kind of model trains on is its task (`mtjax.train.tasks`): GPT presets read text files
(``--data``), the image presets generate their data, T5 restores shuffled lines of ``--data`` (default:
the standard library's top-level modules).

Writes into ``--workdir`` (default ``runs/<preset>``): ``checkpoints/``, ``metrics.jsonl`` (one JSON
object per logged step), ``tensorboard/`` (the same scalars as TensorBoard event files, with the
``tensorboard`` extra) and ``loss.png`` (with matplotlib). SIGTERM and Ctrl-C save a checkpoint and
exit 0 (a second Ctrl-C exits at once). A non-finite loss or gradient norm stops the run without
saving (``--on-nonfinite skip`` skips such steps instead). Exit status: 0 done or stopped by a
signal, 1 the run failed (diverged, a save or metrics write failed, a peer process died), 2 an
unusable configuration. docs/reliability.md lists what is guaranteed on each fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
import traceback
from typing import Any

from mtjax.cli_args import non_negative_float, non_negative_int, positive_float, positive_int
from mtjax.train.presets import PRESETS, TrainPreset, peak_tflops

# Model vocabularies are padded to a multiple of this, so the vocab axis splits over tp.
VOCAB_MULTIPLE = 128


NONFINITE_POLICIES = ("stop", "skip")
# Held-out examples decoded greedily at each evaluation of a seq2seq or captioning run, and how many
# of them the log shows.
SAMPLES, SHOWN = 64, 3

# mtjax.ops.CONTEXT_PARALLEL_STRATEGIES (not imported here: the flags are parsed before jax loads).
CONTEXT_PARALLEL_STRATEGIES = ("ring", "all_gather")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``mtjax train`` flags; unset ones take the preset's value."""
    from mtjax.fp8 import RECIPE_NAMES
    from mtjax.models import REMAT_POLICIES
    from mtjax.xla_flags import XLA_PRESETS

    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="model and run defaults (default: tiny, for the CPU; vit-tiny, t5-tiny and vlm-tiny "
                             "are the CPU-sized image classifier, encoder-decoder and vision-language model)")
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=positive_int, help="optimizer steps")
    run.add_argument("--batch-size", type=positive_int, help="global batch size in sequences")
    run.add_argument("--seq-len", type=positive_int,
                     help="tokens per sequence (T5: per input and per output; VLM: per caption; not for ViT)")
    run.add_argument("--grad-accum", type=positive_int, help="micro-batches per step (default 1)")
    run.add_argument("--lr", type=positive_float, help="peak learning rate")
    run.add_argument("--warmup-steps", type=non_negative_int, help="linear warmup steps (fewer than --steps)")
    run.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="AdamW weight decay (default 0.1)")
    run.add_argument("--clip-norm", type=positive_float, default=1.0, help="gradient global-norm clip (default 1)")
    run.add_argument("--seed", type=non_negative_int, help="initialisation, dropout and data order (default 0)")
    run.add_argument("--fp8", nargs="?", const="delayed", choices=RECIPE_NAMES, metavar="RECIPE",
                     help="FP8 GEMMs (mtjax.fp8) with this recipe: delayed (the default when the flag stands "
                          "alone), current or block (1x128 tiles, 128x128 weight blocks)")
    run.add_argument("--remat", choices=sorted(REMAT_POLICIES), help="rematerialisation policy of the layers")
    run.add_argument("--on-nonfinite", choices=NONFINITE_POLICIES, default="stop",
                     help="a NaN/Inf loss or gradient norm: stop without saving (default), or skip that "
                          "step's update and count it")
    run.add_argument("--max-skipped-steps", type=non_negative_int, default=10,
                     help="with --on-nonfinite skip: stop once more steps than this were skipped (default 10)")
    run.add_argument("--debug-checks", action="store_true",
                     help="check token ids inside the jitted step too (slower; mtjax.config.debug_checks)")
    data = parser.add_argument_group("data")
    data.add_argument("--data", nargs="+", metavar="PATH",
                      help="text files or folders (default: the Python standard library's source; the image "
                           "presets generate their data and take none)")
    data.add_argument("--data-errors", choices=("strict", "replace"), default="strict",
                      help="a --data file that is not UTF-8: an error (default), or read its bad bytes as U+FFFD")
    data.add_argument("--tokenizer", help="'byte', 'hf:TOKENIZER_JSON', 'sentencepiece:MODEL_FILE' or a folder "
                      "holding tokenizer.json / tokenizer.model (default: --init-from's tokenizer, a resumed run's, "
                      "else byte)")
    data.add_argument("--eval-batches", type=non_negative_int, default=4,
                      help="held-out batches per evaluation (0: no evaluation; default 4)")
    mesh = parser.add_argument_group("parallelism (the product must equal the number of devices)")
    mesh.add_argument("--dp", type=positive_int, help="data-parallel ways (default: the devices left over)")
    mesh.add_argument("--fsdp", type=positive_int, default=1, help="fully-sharded data-parallel ways")
    mesh.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ways")
    mesh.add_argument("--ep", type=positive_int, default=1,
                      help="expert-parallel ways (mixture-of-experts presets; splits the batch too)")
    mesh.add_argument("--sp", action="store_true", help="sequence parallelism over the tp axis")
    mesh.add_argument("--cp", type=positive_int, default=1,
                      help="context-parallel ways: the sequence of every activation split over this many devices "
                           "(long sequences; --seq-len a multiple of 2 * cp)")
    mesh.add_argument("--cp-strategy", choices=CONTEXT_PARALLEL_STRATEGIES, default="ring",
                      help="how attention reaches the other sequence shards with --cp: keys/values passed round a "
                           "ring (default), or all-gathered once")
    hosts = parser.add_argument_group("multi-host (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)")
    hosts.add_argument("--coordinator-address", help="host:port of process 0")
    hosts.add_argument("--num-processes", type=positive_int)
    hosts.add_argument("--process-id", type=non_negative_int)
    hosts.add_argument("--peer-timeout", type=positive_int, default=60, metavar="SECONDS",
                       help="a peer process silent this long is taken as dead and every process stops (default 60)")
    hosts.add_argument("--xla-preset", choices=sorted(XLA_PRESETS),
                       help="add XLA flag presets for multi-GPU runs to XLA_FLAGS (mtjax info lists them)")
    out = parser.add_argument_group("output")
    out.add_argument("--workdir", help="checkpoints, metrics.jsonl, tensorboard/ and loss.png (default: runs/<preset>)")
    out.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                     help="TensorBoard event files of the metrics in <workdir>/tensorboard (default: when tensorboardX "
                          "is installed, pip install 'mtjax[tensorboard]')")
    out.add_argument("--resume", action="store_true",
                     help="continue from the newest usable checkpoint in --workdir; flags left out take the "
                          "checkpoint's values")
    out.add_argument("--resume-step", type=non_negative_int, metavar="N",
                     help="with --resume: continue from checkpoint N (newer ones are set aside)")
    out.add_argument("--init-from", metavar="FOLDER",
                     help="fine-tune: start from the weights (and model) of a Hugging Face model folder or an mtjax "
                          "checkpoint (mtjax convert's output, or a run's --workdir), with a fresh optimizer")
    out.add_argument("--override", action="store_true",
                     help="with --resume: accept --steps/--batch-size/--seq-len/--lr/--warmup-steps/--seed values "
                          "that differ from the checkpoint's run (logged)")
    out.add_argument("--save-every", type=non_negative_int,
                     help="checkpoint interval in steps; 0: none, not even at the end (SIGTERM still saves)")
    out.add_argument("--keep", type=positive_int, default=3, help="checkpoints kept (default 3)")
    out.add_argument("--eval-every", type=positive_int, help="evaluation interval in steps")
    out.add_argument("--log-every", type=positive_int, help="metrics interval in steps")
    out.add_argument("--peak-tflops", type=positive_float,
                     help="one device's peak TFLOP/s for MFU (default: known GPUs' dense bf16 peak)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The resolved settings of a run (flags over preset); saved in every checkpoint's meta.

    Attributes mirror `mtjax.train.presets.TrainPreset`, plus ``model_overrides`` (fields changed
    from the model preset, e.g. the vocabulary padded to the tokenizer), ``tokenizer`` (its spec),
    ``grad_accum``, ``seed``, ``fp8`` and ``fp8_recipe`` (a name of `mtjax.fp8.RECIPE_NAMES`). A run
    started from pretrained weights (``--init-from``) has ``model="pretrained"``, the whole model
    configuration in ``model_fields`` (`mtjax.models.GPTConfig.to_dict`) and the weights' folder in
    ``init_from``.
    """

    preset: str
    model: str
    model_overrides: dict[str, Any]
    tokenizer: str
    batch_size: int
    seq_len: int
    steps: int
    learning_rate: float
    warmup_steps: int
    grad_accum: int
    seed: int
    fp8: bool
    fp8_recipe: str = "delayed"
    model_fields: dict[str, Any] | None = None
    init_from: str | None = None

    def model_config(self):
        from mtjax.train.pretrained import run_model_config

        return run_model_config(dataclasses.asdict(self))


# RunConfig fields the saved state's structure depends on: a resume must match them.
STATE_FIELDS = ("model", "model_overrides", "model_fields", "tokenizer", "fp8", "fp8_recipe")
# RunConfig fields that change what a resumed run computes, and their flags.
RUN_FLAGS = {"steps": "--steps", "batch_size": "--batch-size", "seq_len": "--seq-len",
             "learning_rate": "--lr", "warmup_steps": "--warmup-steps", "seed": "--seed"}
_ARG_NAMES = {"steps": "steps", "batch_size": "batch_size", "seq_len": "seq_len", "learning_rate": "lr",
              "warmup_steps": "warmup_steps", "seed": "seed", "grad_accum": "grad_accum"}


def _note(text: str) -> None:
    print(f"mtjax train: {text}", file=sys.stderr, flush=True)


def _resolve(args: argparse.Namespace, tokenizer, saved: RunConfig | None = None, workdir: str = "",
             pretrained: Any = None) -> tuple[RunConfig, TrainPreset, dict[str, tuple[Any, Any]]]:
    """The run's settings: flags, else the checkpoint's run (``saved``), else the preset; the model is
    ``pretrained``'s (`mtjax.train.pretrained.Pretrained`, with float32 parameters) or the saved run's
    when either is given, else the preset's.

    Returns (config, preset, overridden): ``overridden`` maps each `RUN_FLAGS` field whose flag
    differs from ``saved`` to (saved value, new value); that is an error unless ``--override``.

    Raises:
      ValueError: an unusable combination, or a model/tokenizer/FP8 setting (`STATE_FIELDS`)
        that differs from ``saved`` (the saved state would not fit).
    """
    import jax.numpy as jnp

    from mtjax.models import GPTConfig, ViTConfig, model_config
    from mtjax.train.tasks import task_for

    preset = PRESETS[args.preset]
    model_fields = saved.model_fields if saved is not None else None
    if pretrained is not None:  # float32 master weights, whatever the checkpoint stores
        model_fields = dataclasses.replace(pretrained.config, param_dtype=jnp.float32).to_dict()
    base = model_config(preset.model) if model_fields is None else GPTConfig.from_dict(model_fields)
    if isinstance(base, ViTConfig) and args.seq_len is not None:
        raise ValueError(f"--seq-len: the {args.preset} preset's sequence is its {base.seq_len} patch tokens, fixed "
                         "by the model's image and patch sizes")
    defaults = dict(steps=preset.steps, batch_size=preset.batch_size, seq_len=preset.seq_len,
                    learning_rate=preset.learning_rate, warmup_steps=preset.warmup_steps, seed=0, grad_accum=1)
    if saved is not None:  # a resumed run keeps its settings; grad_accum is a memory knob of this mesh
        defaults.update({name: getattr(saved, name) for name in RUN_FLAGS})
    values = {name: defaults[name] if getattr(args, arg) is None else getattr(args, arg)
              for name, arg in _ARG_NAMES.items()}
    overridden = {name: (getattr(saved, name), values[name]) for name in RUN_FLAGS
                  if saved is not None and getattr(args, _ARG_NAMES[name]) is not None
                  and values[name] != getattr(saved, name)}
    if isinstance(base, ViTConfig):
        values["seq_len"] = base.seq_len
    seq_len = values["seq_len"]
    if model_fields is not None:  # a pretrained model's vocabulary and learned positions are what they are
        if tokenizer.vocab_size > base.vocab_size:
            raise ValueError(f"--tokenizer {tokenizer.spec}: {tokenizer.vocab_size} token ids, more than the "
                             f"pretrained model's vocab_size={base.vocab_size}")
        if seq_len > base.max_seq_len and base.position_embedding == "learned":
            raise ValueError(f"--seq-len {seq_len}: the pretrained model's learned positions stop at "
                             f"max_seq_len={base.max_seq_len}")
    remat = args.remat if args.remat is not None or saved is None else _saved_remat(saved.model_overrides)
    overrides = {**_model_overrides(base, tokenizer.vocab_size, seq_len, remat), **task_for(base).model_overrides(base)}
    run = RunConfig(
        preset=args.preset, model=preset.model if model_fields is None else "pretrained", model_overrides=overrides,
        tokenizer=tokenizer.spec, batch_size=values["batch_size"], seq_len=seq_len, steps=values["steps"],
        learning_rate=values["learning_rate"], warmup_steps=values["warmup_steps"],
        grad_accum=values["grad_accum"], seed=values["seed"], fp8=args.fp8 is not None,
        fp8_recipe=args.fp8 or "delayed", model_fields=model_fields,
        init_from=pretrained.source if pretrained is not None else saved.init_from if saved is not None else None)
    if saved is not None and any(getattr(saved, name) != getattr(run, name) for name in STATE_FIELDS):
        raise ValueError(f"the checkpoint in {workdir} was written with "
                         f"{ {name: getattr(saved, name) for name in STATE_FIELDS} }; this run asks for "
                         f"{ {name: getattr(run, name) for name in STATE_FIELDS} }")
    if overridden and not args.override:
        asked = ", ".join(f"{RUN_FLAGS[n]} {new}" for n, (_, new) in overridden.items())
        had = ", ".join(f"{n}={old}" for n, (old, _) in overridden.items())
        raise ValueError(f"--resume with {asked}, but the checkpoint's run has {had}: that changes the run. "
                         "Leave those flags out to continue it as it was, or pass --override")
    if run.warmup_steps >= run.steps:
        if args.warmup_steps is not None or saved is not None:
            whose = "" if args.warmup_steps is not None else " (the checkpoint's)"
            raise ValueError(f"--warmup-steps {run.warmup_steps}{whose} must be fewer than --steps {run.steps}")
        _note(f"the {args.preset} preset's {run.warmup_steps} warmup steps are not fewer than --steps "
              f"{run.steps}: warming up for {run.steps - 1}")
        run = dataclasses.replace(run, warmup_steps=run.steps - 1)
    if run.batch_size % run.grad_accum:
        raise ValueError(f"--batch-size {run.batch_size} is not divisible by --grad-accum {run.grad_accum}")
    run.model_config()  # validates the overrides
    return run, preset, overridden


def _model_overrides(base: Any, vocab_size: int, seq_len: int, remat: str | None) -> dict[str, Any]:
    """The fields a run changes in its model preset ``base``: the vocabulary padded to hold the
    tokenizer's ``vocab_size`` ids, a learned position table long enough for ``seq_len`` (after a
    VLM's image prefix), the remat policy. A `VLMConfig`'s are ``{"text": {...}, "vision": {...}}``."""
    from mtjax.models import GPTConfig, ViTConfig, VLMConfig

    text = base.text if isinstance(base, VLMConfig) else base
    fields: dict[str, Any] = {}
    if not isinstance(base, ViTConfig):
        if vocab_size > text.vocab_size:
            fields["vocab_size"] = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        if isinstance(text, GPTConfig):
            prefix = isinstance(base, VLMConfig) and base.fusion == "prefix"
            longest = seq_len + (base.num_image_tokens if prefix else 0)
            if longest > text.max_seq_len:
                fields["max_seq_len"] = longest
    if remat is not None:
        fields["remat_policy"] = remat
    if not isinstance(base, VLMConfig):
        return fields
    return {"text": fields, **({"vision": {"remat_policy": remat}} if remat is not None else {})}


def _saved_remat(model_overrides: dict[str, Any]) -> str | None:
    """The remat policy a checkpoint's run chose (`_model_overrides`), or None."""
    return model_overrides.get("remat_policy", model_overrides.get("text", {}).get("remat_policy"))


def _tensor_parallel_dims(config: Any) -> dict[str, int]:
    """The dimensions of a model that tensor parallelism splits (Megatron: heads, KV heads, MLP
    columns, vocabulary)."""
    from mtjax.models import GPTConfig, T5Config, VLMConfig

    if isinstance(config, VLMConfig):
        return {**{f"vision {k}": v for k, v in _tensor_parallel_dims(config.vision).items()},
                **_tensor_parallel_dims(config.text)}
    dims = {"query heads": config.num_heads}
    if isinstance(config, GPTConfig):
        dims["key/value heads"] = config.resolved_num_kv_heads
    dims["MLP width"] = config.mlp_dim
    if isinstance(config, GPTConfig | T5Config):
        dims["vocabulary"] = config.vocab_size
    return dims


def _check_tensor_parallel(model_config: Any, tp: int) -> None:
    """The model dimensions split over ``tp`` (`_tensor_parallel_dims`)."""
    if tp == 1:
        return
    dims = _tensor_parallel_dims(model_config)
    bad = {name: size for name, size in dims.items() if size % tp}
    if bad:
        accepted = sorted(d for d in range(1, max(dims.values()) + 1) if all(v % d == 0 for v in dims.values()))
        raise ValueError(f"--tp {tp} must divide the model's {', '.join(f'{n} ({v})' for n, v in bad.items())}; "
                         f"accepted: {', '.join(map(str, accepted[:8]))}")


class MetricsWriteError(RuntimeError):
    """Writing ``metrics.jsonl`` failed (the message names the file and the OS error)."""


class _MetricsLog:
    """``metrics.jsonl`` (appended to, after dropping the records past the step the run starts from), its
    scalars in TensorBoard's event files under ``tensorboard_dir`` (`mtjax.train.metrics`), and the loss
    curve drawn from it at the end. A failed write raises `MetricsWriteError` once; later writes and
    `close` do nothing."""

    def __init__(self, path: str, enabled: bool, resumed_step: int | None = None, tensorboard_dir: str | None = None):
        self.path, self.enabled = path, enabled
        self._file = self._tensorboard = None
        if not enabled:
            return
        try:
            if resumed_step is not None and os.path.isfile(path):  # not a device or a pipe
                self._truncate(resumed_step)
            self._file = open(path, "a")
            if tensorboard_dir is not None:
                from mtjax.train.metrics import TensorBoardWriter

                self._tensorboard = TensorBoardWriter(tensorboard_dir, resumed_step=resumed_step)
        except OSError as err:
            raise MetricsWriteError(f"{err.filename or path}: cannot be written: {err.strerror or err}") from None

    def _truncate(self, step: int) -> None:
        """Keep the records of steps up to ``step``: the ones after it belong to the run being replaced."""
        with open(self.path) as f:
            lines = f.readlines()
        kept = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(json.dumps(record) + "\n")
        temporary = self.path + ".tmp"
        with open(temporary, "w") as f:
            f.writelines(kept)
        os.replace(temporary, self.path)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._tensorboard is not None:
                self._tensorboard.write(record)
        except OSError as err:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                pass
            raise MetricsWriteError(f"writing {self.path} failed: {err.strerror or err}") from None

    def close(self) -> None:
        """Close the event files and metrics.jsonl; the first failure is raised after both are closed."""
        writers = [(writer, where) for writer, where in ((self._tensorboard, "the TensorBoard event files"),
                                                         (self._file, self.path)) if writer is not None]
        self._tensorboard = self._file = None
        failure = None
        for writer, where in writers:
            try:
                writer.close()
            except OSError as err:
                failure = failure or MetricsWriteError(f"writing {where} failed: {err.strerror or err}")
        if failure is not None:
            raise failure

    def plot(self, png_path: str) -> bool:
        """Draw train and eval loss against the step; False when matplotlib is missing."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        with open(self.path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in (("loss", "train"), ("eval_loss", "held-out")):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points), marker="o" if key == "eval_loss" else None, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(png_path, dpi=120)
        plt.close(fig)
        return True


def _collective_failure(err: BaseException) -> BaseException | None:
    """The `jax.errors.JaxRuntimeError` that ``err`` is or was raised from (a failed collective
    or computation), or None."""
    import jax

    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, jax.errors.JaxRuntimeError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _fail(message: str, status: int = 2) -> int:
    print(f"mtjax train: error: {message}", file=sys.stderr, flush=True)
    return status


@dataclasses.dataclass
class _Setup:
    """What `run` builds from the flags before training starts."""

    config: RunConfig
    preset: TrainPreset
    mesh: Any
    rules: Any
    train_data: Any
    eval_data: Any
    tokenizer: Any
    workdir: str
    checkpointer: Any
    resume_candidates: list[int] | None  # steps to try, newest first (None: a fresh run)
    overridden: dict[str, tuple[Any, Any]]
    tensorboard_dir: str | None  # where the TensorBoard event files go (None: none written)
    pretrained: Any = None  # the --init-from weights (mtjax.train.pretrained.Pretrained)


def _refuse_converted(checkpointer: Any) -> None:
    """ValueError if the newest checkpoint holds converted weights (``mtjax convert``) rather than a run."""
    from mtjax.train.checkpoint import CheckpointError
    from mtjax.train.pretrained import WEIGHTS_ONLY

    try:
        converted = checkpointer.all_steps() and checkpointer.restore_meta().get(WEIGHTS_ONLY)
    except CheckpointError:
        return  # a damaged checkpoint: the resume logic reports it
    if converted:
        workdir = os.path.dirname(checkpointer.directory)
        raise ValueError(f"{workdir} holds converted weights (mtjax convert), not a training run: start one from "
                         f"them with --init-from {workdir} and another --workdir")


def _resume_candidates(checkpointer: Any, args: argparse.Namespace) -> tuple[list[int], RunConfig | None]:
    """Steps to resume from (newest first) and the run config of the newest whose meta reads."""
    from mtjax.train.checkpoint import CheckpointError

    steps = checkpointer.all_steps()
    _refuse_converted(checkpointer)
    if args.resume_step is not None:
        if args.resume_step not in steps:
            raise ValueError(f"--resume-step {args.resume_step}: no such checkpoint in {checkpointer.directory} "
                             f"(steps: {', '.join(map(str, steps)) or 'none'})")
        steps = [args.resume_step]
    candidates = sorted(steps, reverse=True)
    for i, step in enumerate(candidates):
        try:
            meta = checkpointer.verify(step)
            return candidates[i:], RunConfig(**meta["run"])
        except (CheckpointError, KeyError, TypeError) as err:
            reason = err if isinstance(err, CheckpointError) else f"checkpoint {checkpointer.step_path(step)}: " \
                                                                  f"its meta holds no run configuration"
            if args.resume_step is not None:
                raise ValueError(f"--resume-step {step}: {reason}") from None
            nxt = f"trying step {candidates[i + 1]}" if i + 1 < len(candidates) else "no older checkpoint left"
            _note(f"warning: {reason}; {nxt}")
    if candidates:
        raise ValueError(f"no usable checkpoint in {checkpointer.directory} (steps {', '.join(map(str, steps))} "
                         "cannot be read); move them away or use another --workdir")
    return [], None


def _setup(args: argparse.Namespace) -> _Setup:
    """Resolve flags, mesh, data and checkpoints; every unusable choice raises ValueError with a message."""
    import jax

    from mtjax.models import GPTConfig
    from mtjax.sharding import MeshConfig, logical_axis_rules
    from mtjax.train.checkpoint import Checkpointer
    from mtjax.train.metrics import TENSORBOARD_DIR, tensorboard_available
    from mtjax.train.pretrained import open_pretrained
    from mtjax.train.tasks import DataSpec, task_for
    from mtjax.train.tokenizer import load_tokenizer

    if args.resume_step is not None and not args.resume:
        raise ValueError("--resume-step needs --resume")
    if args.override and not args.resume:
        raise ValueError("--override needs --resume")
    workdir = os.path.abspath(args.workdir or os.path.join("runs", args.preset))
    for path in (workdir, os.path.join(workdir, "checkpoints")):
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"--workdir {args.workdir or workdir}: {path} is a file, not a folder")
    pretrained = None
    if args.init_from:
        try:
            pretrained = open_pretrained(args.init_from)
        except FileNotFoundError as err:
            raise ValueError(f"--init-from: {err}") from None
        if not isinstance(pretrained.config, GPTConfig):
            raise ValueError(f"--init-from {args.init_from}: a {type(pretrained.config).__name__} model; --init-from "
                             "starts from GPT-family models only")
    tensorboard = tensorboard_available() if args.tensorboard is None else args.tensorboard
    if tensorboard and not tensorboard_available():
        raise ValueError("--tensorboard needs tensorboardX: pip install 'mtjax[tensorboard]' (or --no-tensorboard)")
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=args.keep)
    try:
        saved, candidates = None, None
        if checkpointer.all_steps() and not args.resume:
            _refuse_converted(checkpointer)
            raise ValueError(f"{workdir} already holds checkpoints (latest: step {checkpointer.latest_step()}); pass "
                             "--resume to continue that run, or --workdir for a new one")
        if args.resume:
            candidates, saved = _resume_candidates(checkpointer, args)
            if saved is None:
                _note(f"no checkpoint in {workdir} yet; starting from "
                      f"{'--init-from' if pretrained is not None else 'scratch'}")
                candidates = None
        spec = args.tokenizer or (saved.tokenizer if saved is not None else None)
        if spec is None and pretrained is not None:
            spec = pretrained.tokenizer
            if spec is None:
                raise ValueError(f"--init-from {args.init_from}: it names no tokenizer (no tokenizer.json or "
                                 "tokenizer.model); pass --tokenizer")
        tokenizer = load_tokenizer(spec or "byte")
        config, preset, overridden = _resolve(args, tokenizer, saved, workdir, pretrained)
        _check_tensor_parallel(config.model_config(), args.tp)
        if args.cp > 1 and not isinstance(config.model_config(), GPTConfig):
            raise ValueError(f"--cp {args.cp}: context parallelism is for the GPT presets; --preset {args.preset} is a "
                             f"{type(config.model_config()).__name__}")
        if args.cp > 1 and config.seq_len % (2 * args.cp):
            raise ValueError(f"--seq-len {config.seq_len} must be a multiple of 2 * --cp = {2 * args.cp} (each of the "
                             f"cp devices holds two chunks of every sequence: the causal load-balanced layout)")
        other = args.fsdp * args.tp * args.ep * args.cp
        dp = args.dp if args.dp is not None else max(jax.device_count() // other, 1)
        mesh_config = MeshConfig(dp=dp, fsdp=args.fsdp, tp=args.tp, sp=args.sp, ep=args.ep, cp=args.cp)
        mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
        model_config = config.model_config()
        num_experts = getattr(model_config, "num_experts", 0)
        if args.ep > 1 and (not num_experts or num_experts % args.ep):
            raise ValueError(f"--ep {args.ep} needs a mixture-of-experts preset whose num_experts "
                             f"({num_experts}) it divides")
        batch_ways = dp * args.fsdp * args.ep
        if config.batch_size % (batch_ways * config.grad_accum):
            raise ValueError(f"--batch-size {config.batch_size} must be divisible by dp * fsdp * ep * grad-accum "
                             f"= {batch_ways * config.grad_accum}")
        data_spec = DataSpec(paths=args.data, errors=args.data_errors, tokenizer=tokenizer, seq_len=config.seq_len,
                             seed=config.seed, eval_sequences=args.eval_batches * config.batch_size,
                             model_config=model_config)
        train_data, eval_data = task_for(model_config).datasets(data_spec)
        checkpointer.save_every = preset.save_every if args.save_every is None else args.save_every or None
    except BaseException:
        checkpointer.close()
        raise
    return _Setup(config, preset, mesh, rules, train_data, eval_data, tokenizer, workdir, checkpointer, candidates,
                  overridden, os.path.join(workdir, TENSORBOARD_DIR) if tensorboard else None,
                  pretrained if candidates is None else None)


class Diverged(RuntimeError):
    """The loss or gradient norm went NaN/Inf (the message names the step and the last good checkpoint)."""


def run(args: argparse.Namespace) -> int:
    """Train; returns the exit status (0 done or stopped by a signal, 1 the run failed, 2 an unusable
    configuration), printing one line that says why for 1 and 2."""
    from mtjax.train.checkpoint import PreemptionWatcher

    watcher = PreemptionWatcher()  # first: a signal during the slow set-up below must not kill the run
    try:
        return _run(args, watcher)
    finally:
        watcher.close()


def _run(args: argparse.Namespace, watcher: Any) -> int:
    from mtjax.train import distributed
    from mtjax.xla_flags import apply_xla_flags

    if args.xla_preset:
        apply_xla_flags(args.xla_preset)  # before jax creates its backends
    try:
        spec = distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                                      peer_timeout_seconds=args.peer_timeout)
    except ValueError as err:
        return _fail(str(err))
    print(f"mtjax train: {distributed.topology(spec)}", file=sys.stderr, flush=True)
    # With several processes, each one ends with a line of its own when another dies or fails.
    peers = distributed.watch_peers(args.peer_timeout, on_lost=lambda reason: _fail(
        f"stopping process {spec.process_id} during set-up: {reason}", 1))
    if peers is None:
        return _run_joined(args, watcher, None)
    try:
        status = _run_joined(args, watcher, peers)
    except Exception:  # noqa: BLE001  (printed here: leaving below skips Python's own report)
        traceback.print_exc()
        status = 1
    if status == 0:
        peers.close()
    else:  # leave at once: the others may wait for this process in a collective or in jax's shutdown barrier
        peers.fail(f"it stopped with exit status {status} (its log says why)", status)
    return status


def _run_joined(args: argparse.Namespace, watcher: Any, peers: Any) -> int:
    from mtjax.config import config as mtjax_config
    from mtjax.config import override
    from mtjax.fp8 import fp8_autocast, recipe_by_name

    try:
        setup = _setup(args)
    except ValueError as err:
        return _fail(str(err))
    if watcher.requested:
        setup.checkpointer.close()
        print(f"mtjax train: {watcher.signal_name} before the first step: nothing trained, nothing saved")
        return 0
    # FP8 is decided when the functions are traced: creating the state and the first step.
    recipe = recipe_by_name(setup.config.fp8_recipe) if setup.config.fp8 else None
    debug_checks = args.debug_checks or mtjax_config.debug_checks
    with fp8_autocast(enabled=setup.config.fp8, recipe=recipe), override(debug_checks=debug_checks):
        return _train(args, setup, watcher, peers)


def _train(args: argparse.Namespace, setup: _Setup, watcher: Any, peers: Any) -> int:
    import jax
    from tqdm import tqdm

    from mtjax import fp8
    from mtjax.models import build_model
    from mtjax.sharding import tree_shardings
    from mtjax.train.checkpoint import CheckpointError, NonFiniteStateError
    from mtjax.train.data import DataIterator
    from mtjax.train.distributed import global_batch, process_rows
    from mtjax.train.state import abstract_train_state, batch_sharding, compute_dtype_for, init_train_state
    from mtjax.train.step import make_eval_step, make_optimizer, make_train_step, throughput
    from mtjax.train.tasks import exact_matches, task_for

    run_config, preset, mesh, rules = setup.config, setup.preset, setup.mesh, setup.rules
    checkpointer = setup.checkpointer
    is_main = jax.process_index() == 0
    config = run_config.model_config()
    if args.cp > 1:
        # Context parallelism changes how attention is computed, not the parameters: a checkpoint moves
        # between --cp settings.
        config = dataclasses.replace(config, context_parallel=args.cp_strategy)
    model, task = build_model(config), task_for(config)
    optimizer, schedule = make_optimizer(run_config.learning_rate, total_steps=run_config.steps,
                                         warmup_steps=run_config.warmup_steps, clip_norm=args.clip_norm,
                                         weight_decay=args.weight_decay)
    example = task.example_batch(run_config.batch_size // run_config.grad_accum, run_config.seq_len, config)
    compute_dtype = compute_dtype_for(config.dtype, config.param_dtype)
    abstract = abstract_train_state(model, optimizer, example, mesh=mesh, rules=rules, compute_dtype=compute_dtype,
                                    model_inputs=task.model_inputs)
    tokens_sharding = batch_sharding(mesh, rules)
    rows = process_rows(tokens_sharding, run_config.batch_size)  # this process loads only these rows
    batches = DataIterator(setup.train_data, run_config.batch_size, rows=rows)
    resumed_step = None
    try:
        if setup.resume_candidates:
            def accept(step: int, meta: dict[str, Any]) -> None:
                saved = meta.get("run", {})
                if any(saved.get(name) != getattr(run_config, name) for name in STATE_FIELDS):
                    raise CheckpointError(f"checkpoint {checkpointer.step_path(step)} holds another model "
                                          f"({ {name: saved.get(name) for name in STATE_FIELDS} })")

            state, meta, resumed_step = checkpointer.restore_newest(
                abstract, setup.resume_candidates, accept=accept, warn=lambda text: _note(f"warning: {text}"))
            # The data iterator's own (grain) state; the global batch index where the checkpoint was
            # written by another number of processes.
            if not checkpointer.restore_data(resumed_step, batches.iterator):
                batches.restore(meta["data"])
            hf_config = meta.get("hf_config")
            if resumed_step >= run_config.steps:
                checkpointer.close()
                batches.close()
                return _fail(f"--steps {run_config.steps}: the checkpoint is at step {resumed_step} already; nothing "
                             "to train (ask for more steps, with --override)")
            newer = [s for s in checkpointer.all_steps() if s > resumed_step]
            if newer:
                moved = checkpointer.set_aside(newer)
                _note(f"resuming from step {resumed_step}; set aside the newer checkpoint(s) {', '.join(moved)}")
            else:
                _note(f"resuming from step {resumed_step}")
        else:
            params = None
            if setup.pretrained is not None:
                _note(f"starting from the weights of {setup.pretrained.source}")
                params = setup.pretrained.load_params(config, mesh=mesh, rules=rules)
            state = init_train_state(model, optimizer, jax.random.PRNGKey(run_config.seed), example,
                                     mesh=mesh, rules=rules, compute_dtype=compute_dtype,
                                     model_inputs=task.model_inputs, params=params)
            hf_config = setup.pretrained.hf_config if setup.pretrained is not None else None
    except CheckpointError as err:
        checkpointer.close()
        batches.close()
        return _fail(f"{err} (use another --workdir, or move the damaged checkpoints away)")
    state_sharding = tree_shardings(abstract)
    options = fp8.compiler_options() if run_config.fp8 else None
    skip_nonfinite = args.on_nonfinite == "skip"
    train_step = make_train_step(model, optimizer, task.loss_fn, mesh=mesh, rules=rules, state_sharding=state_sharding,
                                 grad_accum_steps=run_config.grad_accum, learning_rate=schedule,
                                 compiler_options=options, skip_nonfinite=skip_nonfinite,
                                 model_inputs=task.model_inputs)
    eval_step = make_eval_step(model, task.loss_fn, mesh=mesh, rules=rules, state_sharding=state_sharding,
                               compiler_options=options, model_inputs=task.model_inputs, metrics_fn=task.metrics_fn)

    def to_global(local_batch):
        return global_batch(local_batch, tokens_sharding, run_config.batch_size)

    def evaluate() -> dict[str, float]:
        """The held-out loss and the task's metrics, means over ``--eval-batches`` batches."""
        with DataIterator(setup.eval_data, run_config.batch_size, rows=rows) as held_out:
            results = jax.device_get([eval_step(state, to_global(next(held_out)))
                                      for _ in range(args.eval_batches)])
        return {name: float(sum(r[name] for r in results) / len(results)) for name in results[0]}

    def decode_samples() -> list[tuple[str, str, str]] | None:
        """Greedy outputs of held-out examples (seq2seq, captioning); single-process runs only."""
        if jax.process_count() > 1:
            return None
        return task.samples(model, state.variables(), setup.eval_data, setup.tokenizer, SAMPLES)

    def meta() -> dict[str, Any]:
        # hf_config: the Hugging Face config.json the weights came from (`mtjax convert --to-hf` keeps its token ids).
        return {"data": batches.state(), "run": dataclasses.asdict(run_config),
                **({"hf_config": hf_config} if hf_config else {})}

    try:
        os.makedirs(setup.workdir, exist_ok=True)
        # Records past the step this run starts from belong to a run that is being replaced.
        log = _MetricsLog(os.path.join(setup.workdir, "metrics.jsonl"), enabled=is_main,
                          resumed_step=resumed_step or 0, tensorboard_dir=setup.tensorboard_dir)
    except (OSError, MetricsWriteError) as err:
        checkpointer.close()
        return _fail(str(err), 1)
    peak = args.peak_tflops or peak_tflops(jax.devices()[0].device_kind)
    log_every, eval_every = args.log_every or preset.log_every, args.eval_every or preset.eval_every
    tokens_per_step = run_config.batch_size * task.tokens_per_example(run_config.seq_len, config)
    step = int(jax.device_get(state.step))
    if is_main:
        active = (f", {config.num_active_params() / 1e6:.1f}M active" if getattr(config, "num_experts", 0) else "")
        name = run_config.preset if run_config.init_from is None else f"{run_config.init_from} (--init-from)"
        fp8_note = f", FP8 {run_config.fp8_recipe} scaling" if run_config.fp8 else ""
        print(f"mtjax train: {name} ({config.num_params() / 1e6:.1f}M parameters{active}{fp8_note}) on "
              f"{jax.device_count()} {jax.devices()[0].platform} device(s), "
              f"mesh {dict(mesh.shape)}; {task.name}: {task.describe_data(setup.train_data, run_config.seq_len)}; "
              f"steps {step}..{run_config.steps}; writing to {setup.workdir}", flush=True)
    if setup.overridden:
        changes = {name: {"checkpoint": old, "now": new} for name, (old, new) in setup.overridden.items()}
        _note(f"--override: continuing step {step} with changed settings {changes}")
        log.write({"step": step, "override": changes})

    skipped_steps = 0
    last_good = {"step": resumed_step}  # the newest checkpoint known to be good

    def last_good_text() -> str:
        if last_good["step"] is None:
            return f"no checkpoint saved in {checkpointer.directory}"
        return f"the last good checkpoint is step {last_good['step']} in {checkpointer.directory}"

    def check(checked_step: int, metrics: dict[str, Any]) -> None:
        """Stop on (or count) a non-finite loss or gradient norm of step ``checked_step``."""
        nonlocal skipped_steps
        values = jax.device_get(metrics)
        loss, grad_norm = float(values["loss"]), float(values["grad_norm"])
        jump = float(values.get("fp8_amax_jump", 0.0))
        if jump >= fp8.AMAX_JUMP_FACTOR:
            _note(f"warning: step {checked_step}: an FP8 amax jumped {jump:.3g}x above every earlier one in its "
                  f"history; with delayed scaling that tensor's scale stays about as much smaller (coarser FP8 "
                  f"values) for up to amax_history_len steps (an outlier batch? DelayedScaling(amax_compute_algo="
                  f"'most_recent') recovers at once)")
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        where = (f"step {checked_step}: loss {loss}, gradient norm {grad_norm}")
        good = last_good_text()
        if skip_nonfinite:
            skipped_steps += 1
            _note(f"warning: {where}: update skipped ({skipped_steps} skipped so far, "
                  f"--max-skipped-steps {args.max_skipped_steps})")
            log.write({"step": checked_step, "skipped_steps": skipped_steps})
            if skipped_steps > args.max_skipped_steps:
                raise Diverged(f"{where}: {skipped_steps} steps skipped for a non-finite loss or gradient, more than "
                               f"--max-skipped-steps {args.max_skipped_steps}; stopping without saving; {good}")
            return
        raise Diverged(f"{where}: the run diverged; stopping without saving; {good} (lower --lr, raise "
                       "--warmup-steps, or pass --on-nonfinite skip to skip such steps)")

    if peers is not None:
        peers.on_lost = lambda reason: _fail(f"process {jax.process_index()} stopped after step {step}: {reason}; "
                                             f"{last_good_text()}", 1)
    progress = tqdm(total=run_config.steps, initial=step, disable=args.no_progress or not is_main, unit="step",
                    dynamic_ncols=True)
    timer_start, timer_step, stopped = None, step, False
    pending = None  # (step, metrics) of the last step whose finiteness is not checked yet
    status, failure = 0, None
    try:
        while step < run_config.steps and not stopped:
            state, metrics = train_step(state, to_global(next(batches)))
            step += 1
            if pending is not None:  # the previous step: checked while this one runs
                check(*pending)
            pending = (step, metrics)
            if timer_start is None:  # time from the end of the first step on: it compiled
                jax.block_until_ready(metrics)
                timer_start, timer_step = time.perf_counter(), step
            if step % log_every == 0 or step == run_config.steps:
                check(*pending)
                pending = None
                # Scalars as numbers, per-expert vectors (moe_expert_load) as lists.
                record = {"step": step, **{k: v.tolist() for k, v in jax.device_get(metrics).items()}}
                now = time.perf_counter()
                if step > timer_step:
                    record.update(throughput((step - timer_step) * tokens_per_step, now - timer_start,
                                             flops_per_token=config.flops_per_token(run_config.seq_len),
                                             num_devices=jax.device_count(), peak_tflops=peak))
                    timer_start, timer_step = now, step
                log.write(record)
                progress.set_postfix(loss=f"{record['loss']:.3f}",
                                     **({"tok/s": f"{record['tokens_per_s']:.0f}"} if "tokens_per_s" in record else {}))
            if setup.eval_data is not None and (step % eval_every == 0 or step == run_config.steps):
                evaluated = evaluate()
                record = {"step": step, **{f"eval_{name}": value for name, value in evaluated.items()}}
                text = f"step {step}: held-out loss {evaluated['loss']:.4f}"
                if "accuracy" in evaluated:
                    text += f", {task.accuracy_name} {evaluated['accuracy']:.1%}"
                samples = decode_samples()
                if samples:
                    record["eval_exact_match"] = exact_matches(samples) / len(samples)
                    record["samples"] = [{"input": i, "output": o, "reference": r} for i, o, r in samples[:SHOWN]]
                    text += f", {exact_matches(samples)}/{len(samples)} greedy outputs exact"
                    text += "".join(f"\n  {i + ' -> ' if i else ''}{o!r} (reference {r!r})"
                                    for i, o, r in samples[:SHOWN])
                log.write(record)
                if is_main:
                    progress.write(text)
                timer_start, timer_step = time.perf_counter(), step  # evaluation time is not training time
            progress.update(1)
            stopped = watcher.should_stop(step)
            final = step == run_config.steps and checkpointer.save_every is not None
            force = stopped or final
            if force or (checkpointer.save_every is not None and step % checkpointer.save_every == 0):
                if pending is not None:  # never save a step that is not known to be finite
                    check(*pending)
                    pending = None
                if checkpointer.save(step, state, meta(), force=force, data_iterator=batches.iterator):
                    last_good["step"] = step
            checkpointer.poll()  # a background save that failed stops the run at once
        if pending is not None:
            check(*pending)
            pending = None
    except (Diverged, CheckpointError, NonFiniteStateError, MetricsWriteError, jax.errors.JaxRuntimeError) as err:
        collective = _collective_failure(err)
        if collective is not None and jax.process_count() > 1:
            # A collective failed (in the step, or in a save's synchronisation): a peer died or hangs.
            # Waiting for saves or jax's shutdown barrier would hang on it or abort in C++, so say why
            # and leave at once (the last complete checkpoint stays).
            _fail(f"process {jax.process_index()} stopped after step {step}: a peer process died or became "
                  f"unreachable ({str(collective).splitlines()[0][:300]}); {last_good_text()}", 1)
            peers.fail(f"a collective failed on it after step {step}")
        if isinstance(err, jax.errors.JaxRuntimeError):
            raise
        status, failure = 1, str(err)
        if isinstance(err, CheckpointError):
            # The failed write's abandoned asyncio tasks would print the same error again at exit.
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    finally:
        progress.close()
        batches.close()
        for close in (checkpointer.close, log.close):
            try:
                close()
            except (CheckpointError, MetricsWriteError) as err:
                if failure is None:
                    status, failure = 1, str(err)
    if failure is not None:
        return _fail(failure, status)
    if is_main:
        if skipped_steps:
            _note(f"{skipped_steps} step(s) skipped for a non-finite loss or gradient norm")
        if stopped:
            print(f"mtjax train: {watcher.signal_name or 'preemption'}: saved step {step} in {checkpointer.directory}; "
                  "continue with --resume")
        elif log.plot(os.path.join(setup.workdir, "loss.png")):
            print(f"mtjax train: done; loss curve in {os.path.join(setup.workdir, 'loss.png')}")
        else:
            print("mtjax train: done (install matplotlib for the loss-curve PNG)")
    return 0
