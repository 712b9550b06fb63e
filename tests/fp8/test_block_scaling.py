"""`BlockScaling`: the recipe's checks, the tile/block casts' numerics, the block-scaled matmul under
jit/grad/vmap/scan/shard_map and in every mtjax module, accuracy on rows of a wide dynamic range
against per-tensor scaling, a 200-step training run against bf16, and NaN/Inf isolation.

FP8 tolerances: E4M3 keeps 3 mantissa bits (relative rounding error at most 2**-4 per value), so a
GEMM's output over K random terms has a relative error of about 2**-4 / sqrt(3) ~ 0.04 at worst per
element and less after averaging; 0.1 bounds every comparison with f32 here."""

from __future__ import annotations

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from mtjax import flax as mtflax
from mtjax import fp8, ops
from mtjax.fp8 import block_scaling
from tests.fp8.mlp import MLP, Dense

pytestmark = pytest.mark.usefixtures("fast_compiles")

DENSE = (((1,), (0,)), ((), ()))
BLOCK = fp8.BlockScaling()


def _rows_of_wide_range(seed, m, k, low=-4.0, high=2.0):
    """``[m, k]`` normal values, row r scaled by ``10**u_r`` with ``u_r ~ U[low, high]`` (activation outliers)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)) * 10.0 ** rng.uniform(low, high, (m, 1))).astype(np.float32)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)) / np.linalg.norm(np.asarray(b)))


# ----------------------------------------------------------------------------------------------
# The recipe
# ----------------------------------------------------------------------------------------------


def test_recipe_defaults_and_checks():
    assert BLOCK.fp8_format is fp8.Format.E4M3 and BLOCK.block_size == fp8.BLOCK_SIZE == 128
    assert not BLOCK.power_of_two_scales and BLOCK.amax_epsilon == 0.0
    assert hash(fp8.BlockScaling(fp8.Format.HYBRID, power_of_two_scales=True)) is not None
    assert fp8.BlockScaling in fp8.RECIPE_TYPES
    with pytest.raises(ValueError, match=r"fp8_format=.*E5M2.*accepted: \['Format.E4M3', 'Format.HYBRID'\]"):
        fp8.BlockScaling(fp8_format=fp8.Format.E5M2)
    with pytest.raises(TypeError, match="fp8_format"):
        fp8.BlockScaling(fp8_format="E4M3")
    with pytest.raises(TypeError, match="power_of_two_scales"):
        fp8.BlockScaling(power_of_two_scales=1)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="amax_epsilon.*finite float >= 0"):
            fp8.BlockScaling(amax_epsilon=bad)
    with pytest.raises(ValueError, match="BlockScaling keeps no state"):
        fp8.fp8_dot_general(jnp.ones((4, 8)), jnp.ones((8, 4)), DENSE, fp8.init_meta(4), recipe=BLOCK)


# ----------------------------------------------------------------------------------------------
# The casts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("power_of_two", [False, True])
def test_tiles_keep_each_row_tile_precise(power_of_two):
    x = jnp.asarray(_rows_of_wide_range(0, 8, 300))
    x = x.at[2, 128:256].set(0.0)  # an all-zero tile

    @jax.jit
    def casts(x):
        return (ops.tile_quantize(x, jnp.float8_e4m3fn, transpose=True, power_of_two=power_of_two),
                ops.block_quantize(x, jnp.float8_e4m3fn, power_of_two=power_of_two))

    (q, s, q_t, s_t), (w_q, w_q_t, w_s) = casts(x)
    assert s.shape == (8, 3) and s_t.shape == (300, 1) and w_s.shape == (1, 3)
    np.testing.assert_array_equal(np.asarray(w_q_t, np.float32), np.asarray(w_q, np.float32).T)
    assert float(s[2, 1]) == 1.0 and not np.any(np.asarray(q[2, 128:256], np.float32))
    for deq, want, tiles in ((ops.tile_dequantize(q, s), x, s), (ops.tile_dequantize(q_t, s_t), x.T, s_t)):
        # Each value is within half an E4M3 step (2**-4 relative) of itself, or of 0 below the subnormals.
        err = np.abs(np.asarray(deq) - np.asarray(want))
        tile_scales = np.repeat(np.asarray(tiles), 128, axis=1)[:, :want.shape[1]]
        bound = 2.0**-4 * np.abs(np.asarray(want)) + 2.0**-9 * tile_scales
        assert np.all(err <= bound)
        if power_of_two:
            np.testing.assert_array_equal(np.log2(np.asarray(tiles)) % 1, 0.0)
    # A block's scale comes from its largest value: 448 (E4M3's max) maps back to it.
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= 448.0


def test_a_nan_or_inf_stays_in_its_tile():
    x = jnp.asarray(_rows_of_wide_range(1, 4, 256))
    bad = x.at[1, 5].set(jnp.nan).at[2, 200].set(jnp.inf)
    (q, s), (q_bad, s_bad) = (ops.tile_quantize(v, jnp.float8_e4m3fn) for v in (x, bad))
    same = np.ones((4, 2), bool)
    same[1, 0] = same[2, 1] = False
    np.testing.assert_array_equal(np.asarray(s_bad)[same], np.asarray(s)[same])
    assert np.isnan(float(q_bad[1, 5])) and float(s_bad[1, 0]) == 1.0
    assert float(q_bad[2, 200]) == 448.0  # Inf saturates (its tile cannot be scaled)


# ----------------------------------------------------------------------------------------------
# The matmul
# ----------------------------------------------------------------------------------------------


def test_wide_dynamic_range_rows_beat_per_tensor_scaling():
    """Rows scaled by 10**u, u ~ U[-4, 2]: per-tensor scales flush the small rows toward E4M3's
    subnormals; 1x128 tiles keep every row at E4M3's own precision."""
    x = jnp.asarray(_rows_of_wide_range(2, 256, 512))
    w = jnp.asarray(np.random.default_rng(3).standard_normal((512, 256)).astype(np.float32) / 512**0.5)
    per_tensor = fp8.CurrentScaling(fp8_format=fp8.Format.E4M3)

    @jax.jit
    def outputs(x, w):
        return (x @ w, fp8.fp8_dot_general(x, w, DENSE, recipe=BLOCK),
                fp8.fp8_dot_general(x, w, DENSE, recipe=per_tensor))

    want, block, tensor = (np.asarray(o, np.float64) for o in outputs(x, w))

    def row_errors(got):
        return np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)

    block_rows, tensor_rows = row_errors(block).mean(), row_errors(tensor).mean()
    assert block_rows < 0.06, block_rows
    assert block_rows <= tensor_rows / 3, (block_rows, tensor_rows)
    assert _rel(block, want) <= _rel(tensor, want), (_rel(block, want), _rel(tensor, want))


