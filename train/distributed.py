"""Multi-process (multi-host) runs: joining the job, and building global arrays from local data.

Every process runs the same program. `initialize` joins them through ``jax.distributed`` (after
which ``jax.devices()`` lists every process's devices and a mesh spans them all), with the settings
given, from ``JAX_*`` environment variables, or from the launcher (SLURM, Open MPI, Kubernetes
indexed Job / JobSet; `detect_launcher`); `topology` describes the process. Each process then
loads only the rows of each batch that its own devices hold (`process_rows`) and `global_batch`
assembles the global arrays from those local pieces, without any process holding the whole batch.
`watch_peers` (a `PeerWatch`) ends every process with a message of its own when one dies or fails.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
DEFAULT_COORDINATOR_PORT = 8476
LAUNCHERS = ("flags", "env", "slurm", "openmpi", "kubernetes")


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """How this process joins a multi-process run.

    Attributes:
      launcher: where the settings came from, one of `LAUNCHERS` (``"flags"``: arguments;
        ``"env"``: ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``).
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: processes in the run.
      process_id: this process's index.
      local_process_id: its index on its node, where the launcher says (SLURM, Open MPI).
      processes_per_node: processes on each node, where the launcher says.
    """

    launcher: str
    coordinator_address: str
    num_processes: int
    process_id: int
    local_process_id: int | None = None
    processes_per_node: int | None = None

    def local_device_ids(self) -> list[int] | None:
        """The local GPUs this process drives: its own one when the launcher runs several
        processes per node (one per GPU), else None (every visible device; ``JAX_LOCAL_DEVICE_IDS``
        or ``CUDA_VISIBLE_DEVICES`` narrow it)."""
        if self.local_process_id is None or (self.processes_per_node or 1) <= 1:
            return None
        if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
            return None
        return [self.local_process_id]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from None


def _coordinator_port() -> str | None:
    port = _env_int(ENV_COORDINATOR_PORT)
    return None if port is None else str(port)


# Seconds a process may go silent before the others take it as dead (`PeerWatch`).
PEER_TIMEOUT_SECONDS = 60


def _from_jax_cluster(name: str, cluster) -> ProcessSpec | None:
    """The settings jax's own cluster detection reads (``jax._src.clusters``), or None if absent."""
    if not cluster.is_env_present():
        return None
    num_processes = cluster.get_process_count()
    if name == "slurm":
        nodes = _env_int("SLURM_STEP_NUM_NODES") or _env_int("SLURM_NNODES")
        per_node = None if not nodes else -(-num_processes // nodes)
    else:
        per_node = _env_int("OMPI_COMM_WORLD_LOCAL_SIZE")
    return ProcessSpec(launcher=name,
                       coordinator_address=cluster.get_coordinator_address(None, _coordinator_port()),
                       num_processes=num_processes, process_id=cluster.get_process_id(),
                       local_process_id=cluster.get_local_process_id(), processes_per_node=per_node)


def _kubernetes() -> ProcessSpec | None:
    """An indexed Job or a JobSet: the pod's index is ``JOB_COMPLETION_INDEX``.

    Kubernetes tells a pod neither the number of pods nor (for a plain indexed Job) where pod 0
    is, so the manifest sets ``JAX_NUM_PROCESSES`` (and, without a JobSet, ``JAX_COORDINATOR_ADDRESS``,
    e.g. ``<job>-0.<headless service>:8476``). Under a JobSet the coordinator is pod 0 of job 0,
    ``<jobset>-<replicated job>-0-0.<jobset>`` (JobSet's headless service), on ``JAX_COORDINATOR_PORT``
    (default 8476). One replicated job of ``JAX_NUM_PROCESSES`` pods.
    """
    index = os.environ.get("JOB_COMPLETION_INDEX", "").strip()
    if not index:
        return None
    process_id = _env_int("JOB_COMPLETION_INDEX")
    job_index = _env_int("JOB_INDEX") or 0
    if job_index:
        raise ValueError(f"Kubernetes: JOB_INDEX={job_index}: a JobSet with several replicas of the job; use one "
                         f"replicated job of JAX_NUM_PROCESSES pods or set {ENV_PROCESS_ID} yourself")
    num_processes = _env_int(ENV_NUM_PROCESSES)
    if num_processes is None:
        raise ValueError(f"Kubernetes (JOB_COMPLETION_INDEX={index}): set {ENV_NUM_PROCESSES} to the job's number "
                         f"of pods (its completions / parallelism) in the manifest")
    coordinator = os.environ.get(ENV_COORDINATOR, "").strip()
    jobset, replicated_job = os.environ.get("JOBSET_NAME", ""), os.environ.get("REPLICATED_JOB_NAME", "")
    if not coordinator and jobset and replicated_job:
        port = _coordinator_port() or str(DEFAULT_COORDINATOR_PORT)
        coordinator = f"{jobset}-{replicated_job}-0-0.{jobset}:{port}"
    if not coordinator:
        raise ValueError(f"Kubernetes indexed Job: set {ENV_COORDINATOR} to pod 0's host:port (e.g. "
                         f"<job>-0.<headless service>:{DEFAULT_COORDINATOR_PORT}), or run it in a JobSet")
    return ProcessSpec("kubernetes", coordinator, num_processes, process_id)


def detect_launcher() -> ProcessSpec | None:
    """The settings of the launcher this process runs under (read from the environment), or None.

    In this order: ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID`` (all
    three); SLURM (``srun``: ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,
    ``SLURM_PROCID``, ``SLURM_LOCALID``) and Open MPI (``mpirun``: ``OMPI_MCA_orte_hnp_uri`` /
    ``OMPI_COMM_WORLD_*``; Open MPI 5 needs mpi4py) through jax's own cluster detection (the
    coordinator is the first node, on a port derived from the job id unless ``JAX_COORDINATOR_PORT``);
    Kubernetes indexed Jobs and JobSets (`_kubernetes`).
    """
    from jax._src import clusters

    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    if all(os.environ.get(name, "").strip() for name in names) and "JOB_COMPLETION_INDEX" not in os.environ:
        return ProcessSpec("env", os.environ[ENV_COORDINATOR].strip(), _env_int(ENV_NUM_PROCESSES),
                           _env_int(ENV_PROCESS_ID))
    for name, cluster in (("slurm", clusters.SlurmCluster), ("openmpi", clusters.OmpiCluster)):
        spec = _from_jax_cluster(name, cluster)
        if spec is not None:
            return spec
    return _kubernetes()


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None) -> ProcessSpec | None:
    """The `ProcessSpec` of this process: each argument given wins over what the environment says
    (`detect_launcher`; ``JAX_*`` variables fill gaps too); None for a single-process run.

    Raises:
      ValueError: only some of the three are known, or they are inconsistent.
    """
    detected = detect_launcher()
    given = {"coordinator_address": coordinator_address or os.environ.get(ENV_COORDINATOR) or None,
             "num_processes": num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES),
             "process_id": process_id if process_id is not None else _env_int(ENV_PROCESS_ID)}
    explicit = any(v is not None for v in (coordinator_address, num_processes, process_id))
    if detected is not None:
        values = {name: given[name] if given[name] is not None and (explicit or detected.launcher == "env")
                  else getattr(detected, name) for name in given}
        launcher = "flags" if explicit else detected.launcher
        spec = ProcessSpec(launcher, values["coordinator_address"], values["num_processes"], values["process_id"],
                           detected.local_process_id, detected.processes_per_node)
    else:
        if all(v is None for v in given.values()):
            return None
        missing = [name for name, v in given.items() if v is None]
        if missing:
            raise ValueError(
                f"distributed.initialize: {', '.join(missing)} missing; give all of coordinator_address, "
                f"num_processes and process_id (flags --coordinator-address/--num-processes/--process-id or "
                f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}), or run under SLURM, Open MPI or a "
                f"Kubernetes indexed Job / JobSet"
            )
        spec = ProcessSpec("flags" if explicit else "env", given["coordinator_address"], given["num_processes"],
                           given["process_id"])
    if spec.num_processes < 1 or not 0 <= spec.process_id < spec.num_processes:
        raise ValueError(f"distributed.initialize: process_id={spec.process_id} must be in "
                         f"[0, num_processes={spec.num_processes}) (from {spec.launcher})")
    return spec


