"""The train and eval steps: jitted, sharded, donating the state; gradient accumulation; metrics.

``make_train_step`` returns ``step(state, batch) -> (state, metrics)`` where ``batch`` is
``{"inputs": int32[batch, seq], "targets": int32[batch, seq]}`` (global arrays when sharded) and
``metrics`` holds device scalars ``loss``, ``grad_norm`` and ``learning_rate`` (and for a
mixture-of-experts model the auxiliary losses and expert loads of `mtjax.flax.moe_metrics`; ``loss``
stays the task loss, the gradient is that of ``loss + moe_aux_loss``; ``skipped``, 1
where a non-finite loss or gradient norm made the step skip its update, with ``skip_nonfinite``;
``fp8_amax_jump``, `mtjax.fp8.amax_jump` of the new FP8 meta, when the state carries one).
Token ids are checked against the vocabulary: host (numpy) batches on every call, device arrays
inside the step with ``debug_checks`` (`jax.experimental.checkify`). Wall-clock figures
(tokens/s, model TFLOP/s, MFU) are computed on the host by `throughput`, since they need the time
between steps, which the jitted step cannot see.

FP8: the step traces whatever `mtjax.fp8.fp8_autocast` is in force when it is first called. The
next FP8 meta rides on the gradient (see `mtjax.fp8`): `mtjax.fp8.Optimizer` applies the parameter
gradients and replaces the meta, and micro-batches are combined with `accumulate_gradients`, which sums
parameter gradients but combines amaxes by max (summing them would be wrong). Forward amaxes then
equal those of one un-split batch; gradient amaxes are ``grad_accum_steps`` times larger, because
each micro-batch's loss is a mean over its own rows: they are the amaxes of the gradients that the
micro-batches' backward passes actually quantize.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.experimental import checkify
from jax.sharding import Mesh

from mtjax import axes, fp8, ops
from mtjax.config import config as mtjax_config
from mtjax.flax import MOE_LOSSES, MOE_METRICS, moe_aux_loss, moe_metrics
from mtjax.sharding import LogicalRules, jit_sharded
from mtjax.train.state import TrainState, batch_sharding, cast_like

Batch = Mapping[str, jax.Array]
LossFn = Callable[[jax.Array, Batch], jax.Array]
# batch -> the model's keyword arguments (``model.apply(variables, **model_inputs(batch), ...)``).
ModelInputs = Callable[[Batch], dict[str, jax.Array]]
# (logits, batch) -> scalar metrics an evaluation reports beside the loss (e.g. accuracy).
MetricsFn = Callable[[jax.Array, Batch], dict[str, jax.Array]]
# The batch entries holding token ids (checked against the vocabulary).
TOKEN_KEYS = ("inputs", "targets", "encoder_inputs")


def weighted_mean(values: jax.Array, batch: Batch) -> jax.Array:
    """Mean of ``values [batch, seq]``, weighted by ``batch["weights"]`` when the batch has them (0 on
    padding) and plain otherwise."""
    if "weights" not in batch:
        return values.mean()
    weights = batch["weights"].astype(jnp.float32)
    return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def next_token_loss(logits: jax.Array, batch: Batch) -> jax.Array:
    """Mean cross-entropy of ``logits [batch, seq, vocab]`` against ``batch["targets"]``, in f32;
    weighted by ``batch["weights"] [batch, seq]`` where present (0: padding, left out)."""
    return weighted_mean(ops.softmax_cross_entropy(logits, batch["targets"]), batch)


def classification_loss(logits: jax.Array, batch: Batch) -> jax.Array:
    """Mean cross-entropy of ``logits [batch, classes]`` against ``batch["labels"] [batch]``, in f32."""
    return ops.softmax_cross_entropy(logits, batch["labels"]).mean()


def apply_model(model: nn.Module, variables: Any, batch: Batch, model_inputs: ModelInputs | None,
                **kwargs: Any) -> Any:
    """``model.apply`` on a batch: ``batch["inputs"]`` as the one positional argument (the language
    models), or the keyword arguments ``model_inputs(batch)``."""
    if model_inputs is None:
        return model.apply(variables, batch["inputs"], **kwargs)
    return model.apply(variables, **model_inputs(batch), **kwargs)


def _micro_batches(batch: Batch, count: int) -> Batch:
    """``[batch, ...] -> [count, batch / count, ...]``, micro-batch ``i`` taking rows ``i, i + count, ...``.

    Strided rather than contiguous rows, so each device's share of the (data-parallel) batch
    contributes to every micro-batch and no device sits idle during one.
    """
    def split(x: jax.Array) -> jax.Array:
        if x.shape[0] % count:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by grad_accum_steps={count}")
        x = x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)
        return nn.with_logical_constraint(x, (None, axes.ACTIVATION_BATCH) + (None,) * (x.ndim - 2))

    return jax.tree.map(split, dict(batch))


def model_vocab_size(model: nn.Module) -> int | None:
    """``model.config.vocab_size`` or ``model.vocab_size``, whichever the model has (None: neither)."""
    for owner in (getattr(model, "config", None), model):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int):
            return size
    return None


def check_token_ids(batch: Batch, vocab_size: int) -> None:
    """Raise ValueError if a host (numpy) array of ``batch`` holds an id outside ``[0, vocab_size)``.

    Device arrays are left alone (reading them would wait for the device); the train step's
    ``debug_checks`` checks those.
    """
    for name in TOKEN_KEYS:
        ids = batch.get(name)
        if not isinstance(ids, np.ndarray) or ids.size == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"batch[{name!r}] holds token id {bad}, outside [0, vocab_size={vocab_size}) of the "
                             "model: the tokenizer's vocabulary does not fit the model's")


def _debug_check_token_ids(batch: Batch, vocab_size: int) -> None:
    for name in TOKEN_KEYS:
        if name in batch:
            ids = batch[name]
            checkify.check(jnp.all((ids >= 0) & (ids < vocab_size)),
                           f"batch[{name!r}] holds a token id outside [0, vocab_size={vocab_size}): "
                           "min {low}, max {high}", low=jnp.min(ids), high=jnp.max(ids))


def _check_sharding_args(owner: str, mesh: Mesh | None, rules: LogicalRules | None,
                         state_sharding: TrainState | None) -> None:
    if (mesh is None) != (rules is None) or (mesh is not None and state_sharding is None):
        raise ValueError(f"{owner}: pass mesh, rules and state_sharding together (or none of them)")


def make_train_step(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn = next_token_loss,
    *,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    state_sharding: TrainState | None = None,
    grad_accum_steps: int = 1,
    learning_rate: optax.ScalarOrSchedule | None = None,
    donate: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
    expert_bias_update_rate: float | None = None,
    skip_nonfinite: bool = False,
    vocab_size: int | None = None,
    debug_checks: bool | None = None,
    model_inputs: ModelInputs | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """A jitted ``step(state, batch) -> (state, metrics)``.

    Args:
      model: a linen module called as ``model(inputs [batch, seq] int32, deterministic=False)``
        returning logits (or with the keyword arguments ``model_inputs(batch)``); dropout draws
        from the ``"dropout"`` rng.
      optimizer: the optax transformation (clipping and schedules included, e.g. from `make_optimizer`).
      loss_fn: ``loss_fn(logits, batch) -> scalar``; default `next_token_loss`.
      mesh, rules: run sharded on ``mesh`` with the logical-axis ``rules``; then ``state_sharding``
        (the shardings of the state, ``mtjax.sharding.tree_shardings(abstract_state)``) is required.
      grad_accum_steps: split each batch into this many micro-batches, run one after the other.
      learning_rate: the optimizer's learning rate or schedule, reported as ``metrics["learning_rate"]``.
      donate: donate the input state's buffers (the caller must not reuse the old state).
      compiler_options: XLA options for the step's compilation, e.g. `mtjax.fp8.compiler_options()`
        for a step traced under `fp8_autocast`.
      expert_bias_update_rate: after each step, every `mtjax.flax.MoEBlock`'s ``expert_bias`` moves
        by this much towards balance: ``+rate`` for experts with less than an even share of the
        step's routed tokens, ``-rate`` for those with more (DeepSeek-V3's auxiliary-loss-free
        balancing); 0: left alone. Default: the model config's ``expert_bias_update_rate`` when its
        ``use_expert_bias`` is set, else 0.

    The model's auxiliary losses (the ``MOE_LOSSES`` collection a `mtjax.flax.MoEBlock` sows,
    already weighted) are added to ``loss_fn``'s loss before differentiating.
      skip_nonfinite: when the loss or the gradient norm is NaN or Inf, keep the parameters,
        optimizer state and FP8 meta as they were (the step counter and RNG still advance) and
        report ``metrics["skipped"] = 1``; the caller counts and decides when to give up. Without
        it a non-finite step updates the state like any other: the caller stops on it.
      vocab_size: token ids must be in ``[0, vocab_size)`` (default: the model's
        ``config.vocab_size`` or ``vocab_size``); numpy batches are checked on every call.
      debug_checks: also check device batches, inside the jitted step (`jax.experimental.checkify`;
        each call then waits for its step). Default: ``mtjax.config.debug_checks``.
      model_inputs: ``batch -> {argument: array}``, the model's inputs (`apply_model`); None:
        ``batch["inputs"]``, positionally.

    Raises (from the returned step):
      ValueError: a token id outside ``[0, vocab_size)``.
    """
    if expert_bias_update_rate is None:
        config = getattr(model, "config", None)
        expert_bias_update_rate = (getattr(config, "expert_bias_update_rate", 0.0)
                                   if getattr(config, "use_expert_bias", False) else 0.0)
    if not expert_bias_update_rate >= 0:
        raise ValueError(f"make_train_step(expert_bias_update_rate={expert_bias_update_rate!r}): expected >= 0")
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"make_train_step(grad_accum_steps={grad_accum_steps!r}): expected a positive int")
    _check_sharding_args("make_train_step", mesh, rules, state_sharding)
    vocab_size = model_vocab_size(model) if vocab_size is None else vocab_size
    debug_checks = mtjax_config.debug_checks if debug_checks is None else debug_checks
    # The optimizer updates the parameters; the FP8 meta on the gradients replaces the old meta.
    fp8_optimizer = fp8.Optimizer(optimizer, collection="params")

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        if debug_checks and vocab_size is not None:
            _debug_check_token_ids(batch, vocab_size)

        def grads_of(variables: dict[str, Any], batch: Batch, rng: jax.Array) -> tuple[Any, Any]:
            def loss_of(variables: dict[str, Any]) -> tuple[jax.Array, Any]:
                logits, sown = apply_model(model, variables, batch, model_inputs, deterministic=False,
                                           rngs={"dropout": rng}, mutable=[MOE_LOSSES, MOE_METRICS])
                loss = loss_fn(logits, batch)
                losses, metrics = sown.get(MOE_LOSSES, {}), sown.get(MOE_METRICS, {})
                return loss + moe_aux_loss(losses), (loss, moe_metrics(metrics, losses), metrics)

            (_, (loss, aux, sown)), grads = jax.value_and_grad(loss_of, has_aux=True)(variables)
            # Gradients of a compute_params copy come in its dtype: the master weights' dtype is what
            # micro-batches accumulate in and what the optimizer reads (the cast fuses into its update).
            grads["params"] = jax.tree.map(lambda g, p: g.astype(p.dtype), grads["params"], state.params)
            return (loss, aux, _expert_loads(sown)), grads

        rng, step_rng = jax.random.split(state.rng)
        variables = state.variables()
        if grad_accum_steps == 1:
            (loss, aux, loads), grads = grads_of(variables, batch, step_rng)
        else:
            micro = _micro_batches(batch, grad_accum_steps)
            rngs = jax.random.split(step_rng, grad_accum_steps)
            first_out, first_grads = grads_of(variables, jax.tree.map(lambda x: x[0], micro), rngs[0])

            def accumulate(carry, xs):
                out_sum, acc = carry
                out, grads = grads_of(variables, xs[0], xs[1])
                return (jax.tree.map(jnp.add, out_sum, out), fp8.accumulate_gradients(acc, grads)), None

            rest = (jax.tree.map(lambda x: x[1:], micro), rngs[1:])
            (out_sum, acc), _ = jax.lax.scan(
                accumulate, (first_out, fp8.accumulate_gradients(None, first_grads)), rest)
            # Means over the micro-batches (the max / min loads become means of the per-micro-batch ones).
            loss, aux, loads = jax.tree.map(lambda x: x / grad_accum_steps, out_sum)
            grads = fp8.finalize_accumulated(acc, grad_accum_steps)
        master = {"params": state.params, **({fp8.FP8_COLLECTION: state.fp8_meta} if state.fp8_meta else {})}
        applied, opt_state = fp8_optimizer.apply_gradients(master, grads, state.opt_state)
        params = applied["params"]
        param_grads = fp8.split_gradients(grads)[0]["params"]
        if expert_bias_update_rate:
            params = _update_expert_biases(params, loads, expert_bias_update_rate)
        grad_norm = optax.tree.norm(param_grads)
        updated = dict(
            params=params,
            compute_params=None if state.compute_params is None else cast_like(params, state.compute_params),
            fp8_meta=applied.get(fp8.FP8_COLLECTION, state.fp8_meta),
            opt_state=opt_state,
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, **aux}
        if state.fp8_meta:  # the newest amaxes against their histories: one scalar for the host to watch
            metrics["fp8_amax_jump"] = fp8.amax_jump(applied[fp8.FP8_COLLECTION])
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            kept = {name: getattr(state, name) for name in updated}
            updated = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, kept)
            metrics["skipped"] = (~finite).astype(jnp.int32)
        new_state = state.replace(step=state.step + 1, rng=rng, **updated)
        if learning_rate is not None:
            metrics["learning_rate"] = (learning_rate(state.step) if callable(learning_rate)
                                        else jnp.asarray(learning_rate, jnp.float32))
        return new_state, metrics

    jit_kwargs = dict(donate_argnums=(0,) if donate else (), compiler_options=dict(compiler_options or {}) or None)
    traced = checkify.checkify(step, errors=checkify.user_checks) if debug_checks else step
    if mesh is None:
        jitted = jax.jit(traced, **jit_kwargs)
    else:
        outputs = (state_sharding, None)
        jitted = jit_sharded(traced, mesh=mesh, rules=rules, **jit_kwargs,
                             in_shardings=(state_sharding, batch_sharding(mesh, rules)),
                             out_shardings=(None, outputs) if debug_checks else outputs)

    def checked_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        if vocab_size is not None:
            check_token_ids(batch, vocab_size)
        if not debug_checks:
            return jitted(state, batch)
        error, result = jitted(state, batch)
        try:
            error.throw()
        except checkify.JaxRuntimeError as err:
            raise ValueError(str(err).splitlines()[0]) from None
        return result

    # The jitted function's ahead-of-time API (``step.lower(state, batch).compile()``), as `jax.jit` has it.
    checked_step.lower = jitted.lower
    return checked_step


def _expert_loads(sown: Any) -> dict[tuple[str, ...], jax.Array]:
    """``{module path: expert_load}`` of every MoE block in a ``MOE_METRICS`` collection."""
    flat = traverse_util.flatten_dict(dict(sown)) if sown else {}
    return {path[:-1]: sum(value) for path, value in flat.items() if path[-1] == "expert_load"}


def _update_expert_biases(params: Any, loads: Mapping[tuple[str, ...], jax.Array], rate: float) -> Any:
    """Each ``expert_bias`` moved by `mtjax.ops.update_expert_bias` from its block's expert loads
    (a scanned stack's ``[layers, experts]`` biases layer by layer)."""
    flat = traverse_util.flatten_dict(params)
    for path, bias in flat.items():
        if path[-1] == "expert_bias" and path[:-1] in loads:
            experts = bias.shape[-1]
            load = loads[path[:-1]].reshape(-1, experts)
            new = jax.vmap(lambda b, c: ops.update_expert_bias(b, c, rate))(bias.reshape(-1, experts), load)
            flat[path] = new.reshape(bias.shape).astype(bias.dtype)
    return traverse_util.unflatten_dict(flat)


def make_eval_step(
    model: nn.Module,
    loss_fn: LossFn = next_token_loss,
    *,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    state_sharding: TrainState | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    model_inputs: ModelInputs | None = None,
    metrics_fn: MetricsFn | None = None,
) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
    """A jitted ``eval_step(state, batch) -> {"loss": scalar, **metrics_fn(logits, batch)}`` (no
    dropout, state untouched); the other arguments as `make_train_step`'s."""
    _check_sharding_args("make_eval_step", mesh, rules, state_sharding)

    def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
        logits = apply_model(model, state.variables(), batch, model_inputs, deterministic=True)
        return {"loss": loss_fn(logits, batch), **(metrics_fn(logits, batch) if metrics_fn else {})}

    options = dict(compiler_options or {}) or None
    if mesh is None:
        return jax.jit(eval_step, compiler_options=options)
    return jit_sharded(eval_step, mesh=mesh, rules=rules, compiler_options=options,
                       in_shardings=(state_sharding, batch_sharding(mesh, rules)), out_shardings=None)


# Parameter names of `mtjax.flax`'s norms (and biases, any name ending in "bias"): no weight decay.
NORM_PARAM_NAMES = ("scale", "ln_bias")


def decays(path: tuple, param: jax.Array) -> bool:
    """Whether `make_optimizer` decays the parameter at ``path`` (a key path): a matrix that is
    neither a norm parameter nor a bias."""
    name = str(getattr(path[-1], "key", path[-1])) if path else ""
    return param.ndim >= 2 and name not in NORM_PARAM_NAMES and not name.endswith("bias")


def make_optimizer(
    learning_rate: float,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    min_learning_rate_ratio: float = 0.1,
    weight_decay: float = 0.1,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with global-norm clipping and linear warmup then cosine decay; returns (optimizer, schedule).

    Weight decay applies to matrices only, not to biases and norm scales (the GPT-2/3 convention):
    by name (`decays`), since a scanned stack's stacked norm scales are matrices by shape.
    """
    if not 0 < learning_rate < float("inf") or not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"make_optimizer(learning_rate={learning_rate}, total_steps={total_steps}, "
            f"warmup_steps={warmup_steps}): expected a finite learning_rate > 0 and 0 <= warmup_steps < total_steps"
        )
    if not 0 <= weight_decay < float("inf"):
        raise ValueError(f"make_optimizer(weight_decay={weight_decay}): expected a finite number >= 0")
    if clip_norm is not None and not 0 <= clip_norm < float("inf"):
        raise ValueError(f"make_optimizer(clip_norm={clip_norm}): expected a finite number >= 0 "
                         "(0 or None: no clipping)")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=total_steps, end_value=learning_rate * min_learning_rate_ratio)
    adamw = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay,
                        mask=lambda params: jax.tree_util.tree_map_with_path(decays, params))
    chain = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    return optax.chain(*chain, adamw), schedule


def throughput(tokens: int, seconds: float, *, flops_per_token: float | None = None,
               num_devices: int = 1, peak_tflops: float | None = None) -> dict[str, float]:
    """Wall-clock metrics of ``tokens`` trained in ``seconds``.

    Returns ``tokens_per_s``; with ``flops_per_token`` (the model's training FLOPs per token, e.g.
    ``config.flops_per_token(seq_len)``) also ``model_tflops`` per device, and with ``peak_tflops``
    (one device's peak) ``mfu``, the fraction of that peak.
    """
    metrics = {"tokens_per_s": tokens / seconds}
    if flops_per_token:
        tflops = tokens * flops_per_token / seconds / num_devices / 1e12
        metrics["model_tflops"] = tflops
        if peak_tflops:
            metrics["mfu"] = tflops / peak_tflops
    return metrics
