"""Formats, recipes, fp8_autocast / autocast and the scaling arithmetic (exact)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtjax import fp8
from mtjax.sharding import MeshResource, current_mesh_resource

pytestmark = pytest.mark.usefixtures("fast_compiles")


def test_format_dtypes():
    assert fp8.Format.HYBRID.dtypes() == (jnp.float8_e4m3fn, jnp.float8_e5m2)
    assert fp8.Format.E4M3.dtypes() == (jnp.float8_e4m3fn, jnp.float8_e4m3fn)
    assert fp8.Format.E5M2.dtypes() == (jnp.float8_e5m2, jnp.float8_e5m2)
    assert fp8.Format.HYBRID.dtypes(fnuz=True) == (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)
    assert [fp8.fp8_max(d) for d in fp8.FP8_DTYPES] == [448.0, 57344.0, 240.0, 57344.0]


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(margin=-1), ValueError, "margin"),
    (dict(margin=0.5), TypeError, "margin"),
    (dict(amax_history_len=0), ValueError, "amax_history_len"),
    (dict(amax_compute_algo="mean"), ValueError, "amax_compute_algo"),
    (dict(fp8_format="E4M3"), TypeError, "fp8_format"),
    (dict(reduce_amax=1), TypeError, "reduce_amax"),
])
def test_delayed_scaling_validation(kwargs, error, field):
    with pytest.raises(error, match=field):
        fp8.DelayedScaling(**kwargs)


def test_recipe_by_name():
    assert [type(fp8.recipe_by_name(name)) for name in fp8.RECIPE_NAMES] == list(fp8.RECIPE_TYPES)
    assert fp8.recipe_by_name("block") == fp8.BlockScaling()
    with pytest.raises(ValueError, match="'mxfp8'.*delayed, current, block"):
        fp8.recipe_by_name("mxfp8")


def test_current_scaling_and_autocast_validation():
    with pytest.raises(TypeError, match="fp8_format"):
        fp8.CurrentScaling(fp8_format=jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="recipe"):
        with fp8.fp8_autocast(recipe="delayed"):
            pass
    with pytest.raises(TypeError, match="mesh_axes"):
        with fp8.fp8_autocast(mesh_axes=("dp", 3)):
            pass
    with pytest.raises(TypeError, match="enabled"):
        with fp8.fp8_autocast(enabled="yes"):
            pass


def test_autocast_nesting():
    assert fp8.current_autocast() is None
    with fp8.fp8_autocast(mesh_axes="dp"):
        outer = fp8.current_autocast()
        assert outer.recipe == fp8.DelayedScaling() and outer.mesh_axes == ("dp",)
        with fp8.fp8_autocast(enabled=False):
            assert fp8.current_autocast() is None
        with fp8.fp8_autocast(recipe=fp8.CurrentScaling()):
            assert isinstance(fp8.current_autocast().recipe, fp8.CurrentScaling)
        assert fp8.current_autocast() is outer
    assert fp8.current_autocast() is None


def test_autocast_has_transformer_engine_defaults():
    """`autocast` is TransformerEngine-JAX's: FP8 off unless enabled, DelayedScaling by default, and the
    MeshResource in force (even with FP8 off), its axes but the pipeline's reducing the amaxes."""
    resource = MeshResource(dp_resource="data", tp_resource="model", pp_resource="stage")
    with fp8.autocast():
        assert fp8.current_autocast() is None and current_mesh_resource() is None
    with fp8.autocast(enabled=False, recipe=fp8.CurrentScaling(), mesh_resource=resource):
        assert fp8.current_autocast() is None and current_mesh_resource() is resource
    with fp8.autocast(enabled=True, mesh_resource=resource):
        state = fp8.current_autocast()
        assert state.recipe == fp8.DelayedScaling() and state.mesh_axes == ("data", "model")
        with fp8.autocast(enabled=True, recipe=fp8.CurrentScaling()):
            assert isinstance(fp8.current_autocast().recipe, fp8.CurrentScaling) and current_mesh_resource() is None
        assert current_mesh_resource() is resource
    assert fp8.current_autocast() is None and current_mesh_resource() is None
    with pytest.raises(TypeError, match="autocast.mesh_resource=.*MeshResource"):
        with fp8.autocast(mesh_resource=("dp", "tp")):
            pass
    with pytest.raises(TypeError, match="autocast.enabled="):
        with fp8.autocast(enabled=1):
            pass


def test_compute_scale_formula_exact():
    amaxes = np.array([3.7, 0.011, 448.0, 1e4], np.float32)
    for margin in (0, 2):
        for fmt_max in (448.0, 57344.0):
            got = np.asarray(jax.vmap(lambda a: fp8.compute_scale(a, 1.0, fmt_max, margin))(amaxes))
            want = (np.float32(fmt_max) / amaxes) / np.float32(2.0**margin)
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad", [0.0, np.nan, np.inf, -np.inf, 1e-45])
def test_compute_scale_keeps_previous_on_bad_amax(bad):
    # 1e-45 is a float32 denormal: 448 / 1e-45 overflows to Inf, which must not become the scale.
    assert float(fp8.compute_scale(jnp.float32(bad), jnp.float32(7.5), 448.0)) == 7.5