def coordination_heartbeat_timeout(peer_timeout_seconds: int) -> int:
    """The heartbeat timeout given to jax's coordination service: a backstop behind `PeerWatch`.

    When the service declares a process dead it aborts every other one from C++ (a check failure
    with a stack trace) before anything reaches Python, so its timeout is set long enough for
    `PeerWatch` (``peer_timeout_seconds`` plus a few polls) to end them with a message first: the
    service may act from half its timeout on (its heartbeats are periodic).
    """
    return 2 * peer_timeout_seconds + 30


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               peer_timeout_seconds: int = PEER_TIMEOUT_SECONDS) -> ProcessSpec | None:
    """Join a multi-process run (`resolve` says how); returns its `ProcessSpec`, or None when the
    run is single-process (nothing given or detected, or a launcher with one process).

    Must be called before jax creates its backends (before any array). ``peer_timeout_seconds`` is
    how long a silent process is waited for: start `watch_peers` with the same value; jax's own
    detection is set behind it (`coordination_heartbeat_timeout`).
    """
    if isinstance(peer_timeout_seconds, bool) or not isinstance(peer_timeout_seconds, int) \
            or peer_timeout_seconds < 1:
        raise ValueError(f"distributed.initialize(peer_timeout_seconds={peer_timeout_seconds!r}): "
                         "expected a positive int")
    spec = resolve(coordinator_address, num_processes, process_id)
    if spec is None or spec.num_processes == 1:
        return None
    # CPU devices of different processes talk through gloo (the default CPU backend has no
    # cross-process collectives); GPU runs are unaffected by this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Everything is resolved here (with jax's cluster classes where they exist), so jax's own
    # detection is off: it would give a process of a one-process-per-node SLURM job only GPU 0.
    jax.distributed.initialize(spec.coordinator_address, spec.num_processes, spec.process_id,
                               local_device_ids=spec.local_device_ids(), cluster_detection_method="deactivate",
                               heartbeat_timeout_seconds=coordination_heartbeat_timeout(peer_timeout_seconds))
    return spec