@pytest.mark.parametrize("fp8_format", [fp8.Format.E4M3, fp8.Format.HYBRID])
def test_gradients_match_f32(fp8_format):
    recipe = fp8.BlockScaling(fp8_format=fp8_format)
    rng = np.random.default_rng(4)
    x = jnp.asarray(_rows_of_wide_range(4, 200, 300, -2.0, 1.0))
    w = jnp.asarray(rng.standard_normal((300, 160)).astype(np.float32) / 300**0.5)
    c = jnp.asarray(rng.standard_normal((200, 160)).astype(np.float32))

    def loss(dot, x, w):
        return jnp.sum(dot(x, w) * c)

    def block_dot(x, w):
        return fp8.fp8_dot_general(x, w, DENSE, recipe=recipe)

    grads = jax.jit(lambda x, w: (jax.grad(loss, (1, 2))(block_dot, x, w), jax.grad(loss, (1, 2))(jnp.dot, x, w)))
    (dx, dw), (dx_want, dw_want) = grads(x, w)
    # E5M2 gradients keep 2 mantissa bits: twice E4M3's rounding error.
    tol = 0.06 if fp8_format is fp8.Format.E4M3 else 0.12
    assert _rel(dx, dx_want) < tol and _rel(dw, dw_want) < tol, (_rel(dx, dx_want), _rel(dw, dw_want))


