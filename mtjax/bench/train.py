"""The ``train`` suite: whole AdamW train steps of model presets, mtjax against stock Flax.

For each preset (default ``gpt-1.3b``, sequence 2048, batch 8; ``tiny`` with ``--quick``) four
variants run side by side in one process. GPT presets train on ``[batch, seq]`` tokens; ViT presets
(``vit-l16``) on ``[64, 224, 224, 3]`` images; T5 presets (``t5-base``) on 32 pairs of a 512-token
input and a 128-token target (with ``--quick``: batch 2 and 32/16 tokens, the tiny presets
``vit-tiny``, ``t5-tiny``).

- ``mtjax``: the `mtjax.models` model trained by `mtjax.train`'s step (``make_train_step``), bf16 compute,
  f32 parameters;
- ``mtjax fp8``: the same under ``mtjax.fp8.fp8_autocast`` (delayed scaling);
- ``mtjax [op=impl,xla_option=value,...]`` (and its fp8): with kernel choices or XLA options changed
  (``--variant``, `mtjax.bench.variants`); ``--variant recipe=block`` adds ``mtjax fp8 [recipe=block]``
  (`mtjax.fp8.BlockScaling`, opt-in: one more compilation of the step);
- ``flax``: `mtjax.bench.peers.FlaxGPT` (`FlaxViT`, `FlaxT5`), the same model in stock Flax (cuDNN
  attention where jax routes it);
- ``flax fp8``: that model with Flax's ``Fp8DirectDotGeneralOp`` in every Dense.

Model FLOPs are the preset's (``flops_per_token(seq)``: 6·N + attention; T5: ``flops_per_example``)
for all four, so MFU and speed-ups compare the same work; ``tokens_per_s`` counts a ViT's patch
tokens and both of a T5's sequences. Each variant is compiled, timed with the state
threaded through as in training (median of 6 samples of 3 steps dispatched back to back), and
reported (one line on stderr) before the next starts, so a run cut short keeps what it measured;
``--profile DIR`` adds each step's per-op device time (`mtjax.bench.profile`), from a second
compilation of the step without CUDA graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax.bench import peers, profile, timing
from mtjax.bench.variants import DEFAULT, Setting, bf16_label, label, mtjax_context, mtjax_variants, mtjax_xla_options

SEQ_LEN, BATCH = 2048, 8
QUICK_SEQ_LEN, QUICK_BATCH = 32, 2
VIT_BATCH = 64
T5_BATCH, T5_ENCODER_LEN, T5_DECODER_LEN = 32, 512, 128


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
      bf16: for an mtjax FP8 row, the implementation of the bf16 row its speed-up is over.
    """

    implementation: str
    peer: str | None
    ceiling: str
    init: Callable[[], Any]
    step: Callable[..., Any]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    xla_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    profiled: bool = True
    bf16: str | None = None


