"""``mtjax train``: train a GPT preset on text files (default: the tiny preset on Python's stdlib).

    mtjax train                                   # tiny GPT, CPU, a few minutes, loss curve at the end
    mtjax train --preset gpt-1.3b --fp8 --steps 200
    mtjax train --resume                          # continue from the latest checkpoint in --workdir

Writes into ``--workdir`` (default ``runs/<preset>``): ``checkpoints/``, ``metrics.jsonl`` (one JSON
object per logged step) and ``loss.png`` (with matplotlib). SIGTERM saves a checkpoint and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from mtjax.cli_args import non_negative_int, positive_float, positive_int
from mtjax.train.presets import PRESETS, TrainPreset, peak_tflops

# Model vocabularies are padded to a multiple of this, so the vocab axis splits over tp.
VOCAB_MULTIPLE = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``mtjax train`` flags; unset ones take the preset's value."""
    from mtjax.models import REMAT_POLICIES

    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="model and run defaults (default: tiny, for the CPU)")
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=positive_int, help="optimizer steps")
    run.add_argument("--batch-size", type=positive_int, help="global batch size in sequences")
    run.add_argument("--seq-len", type=positive_int, help="tokens per sequence")
    run.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per step (default 1)")
    run.add_argument("--lr", type=positive_float, help="peak learning rate")
    run.add_argument("--warmup-steps", type=non_negative_int, help="linear warmup steps")
    run.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    run.add_argument("--clip-norm", type=positive_float, default=1.0, help="gradient global-norm clip (default 1)")
    run.add_argument("--seed", type=int, default=0, help="initialisation, dropout and data order (default 0)")
    run.add_argument("--fp8", action="store_true", help="FP8 GEMMs with delayed scaling (mtjax.fp8)")
    run.add_argument("--remat", choices=sorted(REMAT_POLICIES), help="rematerialisation policy of the layers")
    data = parser.add_argument_group("data")
    data.add_argument("--data", nargs="+", metavar="PATH",
                      help="text files or folders (default: the Python standard library's source)")
    data.add_argument("--tokenizer", default="byte", help="'byte' (default) or 'sentencepiece:MODEL_FILE'")
    data.add_argument("--eval-batches", type=non_negative_int, default=4,
                      help="held-out batches per evaluation (0: no evaluation; default 4)")
    mesh = parser.add_argument_group("parallelism (the product must equal the number of devices)")
    mesh.add_argument("--dp", type=positive_int, help="data-parallel ways (default: the devices left over)")
    mesh.add_argument("--fsdp", type=positive_int, default=1, help="fully-sharded data-parallel ways")
    mesh.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ways")
    mesh.add_argument("--sp", action="store_true", help="sequence parallelism over the tp axis")
    hosts = parser.add_argument_group("multi-host (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)")
    hosts.add_argument("--coordinator-address", help="host:port of process 0")
    hosts.add_argument("--num-processes", type=positive_int)
    hosts.add_argument("--process-id", type=int)
    out = parser.add_argument_group("output")
    out.add_argument("--workdir", help="checkpoints, metrics.jsonl and loss.png (default: runs/<preset>)")
    out.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --workdir")
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
    ``grad_accum``, ``seed`` and ``fp8``.
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

    def model_config(self):
        from mtjax.models import gpt_config

        return gpt_config(self.model, **self.model_overrides)


def _resolve(args: argparse.Namespace, tokenizer) -> tuple[RunConfig, TrainPreset]:
    from mtjax.models import gpt_config

    preset = PRESETS[args.preset]
    pick = lambda flag, default: default if flag is None else flag
    seq_len = pick(args.seq_len, preset.seq_len)
    base = gpt_config(preset.model)
    overrides: dict[str, Any] = {}
    if tokenizer.vocab_size > base.vocab_size:
        overrides["vocab_size"] = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if seq_len > base.max_seq_len:
        overrides["max_seq_len"] = seq_len
    if args.remat is not None:
        overrides["remat_policy"] = args.remat
    steps = pick(args.steps, preset.steps)
    run = RunConfig(
        preset=args.preset, model=preset.model, model_overrides=overrides, tokenizer=tokenizer.spec,
        batch_size=pick(args.batch_size, preset.batch_size), seq_len=seq_len, steps=steps,
        learning_rate=pick(args.lr, preset.learning_rate),
        warmup_steps=min(pick(args.warmup_steps, preset.warmup_steps), steps - 1),
        grad_accum=args.grad_accum, seed=args.seed, fp8=args.fp8)
    if run.batch_size % run.grad_accum:
        raise ValueError(f"--batch-size {run.batch_size} is not divisible by --grad-accum {run.grad_accum}")
    run.model_config()  # validates the overrides
    return run, preset


