"""Platforms, capabilities, PJRT plugins and the kernel registry.

Every fused op (``layernorm``, ``rmsnorm``, ``softmax``, ``activation``, ``attention``, ``fp8_gemm``,
...) has named implementations: ``"xla"`` (the plain jax.numpy reference, runs everywhere) and
kernels such as ``"pallas_triton"`` (Pallas on its Triton lowering, while the jax in use has it),
``"triton"`` (native Triton through jax-triton) or ``"cudnn"``. Each declares
the capabilities it needs (and optionally the platforms it is limited to and an ``unsupported``
predicate saying why it cannot run a call). `dispatch` picks one:

1. the call's ``implementation=`` argument;
2. else the per-op override in ``mtjax.config.implementations`` (env ``MTJAX_IMPL_<OP>``);
3. else, per *lowering* platform, the available implementation of highest priority that can run the
   call, staged with `jax.lax.platform_dependent`, so a function exported for ``cuda`` on a
   CPU-only machine carries the GPU kernel and the same function exported for ``cpu`` the reference.

An explicit choice (1 or 2) that cannot run here raises `ValueError`. Automatic selection never
fails: it falls back to the reference and logs that once.

The registry knows nothing of the ops: they register their implementations when `mtjax.ops` is
imported, which ``import mtjax`` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax._src import xla_bridge

from mtjax.config import config

logger = logging.getLogger("mtjax")

REFERENCE = "xla"

# Capability names a platform can offer and an implementation can require.
FP8_GEMM = "fp8_gemm"
PALLAS_TRITON = "pallas_triton"
PALLAS_MOSAIC_GPU = "pallas_mosaic_gpu"
TRITON = "triton"  # native Triton kernels through jax-triton
CUDNN_ATTENTION = "cudnn_attention"
ALL_CAPABILITIES = (FP8_GEMM, PALLAS_TRITON, PALLAS_MOSAIC_GPU, TRITON, CUDNN_ATTENTION)

BUILTIN_PLATFORMS = ("cpu", "cuda", "rocm")


# --------------------------------------------------------------------------------------------------
# Platforms and capabilities
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlatformInfo:
    """What mtjax knows of a platform added with `register_platform`."""

    name: str
    capabilities: frozenset[str]
    kernels: Mapping[str, str]


_registered_platforms: dict[str, PlatformInfo] = {}


def platform() -> str:
    """The platform jax lowers for on the default backend: ``cpu``, ``cuda``, ``rocm`` or a plugin's.

    A PJRT plugin reports its own platform name; a plugin wrapping the CUDA runtime under another
    backend name still lowers for ``cuda``, and that is what kernel selection must see.
    """
    default_backend = xla_bridge.get_backend()
    return getattr(default_backend, "_raw_platform", default_backend.platform)


def _local_devices_of(platform_name: str) -> list[Any]:
    return jax.devices() if platform() == platform_name else []


def cuda_compute_capability() -> tuple[int, int]:
    """``(major, minor)`` of the local CUDA devices; without one (lowering for ``cuda`` on a CPU-only
    or ROCm host) ``config.cuda_compute_capability``."""
    devices = _local_devices_of("cuda")
    text = getattr(devices[0], "compute_capability", None) if devices else None
    major, _, minor = str(text or config.cuda_compute_capability).partition(".")
    return int(major), int(minor or 0)


def _jax_gpu_backend_reachable() -> bool:
    """False when CUDA runs through a plugin registered under another name (e.g. ``mtcuda``).

    jax's cuDNN attention asks for the ``gpu`` backend by name and fails on such a plugin, while
    Triton kernels and XLA's own GEMMs run there.
    """
    return platform() != "cuda" or "cuda" in xla_bridge.backends()


@functools.cache
def pallas_triton_present() -> bool:
    """Whether the jax in use has Pallas' Triton backend (deprecated by jax: docs/kernels.md)."""
    try:
        importlib.import_module("jax.experimental.pallas.triton")
    except ImportError:
        return False
    return True


@functools.cache
def triton_problem() -> str | None:
    """Why the ``triton`` package (the compiler, and its interpreter) cannot be imported, or ``None``."""
    try:
        importlib.import_module("triton")
    except Exception as err:  # a broken install raises more than ImportError
        return f"triton cannot be imported ({type(err).__name__}: {err}); install mtjax[gpu]"
    return None


