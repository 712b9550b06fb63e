"""Launching native Triton kernels from jax: `launch`.

On CUDA and ROCm `launch` is `jax_triton.triton_call`: the kernel is compiled while jax lowers the
computation (for the lowering platform; a ``cuda`` export from a CPU-only host compiles for
``config.cuda_compute_capability``) and runs as a custom call. In interpret mode
(``config.pallas_interpret``) it is a `jax.pure_callback` that runs the same kernel in Triton's
interpreter on host copies of the arrays, which needs the ``triton`` package but no GPU: how the CPU
tests check every kernel against its reference.

Conventions of every kernel launched here: its parameters are the input arrays, then the output
arrays, then ``tl.constexpr`` parameters (passed as keywords). No runtime scalars (jax-triton 0.3
passes Python floats as float64 arguments, 0.4 bakes them in as constants; constexprs behave the same
in both) and no aliased or pre-zeroed outputs: every kernel writes every element of its outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from mtjax import backend
from mtjax.kernels.common import interpret


@functools.cache
def _jax_triton() -> Any:
    """The ``jax_triton`` module, or why it cannot be imported (a string)."""
    reason = backend.native_triton_problem()
    if reason is not None:
        return reason
    import jax_triton

    _launch_as_compiled(jax_triton)
    return jax_triton


# The metadata dict of the kernel Triton's CUDA backend compiled last in this thread.
_compiled = threading.local()
_patch_lock = threading.Lock()


class _KernelLibAsCompiled:
    """jaxlib's Triton kernel library as jax-triton 0.3 calls it, making each kernel as Triton
    compiled it: jax-triton 0.3 passes the warp count it asked for and no global scratch, while a
    warp-specialized kernel runs more warps than asked (its producer and consumer partitions) and a
    kernel that builds TMA descriptors on the device writes them to a per-program global scratch
    buffer, which jaxlib allocates at launch when told its size."""

    def __init__(self, lib: Any):
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def TritonKernel(self, name: str, num_warps: int, *args: Any) -> Any:  # noqa: N802
        metadata = getattr(_compiled, "metadata", None) or {}
        if metadata.get("name") != name:
            return self._lib.TritonKernel(name, num_warps, *args)
        num_warps = metadata.get("num_warps") or num_warps
        scratch = metadata.get("global_scratch_size") or 0
        if not scratch or len(args) != 5:  # (num_ctas, shared memory, binary, ttir, capability)
            return self._lib.TritonKernel(name, num_warps, *args)
        return self._lib.TritonKernel(name, num_warps, *args, scratch, metadata.get("global_scratch_align") or 1)


def _launch_as_compiled(jax_triton: Any) -> None:
    """Teach jax-triton 0.3 the launch parameters Triton's compiler decides (`_KernelLibAsCompiled`):
    the CUDA backend's ``make_llir`` leaves them in its metadata dict, which is recorded here; the
    kernel's name, filled in by ``make_ptx`` later, ties the record to the kernel jax-triton makes next.
    jax-triton 0.4 passes them itself."""
    try:
        from triton.backends.nvidia import compiler as nvidia
    except ImportError:  # a Triton without its NVIDIA backend: nothing compiles for CUDA here
        return
    version = tuple(int(part) for part in re.findall(r"\d+", getattr(jax_triton, "__version__", "0.3"))[:2])
    triton_lib = jax_triton.triton_lib
    with _patch_lock:
        if version >= (0, 4) or isinstance(triton_lib.triton_kernel_call_lib, _KernelLibAsCompiled):
            return
        make_llir = nvidia.CUDABackend.make_llir

        @functools.wraps(make_llir)
        def recording_make_llir(self, src, metadata, *args, **kwargs):
            out = make_llir(self, src, metadata, *args, **kwargs)
            _compiled.metadata = metadata
            return out

        nvidia.CUDABackend.make_llir = recording_make_llir
        triton_lib.triton_kernel_call_lib = _KernelLibAsCompiled(triton_lib.triton_kernel_call_lib)


def compute_capability() -> int:
    """The CUDA compute capability kernels compile for, as Triton spells it (``90`` for Hopper): the
    local GPU's, or ``config.cuda_compute_capability`` when lowering without one."""
    major, minor = backend.cuda_compute_capability()
    return major * 10 + minor


def stand_in() -> jax.Array:
    """A one-element array for a pointer parameter a launch does not use (its flags say so)."""
    return jax.numpy.zeros((1,), jax.numpy.int32)