class _MetricsLog:
    """``metrics.jsonl`` (appended to on resume) and the loss curve drawn from it at the end."""

    def __init__(self, path: str, enabled: bool):
        self.path, self.enabled = path, enabled
        self._file = open(path, "a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()

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


def _fail(message: str) -> int:
    print(f"mtjax train: error: {message}", file=sys.stderr)
    return 2


@dataclasses.dataclass
class _Setup:
    """What `run` builds from the flags before training starts."""

    config: RunConfig
    preset: TrainPreset
    mesh: Any
    rules: Any
    train_data: Any
    eval_data: Any
    workdir: str
    checkpointer: Any
    resume_from: int | None


def _setup(args: argparse.Namespace) -> _Setup:
    """Resolve flags, mesh, data and checkpoints; every unusable choice raises ValueError with a message."""
    import jax

    from mtjax.sharding import MeshConfig, logical_axis_rules
    from mtjax.train.checkpoint import Checkpointer
    from mtjax.train.data import PackedDataset, default_corpus
    from mtjax.train.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    config, preset = _resolve(args, tokenizer)
    other = args.fsdp * args.tp
    dp = args.dp if args.dp is not None else max(jax.device_count() // other, 1)
    mesh_config = MeshConfig(dp=dp, fsdp=args.fsdp, tp=args.tp, sp=args.sp)
    mesh, rules = mesh_config.make_mesh(), logical_axis_rules(mesh_config)
    if config.batch_size % (dp * args.fsdp * config.grad_accum):
        raise ValueError(f"--batch-size {config.batch_size} must be divisible by dp * fsdp * grad-accum "
                         f"= {dp * args.fsdp * config.grad_accum}")
    dataset = PackedDataset.from_paths(args.data or default_corpus(), tokenizer, config.seq_len, seed=config.seed)
    eval_sequences = args.eval_batches * config.batch_size
    train_data, eval_data = dataset, None
    if eval_sequences:
        if eval_sequences * 10 > dataset.num_sequences:
            raise ValueError(f"--data holds {dataset.num_sequences} sequences of {config.seq_len} tokens: too few to "
                             f"hold {eval_sequences} out for evaluation (use --eval-batches 0 or more data)")
        train_data, eval_data = dataset.split(eval_sequences)
    workdir = os.path.abspath(args.workdir or os.path.join("runs", args.preset))
    save_every = preset.save_every if args.save_every is None else args.save_every or None
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), save_every=save_every, keep=args.keep)
    latest = checkpointer.latest_step()
    if latest is not None and not args.resume:
        checkpointer.close()
        raise ValueError(f"{workdir} already holds checkpoints (latest: step {latest}); pass --resume to continue "
                         "that run, or --workdir for a new one")
    if latest is not None:
        saved = RunConfig(**checkpointer.restore_meta(latest)["run"])
        kept = ("model", "model_overrides", "tokenizer", "fp8")  # what the saved state's structure depends on
        if any(getattr(saved, name) != getattr(config, name) for name in kept):
            checkpointer.close()
            raise ValueError(f"the checkpoint in {workdir} was written with "
                             f"{ {name: getattr(saved, name) for name in kept} }; this run asks for "
                             f"{ {name: getattr(config, name) for name in kept} }")
    if args.resume and latest is None:
        print(f"mtjax train: no checkpoint in {workdir} yet; starting from scratch", file=sys.stderr)
    return _Setup(config, preset, mesh, rules, train_data, eval_data, workdir, checkpointer, latest)


def run(args: argparse.Namespace) -> int:
    """Train; returns the exit status (0, or 2 with a message for an unusable configuration)."""
    from mtjax.fp8 import fp8_autocast
    from mtjax.train import distributed

    try:
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        setup = _setup(args)
    except ValueError as err:
        return _fail(str(err))
    # FP8 is decided when the functions are traced: creating the state and the first step.
    with fp8_autocast(enabled=setup.config.fp8):
        return _train(args, setup)


