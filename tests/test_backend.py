"""The kernel registry, per-platform selection, jax.export per platform, and the PJRT plugin hook."""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import xla_bridge
from jax.experimental import pallas as pl

from mtjax import backend, ops
from mtjax.config import Config, config, override

TRITON_CALL = "__gpu$xla.gpu.triton"
ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="selection tests assume a CPU-only process")


# A test-only op: "xla" adds one; "pallas_triton" doubles, in a Pallas kernel.
def _double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


@backend.register("_test_op", "pallas_triton", requires=[backend.PALLAS_TRITON], priority=10,
                  unsupported=lambda x: None if x.ndim == 2 else "2-D inputs only")
def _test_op_kernel(x):
    return pl.pallas_call(_double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=config.pallas_interpret)(x)


@backend.register("_test_op", backend.REFERENCE)
def _test_op_reference(x):
    return x + 1


def probe_op(x, implementation=None):
    return backend.dispatch("_test_op", x, implementation=implementation)


def test_registry_lists_ops_and_implementations():
    for op in ("layernorm", "rmsnorm", "softmax", "activation", "attention", "fp8_gemm"):
        assert backend.REFERENCE in backend.implementations(op)
    assert backend.implementations("_test_op") == ("pallas_triton", "xla")
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        backend.implementations("nope")


def test_cpu_picks_the_reference_and_says_why():
    impl, why = backend.select("_test_op", args=[jnp.ones((2, 2))])
    assert impl.name == "xla" and "pallas_triton" in why
    np.testing.assert_array_equal(probe_op(jnp.ones((2, 2))), 2.0)


def test_explicit_choice_that_cannot_run_raises_naming_op_choice_and_available():
    with pytest.raises(ValueError, match=r"_test_op\(implementation='pallas_triton'\).*Available on 'cpu': \['xla'\]"):
        probe_op(jnp.ones((2, 2)), implementation="pallas_triton")
    with pytest.raises(ValueError, match="unknown implementation.*registered"):
        probe_op(jnp.ones((2, 2)), implementation="cudnn")


def test_config_override_comes_after_the_argument():
    with override(implementations={"_test_op": "pallas_triton"}):
        with pytest.raises(ValueError, match="MTJAX_IMPL__TEST_OP"):
            probe_op(jnp.ones((2, 2)))
        np.testing.assert_array_equal(probe_op(jnp.ones((2, 2)), implementation="xla"), 2.0)


def test_env_variables_set_the_config():
    cfg = Config.from_env({"MTJAX_IMPL_LAYERNORM": "xla", "MTJAX_PALLAS_INTERPRET": "1",
                           "MTJAX_CUDA_COMPUTE_CAPABILITY": "8.0"})
    assert cfg.implementations == {"layernorm": "xla"}
    assert cfg.pallas_interpret and cfg.cuda_compute_capability == "8.0"


def test_interpret_mode_runs_the_kernel_on_cpu():
    with override(pallas_interpret=True):
        np.testing.assert_array_equal(probe_op(jnp.ones((2, 2)), implementation="pallas_triton"), 2.0)
        np.testing.assert_array_equal(jax.jit(probe_op)(jnp.ones((2, 2))), 2.0)  # automatic choice


def test_unsupported_predicate_declines_unsupported_configurations():
    impl, why = backend.select("_test_op", platform_name="cuda", args=[jnp.ones((2, 2, 2))])
    assert impl.name == "xla" and "2-D inputs only" in why
    assert backend.select("_test_op", platform_name="cuda", args=[jnp.ones((2, 2))])[0].name == "pallas_triton"


def _triton_kernels() -> set[str]:
    """The Triton kernel capabilities this environment's packages give a GPU."""
    return {"pallas_triton"} | ({"triton"} if backend.native_triton_problem() is None else set())


def test_capabilities_by_compute_capability():
    assert backend.capabilities("cpu") == frozenset()
    assert {"fp8_gemm", "pallas_mosaic_gpu", "cudnn_attention"} | _triton_kernels() == backend.capabilities("cuda")
    with override(cuda_compute_capability="8.0"):
        assert backend.capabilities("cuda") == {"cudnn_attention"} | _triton_kernels()
    assert backend.capabilities("rocm") == _triton_kernels()


