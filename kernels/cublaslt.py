"""Block-scaled FP8 GEMMs on cuBLASLt, through an XLA FFI custom call (Hopper, cuBLAS >= 12.9).

cuBLASLt runs FP8 GEMMs with a float32 scale per 1x128 tile (``VEC128_32F``) or per 128x128 block
(``BLK128x128_32F``) of an operand, which is what `mtjax.fp8.BlockScaling`'s three GEMMs need:
``block_fp8_gemm(a, sa, b, sb)`` with ``a`` in 1x128 tiles and ``b`` in 128x128 blocks (forward,
dgrad) or 1x128 tiles (wgrad). XLA reaches cuBLASLt for per-tensor FP8 only, so mtjax calls it
itself: `cuda/cublaslt_block_fp8.cc` is the FFI handler (C++, host code only).

The handler is compiled on the machine that runs it, against the cuBLASLt there, by
``python -m mtjax.kernels.cublaslt`` (`build`; it needs a C++ compiler, jaxlib's FFI headers, the
CUDA runtime headers and cuBLASLt, which the ``nvidia-*`` wheels of jax's CUDA plugin or a CUDA
toolkit provide). The library goes to `library_path` (``MTJAX_CUBLASLT_LIBRARY`` overrides it);
until it exists, `unsupported` says so and the op runs another implementation.
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
SOURCE = Path(__file__).with_name("cuda") / "cublaslt_block_fp8.cc"
BLOCK = 128
MIN_VERSION = 120900  # cuBLAS 12.9: the first with the 1x128 and 128x128 scale modes
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


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
    """Load the library and register its FFI target for CUDA (once); None when that worked, else why
    not (for `unsupported`): no library, or one bound to a cuBLASLt without the block-scaled modes."""
    path = library_path()
    if not path.exists():
        return f"no cuBLASLt FFI library at {path} (build it: python -m mtjax.kernels.cublaslt)"
    cublaslt = find_cublaslt()
    try:
        if cublaslt is not None:  # the copy jax's CUDA plugin uses, if it has not loaded it yet
            ctypes.CDLL(str(cublaslt), mode=ctypes.RTLD_GLOBAL)
        library = ctypes.CDLL(str(path))
        library.MtjaxCublasLtVersion.restype = ctypes.c_size_t
        found = int(library.MtjaxCublasLtVersion())
        if found < MIN_VERSION:
            return f"cuBLASLt {found} (the block-scaled modes need {MIN_VERSION} or newer)"
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.MtjaxCublasLtBlockFp8Gemm), platform="CUDA")
    except (OSError, AttributeError, ValueError) as err:
        return f"cuBLASLt FFI library {path} did not load: {err}"
    return None


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
    why = unsupported(a.dtype, b.dtype, out_dtype)
    if why is not None:
        raise ValueError(f"cublaslt.block_fp8_gemm: unsupported input: {why}")
    why = load()
    if why is not None:
        raise RuntimeError(f"cublaslt.block_fp8_gemm: {why}")
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