def test_batch_axes_and_bf16():
    """Batched dot_general (vmapped per batch) and bf16 operands: the result type of a plain dot."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 40, 200)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 200, 24)) / 200**0.5, jnp.bfloat16)
    dims = (((2,), (1,)), ((0,), (0,)))

    @jax.jit
    def both(x, w):
        got, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, dims, recipe=BLOCK), x, w)
        want, vjp_want = jax.vjp(lambda x, w: lax.dot_general(x, w, dims, preferred_element_type=jnp.float32), x, w)
        return got, want, vjp(got), vjp_want(want)

    got, want, grads, grads_want = both(x, w)
    assert got.dtype == jnp.bfloat16 and got.shape == (3, 40, 24)
    assert _rel(got.astype(jnp.float32), want) < 0.1
    for g, g_want in zip(grads, grads_want):
        assert g.dtype == jnp.bfloat16 and _rel(g.astype(jnp.float32), g_want) < 0.1


# ----------------------------------------------------------------------------------------------
# Modules, scan, shard_map
# ----------------------------------------------------------------------------------------------


# name -> (module, GEMMs in the forward, GEMMs in all, tile casts fused with a norm, with an activation)
MODULES = {
    "DenseGeneral": (lambda: mtflax.DenseGeneral(features=(4, 32)), 1, 3, 0, 0),
    "LayerNormDenseGeneral": (lambda: mtflax.LayerNormDenseGeneral(features=96), 1, 3, 1, 0),
    "LayerNormMLP": (lambda: mtflax.LayerNormMLP(intermediate_dim=256, activations=("gelu",)), 2, 6, 1, 1),
    "MultiHeadAttention": (lambda: mtflax.MultiHeadAttention(head_dim=16, num_attention_heads=4), 2, 6, 1, 0),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_every_module_runs_block_scaled(name, spy):
    make, fwd_gemms, all_gemms, norm_casts, activation_casts = MODULES[name]
    module = make()
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 32, 128)).astype(np.float32))
    variables = jax.jit(module.init)(jax.random.key(0), x)

    def loss(params):
        kwargs = {"deterministic": True} if name in ("LayerNormMLP", "MultiHeadAttention") else {}
        out = module.apply({"params": params}, x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(jnp.sin(out)), out

    with fp8.fp8_autocast(recipe=BLOCK):
        assert set(jax.eval_shape(module.init, jax.random.key(0), x)) == {"params"}  # no state
        calls = spy(block_scaling, "block_fp8_gemm", lambda args, kwargs: args[0].shape)
        fused = {op: spy(module_of_op, op, lambda args, kwargs: args[0].shape)
                 for module_of_op, op in ((importlib.import_module("mtjax.ops.normalization"), "norm_tile_fp8"),
                                          (importlib.import_module("mtjax.ops.activation"), "activation_tile_fp8"))}
        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    assert len(calls) == all_gemms, calls  # forward, dgrad and wgrad of each projection
    # the norm and the activation in front of a GEMM write its FP8 tiles
    assert (len(fused["norm_tile_fp8"]), len(fused["activation_tile_fp8"])) == (norm_casts, activation_casts), fused
    (_, want), grads_want = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    assert _rel(out, want) < 0.1
    for g, g_want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want)):
        assert np.all(np.isfinite(g)) and _rel(g, g_want) < 0.15


@pytest.mark.parametrize("prologue", [
    ops.Norm(jnp.linspace(0.5, 1.5, 256), jnp.linspace(-0.1, 0.1, 256)),
    ops.Norm(jnp.linspace(0.5, 1.5, 256), None, "rmsnorm", zero_centered_gamma=True),
    ops.Activation(jnp.linspace(-0.5, 0.5, 512).reshape(2, 256), "swiglu"),
], ids=["layernorm", "rmsnorm", "swiglu"])
def test_fused_prologue_is_the_cast_of_its_float32_output(prologue):
    """In float32 the fused cast quantizes the values the separate op writes, so the GEMM with the norm or
    activation fused equals the GEMM of that op's output, forward and backward (to float32 rounding:
    the prologue's backward runs from its input in both)."""
    rng = np.random.default_rng(11)
    shape = (96, 2, 256) if isinstance(prologue, ops.Activation) else (96, 256)
    x = jnp.asarray(rng.standard_normal(shape) * 2.0 + 0.3, jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 64)) / 16.0, jnp.float32)

    def fused(x, prologue, w):
        return fp8.fp8_dot_general(x, w, DENSE, recipe=BLOCK, lhs_prologue=prologue)

    def separate(x, prologue, w):
        return fp8.fp8_dot_general(prologue(x), w, DENSE, recipe=BLOCK)

    got, got_vjp = jax.vjp(jax.jit(fused), x, prologue, w)
    want, want_vjp = jax.vjp(jax.jit(separate), x, prologue, w)
    dy = jnp.asarray(rng.standard_normal(got.shape), jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    for g, g_want in zip(jax.tree.leaves(got_vjp(dy)), jax.tree.leaves(want_vjp(dy))):
        np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(g_want))))


