"""The train step: learning, metrics, gradient accumulation, sharding, the eval step, bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import meta

from mtjax.fp8 import DelayedScaling, fp8_autocast
from mtjax.models import GPT, gpt_config
from mtjax.sharding import MeshConfig, logical_axis_rules
from mtjax.train.data import PackedDataset
from mtjax.train.state import abstract_train_state, init_train_state
from mtjax.train.step import decays, make_eval_step, make_optimizer, make_train_step, throughput
from tests.train.tiny_lm import TinyLM

pytestmark = pytest.mark.usefixtures("fast_compiles")

BATCH, SEQ = 8, 16


@pytest.fixture(scope="module")
def batches():
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, np.uint8).astype(np.int32)
    data = PackedDataset(text, SEQ, seed=0)
    batches = data.batches(BATCH)
    return [batches[i] for i in range(6)]


def _run(model, optimizer, batches, steps, compute_dtype=None, **step_kwargs):
    mesh = step_kwargs.get("mesh")
    rules = step_kwargs.get("rules")
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ), mesh=mesh, rules=rules,
                             compute_dtype=compute_dtype)
    if mesh is not None:
        abstract = abstract_train_state(model, optimizer, (BATCH, SEQ), mesh=mesh, rules=rules,
                                        compute_dtype=compute_dtype)
        step_kwargs["state_sharding"] = jax.tree.map(lambda a: a.sharding, abstract)
    train_step = make_train_step(model, optimizer, **step_kwargs)
    metrics = []
    for batch in batches[:steps]:
        state, m = train_step(state, batch)
        metrics.append(jax.device_get(m))
    return state, metrics


def test_loss_falls_and_metrics_are_reported(batches):
    optimizer, schedule = make_optimizer(3e-2, total_steps=6, warmup_steps=2)
    state, metrics = _run(TinyLM(), optimizer, batches, 6, learning_rate=schedule)
    losses = [float(m["loss"]) for m in metrics]
    assert losses[-1] < losses[0] - 0.5, losses
    assert [float(m["learning_rate"]) for m in metrics] == pytest.approx([float(schedule(i)) for i in range(6)])
    assert all(float(m["grad_norm"]) > 0 for m in metrics)
    assert int(state.step) == 6 and state.fp8_meta == {}


@pytest.fixture(scope="module")
def reference(batches):
    """Three steps without dropout on one device, without accumulation: what the variants must match."""
    return _run(TinyLM(dropout_rate=0.0), optax.adam(1e-2), batches, 3)


def _assert_matches(run, reference):
    (state, metrics), (ref_state, ref_metrics) = run, reference
    np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), state.params, ref_state.params)


def test_gradient_accumulation_matches_the_full_batch(batches, reference):
    _assert_matches(_run(TinyLM(dropout_rate=0.0), optax.adam(1e-2), batches, 3, grad_accum_steps=4), reference)


def test_sharded_step_matches_one_device(batches, reference):
    config = MeshConfig(dp=4, tp=2)
    run = _run(TinyLM(dropout_rate=0.0), optax.adam(1e-2), batches, 3, mesh=config.make_mesh(),
               rules=logical_axis_rules(config), grad_accum_steps=2)
    assert run[0].params["w1"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    _assert_matches(run, reference)


def test_compute_copy_of_the_weights_changes_no_number(batches):
    """A bf16 GPT reading the state's bf16 copy of its weights computes what it computes from the f32
    master weights (its modules cast them to bf16 themselves): same losses, same updated master
    weights; the copy tracks them (matrices only) and is sharded like them."""
    model = GPT(gpt_config("tiny", vocab_size=264, dtype=jnp.bfloat16, tie_embeddings=False))
    # Plain SGD: the update is the gradient times the rate, so the two programs' updates differ by no
    # more than their gradients do (Adam divides by a gradient's own running size and can turn a
    # rounding-sized change of a near-zero gradient into a large one of its update).
    optimizer = optax.sgd(1.0)
    plain, plain_metrics = _run(model, optimizer, batches, 3)
    assert plain.compute_params is None
    state, metrics = _run(model, optimizer, batches, 3, compute_dtype=jnp.bfloat16)
    assert [m["loss"] for m in metrics] == [m["loss"] for m in plain_metrics]
    # The updates agree to 1e-6: the two programs' weight gradients may differ in where XLA rounds a
    # GEMM's float32 result (the gradient's bf16 dtype now reaches the update).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), state.params, plain.params)
    optimizer = optax.adam(1e-2)
    copy = state.compute_params
    assert copy["token_embed"]["embedding"].dtype == copy["logits_dense"]["kernel"].dtype == jnp.bfloat16
    assert copy["final_norm"]["scale"].dtype == jnp.float32  # vectors stay as they are
    assert copy["layers"]["mlp"]["scale"].dtype == jnp.float32  # a scanned stack's norm scales too
    jax.tree.map(lambda c, p: np.testing.assert_array_equal(c, p.astype(c.dtype)), copy, state.params)

    # A weight used twice (TinyLM's tied embedding) has its two bf16 gradient terms summed in bf16,
    # not float32: close, not equal.
    model = TinyLM(dtype=jnp.bfloat16, dropout_rate=0.0)
    tied_plain, tied_plain_metrics = _run(model, optimizer, batches, 3)
    tied, tied_metrics = _run(model, optimizer, batches, 3, compute_dtype=jnp.bfloat16)
    np.testing.assert_allclose([m["loss"] for m in tied_metrics], [m["loss"] for m in tied_plain_metrics], rtol=1e-3)
    # Adam turns a rounding-sized change of a near-zero gradient into up to one step (lr = 1e-2) for
    # a few rarely seen tokens' rows; on average the weights agree far below that.
    for a, b in zip(jax.tree.leaves(tied.params), jax.tree.leaves(tied_plain.params)):
        assert np.mean(np.abs(np.asarray(a) - np.asarray(b))) < 1e-4
    # Sharded, with micro-batches: the copy is laid out as its master weights.
    config = MeshConfig(dp=4, tp=2)
    sharded, _ = _run(model, optimizer, batches, 2, compute_dtype=jnp.bfloat16, mesh=config.make_mesh(),
                      rules=logical_axis_rules(config), grad_accum_steps=2)
    jax.tree.map(lambda c, p: c.sharding == p.sharding or pytest.fail(f"{c.sharding} != {p.sharding}"),
                 sharded.compute_params, sharded.params)


def test_fp8_meta_is_updated_and_accumulated_by_max(batches):
    model, optimizer = TinyLM(dropout_rate=0.0), optax.adam(1e-2)
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=4)):
        initial = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
        assert initial.fp8_meta, "fp8_autocast should create the DotGeneral's meta"
        results = [make_train_step(model, optimizer, grad_accum_steps=n, donate=False)(initial, batches[0])
                   for n in (1, 4)]
    (full, full_metrics), (accumulated, accumulated_metrics) = results
    history = lambda s: s.fp8_meta["DotGeneral_0"]["input_amax_history"]
    assert float(history(full)[0]) > 0 and not np.array_equal(history(full), history(initial))
    # Forward amaxes: the amax of the whole batch is the max over its micro-batches, so combining
    # by max gives the full batch's meta exactly. Gradient amaxes are 4x the full batch's: each
    # micro-batch's loss is a mean over a quarter of the rows, so its output gradients are 4x larger.
    meta, full_meta = accumulated.fp8_meta["DotGeneral_0"], full.fp8_meta["DotGeneral_0"]
    for name in ("input_amax_history", "input_scale", "kernel_amax_history", "kernel_scale"):
        np.testing.assert_array_equal(meta[name], full_meta[name])
    np.testing.assert_allclose(meta["output_grad_amax_history"], 4 * full_meta["output_grad_amax_history"], rtol=1e-6)
    np.testing.assert_allclose(accumulated_metrics["loss"], full_metrics["loss"], rtol=1e-5)


def test_eval_step_is_deterministic_and_leaves_state(batches):
    model, optimizer = TinyLM(), optax.adam(1e-2)
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
    eval_step = make_eval_step(model)
    first, second = eval_step(state, batches[0]), eval_step(state, batches[0])
    assert float(first["loss"]) == float(second["loss"]) > 0
    assert int(state.step) == 0


def test_bad_arguments():
    model, optimizer = TinyLM(), optax.adam(1e-2)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        make_train_step(model, optimizer, grad_accum_steps=0)
    mesh = MeshConfig(dp=8).make_mesh()
    with pytest.raises(ValueError, match="state_sharding"):
        make_train_step(model, optimizer, mesh=mesh, rules=logical_axis_rules(MeshConfig(dp=8)))
    with pytest.raises(ValueError, match="warmup_steps"):
        make_optimizer(1e-3, total_steps=10, warmup_steps=20)
    with pytest.raises(ValueError, match="learning_rate"):
        make_optimizer(0.0, total_steps=10)
    with pytest.raises(ValueError, match="compute_dtype"):  # TinyLM computes in float32
        init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ), compute_dtype=jnp.bfloat16)


def test_weight_decay_skips_norm_scales_and_biases_even_when_stacked():
    """A scanned GPT stacks its norm scales into [layers, hidden] matrices: they still get no decay."""
    model = GPT(gpt_config("tiny", vocab_size=264, use_bias=True))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    decayed = jax.tree_util.tree_map_with_path(decays, meta.unbox(params))
    assert decayed["layers"]["mlp"]["wi_kernel"] and decayed["token_embed"]["embedding"]
    assert not decayed["layers"]["mlp"]["scale"] and not decayed["layers"]["mlp"]["wi_bias"]
    assert not decayed["final_norm"]["scale"] and not decayed["layers"]["self_attention"]["query"]["bias"]


def test_throughput_figures():
    assert throughput(1000, 2.0) == {"tokens_per_s": 500.0}
    metrics = throughput(1000, 2.0, flops_per_token=6e9, num_devices=2, peak_tflops=1.0)
    assert metrics["model_tflops"] == pytest.approx(1.5) and metrics["mfu"] == pytest.approx(1.5)


def test_a_nonfinite_step_is_skipped_when_asked(batches):
    """Defect 1 (issue 27): with skip_nonfinite a NaN loss leaves params and optimizer state as they were."""
    model, optimizer = TinyLM(), optax.adam(1e-2)
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
    before = jax.device_get(state)
    nan_loss = lambda logits, batch: jnp.nan * jnp.mean(logits)  # noqa: E731
    step = make_train_step(model, optimizer, nan_loss, skip_nonfinite=True, donate=False)
    after, metrics = step(state, batches[0])
    assert int(metrics["skipped"]) == 1 and int(after.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((after.params, after.opt_state)),
                 (before.params, before.opt_state))
    _, metrics = make_train_step(model, optimizer, skip_nonfinite=True)(state, batches[0])
    assert int(metrics["skipped"]) == 0


def test_token_ids_outside_the_vocabulary_are_refused(batches):
    """Issue 19 item 6 / issue 27 defect 5: ids outside [0, vocab_size) raise, naming both."""
    model, optimizer = TinyLM(vocab_size=64), optax.adam(1e-2)
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
    step = make_train_step(model, optimizer, donate=False)
    for bad in (64, -1):
        batch = {**batches[0], "inputs": np.where(np.arange(SEQ) == 3, bad, batches[0]["inputs"] % 64)}
        with pytest.raises(ValueError, match=rf"token id {bad}, outside \[0, vocab_size=64\)"):
            step(state, batch)
    ok = jax.tree.map(lambda x: jnp.asarray(x % 64), batches[0])
    device_batch = {**ok, "targets": ok["targets"] + 64}
    checked = make_train_step(model, optimizer, donate=False, debug_checks=True)
    with pytest.raises(ValueError, match=r"batch\['targets'\] holds a token id outside \[0, vocab_size=64\)"):
        checked(state, device_batch)
    _, metrics = checked(state, ok)
    assert np.isfinite(float(metrics["loss"]))


def test_make_optimizer_rejects_nonfinite_settings():
    """Defect 1: --weight-decay nan / -5 were accepted."""
    for kwargs in (dict(weight_decay=float("nan")), dict(weight_decay=-5.0), dict(learning_rate=float("inf")),
                   dict(clip_norm=float("nan"))):
        with pytest.raises(ValueError, match="make_optimizer"):
            make_optimizer(**{"learning_rate": 1e-3, "total_steps": 10, **kwargs})


def test_an_fp8_amax_jump_is_reported(batches):
    """Issue 27 defect 5: one huge amax shrinks a delayed scale for the whole history, unannounced."""
    model, optimizer = TinyLM(dropout_rate=0.0), optax.sgd(0.0)
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=4)):
        state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
        step = make_train_step(model, optimizer, donate=False)
        state, first = step(state, batches[0])
        state, second = step(state, batches[1])
        outlier = state.replace(params={**state.params, "w1": state.params["w1"] * 1e5})
        _, jumped = step(outlier, batches[2])
    assert float(first["fp8_amax_jump"]) == 0.0  # no earlier amax yet
    assert float(second["fp8_amax_jump"]) < 10
    assert float(jumped["fp8_amax_jump"]) >= 1e4  # the kernel's amax
