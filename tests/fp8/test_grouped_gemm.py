"""mtjax.fp8.fp8_grouped_gemm: delayed scaling's state over steps (per-expert kernel histories), the
other recipes, and its argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import fp8, ops

pytestmark = pytest.mark.usefixtures("fast_compiles")

GROUP_SIZES = jnp.asarray([9, 0, 20, 3], jnp.int32)


def _operands(seed, m=32, k=16, n=8, groups=4):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    lhs = 3.0 * jax.random.normal(keys[0], (m, k))
    # experts of very different ranges: one scale for all of them would leave the small ones in subnormals
    rhs = jax.random.normal(keys[1], (groups, k, n)) * jnp.asarray([1.0, 5.0, 0.02, 40.0])[:, None, None]
    return lhs, rhs, jax.random.normal(keys[2], (m, n))


def _step(meta, lhs, rhs, dy, recipe):
    """Output, gradients and the next state of one step."""
    def f(lhs, rhs, meta):
        return fp8.fp8_grouped_gemm(lhs, rhs, GROUP_SIZES, meta, recipe=recipe)

    out, vjp = jax.vjp(f, lhs, rhs, meta)
    return (out, *vjp(dy))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_state_rolls_amaxes_per_expert_and_scales_follow(algo):
    recipe = fp8.DelayedScaling(amax_history_len=3, amax_compute_algo=algo)
    meta = fp8.init_grouped_meta(4, 3)
    steps = [_operands(seed) for seed in range(3)]
    for i, (lhs, rhs, dy) in enumerate(steps):
        out, _, _, next_meta = jax.jit(_step, static_argnums=4)(meta, lhs, rhs, dy, recipe)
        # each role's newest history entry is this step's amax, the kernel's one per expert
        np.testing.assert_array_equal(next_meta["input_amax_history"][0], jnp.max(jnp.abs(lhs)))
        np.testing.assert_array_equal(next_meta["kernel_amax_history"][:, 0], jnp.max(jnp.abs(rhs), axis=(1, 2)))
        np.testing.assert_array_equal(next_meta["output_grad_amax_history"][0], jnp.max(jnp.abs(dy)))
        np.testing.assert_array_equal(next_meta["kernel_amax_history"][:, 1:], meta["kernel_amax_history"][:, :2])
        # the scales used are the state's: fp8_max / amax of the history (unit scales before any)
        history = meta["kernel_amax_history"]
        amax = history.max(-1) if algo == "max" else history[:, 0]
        want = jnp.where(amax > 0, 448.0 / jnp.where(amax > 0, amax, 1.0), 1.0)
        np.testing.assert_allclose(next_meta["kernel_scale"], want, rtol=1e-7)
        given = ops.GroupedFP8Scales(next_meta["input_scale"], next_meta["kernel_scale"],
                                     next_meta["output_grad_scale"])
        np.testing.assert_array_equal(out, ops.grouped_gemm_fp8(lhs, rhs, GROUP_SIZES, scales=given))
        if i:  # from the second step on, the scales bring each expert's range to FP8's
            ref = ops.grouped_gemm(lhs, rhs, GROUP_SIZES)
            assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 0.1
        meta = next_meta


def test_delayed_first_step_has_unit_scales_then_matches_current_scaling():
    """With a history of one, step 2 on step 1's tensors quantizes with current scaling's scales."""
    recipe = fp8.DelayedScaling(amax_history_len=1)
    lhs, rhs, dy = _operands(3)
    _, _, _, meta = _step(fp8.init_grouped_meta(4, 1), lhs, rhs, dy, recipe)
    got = _step(meta, lhs, rhs, dy, recipe)
    want = _step(None, lhs, rhs, dy, fp8.CurrentScaling())
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(a, b)


def test_other_recipes_are_the_stateless_ops():
    lhs, rhs, _ = _operands(4)
    np.testing.assert_array_equal(fp8.fp8_grouped_gemm(lhs, rhs, GROUP_SIZES, recipe=fp8.CurrentScaling()),
                                  ops.grouped_gemm_fp8(lhs, rhs, GROUP_SIZES))
    np.testing.assert_array_equal(
        fp8.fp8_grouped_gemm(lhs, rhs, GROUP_SIZES, recipe=fp8.BlockScaling()),
        ops.grouped_gemm_block_fp8(lhs, rhs, GROUP_SIZES, gradient_dtype=jnp.float8_e4m3fn))


def test_meta_and_recipe_are_checked():
    lhs, rhs, _ = _operands(5)
    with pytest.raises(ValueError, match="keeps no state"):
        fp8.fp8_grouped_gemm(lhs, rhs, GROUP_SIZES, fp8.init_grouped_meta(4, 8), recipe=fp8.CurrentScaling())
    with pytest.raises(ValueError, match="needs the keys"):
        fp8.fp8_grouped_gemm(lhs, rhs, GROUP_SIZES, None)
    with pytest.raises(ValueError, match=r"kernel_amax_history has shape \(3, 8\)"):
        fp8.fp8_grouped_gemm(lhs, rhs, GROUP_SIZES, fp8.init_grouped_meta(3, 8),
                             recipe=fp8.DelayedScaling(amax_history_len=8))
    with pytest.raises(ValueError, match="amax_history_len=16"):
        fp8.fp8_grouped_gemm(lhs, rhs, GROUP_SIZES, fp8.init_grouped_meta(4, 8),
                             recipe=fp8.DelayedScaling(amax_history_len=16))
    with pytest.raises(TypeError, match="recipe"):
        fp8.fp8_grouped_gemm(lhs, rhs, GROUP_SIZES, recipe="delayed")
    with pytest.raises(ValueError, match="num_groups"):
        fp8.init_grouped_meta(0)


def test_margin_and_an_expert_without_weights():
    """``margin`` halves each scale per unit; an all-zero expert keeps its previous scale (no amax to
    take one from) instead of an infinite one."""
    recipe = fp8.DelayedScaling(margin=2, amax_history_len=2)
    lhs, rhs, dy = _operands(6)
    rhs = rhs.at[1].set(0.0)
    _, _, _, meta = _step(fp8.init_grouped_meta(4, 2), lhs, rhs, dy, recipe)
    _, _, _, meta = _step(meta, lhs, rhs, dy, recipe)
    amax = jnp.max(jnp.abs(rhs), axis=(1, 2))
    np.testing.assert_allclose(meta["kernel_scale"][jnp.asarray([0, 2, 3])], (448.0 / amax[jnp.asarray([0, 2, 3])]) / 4,
                               rtol=1e-6)
    assert float(meta["kernel_scale"][1]) == 1.0
    np.testing.assert_allclose(meta["input_scale"], 448.0 / jnp.max(jnp.abs(lhs)) / 4, rtol=1e-6)
    np.testing.assert_allclose(meta["output_grad_scale"], 57344.0 / jnp.max(jnp.abs(dy)) / 4, rtol=1e-6)


def test_inside_shard_map_the_state_sees_every_device():
    """Called inside a ``shard_map`` with the rows split over ``dp`` and the kernel and state replicated:
    the next state's input and gradient amaxes are the maxima over the devices, its kernel amaxes the
    kernel's, replicated as the state is."""
    from jax.sharding import PartitionSpec as P

    devices = 4
    mesh = jax.make_mesh((devices,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    recipe = fp8.DelayedScaling(amax_history_len=2)
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    _, rhs, _ = _operands(7)
    lhs = jax.random.normal(keys[0], (devices, 32, 16)) * jnp.arange(1.0, devices + 1.0)[:, None, None]
    dy = jax.random.normal(keys[1], (devices, 32, 8)) * jnp.arange(devices, 0.0, -1.0)[:, None, None]

    def loss(lhs, rhs, meta, dy):
        def body(lhs, rhs, meta, dy):
            out = fp8.fp8_grouped_gemm(lhs[0], rhs, GROUP_SIZES, meta, recipe=recipe)
            return jax.lax.psum(jnp.sum(out * dy[0]), "dp")

        return jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P(), P(), P("dp")), out_specs=P())(lhs, rhs, meta,
                                                                                                       dy)

    _, _, meta = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(lhs, rhs, fp8.init_grouped_meta(4, 2), dy)
    np.testing.assert_array_equal(meta["input_amax_history"][0], jnp.max(jnp.abs(lhs)))
    np.testing.assert_array_equal(meta["output_grad_amax_history"][0], jnp.max(jnp.abs(dy)))
    np.testing.assert_array_equal(meta["kernel_amax_history"][:, 0], jnp.max(jnp.abs(rhs), axis=(1, 2)))