# The jax-triton releases the native kernels run with, >= the first, < the second: pyproject.toml's gpu
# extra (why not later ones: docs/kernels.md, Versions).
JAX_TRITON_VERSIONS = ((0, 3, 1), (0, 4, 0))


def _version_range_problem(name: str, version: Any, low: tuple[int, ...], high: tuple[int, ...]) -> str | None:
    """Why ``version`` (a PEP 440 string) is outside ``>=low,<high``, or ``None``: its release numbers
    compared, a pre-release (``0.3.1rc1``, ``0.3.1.dev0``) counting as below its release, as pip's
    specifiers do. A version that does not start with release numbers gets a reason, never an error."""
    bounds = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    match = re.match(r"v?(\d+(?:\.\d+)*)(.*)", str(version))
    if match is None:
        return f"{name}'s version {version!r} cannot be read (tested: {bounds}); install mtjax[gpu]"
    release = tuple(int(p) for p in match[1].split("."))
    release += (0,) * (len(low) - len(release))
    prerelease = re.match(r"[-_.]?(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", match[2], re.IGNORECASE) is not None
    if release < low or (release == low and prerelease) or not release < high:
        return f"{name} {version} is outside the tested range {bounds}; install mtjax[gpu]"
    return None


@functools.cache
def native_triton_problem() -> str | None:
    """Why native Triton kernels cannot be lowered in this process (``triton`` and ``jax_triton``,
    which needs a jax with GPU support, must import, in a version of `JAX_TRITON_VERSIONS`), or ``None``."""
    reason = triton_problem()
    if reason is not None:
        return reason
    try:
        jax_triton = importlib.import_module("jax_triton")
    except Exception as err:  # jax_triton raises ImportError or ValueError without a GPU jax
        return f"jax_triton cannot be imported ({type(err).__name__}: {err}); install mtjax[gpu]"
    return _version_range_problem("jax_triton", getattr(jax_triton, "__version__", None), *JAX_TRITON_VERSIONS)


def _triton_kernels() -> set[str]:
    """The kernel capabilities a Triton-capable GPU gets from this process's packages."""
    caps = set()
    if pallas_triton_present():
        caps.add(PALLAS_TRITON)
    if native_triton_problem() is None:
        caps.add(TRITON)
    return caps


def capabilities(platform_name: str | None = None) -> frozenset[str]:
    """What ``platform_name`` (default: the current platform) can run.

    For ``cuda`` the compute capability of the local devices decides; without one (lowering for
    ``cuda`` on a CPU-only host) ``config.cuda_compute_capability`` is assumed. The Triton kernels
    need their packages: ``pallas_triton`` a jax with Pallas' Triton backend, ``triton`` the
    ``triton`` and ``jax_triton`` packages. On any platform, ``config.pallas_interpret`` makes the
    kernels runnable in interpret mode (Pallas', and Triton's interpreter, which needs ``triton``).
    """
    name = platform() if platform_name is None else platform_name
    caps: set[str] = set()
    if name in _registered_platforms:
        caps |= _registered_platforms[name].capabilities
    elif name == "cuda":
        cc = cuda_compute_capability()
        if cc >= (8, 0):
            caps |= _triton_kernels()
            if _jax_gpu_backend_reachable():
                caps.add(CUDNN_ATTENTION)
        if cc >= (8, 9):
            caps.add(FP8_GEMM)
        if cc[0] in (9, 10):
            caps.add(PALLAS_MOSAIC_GPU)
    elif name == "rocm":
        caps |= _triton_kernels()
        devices = _local_devices_of("rocm")
        arch = str(getattr(devices[0], "compute_capability", "")) if devices else ""
        if arch.startswith(("gfx94", "gfx95")):
            caps.add(FP8_GEMM)
    if config.pallas_interpret:
        caps.add(PALLAS_MOSAIC_GPU)
        if pallas_triton_present():
            caps.add(PALLAS_TRITON)
        if triton_problem() is None:
            caps.add(TRITON)
    return frozenset(caps)


def known_platforms() -> tuple[str, ...]:
    """The platforms `dispatch` stages a branch for: the built-in ones and every registered one."""
    return BUILTIN_PLATFORMS + tuple(p for p in _registered_platforms if p not in BUILTIN_PLATFORMS)