def test_triton_kernels_follow_the_installed_packages(monkeypatch):
    """``pallas_triton`` needs a jax with Pallas' Triton backend, ``triton`` the triton and jax_triton
    packages; interpret mode needs only triton for the native kernels (Triton's interpreter)."""
    monkeypatch.setattr(backend, "pallas_triton_present", lambda: False)
    monkeypatch.setattr(backend, "native_triton_problem", lambda: None)
    assert backend.capabilities("rocm") == {"triton"}
    monkeypatch.setattr(backend, "native_triton_problem", lambda: "jax_triton cannot be imported")
    monkeypatch.setattr(backend, "triton_problem", lambda: None)
    assert backend.capabilities("rocm") == frozenset()
    with override(pallas_interpret=True):
        assert backend.capabilities("cpu") == {"pallas_mosaic_gpu", "triton"}
    monkeypatch.setattr(backend, "pallas_triton_present", lambda: True)
    monkeypatch.setattr(backend, "triton_problem", lambda: "triton cannot be imported")
    with override(pallas_interpret=True):
        assert backend.capabilities("cpu") == {"pallas_mosaic_gpu", "pallas_triton"}


def test_native_triton_needs_a_tested_jax_triton(monkeypatch):
    import sys
    import types

    monkeypatch.setattr(backend, "triton_problem", lambda: None)
    cases = (("0.3.1", True), ("0.3.2.post1", True), ("0.3.5+cuda", True), ("0.3", False), ("0.3rc1", False),
             ("0.3.1rc1", False), ("0.4.0rc1", False), ("0.4.1", False), ("0.2.0", False), ("dev", False))
    for version, accepted in cases:
        monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(__version__=version))
        problem = backend.native_triton_problem.__wrapped__()
        assert (problem is None) == accepted, (version, problem)
        if version == "0.2.0":
            assert "jax_triton 0.2.0 is outside the tested range >=0.3.1,<0.4.0" in problem
    assert "jax_triton's version 'dev' cannot be read" in problem
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    low, high = backend.JAX_TRITON_VERSIONS
    assert f"jax-triton>={'.'.join(map(str, low))},<{'.'.join(map(str, high[:2]))}" in gpu


def test_selection_takes_the_native_kernels_without_pallas_triton(monkeypatch):
    """A jax without Pallas' Triton backend: automatic selection moves to the native Triton kernels,
    or to the reference (with the reason) when jax-triton is missing too."""
    monkeypatch.setattr(backend, "pallas_triton_present", lambda: False)
    monkeypatch.setattr(backend, "native_triton_problem", lambda: None)
    x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((2048,), jnp.float32)
    static = dict(epsilon=1e-6, zero_centered_gamma=False)
    assert backend.select("rmsnorm", platform_name="cuda", args=(x, g), static=static)[0].name == "triton"
    monkeypatch.setattr(backend, "native_triton_problem", lambda: "jax_triton cannot be imported")
    impl, why = backend.select("rmsnorm", platform_name="cuda", args=(x, g), static=static)
    assert impl.name == "xla" and "needs ['triton']" in why


def test_cuda_compute_capability_off_cuda_comes_from_config(monkeypatch):
    """On a ROCm host the devices report "gfx942"; staging the cuda branch must not parse that."""
    class RocmDevice:
        compute_capability = "gfx942"

    monkeypatch.setattr(backend, "platform", lambda: "rocm")
    monkeypatch.setattr(jax, "devices", lambda *a: [RocmDevice()])
    with override(cuda_compute_capability="8.0"):
        assert backend.cuda_compute_capability() == (8, 0)
        assert backend.capabilities("cuda") == {"cudnn_attention"} | _triton_kernels()
        q = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
        static = dict(mask_type="causal", scale=1.0, dropout_rate=0.0, window_size=None, logits_soft_cap=None)
        impl, _ = backend.select("attention", platform_name="cuda", args=(q, q, q) + (None,) * 5, static=static)
        assert impl.name == "cudnn"


def _custom_calls(exported) -> str:
    return exported.mlir_module()


