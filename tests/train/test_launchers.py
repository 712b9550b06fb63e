"""How `mtjax train` finds its place in a multi-process run: the environment of each launcher
(SLURM, Open MPI, Kubernetes indexed Job / JobSet, explicit variables), parsed without a cluster;
and the XLA flag presets."""

import pytest

from mtjax.train import distributed
from mtjax.train.distributed import ProcessSpec, detect_launcher, resolve
from mtjax.xla_flags import XLA_PRESETS, apply_xla_flags, xla_flags

LAUNCHER_VARIABLES = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_PORT",
    "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_NODES",
    "OMPI_MCA_orte_hnp_uri", "OMPI_VERSION", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NNODES",
    "JOB_COMPLETION_INDEX", "JOB_INDEX", "JOBSET_NAME", "REPLICATED_JOB_NAME",
    "KUBERNETES_SERVICE_HOST",
)


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


def test_nothing_is_a_single_process_run(env):
    assert detect_launcher() is None
    assert resolve() is None
    assert distributed.initialize() is None


def test_explicit_variables(env):
    env(JAX_COORDINATOR_ADDRESS="10.0.0.1:1234", JAX_NUM_PROCESSES=4, JAX_PROCESS_ID=3)
    assert resolve() == ProcessSpec("env", "10.0.0.1:1234", 4, 3)
    # Arguments (the --coordinator-address/... flags) win over the environment.
    assert resolve("head:99", None, 1) == ProcessSpec("flags", "head:99", 4, 1)


def test_slurm(env):
    env(SLURM_JOB_ID=12345, SLURM_STEP_NODELIST="gpu[003-007,012],login1", SLURM_NTASKS=16, SLURM_PROCID=5,
        SLURM_LOCALID=1)
    port = 12345 % 4096 + 65536 - 4096  # jax's port from the job id
    assert detect_launcher() == ProcessSpec("slurm", f"gpu003:{port}", 16, 5, local_process_id=1)
    assert detect_launcher().local_device_ids() is None  # tasks per node unknown: every visible GPU
    env(JAX_COORDINATOR_PORT=6000, SLURM_STEP_NUM_NODES=4)
    spec = resolve()
    assert spec.coordinator_address == "gpu003:6000"
    assert spec.processes_per_node == 4 and spec.local_device_ids() == [1]  # one process per GPU
    env(SLURM_STEP_NUM_NODES=16)
    assert resolve().local_device_ids() is None  # one process per node drives all its GPUs
    env(SLURM_NTASKS=1, SLURM_PROCID=0)
    assert distributed.initialize() is None  # one task: nothing to join


def test_open_mpi(env):
    env(OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://10.96.0.1,10.148.0.1:34911", OMPI_COMM_WORLD_SIZE=8,
        OMPI_COMM_WORLD_RANK=6, OMPI_COMM_WORLD_LOCAL_RANK=2, OMPI_COMM_WORLD_LOCAL_SIZE=4)
    port = (1531576320 // 4096) % 4096 + 65536 - 4096
    assert resolve() == ProcessSpec("openmpi", f"10.96.0.1:{port}", 8, 6, local_process_id=2, processes_per_node=4)


def test_kubernetes_jobset_and_indexed_job(env):
    env(JOB_COMPLETION_INDEX=3, JOBSET_NAME="llama", REPLICATED_JOB_NAME="workers", JAX_NUM_PROCESSES=4)
    coordinator = f"llama-workers-0-0.llama:{distributed.DEFAULT_COORDINATOR_PORT}"
    assert resolve() == ProcessSpec("kubernetes", coordinator, 4, 3)
    env(JAX_COORDINATOR_PORT=1234)
    assert resolve().coordinator_address == "llama-workers-0-0.llama:1234"
    env(JOB_INDEX=1)
    with pytest.raises(ValueError, match="JOB_INDEX=1"):
        resolve()


def test_kubernetes_indexed_job_needs_its_size_and_coordinator(env):
    env(JOB_COMPLETION_INDEX=0)
    with pytest.raises(ValueError, match="set JAX_NUM_PROCESSES"):
        resolve()
    env(JAX_NUM_PROCESSES=2)
    with pytest.raises(ValueError, match="set JAX_COORDINATOR_ADDRESS"):
        resolve()
    env(JAX_COORDINATOR_ADDRESS="train-0.train:8476")
    assert resolve() == ProcessSpec("kubernetes", "train-0.train:8476", 2, 0)


def test_inconsistent_settings(env):
    with pytest.raises(ValueError, match="num_processes, process_id missing"):
        resolve("localhost:1234")
    with pytest.raises(ValueError, match="process_id=3 must be in"):
        resolve("localhost:1234", 2, 3)
    env(SLURM_JOB_ID=1, SLURM_STEP_NODELIST="n1", SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0)
    with pytest.raises(ValueError, match="process_id=5 must be in .*from flags"):
        resolve(process_id=5)


def test_topology_line(env):
    line = distributed.topology()
    assert line.startswith("process 0 of 1 on ") and "single process" in line and "8 local of 8 devices" in line


def test_xla_flag_presets():
    assert XLA_PRESETS == ("multi_gpu",)
    flags = xla_flags("multi_gpu")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    environ = {"XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=false --xla_dump_to=/tmp/x"}
    merged = apply_xla_flags("multi_gpu", environ).split()
    assert "--xla_gpu_enable_pipelined_all_gather=false" in merged  # the user's value wins
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in merged
    assert merged[:2] == ["--xla_gpu_enable_pipelined_all_gather=false", "--xla_dump_to=/tmp/x"]
    assert len(merged) == len(flags) + 1
    with pytest.raises(ValueError, match="accepted: multi_gpu"):
        xla_flags("tpu")
