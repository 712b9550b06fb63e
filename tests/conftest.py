"""Test setup: 8 virtual CPU devices (before jax is imported), hypothesis profiles, markers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import shutil
import tempfile

import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole run: its xdist workers and the processes the tests
# start (the CLI, two-process runs) compile the same tiny models many times; a cache hit returns the
# executable a compilation of the same program made, so no result changes. The first process to load
# this file (the xdist controller) makes the folder and removes it at the end; workers and child
# processes inherit it through JAX_COMPILATION_CACHE_DIR. MTJAX_TEST_COMPILATION_CACHE=0 turns it off.
# Programs compiled in under 0.1 s (thousands of eager ops and tiny jits) are not written: their
# writes cost a few seconds per module, a hit on one would save less than 0.1 s.
_created_cache = None
if os.environ.get("MTJAX_TEST_COMPILATION_CACHE", "1") != "0":
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        _created_cache = tempfile.mkdtemp(prefix="mtjax-test-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _created_cache
    for name, value in (("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"]),
                        ("jax_persistent_cache_min_compile_time_secs", 0.1),
                        ("jax_persistent_cache_min_entry_size_bytes", 0)):
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)


def pytest_sessionfinish(session):
    if _created_cache is not None:
        shutil.rmtree(_created_cache, ignore_errors=True)


settings.register_profile(
    "ci", max_examples=8, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev", max_examples=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the GPU machine with JAX_PLATFORMS=cuda)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def interpret():
    """Run Pallas kernels in interpret mode (on the CPU) inside the test."""
    from mtjax.config import override

    with override(pallas_interpret=True):
        yield


@pytest.fixture(scope="module")
def fast_compiles():
    """XLA without most optimizations: compiles of toy models take about half the time, and no
    assertion about their results depends on the optimizations (use per module:
    ``pytestmark = pytest.mark.usefixtures("fast_compiles")``)."""
    saved = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", saved)


@pytest.fixture
def optimized_compiles():
    """XLA with its optimizations for one test of a `fast_compiles` module: for a tolerance measured
    against the numbers XLA's optimized CPU code gives (its GELU rounds otherwise in the last bits)."""
    saved = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", saved)
