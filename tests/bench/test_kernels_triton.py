"""`python -m mtjax.bench.kernels_triton`: the comparison rule, and one check end to end in interpret mode."""

import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.bench import kernels_triton

pytestmark = pytest.mark.usefixtures("fast_compiles")


def test_compare_judges_floats_by_the_largest_entry_and_fp8_by_agreement():
    ref = jnp.asarray([100.0, 1.0])
    assert kernels_triton._compare(ref + jnp.asarray([1.0, 1.0]), ref)[0]  # 1e-2 of the largest entry
    assert not kernels_triton._compare(ref + jnp.asarray([5.0, 0.0]), ref)[0]
    assert not kernels_triton._compare(jnp.asarray([np.nan, 1.0]), ref)[0]
    q = jnp.arange(200, dtype=jnp.float32).astype(jnp.float8_e4m3fn)
    assert kernels_triton._compare(q, q)[0]
    assert not kernels_triton._compare(q.at[:10].set(0), q)[0]


def test_a_check_runs_in_interpret_mode(interpret):
    pytest.importorskip("triton")
    [result] = kernels_triton.run_checks(quick=True, only="cast_transpose")
    assert result["status"] == "PASS", result
