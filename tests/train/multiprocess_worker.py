"""One process of the multi-process training test, and the run it performs (shared with the test).

    python -m tests.train.multiprocess_worker PROCESS_ID NUM_PROCESSES PORT CHECKPOINT_DIR

joins the job on localhost:PORT (each process has 4 CPU devices) with a peer watch, trains `TinyLM`
for `STEPS` steps on one 8-device data-parallel mesh, each process loading only its rows of every
batch, saves a checkpoint and prints the losses as JSON (process 0).
"""

import json
import sys

import numpy as np

STEPS, BATCH, SEQ = 5, 8, 16


def train(checkpoint_dir: str) -> list[float]:
    """Train on every device of every process; returns the per-step losses."""
    import jax
    import optax

    from mtjax.sharding import MeshConfig, logical_axis_rules
    from mtjax.train.checkpoint import Checkpointer
    from mtjax.train.data import DataIterator, PackedDataset
    from mtjax.train.distributed import global_batch, process_rows
    from mtjax.train.state import abstract_train_state, batch_sharding, init_train_state
    from mtjax.train.step import make_train_step
    from tests.train.tiny_lm import TinyLM

    config = MeshConfig(dp=8)
    mesh, rules = config.make_mesh(), logical_axis_rules(config)
    model, optimizer = TinyLM(), optax.adam(1e-2)
    abstract = abstract_train_state(model, optimizer, (BATCH, SEQ), mesh=mesh, rules=rules)
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (BATCH, SEQ), mesh=mesh, rules=rules)
    step = make_train_step(model, optimizer, mesh=mesh, rules=rules,
                           state_sharding=jax.tree.map(lambda a: a.sharding, abstract))
    text = np.frombuffer(b"Errors should never pass silently. Unless explicitly silenced. " * 20, np.uint8)
    sharding = batch_sharding(mesh, rules)
    batches = DataIterator(PackedDataset(text.astype(np.int32), SEQ, seed=1), BATCH,
                           rows=process_rows(sharding, BATCH))
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, global_batch(next(batches), sharding, BATCH))
        losses.append(float(metrics["loss"]))
    with Checkpointer(checkpoint_dir) as checkpointer:
        checkpointer.save(STEPS, state, {"data": batches.state()}, force=True)
    return losses


if __name__ == "__main__":
    process_id, num_processes, port, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from mtjax.train import distributed

    distributed.initialize(f"localhost:{port}", num_processes, process_id)
    import jax

    assert jax.device_count() == 8 and jax.local_device_count() == 8 // num_processes
    # The peer watch runs through the whole job and lets both processes finish normally.
    peers = distributed.watch_peers(60, on_lost=lambda reason: print(f"peer lost: {reason}", file=sys.stderr))
    losses = train(directory)
    peers.close()
    if process_id == 0:
        print(json.dumps(losses), flush=True)