def test_export_carries_the_kernel_for_cuda_and_the_reference_for_cpu():
    x = jnp.ones((8, 128), jnp.float32)
    f = jax.jit(probe_op)
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    with backend.abstract_gpu():
        for_cuda = jax.export.export(f, platforms=["cuda"], disabled_checks=checks)(x)
    for_cpu = jax.export.export(f, platforms=["cpu"])(x)
    assert TRITON_CALL in for_cuda.mlir_module()
    assert TRITON_CALL not in for_cpu.mlir_module()
    np.testing.assert_array_equal(for_cpu.call(x), 2.0)  # the cpu export runs here: x + 1


def test_registered_plugin_platform_gets_the_kernels_it_declares():
    # jax accepts a platform name once a backend factory exists for it, even one that can't start here.
    def no_hardware():
        raise RuntimeError("no fake GPU on this machine")

    for name in ("fakegpu", "fakeref"):
        if name not in xla_bridge._backend_factories:
            xla_bridge.register_backend_factory(name, no_hardware, priority=-100, fail_quietly=True)
    backend.register_platform("fakegpu", capabilities=["pallas_triton"])
    backend.register_platform("fakeref")
    assert backend.select("_test_op", platform_name="fakegpu")[0].name == "pallas_triton"
    assert backend.select("_test_op", platform_name="fakeref")[0].name == "xla"
    x = jnp.ones((8, 128), jnp.float32)
    f = jax.jit(lambda x: probe_op(x))  # a new function: jit's trace cache knows nothing of the new platforms
    with backend.abstract_gpu():
        on_fake = f.trace(x).lower(lowering_platforms=("fakegpu",)).as_text()
    on_ref = f.trace(x).lower(lowering_platforms=("fakeref",)).as_text()
    assert TRITON_CALL in on_fake and TRITON_CALL not in on_ref
    with pytest.raises(ValueError, match="unknown"):
        backend.register_platform("fakeref", capabilities=["warp_drive"])
    with pytest.raises(ValueError, match="no implementation 'cudnn'"):
        backend.register_platform("fakeref", kernels={"layernorm": "cudnn"})


def test_parse_plugin_spec():
    assert backend.parse_plugin_spec("musa=/opt/a.so, b=/x/y.so") == {"musa": "/opt/a.so", "b": "/x/y.so"}
    assert backend.parse_plugin_spec("") == {}
    with pytest.raises(ValueError, match="name=/path"):
        backend.parse_plugin_spec("musa")


def _compile_fake_plugin(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a fake PJRT plugin")
    src = tmp_path / "fake.c"
    src.write_text("void* GetPjrtApi(void) { return 0; }\n")
    lib = tmp_path / "libpjrt_fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_load_plugin_error_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        backend.load_plugin("musa", tmp_path / "missing.so")
    text = tmp_path / "notes.so"
    text.write_text("not a library")
    with pytest.raises(ValueError, match="not a loadable shared library"):
        backend.load_plugin("musa", text)
    no_api = tmp_path / "libnothing.so"
    src = tmp_path / "nothing.c"
    src.write_text("int nothing(void) { return 0; }\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is not None:
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(no_api), str(src)], check=True)
        with pytest.raises(ValueError, match="not a PJRT plugin"):
            backend.load_plugin("musa", no_api)
    jax.devices()  # backends are initialised now
    with pytest.raises(RuntimeError, match="after jax initialised its backends"):
        backend.load_plugin("musa", _compile_fake_plugin(tmp_path))
    with pytest.raises(ValueError, match="platform name"):
        backend.load_plugin("bad name", _compile_fake_plugin(tmp_path))


