"""Checkpoints: restore onto other meshes, exact resume, retention, and a save killed midway."""

import errno
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import atomicity

from mtjax.sharding import MeshConfig, logical_axis_rules
from mtjax.train.checkpoint import Checkpointer, CheckpointError, NonFiniteStateError
from mtjax.train.data import DataIterator, PackedDataset
from mtjax.train.state import abstract_train_state, init_train_state
from mtjax.train.step import make_optimizer, make_train_step
from tests.train.tiny_lm import TinyLM

pytestmark = pytest.mark.usefixtures("fast_compiles")

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
            assert not checkpointer.restore_data(2, DataIterator(dataset, BATCH).iterator)  # saved without it
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
        checkpointer.save(10, state, {"data": batches.state()}, data_iterator=batches.iterator)
    del state, batches  # as a killed run: only the checkpoint is left
    with Checkpointer(tmp_path) as checkpointer:
        state, meta = checkpointer.restore(abstract)
        resumed_batches = DataIterator(dataset, BATCH)
        assert checkpointer.restore_data(10, resumed_batches.iterator)  # the data item: grain's state
    assert meta == {"data": {"position": 10}}
    _, second = _train(state, step, resumed_batches, 10)
    assert first + second == straight  # bit-identical: same params, optimizer, RNG and data order
    uninterrupted = DataIterator(dataset, BATCH, position=20)
    np.testing.assert_array_equal(next(resumed_batches)["inputs"], next(uninterrupted)["inputs"])


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


def test_a_nonfinite_state_is_refused_and_the_good_checkpoint_kept(tmp_path, setup):
    """Issue 27 defect 1: a diverged run never writes (nor rotates in) a NaN checkpoint."""
    model, optimizer = setup
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
    nan_state = state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        checkpointer.save(1, state, {})
        with pytest.raises(NonFiniteStateError, match=r"step 2: .* NaN or Inf; not saving .*latest: step 1"):
            checkpointer.save(2, nan_state, {})
        assert checkpointer.all_steps() == [1]


def _fail_commit(monkeypatch, step, error):
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        if self._final_path.name == str(step):
            raise error
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)


def test_a_failed_background_save_surfaces_at_the_next_poll_in_one_line(tmp_path, setup, monkeypatch):
    """Defect 2: the failure of an async save is reported at once (``poll``), naming the folder and the OS error."""
    model, optimizer = setup
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
    _fail_commit(monkeypatch, 2, OSError(errno.ENOSPC, "No space left on device"))
    checkpointer = Checkpointer(tmp_path, save_every=1)
    checkpointer.save(1, state, {})
    checkpointer.save(2, state, {})
    while checkpointer._manager.is_saving_in_progress():
        time.sleep(0.01)
    with pytest.raises(CheckpointError) as failure:
        checkpointer.poll()
    message = str(failure.value)
    assert message.startswith(f"saving checkpoint step 2 to {tmp_path}/2 failed: [Errno 28] No space left on device")
    assert "\n" not in message and "keep=3 needs" in message
    checkpointer.poll()  # reported once
    checkpointer.close()
    with Checkpointer(tmp_path) as reopened:
        assert reopened.all_steps() == [1]


def test_rotation_deletes_the_oldest_before_writing(tmp_path, setup, monkeypatch):
    """Defect 2: with keep=2 at most two checkpoints (one complete, one being written) are on disk."""
    model, optimizer = setup
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
    on_disk = []
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        if str(self._final_path.parent) == str(tmp_path):  # the step folder's commit (not its items')
            on_disk.append(sorted(name.split(".")[0] for name in os.listdir(tmp_path)))
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    with Checkpointer(tmp_path, save_every=1, keep=2) as checkpointer:
        for step in range(1, 5):
            checkpointer.save(step, state, {})
        checkpointer.wait()
        assert checkpointer.all_steps() == [3, 4]
    assert on_disk == [["1"], ["1", "2"], ["2", "3"], ["3", "4"]]


def test_restore_newest_skips_damaged_steps_with_a_warning(tmp_path, setup):
    """Defect 3: an empty or garbled newest step is skipped (named), and the intact older one restored."""
    model, optimizer = setup
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ))
    abstract = abstract_train_state(model, optimizer, (BATCH, SEQ))
    with Checkpointer(tmp_path, save_every=1) as checkpointer:
        checkpointer.save(1, state, {"data": {"position": 1}})
        checkpointer.save(2, state, {"data": {"position": 2}})
    with open(tmp_path / "2" / "meta" / "metadata", "wb") as f:
        f.write(b"\x80\xff not json")
    os.mkdir(tmp_path / "3")
    warnings = []
    with Checkpointer(tmp_path) as checkpointer:
        _, meta, step = checkpointer.restore_newest(abstract, warn=warnings.append)
        assert (step, meta) == (1, {"data": {"position": 1}})
        assert warnings[0] == (f"checkpoint {tmp_path}/3 is incomplete: state, meta, _CHECKPOINT_METADATA missing; "
                               "trying step 2")
        assert warnings[1].startswith(f"checkpoint {tmp_path}/2: its meta cannot be read")
        assert warnings[1].endswith("trying step 1")
        with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path}/2: its meta cannot be read"):
            checkpointer.verify(2)
        assert checkpointer.set_aside([2, 3]) == [f"{tmp_path}/2.unusable", f"{tmp_path}/3.unusable"]
        assert checkpointer.all_steps() == [1]
