"""The ``train`` suite: whole AdamW train steps of GPT presets, mtjax against stock Flax.

For each preset (default ``gpt-1.3b``, sequence 2048, batch 8; ``tiny`` with ``--quick``) four
variants run side by side in one process:

- ``mtjax``: `mtjax.models.GPT` trained by `mtjax.train`'s step, bf16 compute, f32 parameters;
- ``mtjax fp8``: the same under ``mtjax.fp8.fp8_autocast`` (delayed scaling);
- ``flax``: `mtjax.bench.peers.FlaxGPT`, the same model in stock Flax (cuDNN attention);
- ``flax fp8``: that model with Flax's ``Fp8DirectDotGeneralOp`` in every Dense.

Model FLOPs per token are the preset's ``flops_per_token(seq)`` (6·N + causal attention) for all
four, so MFU and speed-ups compare the same work. All steps are compiled first, concurrently (the
compilations are independent CPU work), then timed one after the other with the state threaded
through as in training.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mtjax.bench import peers, profile, timing

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
      init: ``init(tokens) -> state`` (params, FP8 state and optimizer state).
      step: jitted ``step(state, (inputs, targets)) -> (state, loss)`` donating ``state``.
    """

    implementation: str
    peer: str | None
    ceiling: str
    init: Callable[[jax.Array], Any]
    step: Callable[..., Any]


def _flax_variant(config: Any, fp8: bool) -> Variant:
    model = peers.FlaxGPT.like(config, fp8=fp8)
    opt = optimizer()

    def init(tokens):
        params, fp8_state = peers.init(model, tokens)
        return params, fp8_state, jax.jit(opt.init)(params)

    return Variant("flax fp8" if fp8 else "flax", "flax" if fp8 else None,
                   "fp8_gemm_tflops" if fp8 else "bf16_gemm_tflops", init, peers.train_step(model, opt))


def _mtjax_variant(config: Any, fp8: bool) -> Variant:
    from mtjax import fp8 as mtjax_fp8
    from mtjax.models import GPT

    model = GPT(config)
    opt = optimizer()

    def init(tokens):
        with mtjax_fp8.fp8_autocast(enabled=fp8):
            variables = jax.jit(model.init)(jax.random.key(0), tokens)
        params = variables["params"]
        return params, dict(variables.get(mtjax_fp8.FP8_COLLECTION, {})), jax.jit(opt.init)(params)

    def loss_fn(variables, inputs, targets):
        with mtjax_fp8.fp8_autocast(enabled=fp8):
            logits = model.apply(variables, inputs)
        return peers.cross_entropy(logits, targets)

    def step(state, batch):
        params, meta, opt_state = state
        variables = {"params": params, mtjax_fp8.FP8_COLLECTION: meta} if meta else {"params": params}
        loss, grads = jax.value_and_grad(loss_fn)(variables, *batch)
        param_grads, new_meta = mtjax_fp8.split_gradients(grads)
        updates, opt_state = opt.update(param_grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_meta, opt_state), loss

    return Variant("mtjax fp8" if fp8 else "mtjax", "flax fp8" if fp8 else "flax",
                   "fp8_gemm_tflops" if fp8 else "bf16_gemm_tflops", init, jax.jit(step, donate_argnums=0))


def variants(config: Any) -> list[Variant]:
    return [_mtjax_variant(config, False), _mtjax_variant(config, True),
            _flax_variant(config, False), _flax_variant(config, True)]


def _batches(vocab_size: int, batch: int, seq: int, count: int = 2) -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(jax.random.key(42), count)
    out = []
    for key in keys:
        tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab_size, dtype=jnp.int32)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _compile_all(todo: Sequence[Variant], batch: tuple[jax.Array, jax.Array]) -> list[tuple[Any, float]]:
    """``(compiled step, seconds)`` for each variant, compiled concurrently from abstract states."""

    def compile_one(variant):
        start = time.perf_counter()
        state = jax.eval_shape(variant.init, batch[0])
        compiled = variant.step.lower(state, batch).compile()
        return compiled, time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(todo)) as pool:
        return list(pool.map(compile_one, todo))


def run(quick: bool, presets: Sequence[str] | None = None, profile_dir: str | None = None) -> list[dict]:
    """Rows for each preset and variant (see the module docstring)."""
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
        todo = variants(config)
        compiled = _compile_all(todo, batches[0])
        name = f"{preset} b{batch_size} s{seq_len}"
        times = {}
        for variant, (step, compile_s) in zip(todo, compiled):
            state = variant.init(batches[0][0])
            t, (state, loss) = timing.measure_steps(step, state, batches, warmup=2, runs=3 if quick else 10)
            times[variant.implementation] = t.median
            extra = {"tokens_per_s": tokens_per_step / t.median, "batch": batch_size, "seq_len": seq_len,
                     "params": config.num_params(), "loss": float(loss), "compile_s": compile_s}
            if variant.implementation == "mtjax fp8":
                extra["speedup_vs_mtjax_bf16"] = times["mtjax"] / t.median
            if profile_dir is not None:
                label = f"{preset}_{variant.implementation.replace(' ', '_')}"
                holder = [state]

                def once(holder=holder, step=step):
                    holder[0], loss = step(holder[0], batches[0])
                    return loss

                # A profiler that cannot attach (no CUPTI in a VM) must not cost the measurements.
                try:
                    summary = profile.profile(once, out_dir=profile_dir, label=label)
                    extra["profile_ms"] = summary["by_category_ms"]
                    print(profile.format_summary(label, summary), file=sys.stderr, flush=True)
                except Exception as err:  # noqa: BLE001
                    extra["profile_error"] = repr(err)
                state = holder[0]
            del state
            rows.append(timing.row("train", name, variant.implementation, t, flops=flops, peer=variant.peer,
                                   ceiling=variant.ceiling, **extra))
    return rows
