"""Multi-process (multi-host) runs: joining the job, and building global arrays from local data.

Every process runs the same program. `initialize` joins them through ``jax.distributed`` (after
which ``jax.devices()`` lists every process's devices and a mesh spans them all). Each process then
loads only the rows of each batch that its own devices hold (`process_rows`) and `global_batch`
assembles the global arrays from those local pieces, without any process holding the whole batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Sharding

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from None


# Seconds a process may go without a heartbeat before the coordination service declares it dead
# and every other process stops (jax's own default is 100).
HEARTBEAT_TIMEOUT_SECONDS = 60


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cluster_detection: bool = False,
               heartbeat_timeout_seconds: int = HEARTBEAT_TIMEOUT_SECONDS) -> bool:
    """Join a multi-process run; returns True if one was joined, False for a single-process run.

    Each argument falls back to its environment variable (``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``). Without any of them the run is single-process,
    unless ``cluster_detection`` asks jax to read them from the cluster (SLURM, Open MPI,
    Kubernetes, Cloud TPU). Must be called before jax creates its backends (before any array).

    ``heartbeat_timeout_seconds`` bounds how long the others wait for a process that died or hangs:
    after it, the coordination service reports the missing process to every other one, which stops
    (jax terminates it with a message naming the task) instead of waiting in a collective forever.

    Raises:
      ValueError: only some of the three were given, or they are inconsistent.
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if all(v is None for v in given.values()) and not cluster_detection:
        return False
    missing = [name for name, v in given.items() if v is None]
    if missing and not cluster_detection:
        raise ValueError(
            f"distributed.initialize: {', '.join(missing)} missing; give all of coordinator_address, "
            f"num_processes and process_id (flags --coordinator-address/--num-processes/--process-id or "
            f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}), or none"
        )
    if not isinstance(heartbeat_timeout_seconds, int) or heartbeat_timeout_seconds < 1:
        raise ValueError(f"distributed.initialize(heartbeat_timeout_seconds={heartbeat_timeout_seconds!r}): "
                         "expected a positive int")
    if num_processes is not None and (num_processes < 1 or not 0 <= (process_id or 0) < num_processes):
        raise ValueError(f"distributed.initialize: process_id={process_id} must be in [0, "
                         f"num_processes={num_processes})")
    # CPU devices of different processes talk through gloo (the default CPU backend has no
    # cross-process collectives); GPU runs are unaffected by this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    return True


def process_rows(sharding: Sharding, batch_size: int) -> slice:
    """The rows of a ``[batch_size, ...]`` global batch laid out by ``sharding`` that this process holds.

    Raises:
      ValueError: this process's rows are not one contiguous range (a mesh whose device order
        does not follow the processes; build it with `mtjax.sharding.MeshConfig.make_mesh`).
    """
    slices = sharding.addressable_devices_indices_map((batch_size,)).values()
    rows = sorted({row for index in slices for row in range(*index[0].indices(batch_size))})
    if rows != list(range(rows[0], rows[-1] + 1)):
        raise ValueError(f"process {jax.process_index()} holds rows {rows} of the batch, not one contiguous range")
    return slice(rows[0], rows[-1] + 1)


def global_batch(local_batch: Mapping[str, np.ndarray], sharding: Sharding, batch_size: int) -> dict[str, jax.Array]:
    """Global ``[batch_size, ...]`` arrays from this process's rows (`process_rows`) of each."""
    return {
        name: jax.make_array_from_process_local_data(sharding, local, (batch_size, *local.shape[1:]))
        for name, local in local_batch.items()
    }