def test_plugins_from_env_load_on_import_and_report_bad_paths(tmp_path):
    env = {**os.environ, "MTJAX_PJRT_PLUGINS": f"musa={tmp_path / 'missing.so'}", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", "import mtjax"], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "no such file" in result.stderr
    env["MTJAX_PJRT_PLUGINS"] = "musa"
    result = subprocess.run([sys.executable, "-c", "import mtjax"], env=env, capture_output=True, text=True)
    assert "name=/path/to/libpjrt_plugin.so" in result.stderr


def test_plugin_registers_before_backends_start(tmp_path):
    lib = _compile_fake_plugin(tmp_path)
    code = textwrap.dedent(f"""
        from unittest import mock
        from jax._src import xla_bridge
        import mtjax
        with mock.patch.object(xla_bridge, "register_plugin") as register:
            mtjax.backend.load_plugin("musa", {str(lib)!r}, options={{"visible_devices": [0]}})
        register.assert_called_once()
        assert register.call_args.kwargs["library_path"] == {str(lib)!r}
        assert mtjax.backend.loaded_plugins() == {{"musa": {str(lib)!r}}}
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.stdout.strip() == "ok", result.stderr


def test_mtjax_info_runs(capsys):
    from mtjax.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "platform:    cpu" in out and "layernorm" in out
    assert main(["info", "--json"]) == 0


def test_ops_use_the_reference_on_cpu():
    x = jnp.ones((2, 4))
    chosen = backend.select("layernorm", args=[x, jnp.ones(4), None],
                            static={"epsilon": 1e-6, "zero_centered_gamma": False})[0]
    assert chosen.name in backend.implementations("layernorm")
    np.testing.assert_allclose(ops.layernorm(x, jnp.ones(4)), 0.0, atol=1e-6)


@backend.register("_test_untraceable", "needs_vendor_library", requires=[backend.PALLAS_TRITON], priority=10)
def _untraceable(x):
    raise RuntimeError("vendor library is not detected")


@backend.register("_test_untraceable", backend.REFERENCE)
def _untraceable_reference(x):
    return x * 3


def test_a_foreign_platform_kernel_that_cannot_trace_here_gets_the_reference(caplog):
    x = jnp.ones((2, 2))
    with caplog.at_level("WARNING", logger="mtjax"):
        y = jax.jit(lambda x: backend.dispatch("_test_untraceable", x))(x)
    np.testing.assert_array_equal(y, 3.0)
    assert "cannot be traced on this machine" in caplog.text
    with pytest.raises(RuntimeError, match="not detected"), override(pallas_interpret=True):
        backend.dispatch("_test_untraceable", x)  # on the platform it runs on, the error surfaces


def test_single_device_kernels_are_skipped_in_partitioned_traces_only():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    @backend.register("_test_single_device", "pallas_triton", requires=[backend.PALLAS_TRITON], priority=10,
                      single_device=True)
    def _kernel(x):
        return x * 2

    backend.register("_test_single_device", backend.REFERENCE)(lambda x: x + 1)
    x = jnp.ones((8, 4))
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    with override(pallas_interpret=True):
        assert backend.select("_test_single_device", args=[x])[0].name == "pallas_triton"
        with jax.set_mesh(mesh):
            impl, why = backend.select("_test_single_device", args=[x])
            assert impl.name == "xla" and "partitioned over 8 devices" in why
            np.testing.assert_array_equal(  # inside shard_map each device runs the kernel on its rows
                jax.shard_map(lambda x: backend.dispatch("_test_single_device", x), in_specs=P("dp"),
                              out_specs=P("dp"))(x), 2.0)
        # An explicit choice is honoured anywhere.
        with jax.set_mesh(mesh):
            assert backend.select("_test_single_device", "pallas_triton", args=[x])[0].name == "pallas_triton"


def test_config_is_a_module_whose_settings_forward_to_the_config_object():
    import mtjax
    import mtjax.config as config_module

    assert mtjax.config is config_module and mtjax.config.config is config
    with mtjax.config.override(pallas_interpret=not config.pallas_interpret) as changed:
        assert changed is config and mtjax.config.pallas_interpret == config.pallas_interpret
    saved = dict(config.implementations)
    try:
        mtjax.config.implementations = {"layernorm": "xla"}
        assert config.implementations == {"layernorm": "xla"}
        assert mtjax.config.config.implementations["layernorm"] == "xla"
    finally:
        config.implementations = saved
    with pytest.raises(AttributeError, match="no such setting.*pallas_interpret"):
        mtjax.config.pallas_interpet = True
    with pytest.raises(AttributeError, match="the settings are"):
        _ = mtjax.config.no_such_setting