def seed_input(seed: jax.Array | None) -> jax.Array:
    """A uint32 dropout seed as the one-element int32 array the kernels load (and bitcast back), or a
    stand-in without dropout."""
    if seed is None:
        return stand_in()
    return jax.lax.bitcast_convert_type(jax.numpy.reshape(seed, (1,)).astype(jax.numpy.uint32), jax.numpy.int32)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as `launch` saw it (what `record_launches` collects)."""

    kernel: Any
    name: str
    inputs: tuple[jax.ShapeDtypeStruct, ...]
    outputs: tuple[jax.ShapeDtypeStruct, ...]
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    constexprs: dict[str, Any]


_recorders: list[list[Launch]] = []


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Collect every `launch` traced inside the block (e.g. under `jax.eval_shape`), to compile the
    kernels with `compile_launch` on a machine without a GPU. Where jax-triton is not installed, the
    launches inside the block return zeros of their output types (only ``triton`` is needed)."""
    launches: list[Launch] = []
    _recorders.append(launches)
    try:
        yield launches
    finally:
        _recorders.remove(launches)


# Triton's names of the dtypes kernels take pointers to.
_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8e4nv",
                 "float8_e5m2": "fp8e5", "float8_e4m3fnuz": "fp8e4b8", "float8_e5m2fnuz": "fp8e5b16", "int8": "i8",
                 "int32": "i32", "uint32": "u32", "int64": "i64"}


def compile_launch(record: Launch, capability: int = 90) -> Any:
    """Compile a recorded launch for an NVIDIA GPU of ``capability`` with ``triton.compile`` (ptxas
    included, no GPU needed), its array arguments 16-byte aligned as jax-triton declares them.
    Returns Triton's compiled kernel (``.metadata.shared``: bytes of shared memory; ``.asm``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    arrays = record.inputs + record.outputs
    names = record.kernel.arg_names
    signature = {name: f"*{_TRITON_TYPES[jax.numpy.dtype(a.dtype).name]}" for name, a in zip(names, arrays)}
    signature.update({name: "constexpr" for name in record.constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(arrays))}
    source = ASTSource(record.kernel, signature, constexprs=dict(record.constexprs), attrs=attrs)
    # jax-triton 0.3 empties TRITON_CACHE_DIR when imported, and triton.compile needs a cache.
    with tempfile.TemporaryDirectory() as cache, triton.knobs.cache.scope():
        triton.knobs.cache.dir = cache
        # FP fusion on, as jax-triton compiles its launches (Triton's own default is changing).
        return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": record.num_warps, "num_stages": record.num_stages,
                                       "enable_fp_fusion": True})


def launch(kernel: Any, *inputs: jax.Array, out_shape: Sequence[jax.ShapeDtypeStruct], grid: tuple[int, ...],
           name: str, num_warps: int = 4, num_stages: int = 1, **constexprs: Any) -> list[jax.Array]:
    """Run the ``@triton.jit`` ``kernel`` on ``inputs`` over ``grid``; returns its outputs (one array per
    entry of ``out_shape``). ``constexprs`` are its ``tl.constexpr`` parameters."""
    out_shape = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape]
    grid = tuple(int(g) for g in grid)
    if min(grid) < 1:
        raise ValueError(f"{name}: empty launch grid {grid}")
    for launches in _recorders:
        launches.append(Launch(kernel, name, tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs),
                               tuple(out_shape), grid, num_warps, num_stages, dict(constexprs)))
    if interpret():
        return list(jax.pure_callback(
            functools.partial(_run_interpreted, kernel, out_shape=out_shape, grid=grid, constexprs=constexprs),
            out_shape, *inputs))
    jt = _jax_triton()
    if isinstance(jt, str) and _recorders:  # recorded for compile_launch only
        return [jax.numpy.zeros(s.shape, s.dtype) for s in out_shape]
    if isinstance(jt, str):
        raise RuntimeError(f"{name}: native Triton kernels need jax-triton: {jt}")
    outs = jt.triton_call(*inputs, kernel=kernel, grid=grid, name=name, num_warps=num_warps, num_stages=num_stages,
                          compute_capability=compute_capability(), out_shape=out_shape, **constexprs)
    return list(outs)


# --------------------------------------------------------------------------------------------------
# Triton's interpreter on host arrays
# --------------------------------------------------------------------------------------------------


class _HostBuffer:
    """What Triton's interpreter reads of a tensor argument: its address and its dtype's name."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype.name

    def data_ptr(self) -> int:
        return self.array.ctypes.data


_interpreter_lock = threading.Lock()


def _jit_namespaces(kernel: Any) -> list[dict]:
    """The module namespaces whose ``@triton.jit`` functions ``kernel`` may call, transitively, and
    triton.language's own (``tl.max``, ``tl.sum``... are jit functions too)."""
    import triton.language as tl
    import triton.language.standard as standard
    from triton.runtime.jit import JITFunction

    namespaces = {id(vars(m)): vars(m) for m in (tl, standard, tl.math)}
    pending = [kernel.fn.__globals__]
    while pending:
        namespace = pending.pop()
        if id(namespace) in namespaces:
            continue
        namespaces[id(namespace)] = namespace
        pending += [v.fn.__globals__ for v in namespace.values() if isinstance(v, JITFunction)]
    return list(namespaces.values())


