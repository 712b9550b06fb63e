"""The ``train`` suite: whole AdamW train steps of GPT presets, mtjax against stock Flax.

For each preset (default ``gpt-1.3b``, sequence 2048, batch 8; ``tiny`` with ``--quick``) four
variants run side by side in one process:

- ``mtjax``: `mtjax.models.GPT` trained by `mtjax.train`'s step (``make_train_step``), bf16 compute,
  f32 parameters;
- ``mtjax fp8``: the same under ``mtjax.fp8.fp8_autocast`` (delayed scaling);
- ``mtjax [op=impl,xla_option=value,...]`` (and its fp8): with kernel choices or XLA options changed
  (``--variant``, `mtjax.bench.variants`);
- ``flax``: `mtjax.bench.peers.FlaxGPT`, the same model in stock Flax (cuDNN attention);
- ``flax fp8``: that model with Flax's ``Fp8DirectDotGeneralOp`` in every Dense.

Model FLOPs per token are the preset's ``flops_per_token(seq)`` (6·N + causal attention) for all
four, so MFU and speed-ups compare the same work. Each variant is compiled, timed with the state
threaded through as in training (median of 6 samples of 3 steps dispatched back to back), and
reported (one line on stderr) before the next starts, so a run cut short keeps what it measured;
``--profile DIR`` adds each step's per-op device time (`mtjax.bench.profile`), from a second
compilation of the step without CUDA graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mtjax.bench import peers, profile, timing
from mtjax.bench.variants import DEFAULT, Setting, label, mtjax_context, mtjax_variants, mtjax_xla_options

SEQ_LEN, BATCH = 2048, 8
QUICK_SEQ_LEN, QUICK_BATCH = 32, 2


def optimizer() -> optax.GradientTransformation:
    """The optimizer of every variant (the anchors' AdamW)."""
    return optax.adamw(learning_rate=1e-4, b1=0.9, b2=0.95, weight_decay=0.1)


@dataclasses.dataclass
class Variant:
    """One model + train step to time.

    Attributes:
      implementation: the row's name for it (``"mtjax"``, ``"flax fp8"``...).
      peer: the implementation it is compared with.
      ceiling: the GEMM ceiling its compute is bound by.
      init: ``init() -> state`` (parameters, FP8 state, optimizer state).
      step: jitted ``step(state, batch) -> (state, metrics)`` donating ``state``; ``metrics["loss"]``.
      context: entered around tracing and init (``fp8_autocast`` for mtjax FP8).
      xla_options: XLA compiler options of its compilation.
      profiled: profiled under ``--profile`` (the headline rows; not the ``--variant`` ones).
    """

    implementation: str
    peer: str | None
    ceiling: str
    init: Callable[[], Any]
    step: Callable[..., Any]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    xla_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    profiled: bool = True


def _flax_variant(config: Any, fp8: bool, batch_shape: tuple[int, int]) -> Variant:
    model = peers.FlaxGPT.like(config, fp8=fp8)
    opt = optimizer()

    def init():
        params, fp8_state = peers.init(model, jnp.zeros(batch_shape, jnp.int32))
        return params, fp8_state, jax.jit(opt.init)(params)

    return Variant("flax fp8" if fp8 else "flax", "flax" if fp8 else None,
                   "fp8_gemm_tflops" if fp8 else "bf16_gemm_tflops", init, peers.train_step(model, opt))


def _mtjax_variant(config: Any, fp8: bool, setting: Setting, batch_shape: tuple[int, int]) -> Variant:
    from mtjax.models import GPT
    from mtjax.train.state import compute_dtype_for, init_train_state
    from mtjax.train.step import make_train_step

    config = dataclasses.replace(config, **setting.model)
    model = GPT(config)
    opt = optimizer()
    # As `mtjax train` does: a bf16 model reads a bf16 copy of its f32 weights.
    keep_copy = setting.train.get("compute_params", True)
    compute_dtype = compute_dtype_for(config.dtype, config.param_dtype) if keep_copy else None
    return Variant(
        label(fp8, setting), peers.FP8_PEER if fp8 else "flax", "fp8_gemm_tflops" if fp8 else "bf16_gemm_tflops",
        init=lambda: init_train_state(model, opt, jax.random.PRNGKey(0), batch_shape, compute_dtype=compute_dtype),
        step=make_train_step(model, opt),
        context=lambda: mtjax_context(fp8, setting),
        xla_options=mtjax_xla_options(fp8, setting),
        profiled=setting == DEFAULT,
    )


def variants(config: Any, batch_shape: tuple[int, int], settings: Sequence[Setting] = ()) -> list[Variant]:
    """mtjax and Flax, bf16 then FP8, then the rows of each setting: the headline comparisons come first."""
    mtjax_rows = [_mtjax_variant(config, fp8, setting, batch_shape) for fp8, setting in mtjax_variants(list(settings))]
    flax_fp8 = [_flax_variant(config, True, batch_shape)] if peers.HAS_FLAX_FP8 else []
    return [mtjax_rows[0], _flax_variant(config, False, batch_shape), mtjax_rows[1], *flax_fp8, *mtjax_rows[2:]]


def _batches(vocab_size: int, batch: int, seq: int, count: int = 2) -> list[dict[str, jax.Array]]:
    out = []
    for key in jax.random.split(jax.random.key(42), count):
        tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab_size, dtype=jnp.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


# Profiled steps are compiled without CUDA graphs ("command buffers"): inside one, the profiler sees
# a single event (named after its first kernel, e.g. a memcpy) for the whole scanned layer stack.
PROFILE_XLA_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def _compile(variant: Variant, batch: dict[str, jax.Array], extra_options: dict[str, Any] | None = None
             ) -> tuple[Any, float]:
    """``(compiled step, seconds)``; traced under the variant's context (``fp8_autocast`` is read then)."""
    with variant.context():
        lowered = variant.step.lower(jax.eval_shape(variant.init), batch)
    return timing.compile_lowered(lowered, {**variant.xla_options, **(extra_options or {})})


def _profile(step: Callable[..., Any], state: Any, batch: dict[str, jax.Array], out_dir: str,
             label: str) -> tuple[Any, dict]:
    """Profile a few steps; returns the state after them and the row's ``extra`` entries."""
    holder = {"state": state}

    def once():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    hlo_text = step.as_text()
    # A profiler that cannot attach (no CUPTI in a VM) must not cost the measurements.
    try:
        summary = profile.profile(once, out_dir=out_dir, label=label, hlo_text=hlo_text)
    except Exception as err:
        return holder["state"], {"profile_error": repr(err)}
    print(profile.format_summary(label, summary, top=40), file=sys.stderr, flush=True)
    # The optimized HLO beside the trace names what each fusion in the top ops computes.
    with open(os.path.join(out_dir, f"{label}.hlo.txt"), "w") as f:
        f.write(hlo_text)
    return holder["state"], {"profile_ms": summary["by_category_ms"], "profile_top_ops_ms": summary["top_ops_ms"],
                             "profile_by_source_ms": summary["by_source_ms"]}


def run(quick: bool, presets: Sequence[str] | None = None, profile_dir: str | None = None,
        settings: Sequence[Setting] = ()) -> list[dict]:
    """Rows for each preset and variant (see the module docstring); ``settings``: `mtjax.bench.variants`."""
    from mtjax.models import gpt_config

    presets = list(presets or (["tiny"] if quick else ["gpt-1.3b"]))
    batch_size, seq = (QUICK_BATCH, QUICK_SEQ_LEN) if quick else (BATCH, SEQ_LEN)
    rows = []
    for preset in presets:
        config = gpt_config(preset)
        seq_len = min(seq, config.max_seq_len)
        batches = _batches(config.vocab_size, batch_size, seq_len)
        tokens_per_step = batch_size * seq_len
        flops = config.flops_per_token(seq_len) * tokens_per_step
        todo = variants(config, (batch_size, seq_len), settings)
        name = f"{preset} b{batch_size} s{seq_len}"
        times = {}
        for variant in todo:
            step, compile_s = _compile(variant, batches[0])
            with variant.context():
                state = variant.init()
            t, (state, metrics) = timing.measure_steps(step, state, batches, warmup=2, runs=3 if quick else 6,
                                                      steps_per_sample=1 if quick else 3)
            times[variant.implementation] = t.median
            extra = {"tokens_per_s": tokens_per_step / t.median, "batch": batch_size, "seq_len": seq_len,
                     "params": config.num_params(), "loss": float(metrics["loss"]), "compile_s": compile_s,
                     "temp_memory_gb": step.memory_analysis().temp_size_in_bytes / 1e9,
                     "xla_options": {k: str(v) for k, v in variant.xla_options.items()}}
            if variant.implementation.startswith("mtjax fp8"):
                bf16 = variant.implementation.replace("mtjax fp8", "mtjax", 1)
                extra["speedup_vs_mtjax_bf16"] = times[bf16] / t.median
            print(f"mtjax bench: train {name} {variant.implementation}: {t.median * 1e3:.1f} ms/step, "
                  f"{extra['tokens_per_s']:.0f} tokens/s, loss {extra['loss']:.3f}, compiled in {compile_s:.0f} s",
                  file=sys.stderr, flush=True)
            if profile_dir is not None and variant.profiled:
                profiled_step, _ = _compile(variant, batches[0], PROFILE_XLA_OPTIONS)
                state, profiled = _profile(profiled_step, state, batches[0], profile_dir,
                                           f"{preset}_{variant.implementation.replace(' ', '_')}")
                extra.update(profiled)
            del state
            rows.append(timing.row("train", name, variant.implementation, t, flops=flops, peer=variant.peer,
                                   ceiling=variant.ceiling, **extra))
    return rows
