"""On a CUDA machine: load jax's own CUDA PJRT library through `mtjax.backend.load_plugin` under a new
platform name, as a vendor GPU's plugin would be loaded, and run jitted mtjax ops on it."""

import glob
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu


def _cuda_plugin_library() -> str:
    import jax_plugins

    for root in jax_plugins.__path__:
        found = glob.glob(os.path.join(root, "xla_cuda*", "xla_cuda_plugin.so"))
        if found:
            return found[0]
    pytest.skip("jax's CUDA PJRT plugin library is not installed")


def test_cuda_library_loaded_as_a_vendor_plugin_runs_mtjax_ops():
    library = _cuda_plugin_library()
    code = textwrap.dedent(f"""
        import numpy as np
        import mtjax
        from mtjax import backend, ops
        backend.load_plugin("mtcuda", {library!r}, options=backend.gpu_plugin_options())
        import jax, jax.numpy as jnp
        print("devices:", jax.devices(), "lowering platform:", backend.platform())
        print("capabilities:", sorted(backend.capabilities()))
        x = jax.random.normal(jax.random.key(0), (256, 1000), jnp.float32)
        g = jnp.linspace(0.5, 1.5, 1000)
        y = jax.jit(lambda x: ops.layernorm(x, g))(x)
        xn = np.asarray(x, np.float64)
        ref = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-6) * np.asarray(g)
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)
        for impl in backend.implementations("layernorm"):
            if impl != "xla":
                z = jax.jit(lambda x: ops.layernorm(x, g, implementation=impl))(x)
                np.testing.assert_allclose(np.asarray(z), ref, rtol=1e-4, atol=1e-4)
                print("layernorm", impl, "ok on mtcuda")
        impl, why = backend.select("attention")
        print("attention on mtcuda:", impl.name, why)
        q = jax.random.normal(jax.random.key(1), (2, 256, 4, 64), jnp.bfloat16)
        out = jax.jit(lambda q: ops.attention(q, q, q, mask_type="causal"))(q)
        ref = ops.attention(q, q, q, mask_type="causal", implementation="xla")
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)
        print("PLUGIN_OK", backend.loaded_plugins())
    """)
    env = {**os.environ, "JAX_PLATFORMS": "mtcuda"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    print(result.stdout, result.stderr[-3000:])
    assert "PLUGIN_OK" in result.stdout
