"""GEMMs on cuBLASLt that XLA does not issue itself, through XLA FFI custom calls (CUDA).

* Block-scaled FP8 (Hopper, cuBLAS >= 12.9): cuBLASLt runs FP8 GEMMs with a float32 scale per 1x128
  tile (``VEC128_32F``) or per 128x128 block (``BLK128x128_32F``) of an operand, which is what
  `mtjax.fp8.BlockScaling`'s three GEMMs need: ``block_fp8_gemm(a, sa, b, sb)`` with ``a`` in 1x128
  tiles and ``b`` in 128x128 blocks (forward, dgrad) or 1x128 tiles (wgrad). XLA reaches cuBLASLt for
  per-tensor FP8 only.
* Grouped GEMMs (a mixture of experts' expert MLPs): ``grouped_gemm`` and ``grouped_gemm_wgrad``, one
  cuBLASLt GEMM per non-empty group, FP8 (per-tensor scales, a scale per group) or 16-bit operands.
  cuBLASLt takes each group's size on the host, so each call copies ``group_sizes`` (and the group
  scales) off the device and waits for them (one stream synchronization per call). FP8 GEMMs take
  rows in multiples of 16: a group's last rows past one go through a zero-padded 16-row copy.

`cuda/cublaslt_gemm.cc` holds the FFI handlers (C++, host code only). They are compiled on the machine
that runs them, against the cuBLASLt there, by ``python -m mtjax.kernels.cublaslt`` (`build`; it needs
a C++ compiler, jaxlib's FFI headers, the CUDA runtime headers and cuBLASLt, which the ``nvidia-*``
wheels of jax's CUDA plugin or a CUDA toolkit provide). The library goes to `library_path`
(``MTJAX_CUBLASLT_LIBRARY`` overrides it); until it exists, `load` says so and the ops run another
implementation.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import shutil
import site
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.kernels.common import vary_together

TARGET = "mtjax_cublaslt_block_fp8_gemm"
GROUPED_TARGET = "mtjax_cublaslt_grouped_gemm"
GROUPED_WGRAD_TARGET = "mtjax_cublaslt_grouped_gemm_wgrad"
_HANDLERS = {TARGET: "MtjaxCublasLtBlockFp8Gemm", GROUPED_TARGET: "MtjaxCublasLtGroupedGemm",
             GROUPED_WGRAD_TARGET: "MtjaxCublasLtGroupedGemmWgrad"}
SOURCE = Path(__file__).with_name("cuda") / "cublaslt_gemm.cc"
BLOCK = 128
MIN_VERSION = 120900  # cuBLAS 12.9: the first with the 1x128 and 128x128 scale modes
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ALIGNMENT = 16  # K and N of the grouped GEMMs: each group's rows start on a 16-byte boundary


def library_path() -> Path:
    """Where `build` writes the library and `load` reads it: ``$MTJAX_CUBLASLT_LIBRARY``, else
    ``libmtjax_cublaslt.so`` in ``$XDG_CACHE_HOME/mtjax`` (``~/.cache/mtjax``)."""
    if os.environ.get("MTJAX_CUBLASLT_LIBRARY"):
        return Path(os.environ["MTJAX_CUBLASLT_LIBRARY"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mtjax" / "libmtjax_cublaslt.so"


def _cuda_roots() -> list[Path]:
    """Folders that may hold CUDA headers and libraries, in a fixed order: the ``nvidia-*`` wheels'
    (``site-packages/nvidia/cu13``, ``nvidia/cublas``...: the copies jax's CUDA plugin loads), then
    ``$CUDA_HOME``, ``$CUDA_PATH`` and ``/usr/local/cuda``."""
    roots = []
    for packages in dict.fromkeys([*site.getsitepackages(), site.getusersitepackages(), *sys.path]):
        roots += sorted(Path(p) for p in glob.glob(os.path.join(packages, "nvidia", "*")) if os.path.isdir(p))
    roots += [Path(p) for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if p]
    return list(dict.fromkeys(roots))


def _find(names: Sequence[str], subdirs: Sequence[str], roots: Sequence[Path]) -> list[Path]:
    return [root / sub for root in roots for sub in subdirs
            if any(glob.glob(str(root / sub / name)) for name in names)]


def find_cublaslt() -> Path | None:
    """The cuBLASLt shared library this machine has (a versioned ``libcublasLt.so.N``), or None."""
    for folder in _find(["libcublasLt.so.*"], ["lib", "lib64"], _cuda_roots()):
        for candidate in sorted(folder.glob("libcublasLt.so.*"), key=lambda p: len(p.name)):
            return candidate
    return None


def build(output: str | os.PathLike | None = None, *, include_dirs: Sequence[str] = (),
          cublaslt: str | os.PathLike | None = None, compiler: str | None = None) -> Path:
    """Compile the FFI handler into ``output`` (default `library_path`) and return its path.

    ``include_dirs`` are searched before the headers found on this machine; ``cublaslt`` is the
    ``libcublasLt.so.N`` to link (default `find_cublaslt`). Raises ``RuntimeError`` naming what is
    missing."""
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("mtjax.kernels.cublaslt.build: no C++ compiler (set CXX or install g++)")
    cublaslt = Path(cublaslt) if cublaslt else find_cublaslt()
    if cublaslt is None:
        raise RuntimeError("mtjax.kernels.cublaslt.build: no libcublasLt.so.N (install jax's CUDA plugin, whose "
                           "nvidia-cublas wheel has it, or a CUDA toolkit, or pass cublaslt=)")
    roots = _cuda_roots()
    headers = [*map(Path, include_dirs)]
    # cuda_runtime's headers include crt/host_defines.h, which some header-only wheels leave out.
    for name in ("cublasLt.h", "driver_types.h", "crt/host_defines.h"):
        if not any((d / name).exists() for d in headers):
            found = _find([name], ["include"], roots)
            if not found:
                raise RuntimeError(f"mtjax.kernels.cublaslt.build: no {name} (install the nvidia-cublas and "
                                   "nvidia-cuda-runtime wheels or a CUDA toolkit, or pass include_dirs=)")
            headers.append(found[0])
    output = Path(output) if output else library_path()
    output.parent.mkdir(parents=True, exist_ok=True)
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-o", str(output), str(SOURCE),
               f"-I{jax.ffi.include_dir()}", *(f"-I{d}" for d in dict.fromkeys(headers)),
               f"-L{cublaslt.parent}", f"-l:{cublaslt.name}", f"-Wl,-rpath,{cublaslt.parent}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"mtjax.kernels.cublaslt.build: {' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return output


@functools.cache
def load() -> str | None:
    """Load the library and register its FFI targets for CUDA (once); None when that worked, else why
    not (for the implementations' ``unsupported``): no library, or one that does not load."""
    path = library_path()
    if not path.exists():
        return f"no cuBLASLt FFI library at {path} (build it: python -m mtjax.kernels.cublaslt)"
    cublaslt = find_cublaslt()
    try:
        if cublaslt is not None:  # the copy jax's CUDA plugin uses, if it has not loaded it yet
            ctypes.CDLL(str(cublaslt), mode=ctypes.RTLD_GLOBAL)
        library = ctypes.CDLL(str(path))
        for target, symbol in _HANDLERS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="CUDA")
    except (OSError, AttributeError, ValueError) as err:
        return f"cuBLASLt FFI library {path} did not load (rebuild it: python -m mtjax.kernels.cublaslt): {err}"
    return None


def block_modes_problem() -> str | None:
    """`load`'s answer, or why the loaded cuBLASLt has no block-scaled modes; None where they run."""
    why = load()
    if why is not None:
        return why
    found = version()
    return f"cuBLASLt {found} (the block-scaled modes need {MIN_VERSION} or newer)" if found < MIN_VERSION else None


def version(path: str | os.PathLike | None = None) -> int:
    """The cuBLASLt version (``major * 10000 + minor * 100 + patch``) the library at ``path``
    (default `library_path`) runs against: a check that it loads and links."""
    library = ctypes.CDLL(str(path or library_path()))
    library.MtjaxCublasLtVersion.restype = ctypes.c_size_t
    return int(library.MtjaxCublasLtVersion())


def unsupported(a_dtype, b_dtype, out_dtype) -> str | None:
    """Why cuBLASLt cannot run this block-scaled GEMM, or None (shapes are padded to fit)."""
    a_dtype, b_dtype = jnp.dtype(a_dtype), jnp.dtype(b_dtype)
    if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES:
        return f"operands {a_dtype} x {b_dtype} (cuBLASLt: float8_e4m3fn or float8_e5m2)"
    if a_dtype == b_dtype == jnp.dtype(jnp.float8_e5m2):
        return "float8_e5m2 x float8_e5m2 (cuBLASLt's FP8 GEMMs take at most one E5M2 operand)"
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        return f"out_dtype {jnp.dtype(out_dtype)} (cuBLASLt here: bfloat16, float16 or float32)"
    return None


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pad(x: jax.Array, shape: tuple[int, int], value: float = 0.0) -> jax.Array:
    widths = [(0, s - d) for s, d in zip(shape, x.shape)]
    return jnp.pad(x, widths, constant_values=value) if any(w for _, w in widths) else x


def block_fp8_gemm(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, out_dtype) -> jax.Array:
    """`mtjax.ops.block_fp8_gemm` on cuBLASLt: ``a [m, k]``, ``sa [m, ceil(k/128)]``, ``b [n, k]``,
    ``sb [n, ceil(k/128)]`` (1x128 tiles) or ``[ceil(n/128), ceil(k/128)]`` (128x128 blocks); the
    operands padded to 16 rows and whole K blocks, the scales laid out as cuBLASLt reads them."""
    _checked(unsupported(a.dtype, b.dtype, out_dtype), "block_fp8_gemm", block_modes_problem)
    (m, k), n = a.shape, b.shape[0]
    kb = -(-k // BLOCK)
    b_blocks = sb.shape[0] != n  # as `mtjax.ops.block_fp8_gemm` tells them apart
    mp, np_, kp = _round_up(m, 16), _round_up(n, 16), kb * BLOCK
    a, b = _pad(a, (mp, kp)), _pad(b, (np_, kp))
    # Padded rows' scales are 1, so they stay rows of zeros.
    sa_t = _pad(sa.astype(jnp.float32).T, (kb, mp), 1.0)  # [kb, m4]: rows contiguous per K block
    if b_blocks:
        sb_lt = _pad(sb.astype(jnp.float32), (sb.shape[0], _round_up(kb, 4)), 1.0)  # [ceil(n/128), kb4]
    else:
        sb_lt = _pad(sb.astype(jnp.float32).T, (kb, np_), 1.0)  # [kb, n4]
    # Batched callers (vmap) run one GEMM per batch entry: the handler takes 2-D operands.
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((mp, np_), out_dtype), vmap_method="sequential")
    out = vary_together(call(a, sa_t, b, sb_lt, b_blocks=np.int32(b_blocks)), a, sa_t, b, sb_lt)[0]
    return out[:m, :n] if (mp, np_) != (m, n) else out


def grouped_unsupported(lhs_shape: Sequence[int], rhs_shape: Sequence[int], lhs_dtype, rhs_dtype, out_dtype, *,
                        transpose_rhs: bool) -> str | None:
    """Why `grouped_gemm` cannot run these operands, or None (the library's presence is `load`'s)."""
    lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
    fp8 = lhs_dtype in FP8_DTYPES and rhs_dtype in FP8_DTYPES
    if fp8:
        if lhs_dtype == rhs_dtype == jnp.dtype(jnp.float8_e5m2):
            return "float8_e5m2 x float8_e5m2 (cuBLASLt's FP8 GEMMs take at most one E5M2 operand)"
        if not transpose_rhs:
            return "FP8 rhs as [G, K, N] (cuBLASLt's FP8 GEMMs take both operands K-major: [G, N, K])"
    elif lhs_dtype != rhs_dtype or lhs_dtype not in HALF_DTYPES:
        return f"operands {lhs_dtype} x {rhs_dtype} (cuBLASLt here: FP8, or bfloat16/float16 for both)"
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        return f"out_dtype {jnp.dtype(out_dtype)} (cuBLASLt here: bfloat16, float16 or float32)"
    k, n = lhs_shape[1], (rhs_shape[1] if transpose_rhs else rhs_shape[2])
    if k % ALIGNMENT or n % ALIGNMENT:
        return f"K={k}, N={n} (cuBLASLt here: multiples of {ALIGNMENT})"
    return None


def grouped_wgrad_unsupported(lhs_shape: Sequence[int], grad_shape: Sequence[int], lhs_dtype, grad_dtype, out_dtype,
                              *, scaled: bool) -> str | None:
    """Why `grouped_gemm_wgrad` cannot run these operands, or None."""
    lhs_dtype, grad_dtype = jnp.dtype(lhs_dtype), jnp.dtype(grad_dtype)
    if lhs_dtype != grad_dtype or lhs_dtype not in HALF_DTYPES:
        return (f"operands {lhs_dtype} x {grad_dtype} (cuBLASLt here: bfloat16/float16 for both; its FP8 GEMMs "
                "cannot contract over rows)")
    if scaled:
        return "a group scale (the weight-gradient handler takes none)"
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        return f"out_dtype {jnp.dtype(out_dtype)} (cuBLASLt here: bfloat16, float16 or float32)"
    if lhs_shape[1] % ALIGNMENT or grad_shape[1] % ALIGNMENT:
        return f"K={lhs_shape[1]}, N={grad_shape[1]} (cuBLASLt here: multiples of {ALIGNMENT})"
    return None


def _checked(why: str | None, op: str, library_problem=None) -> None:
    """``ValueError`` for operands cuBLASLt cannot take (``why``), ``RuntimeError`` for a missing or
    unfit library (``library_problem()``, default `load`)."""
    if why is not None:
        raise ValueError(f"cublaslt.{op}: unsupported input: {why}")
    why = (library_problem or load)()
    if why is not None:
        raise RuntimeError(f"cublaslt.{op}: {why}")


def grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_scale: jax.Array | None, *,
                 transpose_rhs: bool, out_dtype) -> jax.Array:
    """``out[rows of g] = lhs[rows of g] @ rhs[g]`` (``rhs [G, K, N]``, or ``[G, N, K]`` transposed with
    ``transpose_rhs``) times ``group_scale[g]``; rows past ``sum(group_sizes)`` are zeros. FP8 operands
    accumulate with the tensor cores' fast accumulation where both are E4M3 (the forward GEMM, as
    XLA's FP8 GEMMs do by default) and with cuBLASLt's promotion otherwise (gradients)."""
    _checked(grouped_unsupported(lhs.shape, rhs.shape, lhs.dtype, rhs.dtype, out_dtype, transpose_rhs=transpose_rhs),
             "grouped_gemm")
    g = rhs.shape[0]
    scale = jnp.ones((g,), jnp.float32) if group_scale is None else group_scale.astype(jnp.float32).reshape(g)
    sizes = group_sizes.astype(jnp.int32)
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    call = jax.ffi.ffi_call(GROUPED_TARGET, jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[1 if transpose_rhs else 2]),
                                                                 out_dtype), vmap_method="sequential")
    out = call(lhs, rhs, sizes, scale, transpose_rhs=np.int32(transpose_rhs),
               has_scale=np.int32(group_scale is not None),
               fast_accum=np.int32(jnp.dtype(lhs.dtype) == jnp.dtype(rhs.dtype) == e4m3))
    return vary_together(out, lhs, rhs, sizes, scale)[0]


def grouped_gemm_wgrad(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, *, out_dtype) -> jax.Array:
    """``out[g] = lhs[rows of g]^T @ grad[rows of g]`` into ``[G, K, N]``; an empty group's is zeros."""
    _checked(grouped_wgrad_unsupported(lhs.shape, grad.shape, lhs.dtype, grad.dtype, out_dtype, scaled=False),
             "grouped_gemm_wgrad")
    call = jax.ffi.ffi_call(GROUPED_WGRAD_TARGET, jax.ShapeDtypeStruct(
        (group_sizes.shape[0], lhs.shape[1], grad.shape[1]), out_dtype), vmap_method="sequential")
    sizes = group_sizes.astype(jnp.int32)
    return vary_together(call(lhs, grad, sizes), lhs, grad, sizes)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mtjax.kernels.cublaslt [OUTPUT]``: build the library and print its path."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        path = build(args[0] if args else None)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{path} (cuBLASLt {version(path)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