def register_platform(
    name: str,
    kernels: Mapping[str, str] | None = None,
    *,
    capabilities: Iterable[str] = (),
) -> PlatformInfo:
    """Tell mtjax what a new platform (a PJRT plugin's) can run.

    Args:
      name: the platform name jax lowers for (what ``jax.devices()[0].platform`` reports).
      kernels: ``{op: implementation}`` to prefer on this platform, e.g. ``{"layernorm": "pallas_triton"}``.
      capabilities: capability names from `ALL_CAPABILITIES`; a Triton-capable vendor GPU passes
        ``("pallas_triton",)`` and gets every Pallas Triton kernel, ``("triton",)`` every native
        Triton kernel. A platform registered with none gets the references only.
    """
    caps = frozenset(capabilities)
    unknown = caps - set(ALL_CAPABILITIES)
    if unknown:
        raise ValueError(f"register_platform(capabilities=...): unknown {sorted(unknown)}; accepted: "
                         f"{ALL_CAPABILITIES}")
    kernels = dict(kernels or {})
    for op, impl_name in kernels.items():
        if op in _registry and impl_name not in _registry[op]:
            raise ValueError(
                f"register_platform(kernels=...): op {op!r} has no implementation {impl_name!r}; "
                f"registered: {implementations(op)}"
            )
        if op in _registry:
            caps |= _registry[op][impl_name].requires
    info = PlatformInfo(name=name, capabilities=caps, kernels=kernels)
    _registered_platforms[name] = info
    if PALLAS_TRITON in caps:
        _lower_pallas_triton_on(name)
    if TRITON in caps:
        _lower_native_triton_on(name)
    return info


def _lower_pallas_triton_on(platform_name: str) -> None:
    """Lower ``pallas_call`` on ``platform_name`` as on ``cuda``: through Triton.

    jax only knows Triton lowering rules for ``cuda`` and ``rocm``; a vendor GPU whose PJRT plugin
    runs Triton kernels reuses the ``cuda`` rule under its own platform name.
    """
    if platform_name in BUILTIN_PLATFORMS:
        return
    from jax._src.interpreters import mlir
    from jax._src.pallas import pallas_call as pallas_call_lib

    def lowering(ctx, *args, **params):
        cuda_ctx = ctx.replace(module_context=ctx.module_context.replace(platforms=("cuda",)))
        return pallas_call_lib._pallas_call_lowering(cuda_ctx, *args, **params)

    mlir.register_lowering(pallas_call_lib.pallas_call_p, lowering, platform=platform_name)