@dataclasses.dataclass
class Workload:
    """What the rows of one preset train on.

    Attributes:
      name: the rows' name (``"gpt-1.3b b8 s2048"``).
      config: the mtjax model config.
      batches: two batches to alternate between.
      tokens_per_step: tokens one step trains on (throughput figures).
      flops: model FLOPs of one step.
      model_inputs: the mtjax model's keyword arguments from a batch (None: ``batch["inputs"]``).
      loss_fn: the mtjax step's loss.
      peer: ``fp8 -> the stock-Flax model``.
      peer_inputs: the stock-Flax model's arguments from a batch.
      peer_labels: the batch entry its cross-entropy compares against.
      extra: row fields (batch, sequence lengths).
    """

    name: str
    config: Any
    batches: list[dict[str, jax.Array]]
    tokens_per_step: int
    flops: float
    model_inputs: Callable[[dict[str, jax.Array]], dict[str, jax.Array]] | None
    loss_fn: Callable[..., jax.Array]
    peer: Callable[[bool], nn.Module]
    peer_inputs: Callable[[dict[str, jax.Array]], tuple[jax.Array, ...]]
    peer_labels: str
    extra: dict[str, Any]

    @property
    def example(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of a batch (what train states are built from)."""
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self.batches[0].items()}


def workload(preset: str, quick: bool) -> Workload:
    """The batches, FLOPs and peer of ``preset`` (a GPT, ViT or T5 preset of `mtjax.models.model_config`)."""
    from mtjax.models import GPTConfig, T5Config, ViTConfig, model_config
    from mtjax.train.step import classification_loss, next_token_loss

    config = model_config(preset)
    if isinstance(config, ViTConfig):
        batch = QUICK_BATCH if quick else VIT_BATCH
        rng = np.random.default_rng(42)
        shape = (batch, config.image_size, config.image_size, config.num_channels)
        batches = [{"images": jnp.asarray(rng.normal(size=shape), jnp.float32),
                    "labels": jnp.asarray(rng.integers(0, config.num_classes, batch), jnp.int32)} for _ in range(2)]
        tokens = batch * config.seq_len
        return Workload(f"{preset} b{batch} {config.image_size}px", config, batches, tokens,
                        config.flops_per_token() * tokens, lambda b: {"images": b["images"]}, classification_loss,
                        lambda fp8: peers.FlaxViT.like(config, fp8=fp8), lambda b: (b["images"],), "labels",
                        {"batch": batch, "seq_len": config.seq_len})
    if isinstance(config, T5Config):
        batch, enc, dec = (QUICK_BATCH, QUICK_SEQ_LEN, QUICK_SEQ_LEN // 2) if quick else (
            T5_BATCH, T5_ENCODER_LEN, T5_DECODER_LEN)
        batches = [{"encoder_inputs": source["inputs"], **target} for source, target in
                   zip(_batches(config.vocab_size, batch, enc, seed=1), _batches(config.vocab_size, batch, dec))]
        return Workload(f"{preset} b{batch} s{enc}+{dec}", config, batches, batch * (enc + dec),
                        config.flops_per_example(enc, dec) * batch,
                        lambda b: {"encoder_tokens": b["encoder_inputs"], "decoder_tokens": b["inputs"]},
                        next_token_loss, lambda fp8: peers.FlaxT5.like(config, fp8=fp8),
                        lambda b: (b["encoder_inputs"], b["inputs"]), "targets",
                        {"batch": batch, "seq_len": enc, "decoder_len": dec})
    if not isinstance(config, GPTConfig):
        raise ValueError(f"mtjax bench train: preset {preset!r} is a {type(config).__name__}; the train suite "
                         "runs GPT, ViT and T5 presets")
    batch, seq = (QUICK_BATCH, QUICK_SEQ_LEN) if quick else (BATCH, SEQ_LEN)
    seq_len = min(seq, config.max_seq_len)
    return Workload(f"{preset} b{batch} s{seq_len}", config, _batches(config.vocab_size, batch, seq_len),
                    batch * seq_len, config.flops_per_token(seq_len) * batch * seq_len, None, next_token_loss,
                    lambda fp8: peers.FlaxGPT.like(config, fp8=fp8), peers.token_inputs, "targets",
                    {"batch": batch, "seq_len": seq_len})


def _flax_variant(work: Workload, fp8: bool) -> Variant:
    model = work.peer(fp8)
    opt = optimizer()

    def init():
        params, fp8_state = peers.init(model, *work.peer_inputs(work.batches[0]))
        return params, fp8_state, jax.jit(opt.init)(params)

    return Variant("flax fp8" if fp8 else "flax", "flax" if fp8 else None,
                   "fp8_gemm_tflops" if fp8 else "bf16_gemm_tflops", init,
                   peers.train_step(model, opt, work.peer_inputs, work.peer_labels))


def _mtjax_variant(config: Any, fp8: bool, setting: Setting, batch_shape: Any, model_inputs: Any = None,
                   loss_fn: Any = None) -> Variant:
    """An mtjax row: ``batch_shape`` as `mtjax.train.init_train_state`'s (a token ``(batch, seq)`` or an
    example batch with ``model_inputs``), ``loss_fn`` the step's (default: next-token)."""
    from mtjax.models import build_model
    from mtjax.train.state import compute_dtype_for, init_train_state
    from mtjax.train.step import make_train_step, next_token_loss

    config = dataclasses.replace(config, **setting.model)
    model = build_model(config)
    opt = optimizer()
    # As `mtjax train` does: a bf16 model reads a bf16 copy of its f32 weights.
    keep_copy = setting.train.get("compute_params", True)
    compute_dtype = compute_dtype_for(config.dtype, config.param_dtype) if keep_copy else None
    return Variant(
        label(fp8, setting), peers.FP8_PEER if fp8 else "flax", "fp8_gemm_tflops" if fp8 else "bf16_gemm_tflops",
        init=lambda: init_train_state(model, opt, jax.random.PRNGKey(0), batch_shape, compute_dtype=compute_dtype,
                                      model_inputs=model_inputs),
        step=make_train_step(model, opt, loss_fn or next_token_loss, model_inputs=model_inputs),
        context=lambda: mtjax_context(fp8, setting),
        xla_options=mtjax_xla_options(fp8, setting),
        profiled=setting == DEFAULT,
        bf16=bf16_label(setting) if fp8 else None,
    )


