"""Expert parallelism on the 8 CPU devices: the all-to-all dispatch/combine and MoEBlock on ep meshes
against the single-device block (loss and gradients), with dp/fsdp/tp beside ep."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtjax import fp8
from mtjax.flax import MOE_LOSSES, MOE_METRICS, MoEBlock, moe_aux_loss
from mtjax.sharding import MeshConfig, expert, logical_axis_rules, shard_variables, use_mesh

pytestmark = pytest.mark.usefixtures("fast_compiles")


def test_rules_split_experts_and_batch_over_ep():
    rules = dict(logical_axis_rules(MeshConfig(dp=2, ep=4)))
    assert rules["expert"] == "ep"
    assert rules["activation_batch"] == ("dp", "fsdp", "ep")
    assert dict(logical_axis_rules(MeshConfig(dp=8)))["activation_batch"] == ("dp", "fsdp")
    with pytest.raises(ValueError, match="ep=0"):
        MeshConfig(ep=0)


def _routed_rows(key, ep, rows, hidden, local_experts):
    """Per device: rows sorted by a random expert choice (some experts empty) and their group sizes."""
    experts = jax.random.randint(key, (ep, rows), 0, ep * local_experts)
    experts = jnp.sort(jnp.where(experts % 3 == 1, 0, experts), axis=1)   # skewed: expert 0 gets a third
    sizes = jax.vmap(lambda e: jnp.bincount(e, length=ep * local_experts))(experts).astype(jnp.int32)
    x = jax.random.normal(jax.random.fold_in(key, 1), (ep, rows, hidden))
    return x, experts, sizes


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_dispatch_combine_round_trip(capacity_factor):
    ep, rows, hidden, local = 8, 24, 4, 2
    x, experts, sizes = _routed_rows(jax.random.PRNGKey(0), ep, rows, hidden, local)
    capacity = expert.capacity(rows, ep, capacity_factor)
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x, sizes):
        x_local, local_sizes, state = expert.dispatch(x[0], sizes[0], axis_name="ep", capacity=capacity)
        # "Experts": scale rows by (global expert id + 1), so a row that came back from the wrong expert shows.
        first = jax.lax.axis_index("ep") * local
        ends = jnp.cumsum(local_sizes)
        row_expert = jnp.searchsorted(ends, jnp.arange(x_local.shape[0]), side="right") + first
        y_local = x_local * (row_expert + 1)[:, None].astype(x_local.dtype)
        y = expert.combine(y_local, state, axis_name="ep", rows=rows)
        return y[None], local_sizes[None], state.dropped[None]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
    y, local_sizes, dropped = run(x, sizes)
    expected = x * (experts + 1)[..., None]
    if capacity_factor is None:
        # Each expert's device receives every source's rows of the expert.
        np.testing.assert_array_equal(local_sizes.reshape(-1), sizes.sum(0))
        np.testing.assert_allclose(y, expected, rtol=1e-6)
        assert int(dropped.sum()) == 0
    else:
        kept = np.any(np.asarray(y) != 0, axis=-1)
        np.testing.assert_allclose(np.asarray(y)[kept], np.asarray(expected)[kept], rtol=1e-6)
        assert int(dropped.sum()) == int((~kept).sum()) > 0
        assert int(local_sizes.sum()) == ep * rows - int(dropped.sum())


def test_capacity_bounds():
    assert expert.capacity(100, 4) == 100
    assert expert.capacity(100, 4, 1.0) == 32    # ceil(25) rounded up to 8
    assert expert.capacity(10, 2, 8.0) == 10     # never more than the rows
    with pytest.raises(ValueError, match="capacity_factor"):
        expert.capacity(10, 2, 0.0)


BLOCK = MoEBlock(num_experts=8, experts_per_token=2, expert_dim=16, num_shared_experts=1, router_z_loss_weight=1e-3,
                 activations=("silu", "linear"))


def _loss(block, params, x):
    (y, _), sown = block.apply({"params": params}, x, deterministic=True, mutable=[MOE_LOSSES, MOE_METRICS])
    return jnp.mean(y ** 2) + moe_aux_loss(sown[MOE_LOSSES]), sown[MOE_METRICS]


@functools.cache
def _single_device():
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 4, 32))
    variables = jax.jit(lambda x: BLOCK.init(jax.random.PRNGKey(1), x, deterministic=True))(x)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(functools.partial(_loss, BLOCK), has_aux=True))(
        nn.meta.unbox(variables["params"]), x)
    return x, {"params": variables["params"]}, loss, metrics, grads


@pytest.mark.parametrize("config, alignment", [(MeshConfig(ep=8), 1), (MeshConfig(dp=2, ep=2, tp=2), 1),
                                               (MeshConfig(fsdp=2, ep=4), 1), (MeshConfig(dp=2, ep=4), 8)],
                         ids=["ep8", "dp2-ep2-tp2", "fsdp2-ep4", "dp2-ep4-aligned"])
def test_moe_block_on_ep_mesh_equals_single_device(config, alignment):
    """The padded groups of ``expert_row_alignment`` change the layout, not the numbers."""
    x, variables, want_loss, want_metrics, want_grads = _single_device()
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    params = shard_variables(variables, mesh, rules)["params"]
    block = BLOCK.clone(expert_row_alignment=alignment)
    step = jax.jit(jax.value_and_grad(functools.partial(_loss, block), has_aux=True))
    with use_mesh(mesh, rules):
        (loss, metrics), grads = step(params, x)
        hlo = step.lower(params, x).compile().as_text()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["expert_load"][0], want_metrics["expert_load"][0], rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # The experts stay on their devices: dispatch and combine are all-to-alls over ep.
    assert "all-to-all" in hlo
    assert params["wi_kernel"].sharding.spec[0] == "ep"


def _delayed_loss(block, variables, x):
    (y, _), sown = block.apply(variables, x, deterministic=True, mutable=[MOE_LOSSES, MOE_METRICS])
    return jnp.mean(y ** 2) + moe_aux_loss(sown[MOE_LOSSES])


@pytest.mark.parametrize("config", [MeshConfig(ep=8), MeshConfig(dp=2, ep=2, tp=2)], ids=["ep8", "dp2-ep2-tp2"])
def test_delayed_scaling_on_ep_mesh_equals_single_device(config):
    """The grouped GEMMs' delayed-scaling state on an ep mesh: each device keeps its experts' kernel
    histories, the input and gradient amaxes are max-reduced over the devices, so the next state,
    the loss and the gradients are the single-device block's (second step: scales from a history)."""
    x, variables, *_ = _single_device()
    step = jax.jit(jax.value_and_grad(functools.partial(_delayed_loss, BLOCK)))
    with fp8.fp8_autocast(recipe=fp8.DelayedScaling(amax_history_len=4)):
        meta = jax.jit(lambda x: BLOCK.init(jax.random.PRNGKey(1), x, deterministic=True))(x)[fp8.FP8_COLLECTION]
        state = {"params": nn.meta.unbox(variables["params"]), fp8.FP8_COLLECTION: meta}
        _, grads = step(state, x)
        state[fp8.FP8_COLLECTION] = fp8.split_gradients(grads)[1]
        want_loss, want_grads = step(state, x)
        mesh, rules = config.make_mesh(), logical_axis_rules(config)
        sharded = shard_variables(state, mesh, rules)
        with use_mesh(mesh, rules):
            loss, grads = step(sharded, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _, want_meta = fp8.split_gradients(want_grads)
    assert float(want_meta["wi_fp8"]["kernel_amax_history"][:, 1].min()) > 0  # two steps rolled in
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_aligned_groups_with_a_capacity_drop_what_packed_ones_drop():
    """With a capacity factor each device pair's chunk holds the padded groups: aligned rows give the
    packed layout's loss, gradients and dropped fraction on an ep mesh."""
    config = MeshConfig(dp=2, ep=4)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    x, variables, *_ = _single_device()
    params = shard_variables(variables, mesh, rules)["params"]
    results = []
    for alignment in (1, 16):
        block = BLOCK.clone(capacity_factor=1.0, expert_row_alignment=alignment)
        with use_mesh(mesh, rules):
            results.append(jax.jit(jax.value_and_grad(functools.partial(_loss, block), has_aux=True))(params, x))
    ((loss, metrics), grads), ((loss16, metrics16), grads16) = results
    assert float(metrics["dropped_fraction"][0]) > 0
    np.testing.assert_allclose(loss16, loss, rtol=1e-6)
    np.testing.assert_allclose(metrics16["dropped_fraction"][0], metrics["dropped_fraction"][0])
    for got, want in zip(jax.tree.leaves(grads16), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_num_experts_must_divide_ep():
    config = MeshConfig(ep=8)
    block = BLOCK.clone(num_experts=4)
    x = jnp.ones((8, 2, 32))
    with use_mesh(config.make_mesh(), logical_axis_rules(config)), pytest.raises(ValueError, match="num_experts=4"):
        jax.eval_shape(lambda x: block.init(jax.random.PRNGKey(0), x, deterministic=True), x)


def _simulated_payload(x):
    """numpy model of the FP8 payload: E4M3 per tile of 128 features (a row's last tile shorter), the
    float32 scale ``448 / amax`` of `mtjax.ops.tile_quantize`, saturating."""
    import ml_dtypes

    x = np.asarray(x, np.float32)
    out = np.empty(x.shape, np.float64)
    for start in range(0, x.shape[-1], 128):
        tile = x[..., start:start + 128]
        amax = np.abs(tile).max(-1, keepdims=True)
        scale = np.where(amax > 0, np.float32(448.0) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
        q = np.clip(tile * scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        out[..., start:start + 128] = q * (np.float32(1) / scale)
    return out


@pytest.mark.parametrize("hidden", [256, 48], ids=["tiles-of-128", "one-short-tile"])
def test_fp8_payload_dispatch_is_the_quantized_rows_and_its_gradient_is_exact(hidden):
    ep, rows, local = 8, 24, 2
    x, experts, sizes = _routed_rows(jax.random.PRNGKey(0), ep, rows, hidden, local)
    # Rows over a wide dynamic range, as activation outliers make them: per-tile scales keep each tile's precision.
    x = x * jnp.exp2(jax.random.randint(jax.random.PRNGKey(2), (ep, rows, 1), -12, 6).astype(jnp.float32))
    mesh = jax.make_mesh((ep,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    weights = jax.random.normal(jax.random.PRNGKey(3), x.shape)

    def run(payload_dtype):
        def body(x, sizes):
            x_local, local_sizes, state = expert.dispatch(x[0], sizes[0], axis_name="ep", capacity=rows,
                                                          payload_dtype=payload_dtype)
            first = jax.lax.axis_index("ep") * local
            row_expert = jnp.searchsorted(jnp.cumsum(local_sizes), jnp.arange(x_local.shape[0]), side="right") + first
            y_local = x_local * (row_expert + 1)[:, None].astype(x_local.dtype)
            return expert.combine(y_local, state, axis_name="ep", rows=rows)[None]

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
        loss = lambda x: jnp.sum(f(x, sizes) * weights)
        return jax.jit(f)(x, sizes), jax.jit(jax.grad(loss))(x), jax.jit(f).lower(x, sizes).compile().as_text()

    y8, grad8, hlo8 = run(jnp.float8_e4m3fn)
    y, grad, _ = run(None)
    # Each row arrives as its FP8 tiles dequantized (the same numbers as a float64 model of the cast).
    expected = _simulated_payload(np.asarray(x)) * (np.asarray(experts) + 1)[..., None]
    np.testing.assert_allclose(y8, expected, rtol=1e-6, atol=0)
    # E4M3 keeps 3 mantissa bits: each value within 2^-4 of itself relative to its own magnitude, or
    # within the tile's smallest normal step (values below amax * 2^-6 / 448... fall to subnormals).
    tile_amax = np.abs(np.asarray(y)).reshape(ep, rows, -1, min(hidden, 128))  # both cases: whole tiles
    tile_amax = np.repeat(tile_amax.max(-1), tile_amax.shape[-1], axis=-1).reshape(y.shape)
    np.testing.assert_array_less(np.abs(np.asarray(y8) - np.asarray(y)),
                                 2.0 ** -4 * np.abs(np.asarray(y)) + tile_amax / 448 * 2.0 ** -9 + 1e-30)
    # The backward is the unquantized reverse exchange (straight through the cast).
    np.testing.assert_array_equal(grad8, grad)
    assert "f8e4m3fn" in hlo8 and "all-to-all" in hlo8


def test_moe_block_with_fp8_dispatch_on_ep_mesh_is_close_to_single_device():
    x, variables, want_loss, _, want_grads = _single_device()
    config = MeshConfig(dp=2, ep=4)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    params = shard_variables(variables, mesh, rules)["params"]
    block = BLOCK.clone(dispatch_dtype=jnp.float8_e4m3fn)
    step = jax.jit(jax.value_and_grad(functools.partial(_loss, block), has_aux=True))
    with use_mesh(mesh, rules):
        (loss, _), grads = step(params, x)
    # E4M3 rounds each dispatched value by at most 2^-4 of itself (about 2^-4 / sqrt(3) = 0.036 RMS).
    # The expert kernels' gradients contract the rounded rows directly, so their relative error is of
    # that size (0.04-0.05 seen); the loss averages the rounding away (3e-4 seen).
    np.testing.assert_allclose(loss, want_loss, rtol=2e-3)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert np.linalg.norm(np.asarray(got) - np.asarray(want)) <= 0.08 * np.linalg.norm(want)


def test_dispatch_dtype_must_be_fp8():
    with pytest.raises(TypeError, match="dispatch_dtype"):
        BLOCK.clone(dispatch_dtype=jnp.bfloat16)._validate()
    with pytest.raises(TypeError, match="payload_dtype"):
        expert.dispatch(jnp.ones((4, 8)), jnp.array([2, 2]), axis_name="ep", capacity=4, payload_dtype=jnp.int8)
