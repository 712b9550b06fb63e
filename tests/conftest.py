"""Test setup: 8 virtual CPU devices (before jax is imported), hypothesis profiles, markers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_default_matmul_precision", "highest")

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