class ScannedStack(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(lambda layer, h, _: (h + layer(h), None), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=self.layers)
        return scan(Dense(x.shape[-1], dtype=jnp.float32), x, None)[0]


def test_scan_and_shard_map():
    x = jnp.asarray(_rows_of_wide_range(7, 64, 128, -2.0, 1.0))
    model = ScannedStack(layers=3)
    variables = model.init(jax.random.key(1), x)

    def grads(variables, x):
        with fp8.fp8_autocast(recipe=BLOCK):
            return jax.value_and_grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(variables)

    loss, full = jax.jit(grads)(variables, x)
    loss_want, want = jax.jit(jax.value_and_grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)
    assert abs(float(loss) / float(loss_want) - 1) < 0.05
    assert _rel(full["params"]["Dense_0"]["kernel"], want["params"]["Dense_0"]["kernel"]) < 0.1
    # Data parallel: each device quantizes its own rows; no collective is needed for the scales.
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.shard_map(lambda v, x: jax.tree.map(lambda g: g[None], grads(v, x)), mesh=mesh,
                            in_specs=(P(), P("dp")), out_specs=P("dp"))
    losses, per_shard = jax.jit(sharded)(variables, jax.device_put(x, jax.NamedSharding(mesh, P("dp"))))
    assert abs(float(jnp.sum(losses)) / float(loss) - 1) < 1e-5  # forward tiles lie within a row: the same
    kernel = per_shard["params"]["Dense_0"]["kernel"]
    np.testing.assert_array_equal(kernel, np.broadcast_to(kernel[:1], kernel.shape))  # summed over shards
    assert _rel(kernel[0], full["params"]["Dense_0"]["kernel"]) < 0.05


# ----------------------------------------------------------------------------------------------
# Training, NaN/Inf
# ----------------------------------------------------------------------------------------------


def _teacher_batches(steps, batch=32, features=128, outputs=16, noise=0.3):
    """Regression on a random tanh teacher with label noise (the loss floor is noise**2)."""
    rng = np.random.default_rng(8)
    w1 = rng.standard_normal((features, 64)).astype(np.float32) / features**0.5
    w2 = rng.standard_normal((64, outputs)).astype(np.float32) / 8.0
    x = rng.standard_normal((steps, batch, features)).astype(np.float32)
    y = np.tanh(x @ w1) @ w2 * 2.0
    return jnp.asarray(x), jnp.asarray(y + noise * rng.standard_normal(y.shape).astype(np.float32))


def _train_losses(recipe, x, y):
    model = MLP(256, y.shape[-1])  # bf16 compute, f32 params
    opt = optax.adam(3e-3)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply({"params": params}, x).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def run(x, y):
        with fp8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            params = model.init(jax.random.key(0), x[0])["params"]

            def step(carry, batch):
                params, opt_state = carry
                loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
                updates, opt_state = opt.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), loss

            return lax.scan(step, (params, opt.init(params)), (x, y))[1]

    return np.asarray(run(x, y))


def test_200_steps_of_block_scaled_training_match_bf16():
    x, y = _teacher_batches(200)
    bf16, block = _train_losses(None, x, y), _train_losses(BLOCK, x, y)
    assert bf16[-20:].mean() < 0.5 * bf16[:20].mean()  # it learned
    assert abs(block[-20:].mean() / bf16[-20:].mean() - 1) < 0.01, (block[-20:].mean(), bf16[-20:].mean())


def test_nan_and_inf_inputs_do_not_poison_other_rows_or_later_steps():
    model = MLP(256, 16, dtype=jnp.float32)
    x = jnp.asarray(_rows_of_wide_range(9, 16, 128, -2.0, 1.0))
    with fp8.fp8_autocast(recipe=BLOCK):
        variables = jax.jit(model.init)(jax.random.key(2), x)
    assert set(variables) == {"params"}  # nothing a bad step could leave behind

    @jax.jit
    def step(params, x):
        with fp8.fp8_autocast(recipe=BLOCK):
            out, vjp = jax.vjp(lambda p: model.apply({"params": p}, x), params)
            return out, vjp(jnp.ones_like(out))[0]

    clean_out, clean_grads = step(variables["params"], x)
    bad_out, _ = step(variables["params"], x.at[3, 7].set(jnp.nan).at[9, 100].set(jnp.inf))
    rows = np.r_[0:3, 4:9, 10:16]
    # Forward tiles lie within a row: only the bad rows' outputs change (hidden GEMM's NaN row stays NaN).
    np.testing.assert_array_equal(np.asarray(bad_out)[rows], np.asarray(clean_out)[rows])
    assert np.all(np.isnan(np.asarray(bad_out)[3]))
    after_out, after_grads = step(variables["params"], x)  # the next step is exactly a clean step
    np.testing.assert_array_equal(after_out, clean_out)
    jax.tree.map(np.testing.assert_array_equal, after_grads, clean_grads)