def _lower_native_triton_on(platform_name: str) -> None:
    """Lower jax-triton's kernel calls on ``platform_name`` with its ``cuda`` rule (as
    `_lower_pallas_triton_on` does for Pallas); nothing if jax-triton is missing (then the platform
    cannot run the ``triton`` kernels, and selection says why when it skips them)."""
    if platform_name in BUILTIN_PLATFORMS or native_triton_problem() is not None:
        return
    from jax._src.interpreters import mlir

    primitive = importlib.import_module("jax_triton.triton_lib").triton_kernel_call_p
    cuda_rule = mlir._platform_specific_lowerings["cuda"][primitive]

    def lowering(ctx, *args, **params):
        return cuda_rule(ctx.replace(module_context=ctx.module_context.replace(platforms=("cuda",))), *args, **params)

    mlir.register_lowering(primitive, lowering, platform=platform_name)


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H200", num_cores: int = 132) -> Iterator[None]:
    """Lower GPU kernels for ``device_kind`` on a machine without that GPU (e.g. CPU-only CI).

    ``with abstract_gpu(): jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))`` runs the
    Pallas Triton lowering as it would run on that device.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    mesh = AbstractMesh((1,), ("_abstract_gpu",), (AxisType.Auto,), abstract_device=device)
    with use_abstract_mesh(mesh):
        yield


# --------------------------------------------------------------------------------------------------
# PJRT plugins
# --------------------------------------------------------------------------------------------------

_loaded_plugins: dict[str, str] = {}


def gpu_plugin_options() -> dict[str, Any]:
    """The client options jax passes to its own GPU PJRT plugins (memory fraction, allocator...)."""
    from jax._src.lib import xla_client

    return dict(xla_client.generate_pjrt_gpu_plugin_options())


def load_plugin(name: str, library_path: str | os.PathLike, options: Mapping[str, Any] | None = None) -> None:
    """Register a PJRT plugin library (e.g. a vendor GPU's ``libpjrt_musa.so``) with jax.

    Must run before jax initialises its backends (before the first array or ``jax.devices()``).
    Select it with ``JAX_PLATFORMS=<name>`` or as the highest-priority backend, then call
    `register_platform` to tell mtjax which kernels it can run.

    Raises:
      FileNotFoundError: ``library_path`` does not exist.
      ValueError: the file is no PJRT plugin (no ``GetPjrtApi`` symbol) or ``name`` is taken.
      RuntimeError: jax's backends are already initialised; loading now would be ignored.
    """
    path = os.fspath(library_path)
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"load_plugin(name={name!r}): expected a platform name of letters, digits and '_'")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_plugin(library_path={path!r}): no such file")
    try:
        library = ctypes.CDLL(path)
    except OSError as err:
        raise ValueError(f"load_plugin(library_path={path!r}): not a loadable shared library: {err}") from err
    if not hasattr(library, "GetPjrtApi"):
        raise ValueError(f"load_plugin(library_path={path!r}): not a PJRT plugin (it exports no GetPjrtApi)")
    if name in _loaded_plugins or name in xla_bridge._backend_factories:
        raise ValueError(f"load_plugin(name={name!r}): a backend of that name is already registered")
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            f"load_plugin({name!r}) called after jax initialised its backends; call it before the "
            "first jax computation, or name it in MTJAX_PJRT_PLUGINS so it loads when mtjax is imported"
        )
    xla_bridge.register_plugin(name, library_path=path, options=dict(options) if options else None)
    _loaded_plugins[name] = path
    logger.info("loaded PJRT plugin %s from %s", name, path)


def parse_plugin_spec(spec: str) -> dict[str, str]:
    """Parse ``"name=/path/libpjrt_a.so,other=/path/b.so"`` into ``{name: path}``."""
    plugins: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"MTJAX_PJRT_PLUGINS entry {item!r}: expected name=/path/to/libpjrt_plugin.so")
        plugins[name.strip()] = path.strip()
    return plugins


def load_plugins_from_env() -> None:
    """Load the plugins named in ``MTJAX_PJRT_PLUGINS`` (called once when mtjax is imported)."""
    for name, path in parse_plugin_spec(os.environ.get("MTJAX_PJRT_PLUGINS", "")).items():
        if name not in _loaded_plugins:
            load_plugin(name, path, options=gpu_plugin_options())


def loaded_plugins() -> dict[str, str]:
    """``{name: library_path}`` of the plugins loaded through mtjax."""
    return dict(_loaded_plugins)


# --------------------------------------------------------------------------------------------------
# The kernel registry
# --------------------------------------------------------------------------------------------------


def _runs_anything(*_: Any, **__: Any) -> str | None:
    """The ``unsupported`` predicate of an implementation that can run every call of its op."""
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute an op.

    Attributes:
      op: the op's name (the name of its `mtjax.ops` function).
      name: the implementation's name (``"xla"``, ``"pallas_triton"``...).
      fn: ``fn(*arrays, **static) -> result``, the same signature for every implementation of the op.
      requires: capability names the platform must offer.
      platforms: the platforms it is limited to, or ``None`` for any with the capabilities.
      unsupported: ``unsupported(*arrays, **static) -> str | None`` on abstract arrays: ``None`` when
        this implementation can run the call, else the reason it cannot (shapes, dtypes, options).
      prefer: like ``unsupported`` but consulted by automatic selection only: ``None`` where this
        implementation should be picked, else why not (e.g. "xla is as fast on arrays this small"). An
        explicit choice ignores it, so tests and benchmarks can still run the kernel there.
      priority: higher wins in automatic selection.
      single_device: the implementation is a custom call XLA cannot partition (a Pallas kernel).
        Automatic selection skips it when tracing under a mesh of several devices in automatic or
        explicit axes (XLA would gather its operands onto every device); inside ``shard_map``,
        where arrays are per-device, it is used.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    requires: frozenset[str] = frozenset()
    platforms: frozenset[str] | None = None
    unsupported: Callable[..., str | None] = _runs_anything
    prefer: Callable[..., str | None] | None = None
    priority: int = 0
    single_device: bool = False

    def runs_on(self, platform_name: str) -> str | None:
        """``None`` if this implementation can run on ``platform_name``, else the reason it cannot."""
        if self.platforms is not None and platform_name not in self.platforms:
            return f"runs on {sorted(self.platforms)} only"
        missing = self.requires - capabilities(platform_name)
        if missing:
            return f"needs {sorted(missing)}, which {platform_name!r} lacks"
        return None

    def not_preferred(self, args: Sequence[Any], static: Mapping[str, Any]) -> str | None:
        if self.single_device and (devices := _partitioned_devices()) > 1:
            return f"a single-device kernel, and this trace is partitioned over {devices} devices"
        return None if self.prefer is None else self.prefer(*args, **static)


def _partitioned_devices() -> int:
    """How many devices XLA partitions the current trace over (its mesh's non-manual axes)."""
    from jax.sharding import AxisType, get_abstract_mesh

    mesh = get_abstract_mesh()
    if mesh.empty:
        return 1
    sizes = [size for size, kind in zip(mesh.axis_sizes, mesh.axis_types) if kind != AxisType.Manual]
    return math.prod(sizes)


_registry: dict[str, dict[str, Implementation]] = {}
_logged_fallbacks: set[tuple[str, str, str, str]] = set()


def register(
    op: str,
    name: str,
    *,
    requires: Iterable[str] = (),
    platforms: Iterable[str] | None = None,
    unsupported: Callable[..., str | None] | None = None,
    prefer: Callable[..., str | None] | None = None,
    priority: int = 0,
    single_device: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as implementation ``name`` of ``op``. Returns ``fn`` unchanged."""
    requires = frozenset(requires)
    unknown = requires - set(ALL_CAPABILITIES)
    if unknown:
        raise ValueError(f"register({op!r}, {name!r}, requires=...): unknown capabilities {sorted(unknown)}")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        _registry.setdefault(op, {})[name] = Implementation(
            op=op,
            name=name,
            fn=fn,
            requires=requires,
            platforms=None if platforms is None else frozenset(platforms),
            unsupported=_runs_anything if unsupported is None else unsupported,
            prefer=prefer,
            priority=priority,
            single_device=single_device,
        )
        return fn

    return decorator


def ops() -> tuple[str, ...]:
    """Every op name with at least one registered implementation."""
    return tuple(sorted(_registry))


def _implementations_of(op: str) -> dict[str, Implementation]:
    if op not in _registry:
        raise ValueError(f"unknown op {op!r}; registered ops: {sorted(_registry)}")
    return _registry[op]


def implementations(op: str) -> tuple[str, ...]:
    """The implementation names registered for ``op``, highest priority first."""
    return tuple(impl.name for impl in sorted(_implementations_of(op).values(), key=lambda i: -i.priority))


def get_implementation(op: str, name: str) -> Implementation:
    """The `Implementation` registered as ``name`` for ``op``; `ValueError` naming the registered ones if none."""
    registered = _implementations_of(op)
    if name not in registered:
        raise ValueError(f"{op}(implementation={name!r}): unknown implementation; registered: {implementations(op)}")
    return registered[name]


def _best_for(op: str, platform_name: str, args: Sequence[Any],
              static: Mapping[str, Any]) -> tuple[Implementation, str]:
    """The implementation automatic selection uses for ``op`` on ``platform_name``, and why."""
    registered = _implementations_of(op)
    preferred = _registered_platforms.get(platform_name)
    candidates = sorted(registered.values(), key=lambda i: -i.priority)
    if preferred is not None and op in preferred.kernels:
        chosen = registered[preferred.kernels[op]]
        candidates = [chosen] + [c for c in candidates if c is not chosen]
    skipped = []
    for impl in candidates:
        reason = impl.runs_on(platform_name)
        if reason is None and args:
            reason = impl.unsupported(*args, **static) or impl.not_preferred(args, static)
        if reason is None:
            why = "highest priority available" if not skipped else "; ".join(skipped)
            return impl, why
        skipped.append(f"{impl.name}: {reason}")
    raise AssertionError(f"op {op!r} has no implementation for {platform_name!r}: {skipped}")


def select(op: str, implementation: str | None = None, *, platform_name: str | None = None,
           args: Sequence[Any] = (), static: Mapping[str, Any] | None = None) -> tuple[Implementation, str]:
    """The implementation `dispatch` would run for ``op`` on ``platform_name``, with the reason.

    With ``args`` (arrays or `jax.ShapeDtypeStruct`) and ``static`` the implementations' support
    predicates are consulted; without them only platform and capabilities are.
    """
    platform_name = platform() if platform_name is None else platform_name
    static = dict(static or {})
    explicit, source = _explicit_choice(op, implementation)
    if explicit is not None:
        impl = get_implementation(op, explicit)
        reason = impl.runs_on(platform_name) or (impl.unsupported(*args, **static) if args else None)
        if reason is not None:
            available = [n for n in implementations(op) if get_implementation(op, n).runs_on(platform_name) is None]
            raise ValueError(
                f"{op}(implementation={explicit!r}) from {source} cannot run here: {reason}. "
                f"Available on {platform_name!r}: {available}"
            )
        return impl, f"chosen by {source}"
    return _best_for(op, platform_name, args, static)


def _explicit_choice(op: str, implementation: str | None) -> tuple[str | None, str]:
    if implementation is not None:
        return implementation, "the implementation= argument"
    override = config.implementations.get(op)
    if override is not None:
        return override, f"mtjax.config (MTJAX_IMPL_{op.upper()})"
    return None, ""


def dispatch(op: str, *args: Any, implementation: str | None = None, **static: Any) -> Any:
    """Run ``op`` on ``args`` with the implementation chosen as the module docstring says.

    ``args`` are the op's arrays (pytrees; ``None`` allowed), ``static`` its hashable options.
    """
    explicit, _ = _explicit_choice(op, implementation)
    if explicit is not None:
        impl, _ = select(op, implementation, args=args, static=static)
        return impl.fn(*args, **static)

    current = platform()
    chosen: dict[str, Implementation] = {}
    for platform_name in known_platforms():
        impl, why = _best_for(op, platform_name, args, static)
        chosen[platform_name] = impl
        if platform_name == current:
            _log_fallback_once(op, platform_name, impl, why)
    if len({impl.name for impl in chosen.values()}) == 1:
        return next(iter(chosen.values())).fn(*args, **static)
    # One callable per implementation, so platform_dependent joins platforms that share it.
    reference = _implementations_of(op)[REFERENCE]
    callables = {
        impl.name: _bind(impl.fn, static) if impl is chosen[current] or impl is reference
        else _traced_or_reference(impl, reference, static)
        for impl in chosen.values()
    }
    branches = {platform_name: callables[impl.name] for platform_name, impl in chosen.items()}
    return jax.lax.platform_dependent(*args, default=_bind(reference.fn, static), **branches)


def _bind(fn: Callable[..., Any], static: Mapping[str, Any]) -> Callable[..., Any]:
    return lambda *args: fn(*args, **static)


def _traced_or_reference(impl: Implementation, reference: Implementation,
                         static: Mapping[str, Any]) -> Callable[..., Any]:
    """The branch of a platform this process is not running on.

    Every branch of `jax.lax.platform_dependent` is traced here, and some kernels cannot even be
    traced without their platform's libraries (jax's cuDNN attention checks for cuDNN while
    tracing). Such a branch is replaced by the reference, with a warning, instead of failing the
    computation that runs here.
    """

    def branch(*args):
        try:
            return impl.fn(*args, **static)
        except Exception as err:
            _log_once((impl.op, "trace", impl.name, type(err).__name__), logging.WARNING,
                      "%s: %r cannot be traced on this machine (%s: %s); its platforms get the %r "
                      "reference in this computation", impl.op, impl.name, type(err).__name__, err, REFERENCE)
            return reference.fn(*args, **static)

    return branch


def _log_fallback_once(op: str, platform_name: str, impl: Implementation, why: str) -> None:
    if impl.name != REFERENCE or not why or why == "highest priority available":
        return
    _log_once((op, platform_name, impl.name, why), logging.INFO,
              "%s on %s falls back to the %r reference (%s)", op, platform_name, REFERENCE, why)


def _log_once(key: tuple[str, ...], level: int, message: str, *args: Any) -> None:
    if key not in _logged_fallbacks:
        _logged_fallbacks.add(key)
        logger.log(level, message, *args)


def describe() -> list[dict[str, str]]:
    """For each op: the implementation chosen on the current platform and why (for `mtjax info`)."""
    rows = []
    for op in ops():
        impl, why = select(op)
        rows.append({"op": op, "implementation": impl.name, "why": why, "registered": ", ".join(implementations(op))})
    return rows