def test_history_roll_exact():
    history = jnp.array([5.0, 4.0, 3.0, 2.0], jnp.float32)
    np.testing.assert_array_equal(fp8.roll_amax_history(history, 9.0), [9.0, 5.0, 4.0, 3.0])
    np.testing.assert_array_equal(fp8.roll_amax_history(history, jnp.inf), [0.0, 5.0, 4.0, 3.0])
    np.testing.assert_array_equal(fp8.roll_amax_history(history, jnp.nan), [0.0, 5.0, 4.0, 3.0])
    assert float(fp8.history_amax(history, "max")) == 5.0
    assert float(fp8.history_amax(jnp.array([1.0, 8.0]), "most_recent")) == 1.0
    with pytest.raises(ValueError, match="amax_compute_algo"):
        fp8.history_amax(history, "mean")


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES)
def test_quantize_saturates_never_inf(dtype):
    x = jnp.array([1.0, -2.5, 1e9, -1e9, jnp.inf, -jnp.inf, jnp.nan, 0.0], jnp.float32)
    q = fp8.quantize(x, jnp.float32(4.0), dtype)
    assert q.dtype == dtype
    back = np.asarray(q.astype(jnp.float32))
    limit = fp8.fp8_max(dtype)
    np.testing.assert_array_equal(back[:6], [4.0, -10.0, limit, -limit, limit, -limit])
    assert np.isnan(back[6]) and back[7] == 0.0
    np.testing.assert_array_equal(fp8.dequantize(q[:2], jnp.float32(4.0), jnp.float32), [1.0, -2.5])


def test_quantize_round_trip_error():
    x = jax.random.normal(jax.random.key(0), (4096,), jnp.float32)
    scale = fp8.compute_scale(fp8.amax(x), 1.0, 448.0)
    err = fp8.dequantize(fp8.quantize(x, scale, jnp.float8_e4m3fn), scale) - x
    # E4M3 keeps 3 mantissa bits: round-to-nearest is within 2**-4 relative in the normal range.
    normal = jnp.abs(x * scale) >= 2.0**-6
    assert float(jnp.max(jnp.abs(err / x)[normal])) <= 2.0**-4
    with pytest.raises(TypeError, match="dtype"):
        fp8.quantize(x, scale, jnp.bfloat16)


def test_amax_reduced_over_bound_mesh_axes():
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.arange(64.0).reshape(8, 8) - 60.0  # |min| = 60 lives on the first shard only
    xs = jax.device_put(x, jax.NamedSharding(mesh, P("dp")))
    local = jax.shard_map(lambda s: fp8.amax(s)[None], mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))(xs)
    reduced = jax.shard_map(lambda s: fp8.amax(s, ("dp",))[None], mesh=mesh, in_specs=P("dp"),
                            out_specs=P("dp"))(xs)
    assert float(local[1]) == 52.0 and np.all(np.asarray(reduced) == 60.0)
    # Unbound axes (plain jit over a sharded array) are skipped: jnp.max is already global there.
    assert float(jax.jit(lambda s: fp8.amax(s, ("dp",)))(xs)) == 60.0


@pytest.mark.parametrize("fp8_format, limit", [(fp8.Format.HYBRID, 14), (fp8.Format.E4M3, 14), (fp8.Format.E5M2, 29)])
def test_margin_is_bounded_by_the_format(fp8_format, limit):
    """Issue 27 defect 5: margin >= ~30 zeroed the outputs, >= ~80 gave NaN, 10**6 raised OverflowError."""
    assert fp8.max_margin(fp8_format) == limit
    fp8.DelayedScaling(margin=limit, fp8_format=fp8_format)
    with pytest.raises(ValueError, match=rf"margin={limit + 1}\): expected an int in \[0, {limit}\]"):
        fp8.DelayedScaling(margin=limit + 1, fp8_format=fp8_format)
    with pytest.raises(ValueError, match=r"margin=1000000\)"):
        fp8.DelayedScaling(margin=10**6, fp8_format=fp8_format)


@pytest.mark.parametrize("amax, scale, margin", [
    (3e38, 1.0, 29),     # the formula underflows to 0
    (1e-30, 1.0, 0),     # 448 / 1e-30 is finite, but its inverse would be a float32 denormal
    (0.0, 0.0, 0),       # no amax yet, and a zero previous scale
    (np.nan, -2.0, 0),   # a negative previous scale
    (1.0, 1.0, 10**6),   # a margin no recipe allows, called directly
])
def test_compute_scale_is_never_zero_or_inf(amax, scale, margin):
    got = float(fp8.compute_scale(jnp.float32(amax), jnp.float32(scale), 448.0, margin))
    assert fp8.MIN_SCALE <= got <= fp8.MAX_SCALE and np.isfinite(1.0 / np.float32(got))


def test_amax_jump_is_the_newest_amax_over_the_largest_earlier_one():
    """Issue 27 defect 5: one huge amax silently shrinks a delayed scale for the whole history."""
    history = jnp.array([5e3, 2.0, 4.0, 0.0], jnp.float32)
    meta = {"layer": {"dot_general": {"input_amax_history": history, "input_scale": jnp.float32(1.0),
                                      "kernel_amax_history": jnp.stack([history, history / 100])}},
            "fresh": {"input_amax_history": jnp.array([3.0, 0.0, 0.0, 0.0])}}
    assert float(fp8.amax_jump(meta)) == 1250.0
    assert float(fp8.amax_jump({})) == 0.0


def test_histories_of_several_groups_roll_and_reduce_along_their_last_axis():
    history = jnp.asarray([[3.0, 1.0, 0.0], [0.5, 4.0, 2.0]])
    rolled = fp8.roll_amax_history(history, jnp.asarray([2.0, jnp.inf]))
    np.testing.assert_array_equal(rolled, [[2.0, 3.0, 1.0], [0.0, 0.5, 4.0]])  # a non-finite amax enters as 0
    np.testing.assert_array_equal(fp8.history_amax(history, "max"), [3.0, 4.0])
    np.testing.assert_array_equal(fp8.history_amax(history, "most_recent"), [3.0, 0.5])