@contextlib.contextmanager
def _interpreting(kernel: Any):
    """Triton's interpreter state around one run of ``kernel`` on the host.

    Triton picks the interpreter when a function is decorated (``TRITON_INTERPRET=1`` at import);
    here the same jit functions serve jax-triton and the interpreter, so for the run every jit
    function the kernel can reach is swapped for an interpreted one, and every patch of
    triton.language the interpreter makes is undone afterwards (compiling works again). Two fixes to the interpreter:
    its ``tl.dot`` multiplies the bit patterns of bfloat16 operands (it widens only FP8 ones), so
    they are widened to float32 first, which is exact; and its scalars are one-element arrays, which
    numpy does not convert to ``int`` (loop bounds), so they are reshaped to 0-d first.
    """
    import triton
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    saved = [(ns, {k: v for k, v in ns.items() if isinstance(v, JITFunction)}) for ns in _jit_namespaces(kernel)]
    builder = interpreter.interpreter_builder
    create_dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != triton.language.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), triton.language.float32)

    def dot(a, b, d, *args):
        return create_dot(widened(a), widened(b), d, *args)

    create_fp_to_fp = builder.create_fp_to_fp
    language = triton.language
    as_numpy = {language.float32: np.float32, language.float16: np.float16, language.bfloat16: ml_dtypes.bfloat16,
                language.float8e4nv: ml_dtypes.float8_e4m3fn, language.float8e5: ml_dtypes.float8_e5m2,
                language.float8e4b8: ml_dtypes.float8_e4m3fnuz, language.float8e5b16: ml_dtypes.float8_e5m2fnuz}

    def fp_to_fp(src, dst_type, rounding_mode):
        src_type, dst = as_numpy.get(src.dtype.scalar), as_numpy.get(dst_type.scalar)
        if src_type is None or dst is None or rounding_mode not in (None, triton._C.libtriton.ir.ROUNDING_MODE.RTNE):
            return create_fp_to_fp(src, dst_type, rounding_mode)
        converted = src.data.view(src_type).astype(dst)
        return interpreter.TensorHandle(converted.view(interpreter._get_np_dtype(dst_type)), dst_type.scalar)

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    class DeviceFunction(interpreter.InterpretedFunction):
        """A jit function called from the kernel, which puts back the patches of triton.language it
        makes (the interpreter's own leaves them, assuming the whole process interprets)."""

        def __call__(self, *args, **kwargs):
            scope = interpreter._patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            finally:
                scope.restore()

    interpret_knob = triton.knobs.runtime.interpret
    try:
        triton.knobs.runtime.interpret = True
        builder.create_dot = dot
        builder.create_fp_to_fp = fp_to_fp
        interpreter._patch_lang_tensor = patch_lang_tensor
        for namespace, functions in saved:
            namespace.update({k: DeviceFunction(v.fn) for k, v in functions.items()})
        yield
    finally:
        for namespace, functions in saved:
            namespace.update(functions)
        interpreter._patch_lang_tensor = patch_tensor
        del builder.create_dot, builder.create_fp_to_fp
        triton.knobs.runtime.interpret = interpret_knob


def _unwritten(shape: jax.ShapeDtypeStruct) -> np.ndarray:
    """An output buffer of all-ones bytes: NaN for floats, -1 for integers, so an element the kernel
    fails to write shows in the tests."""
    dtype = np.dtype(shape.dtype)
    return np.full(int(np.prod(shape.shape)) * dtype.itemsize, 0xFF, np.uint8).view(dtype).reshape(shape.shape)


def _run_interpreted(kernel: Any, *arrays: np.ndarray, out_shape, grid, constexprs) -> list[np.ndarray]:
    from triton.runtime import interpreter

    class HostGrid(interpreter.GridExecutor):
        """The interpreter's grid loop on host buffers, which need no copies to and from a device."""

        def _init_args_hst(self, args, kwargs):
            return args, kwargs

        def _restore_args_dev(self, *_):
            pass

    inputs = [np.ascontiguousarray(a) for a in arrays]
    outputs = [_unwritten(s) for s in out_shape]
    interpreted = interpreter.InterpretedFunction(kernel.fn)
    # The kernels rely on IEEE semantics (exp overflowing to inf in a saturating tanh, -inf logits).
    with _interpreter_lock, _interpreting(kernel), np.errstate(all="ignore"):
        HostGrid(interpreted.rewrite(), interpreted.arg_names, grid)(
            *(_HostBuffer(a) for a in inputs + outputs), **constexprs)
    return outputs
