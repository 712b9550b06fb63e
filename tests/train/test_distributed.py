"""Multi-process training on localhost (2 processes x 4 CPU devices) against 1 process x 8 devices."""

import json
import os
import socket
import subprocess
import sys
import threading

import jax
import numpy as np
import optax
import pytest

from mtjax.sharding import MeshConfig, logical_axis_rules
from mtjax.train import distributed
from mtjax.train.checkpoint import Checkpointer
from mtjax.train.state import abstract_train_state
from tests.train import multiprocess_worker
from tests.train.tiny_lm import TinyLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.usefixtures("fast_compiles")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(tmp_path):
    # The workers compile as this process does (`fast_compiles`): the losses are compared to 1e-6.
    port, env = _free_port(), {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
                               "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    workers = [subprocess.Popen([sys.executable, "-m", "tests.train.multiprocess_worker", str(i), "2", str(port),
                                 str(tmp_path / "two")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outputs = [w.communicate(timeout=120) for w in workers]
    finally:
        for w in workers:
            w.kill()
    for w, (_, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-3000:]
    two_process_losses = json.loads(outputs[0][0].splitlines()[-1])  # after gloo's connection messages

    one_process_losses = multiprocess_worker.train(str(tmp_path / "one"))
    np.testing.assert_allclose(two_process_losses, one_process_losses, rtol=1e-6)

    config = MeshConfig(dp=8)
    abstract = abstract_train_state(TinyLM(), optax.adam(1e-2), (8, 16), mesh=config.make_mesh(),
                                    rules=logical_axis_rules(config))
    with Checkpointer(tmp_path / "two") as two, Checkpointer(tmp_path / "one") as one:
        (from_two, meta), (from_one, _) = two.restore(abstract), one.restore(abstract)
    assert meta == {"data": {"position": multiprocess_worker.STEPS}}
    # The gradients' all-reduce adds in another order across two processes; Adam divides by the root
    # of the second moment, which makes those last-bit differences of near-zero entries larger.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6),
                 jax.device_get(from_two), jax.device_get(from_one))


def test_initialize_is_a_no_op_alone_and_rejects_partial_settings(monkeypatch):
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is None
    with pytest.raises(ValueError, match="num_processes, process_id missing"):
        distributed.initialize("localhost:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two'"):
        distributed.initialize()
    with pytest.raises(ValueError, match="process_id=3"):
        distributed.initialize("localhost:1234", 2, 3)


def test_process_rows_of_a_single_process_is_the_whole_batch():
    config = MeshConfig(dp=4, tp=2)
    sharding = jax.sharding.NamedSharding(config.make_mesh(), jax.sharding.PartitionSpec(("dp", "fsdp")))
    assert distributed.process_rows(sharding, 8) == slice(0, 8)
    batch = distributed.global_batch({"inputs": np.arange(16).reshape(8, 2)}, sharding, 8)
    assert batch["inputs"].sharding == sharding
    np.testing.assert_array_equal(batch["inputs"], np.arange(16).reshape(8, 2))


class _Store:
    """The coordination service's key-value store, in memory."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.values
        self.values[key] = value

    def key_value_dir_get(self, directory):
        return [(key, value) for key, value in self.values.items() if key.startswith(directory)]


def _watches(num_processes, timeout=10.0):
    """One `PeerWatch` per process over one store and one clock (no threads; polls by hand)."""
    store, now, lost, exits = _Store(), [0.0], {}, {}
    watches = [distributed.PeerWatch(store, p, num_processes, timeout, interval=1.0, clock=lambda: now[0],
                                     on_lost=lambda reason, p=p: lost.setdefault(p, reason),
                                     exit=lambda status, p=p: exits.setdefault(p, status))
               for p in range(num_processes)]
    return watches, now, lost, exits


def test_peer_watch_gives_every_survivor_the_verdict_on_a_silent_process():
    watches, now, _, _ = _watches(3)
    for t in range(1, 10):  # all beat: no verdict
        now[0] = float(t)
        assert [w.poll() for w in watches] == [None, None, None]
    for t in range(10, 30):  # process 2 goes silent; process 0 saw its last beat at t=10
        now[0] = float(t)
        verdicts = [w.poll() for w in watches[:2]]
        if verdicts[0] is not None:
            break
    assert t == 21
    assert verdicts[0] == verdicts[1] == "process 2 sent no heartbeat for 11 s: it died or became unreachable"


def test_peer_watch_reports_a_failed_process_at_once_and_ignores_a_finished_one():
    watches, now, lost, exits = _watches(3)
    watches[2].close()  # finished normally: never reported
    watches[1].fail("it stopped with exit status 1")
    assert exits == {1: 1} and lost == {}  # the failing process reported itself
    now[0] = 1.0
    assert watches[0].poll() == "process 1 failed: it stopped with exit status 1"
    now[0] = 100.0
    assert watches[0].poll() == "process 1 failed: it stopped with exit status 1"


def test_peer_watch_process_0_leaves_after_the_others():
    watches, _, lost, exits = _watches(2)  # the clock stands still: process 0 waits for the acknowledgement
    leaving = threading.Thread(target=watches[0].fail, args=("step 3 diverged",))
    leaving.start()
    while 1 not in exits:
        watches[1].check()
    leaving.join(timeout=30)
    assert exits == {0: 1, 1: 1} and lost == {1: "process 0 failed: step 3 diverged"}
    with pytest.raises(ValueError, match="peer_timeout_seconds"):
        distributed.initialize("localhost:1234", 2, 0, peer_timeout_seconds=0)