class PeerWatch:
    """Ends every process of a run, each with one line, when one of them dies or fails.

    A background thread of each process writes a heartbeat counter into the coordination service's
    key-value store every ``interval`` seconds. Process 0 (which hosts the service) reads them all:
    for a process whose counter has not moved for ``timeout_seconds``, or that reported a failure
    (`fail`), it writes a verdict into the store. Every process reads the verdict at its next poll,
    calls ``on_lost(reason)`` (which prints why) and exits with status 1. Process 0 leaves last
    (once each survivor acknowledged the verdict, or after a few polls), since its exit takes the
    service away and jax aborts the processes still connected to it.

    Without this, a dead process is noticed only by jax's coordination service, which aborts every
    other process from C++ (a check failure), or by a collective that fails or waits forever,
    depending on the backend and jax version. A process that hangs with its threads alive keeps
    beating and is not detected. Process 0's own death ends the others through jax at once: the
    service goes with it.

    Args:
      store: the coordination service's client (``key_value_set(key, value, allow_overwrite)``,
        ``key_value_dir_get(directory) -> [(key, value)]``).
      process_id, num_processes: this process and the run's size.
      timeout_seconds: silence after which a process is taken as dead.
      on_lost: ``reason -> None``, prints why this process stops (called from the watch thread); the
        watch then exits the process. Reassign it as the run progresses.
      interval: seconds between polls (default ``timeout_seconds / 10``, within [0.2, 5]).
      clock, exit: time source and process exit (``time.monotonic``, ``os._exit``).
    """

    DIRECTORY = "mtjax/peer_watch"
    DONE, FAILED = "done", "failed: "

    def __init__(self, store: Any, process_id: int, num_processes: int, timeout_seconds: float,
                 on_lost: Callable[[str], None], interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic, exit: Callable[[int], Any] = os._exit) -> None:
        self.store, self.process_id, self.num_processes = store, process_id, num_processes
        self.timeout = float(timeout_seconds)
        self.interval = interval if interval is not None else min(max(self.timeout / 10, 0.2), 5.0)
        self.on_lost, self.clock, self.exit = on_lost, clock, exit
        self.beats = 0
        now = clock()
        # Process 0's view of every other process: its last heartbeat value and when it changed.
        self.seen = {p: ("", now) for p in range(num_processes) if p != process_id}
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def _set(self, kind: str, value: str) -> None:
        self.store.key_value_set(f"{self.DIRECTORY}/{kind}/{self.process_id}", value, allow_overwrite=True)

    def _get(self, kind: str) -> dict[int, str]:
        prefix = f"{self.DIRECTORY}/{kind}/"
        return {int(key[len(prefix):]): value for key, value in self.store.key_value_dir_get(prefix)}

    def poll(self) -> str | None:
        """One round: beat, and return the verdict (why the run must end), or None."""
        self.beats += 1
        self._set("beat", str(self.beats))
        verdicts = self._get("verdict")
        if verdicts or self.process_id != 0:
            return verdicts[min(verdicts)] if verdicts else None
        now, lost = self.clock(), []
        for process, value in self._get("beat").items():
            if process in self.seen and value != self.seen[process][0]:
                self.seen[process] = (value, now)
        for process, (value, since) in sorted(self.seen.items()):
            if value.startswith(self.FAILED):
                lost.append(f"process {process} {value}")
            elif value != self.DONE and now - since > self.timeout:
                lost.append(f"process {process} sent no heartbeat for {now - since:.0f} s: it died or became "
                            "unreachable")
        if not lost:
            return None
        verdict = "; ".join(lost)
        self._set("verdict", verdict)
        return verdict

    def check(self) -> None:
        """`poll`; on a verdict, report it (``on_lost``) and exit with status 1."""
        verdict = self.poll()
        if verdict is not None and not self.stopped.is_set():
            self.stopped.set()
            self.on_lost(verdict)
            self._leave(status=1)

    def _watch(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001  (the service is unreachable: jax itself ends this process then)
                continue

    def start(self) -> PeerWatch:
        self.thread = threading.Thread(target=self._watch, name="mtjax-peer-watch", daemon=True)
        self.thread.start()
        atexit.register(self.close)  # runs before jax's own exit handler, which shuts the service down
        return self

    def _leave(self, status: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            if self.process_id == 0:
                self._wait_for_the_others()
            else:
                self._set("left", "")
        finally:
            self.exit(status)

    def _wait_for_the_others(self) -> None:
        """Until every other process left, failed, finished or went silent, for a few polls at most."""
        deadline = self.clock() + 3 * self.interval + 2
        while self.clock() < deadline:
            left, beats, now = self._get("left"), self._get("beat"), self.clock()
            for process, value in beats.items():
                if process in self.seen and value != self.seen[process][0]:
                    self.seen[process] = (value, now)
            if all(process in left or value.startswith(self.FAILED) or value == self.DONE
                   or now - since > self.timeout for process, (value, since) in self.seen.items()):
                return
            time.sleep(min(self.interval, 0.2))

    def fail(self, reason: str, status: int = 1) -> None:
        """This process ends with an error (printed already): tell the others, then exit with ``status``.

        Leaving through `sys.exit` instead would wait in jax's shutdown barrier for processes that
        wait in a collective for this one."""
        if not self.stopped.is_set():
            self.stopped.set()
            if self.process_id == 0:
                self._set("verdict", f"process 0 {self.FAILED}{reason}")
            else:
                self._set("beat", f"{self.FAILED}{reason}")
        self._leave(status)

    def close(self) -> None:
        """This process finished normally: the others stop expecting its heartbeats; the thread stops."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        try:
            self._set("beat", self.DONE)
        finally:
            if self.thread is not None and self.thread is not threading.current_thread():
                self.thread.join(timeout=self.interval + 5)


def watch_peers(timeout_seconds: int, on_lost: Callable[[str], None]) -> PeerWatch | None:
    """Start a `PeerWatch` over the processes `initialize` joined; None for a single process."""
    if jax.process_count() == 1:
        return None
    from jax._src import distributed as jax_distributed  # the client: no public accessor

    client = getattr(getattr(jax_distributed, "global_state", None), "client", None)
    if client is None:
        raise RuntimeError("watch_peers: jax.distributed is not initialized (call distributed.initialize first)")
    return PeerWatch(client, jax.process_index(), jax.process_count(), timeout_seconds, on_lost).start()


def topology(spec: ProcessSpec | None = None) -> str:
    """One line on this process: its index, host, launcher, local and global devices."""
    local, devices = jax.local_devices(), jax.devices()
    how = "single process" if spec is None else f"{spec.launcher}, coordinator {spec.coordinator_address}"
    kinds = sorted({d.device_kind for d in local})
    return (f"process {jax.process_index()} of {jax.process_count()} on {socket.gethostname()} ({how}): "
            f"{len(local)} local of {len(devices)} devices ({', '.join(kinds)}; ids "
            f"{[d.id for d in local][:8]}{' ...' if len(local) > 8 else ''})")


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