def _train(args: argparse.Namespace, setup: _Setup) -> int:
    import jax
    from tqdm import tqdm

    from mtjax import fp8
    from mtjax.models import GPT
    from mtjax.sharding import tree_shardings
    from mtjax.train.checkpoint import PreemptionWatcher
    from mtjax.train.data import DataIterator
    from mtjax.train.distributed import global_batch, process_rows
    from mtjax.train.state import abstract_train_state, batch_sharding, compute_dtype_for, init_train_state
    from mtjax.train.step import make_eval_step, make_optimizer, make_train_step, throughput

    run_config, preset, mesh, rules = setup.config, setup.preset, setup.mesh, setup.rules
    checkpointer = setup.checkpointer
    config = run_config.model_config()
    model = GPT(config)
    optimizer, schedule = make_optimizer(run_config.learning_rate, total_steps=run_config.steps,
                                         warmup_steps=run_config.warmup_steps, clip_norm=args.clip_norm,
                                         weight_decay=args.weight_decay)
    micro_batch_shape = (run_config.batch_size // run_config.grad_accum, run_config.seq_len)
    compute_dtype = compute_dtype_for(config.dtype, config.param_dtype)
    abstract = abstract_train_state(model, optimizer, micro_batch_shape, mesh=mesh, rules=rules,
                                    compute_dtype=compute_dtype)
    if setup.resume_from is not None:
        state, meta = checkpointer.restore(abstract, setup.resume_from)
        position = meta["data"]["position"]
    else:
        state = init_train_state(model, optimizer, jax.random.PRNGKey(run_config.seed), micro_batch_shape,
                                 mesh=mesh, rules=rules, compute_dtype=compute_dtype)
        position = 0
    state_sharding = tree_shardings(abstract)
    options = fp8.compiler_options() if run_config.fp8 else None
    train_step = make_train_step(model, optimizer, mesh=mesh, rules=rules, state_sharding=state_sharding,
                                 grad_accum_steps=run_config.grad_accum, learning_rate=schedule,
                                 compiler_options=options)
    eval_step = make_eval_step(model, mesh=mesh, rules=rules, state_sharding=state_sharding, compiler_options=options)
    tokens_sharding = batch_sharding(mesh, rules)
    rows = process_rows(tokens_sharding, run_config.batch_size)  # this process loads only these rows
    batches = DataIterator(setup.train_data, run_config.batch_size, position=position, rows=rows)

    def to_global(local_batch):
        return global_batch(local_batch, tokens_sharding, run_config.batch_size)

    def evaluate() -> float:
        held_out = DataIterator(setup.eval_data, run_config.batch_size, rows=rows)
        losses = [eval_step(state, to_global(next(held_out)))["loss"] for _ in range(args.eval_batches)]
        return float(sum(jax.device_get(losses)) / len(losses))

    def meta() -> dict[str, Any]:
        return {"data": batches.state(), "run": dataclasses.asdict(run_config)}

    is_main = jax.process_index() == 0
    os.makedirs(setup.workdir, exist_ok=True)
    log = _MetricsLog(os.path.join(setup.workdir, "metrics.jsonl"), enabled=is_main)
    peak = args.peak_tflops or peak_tflops(jax.devices()[0].device_kind)
    log_every, eval_every = args.log_every or preset.log_every, args.eval_every or preset.eval_every
    tokens_per_step = run_config.batch_size * run_config.seq_len
    step = int(jax.device_get(state.step))
    if is_main:
        print(f"mtjax train: {run_config.preset} ({config.num_params() / 1e6:.1f}M parameters"
              f"{', FP8' if run_config.fp8 else ''}) on {jax.device_count()} {jax.devices()[0].platform} device(s), "
              f"mesh {dict(mesh.shape)}; {setup.train_data.num_sequences} training sequences of "
              f"{run_config.seq_len} tokens; steps {step}..{run_config.steps}; writing to {setup.workdir}", flush=True)

    watcher = PreemptionWatcher()
    progress = tqdm(total=run_config.steps, initial=step, disable=args.no_progress or not is_main, unit="step",
                    dynamic_ncols=True)
    timer_start, timer_step, stopped = None, step, False
    try:
        while step < run_config.steps and not stopped:
            state, metrics = train_step(state, to_global(next(batches)))
            step += 1
            if timer_start is None:  # time from the end of the first step on: it compiled
                jax.block_until_ready(metrics)
                timer_start, timer_step = time.perf_counter(), step
            if step % log_every == 0 or step == run_config.steps:
                record = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
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
                eval_loss = evaluate()
                log.write({"step": step, "eval_loss": eval_loss})
                if is_main:
                    progress.write(f"step {step}: held-out loss {eval_loss:.4f}")
                timer_start, timer_step = time.perf_counter(), step  # evaluation time is not training time
            progress.update(1)
            stopped = watcher.should_stop(step)
            final = step == run_config.steps and checkpointer.save_every is not None
            checkpointer.save(step, state, meta(), force=stopped or final)
    finally:
        progress.close()
        watcher.close()
        checkpointer.close()
        log.close()
    if is_main:
        if stopped:
            print(f"mtjax train: SIGTERM: saved step {step} in {checkpointer.directory}; continue with --resume")
        elif log.plot(os.path.join(setup.workdir, "loss.png")):
            print(f"mtjax train: done; loss curve in {os.path.join(setup.workdir, 'loss.png')}")
        else:
            print("mtjax train: done (install matplotlib for the loss-curve PNG)")
    return 0
