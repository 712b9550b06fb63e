"""Checkpoints: restore onto other meshes, exact resume, retention, and a save killed midway."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtjax.sharding import MeshConfig, logical_axis_rules
from mtjax.train.checkpoint import Checkpointer
from mtjax.train.data import DataIterator, PackedDataset
from mtjax.train.state import abstract_train_state, init_train_state
from mtjax.train.step import make_optimizer, make_train_step
from tests.train.tiny_lm import TinyLM

BATCH, SEQ = 8, 16
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def dataset():
    text = np.frombuffer(b"Simple is better than complex. Flat is better than nested. " * 30, np.uint8)
    return PackedDataset(text.astype(np.int32), SEQ, seed=3)


@pytest.fixture(scope="module")
def setup():
    model = TinyLM()
    optimizer, schedule = make_optimizer(1e-2, total_steps=20, warmup_steps=3)
    return model, optimizer


def _sharded(model, optimizer, config):
    mesh, rules = config.make_mesh(jax.devices()[: config.num_devices]), logical_axis_rules(config)
    abstract = abstract_train_state(model, optimizer, (BATCH, SEQ), mesh=mesh, rules=rules)
    step = make_train_step(model, optimizer, mesh=mesh, rules=rules,
                           state_sharding=jax.tree.map(lambda a: a.sharding, abstract))
    return mesh, rules, abstract, step


def _train(state, step_fn, batches, steps):
    losses = []
    for _ in range(steps):
        state, metrics = step_fn(state, next(batches))
        losses.append(float(metrics["loss"]))
    return state, losses


def test_restore_onto_another_mesh_and_one_device(tmp_path, setup, dataset):
    model, optimizer = setup
    mesh, rules, _, step8 = _sharded(model, optimizer, MeshConfig(dp=8))
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ), mesh=mesh, rules=rules)
    batches = DataIterator(dataset, BATCH)
    state, _ = _train(state, step8, batches, 2)
    expected = jax.device_get(state)
    with Checkpointer(tmp_path, save_every=1) as checkpointer:
        assert checkpointer.save(2, state, {"data": batches.state()})

    for config in [MeshConfig(dp=4, tp=2), MeshConfig()]:
        mesh = config.make_mesh(jax.devices()[: config.num_devices])
        abstract = abstract_train_state(model, optimizer, (BATCH, SEQ), mesh=mesh, rules=logical_axis_rules(config))
        with Checkpointer(tmp_path) as checkpointer:
            restored, meta = checkpointer.restore(abstract)
        assert meta == {"data": {"position": 2}}
        for leaf, target in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
            assert leaf.sharding == target.sharding
        assert restored.params["w1"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
        assert len(restored.params["w1"].sharding.device_set) == config.num_devices
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), expected)


def test_the_compute_copy_is_not_saved_and_is_rebuilt_on_restore(tmp_path, setup, dataset):
    """``compute_params`` stays out of the checkpoint; a restore derives it from the params, so states
    with and without the copy restore from the same checkpoint, onto another mesh too."""
    _, optimizer = setup
    model = TinyLM(dtype=jnp.bfloat16)
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ), compute_dtype=jnp.bfloat16)
    state, _ = _train(state, make_train_step(model, optimizer), DataIterator(dataset, BATCH), 2)
    with Checkpointer(tmp_path, save_every=1) as checkpointer:
        checkpointer.save(2, state, {"data": {}})
    config = MeshConfig(dp=4, tp=2)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    for compute_dtype in (jnp.bfloat16, None):
        abstract = abstract_train_state(model, optimizer, (BATCH, SEQ), mesh=mesh, rules=rules,
                                        compute_dtype=compute_dtype)
        with Checkpointer(tmp_path) as checkpointer:
            restored, _ = checkpointer.restore(abstract)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(state.params))
        if compute_dtype is None:
            assert restored.compute_params is None
            continue
        for leaf, target in zip(jax.tree.leaves(restored.compute_params), jax.tree.leaves(abstract.compute_params)):
            assert leaf.sharding == target.sharding and leaf.dtype == target.dtype
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.compute_params),
                     jax.device_get(state.compute_params))


def test_resume_is_exact(tmp_path, setup, dataset):
    model, optimizer = setup
    mesh, rules, abstract, step = _sharded(model, optimizer, MeshConfig(dp=2, tp=2))
    fresh = lambda: init_train_state(model, optimizer, jax.random.PRNGKey(7), (BATCH, SEQ), mesh=mesh, rules=rules)

    _, straight = _train(fresh(), step, DataIterator(dataset, BATCH), 20)

    batches = DataIterator(dataset, BATCH)
    state, first = _train(fresh(), step, batches, 10)
    with Checkpointer(tmp_path, save_every=10) as checkpointer:
        checkpointer.save(10, state, {"data": batches.state()})
    del state
    with Checkpointer(tmp_path) as checkpointer:
        state, meta = checkpointer.restore(abstract)
    resumed_batches = DataIterator(dataset, BATCH)
    resumed_batches.restore(meta["data"])
    _, second = _train(state, step, resumed_batches, 10)
    assert first + second == straight  # bit-identical: same params, optimizer, RNG and data order


def test_saves_every_n_and_keeps_the_last_k(tmp_path, setup):
    model, optimizer = setup
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
    with Checkpointer(tmp_path, save_every=2, keep=2) as checkpointer:
        saved = [checkpointer.save(s, state, {"data": {"position": s}}) for s in range(1, 7)]
        assert checkpointer.save(7, state, {"data": {"position": 7}}, force=True)
    assert saved == [False, True, False, True, False, True]
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [6, 7]
        assert checkpointer.restore_meta(6) == {"data": {"position": 6}}
        with pytest.raises(FileNotFoundError, match="step 3"):
            checkpointer.restore_meta(3)
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path, save_every=0)
    with Checkpointer(tmp_path / "forced", save_every=None) as checkpointer:
        assert not checkpointer.save(100, state, {}) and checkpointer.save(3, state, {}, force=True)


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_last_complete_checkpoint(tmp_path):
    child = subprocess.Popen([sys.executable, "-m", "tests.train.save_and_hang", str(tmp_path)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    try:
        line = child.stdout.readline()
        assert line.strip() == "saving", child.stderr.read()
    finally:
        child.kill()
        child.wait()
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith("2")]
    assert leftovers and all("tmp" in name for name in leftovers)  # the kill did land mid-save
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [1]
        state, meta = checkpointer.restore(abstract_train_state(TinyLM(), optax.adam(1e-3), (2, 8)))
    assert int(state.step) == 0 and meta == {"data": {"position": 1}}