def variants(work: Workload, settings: Sequence[Setting] = ()) -> list[Variant]:
    """mtjax and Flax, bf16 then FP8, then the rows of each setting: the headline comparisons come first."""
    example = work.example if work.model_inputs is not None else work.batches[0]["inputs"].shape
    mtjax_rows = [_mtjax_variant(work.config, fp8, setting, example, work.model_inputs, work.loss_fn)
                  for fp8, setting in mtjax_variants(list(settings))]
    flax_fp8 = [_flax_variant(work, True)] if peers.HAS_FLAX_FP8 else []
    return [mtjax_rows[0], _flax_variant(work, False), mtjax_rows[1], *flax_fp8, *mtjax_rows[2:]]


def _batches(vocab_size: int, batch: int, seq: int, count: int = 2, seed: int = 42) -> list[dict[str, jax.Array]]:
    out = []
    for key in jax.random.split(jax.random.key(seed), count):
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


def custom_call_targets(hlo_text: str) -> list[str]:
    """The custom-call targets of a compiled program's HLO, sorted: which kernels a step runs
    (``mtjax_cublaslt_block_fp8_gemm``, ``mosaic_gpu``, ``triton_kernel_call``, cuDNN's attention,
    ``__cublas$lt$matmul$f8``...)."""
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def run(quick: bool, presets: Sequence[str] | None = None, profile_dir: str | None = None,
        settings: Sequence[Setting] = (), only: Sequence[str] | None = None) -> list[dict]:
    """Rows for each preset and variant (see the module docstring); ``settings``: `mtjax.bench.variants`;
    ``only``: the labels of the variants to run (e.g. ``["mtjax", "mtjax fp8 [recipe=block]"]``; None:
    all). A variant that fails to compile or run gives an error row and the next one runs."""
    presets = list(presets or (["tiny"] if quick else ["gpt-1.3b"]))
    rows = []
    for preset in presets:
        work = workload(preset, quick)
        batches, name = work.batches, work.name
        times = {}
        candidates = variants(work, settings)
        if only is not None:
            unknown = set(only) - {v.implementation for v in candidates}
            if unknown:
                raise ValueError(f"train suite: rows {sorted(unknown)} are not among "
                                 f"{[v.implementation for v in candidates]}")
            candidates = [v for v in candidates if v.implementation in only]
        for variant in candidates:
            try:
                step, compile_s = _compile(variant, batches[0])
                with variant.context():
                    state = variant.init()
                t, (state, metrics) = timing.measure_steps(step, state, batches, warmup=2, runs=3 if quick else 6,
                                                          steps_per_sample=1 if quick else 3)
            except Exception as err:  # noqa: BLE001 - a failing variant becomes a row; the next one runs
                print(f"mtjax bench: train {name} {variant.implementation}: failed: {err!r}"[:2000], file=sys.stderr,
                      flush=True)
                rows.append(timing.error_row("train", name, variant.implementation, err, **work.extra))
                continue
            times[variant.implementation] = t.median
            extra = {"tokens_per_s": work.tokens_per_step / t.median, **work.extra,
                     "params": work.config.num_params(), "loss": float(metrics["loss"]), "compile_s": compile_s,
                     "temp_memory_gb": step.memory_analysis().temp_size_in_bytes / 1e9,
                     "xla_options": {k: str(v) for k, v in variant.xla_options.items()},
                     "custom_calls": custom_call_targets(step.as_text())}
            if variant.bf16 in times:
                extra["speedup_vs_mtjax_bf16"] = times[variant.bf16] / t.median
            print(f"mtjax bench: train {name} {variant.implementation}: {t.median * 1e3:.1f} ms/step, "
                  f"{extra['tokens_per_s']:.0f} tokens/s, loss {extra['loss']:.3f}, compiled in {compile_s:.0f} s; "
                  f"custom calls: {', '.join(extra['custom_calls']) or 'none'}", file=sys.stderr, flush=True)
            if profile_dir is not None and variant.profiled:
                profiled_step, _ = _compile(variant, batches[0], PROFILE_XLA_OPTIONS)
                state, profiled = _profile(profiled_step, state, batches[0], profile_dir,
                                           f"{preset}_{variant.implementation.replace(' ', '_')}")
                extra.update(profiled)
            del state
            rows.append(timing.row("train", name, variant.implementation, t, flops=work.flops, peer=variant.peer,
                                   ceiling=variant.ceiling, **extra))
    return rows
