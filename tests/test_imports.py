"""The import graph of mtjax's sources, read with `ast` (nothing is imported): no cycles, arrows one way,
no private module or name used across packages.

Layers, bottom up: ``config``, ``axes``, ``dtypes`` and ``cli_args`` import nothing from mtjax;
``backend`` knows nothing of the ops (they register themselves when `mtjax.ops` is imported);
``kernels`` <- ``ops`` <- ``fp8`` <- ``flax`` <- ``models`` <- ``train`` / ``inference``, with
``sharding`` beside; ``bench`` and ``cli`` sit on top. Every package and top-level module of mtjax must
have an entry in `MAY_IMPORT`, so a new one (``mtjax/inference``, ``mtjax/moe``...) says where it sits.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

BASE = {"config", "axes", "dtypes", "xla_flags"}
LOW = BASE | {"backend", "kernels"}
LAYERS_UNDER_MODELS = LOW | {"ops", "fp8", "flax", "sharding"}
# component -> the other components it may import ("mtjax" is the package's own __init__.py).
MAY_IMPORT: dict[str, set[str]] = {
    "config": set(),
    "axes": set(),
    "dtypes": set(),
    "xla_flags": set(),
    "cli_args": set(),
    "backend": {"config"},
    "kernels": {"config", "dtypes", "backend"},
    "ops": LOW,
    "fp8": LOW | {"ops"},
    "flax": LOW | {"ops", "fp8", "sharding"},
    "sharding": LOW | {"ops", "fp8", "flax"},
    "models": LAYERS_UNDER_MODELS,
    # Checkpoints from elsewhere (Hugging Face): models' users, beneath train and the commands.
    "interop": LAYERS_UNDER_MODELS | {"models"},
    "train": LAYERS_UNDER_MODELS | {"models", "interop", "cli_args"},
    "inference": LAYERS_UNDER_MODELS | {"models", "cli_args"},
    "info": LOW,
    "bench": LAYERS_UNDER_MODELS | {"models", "train", "inference", "cli_args", "info"},
    # Commands that join train's checkpoints with the inference engine sit on top, as bench does.
    "generate": LAYERS_UNDER_MODELS | {"models", "train", "inference", "interop", "cli_args"},
    "serve": LAYERS_UNDER_MODELS | {"models", "train", "inference", "interop", "cli_args", "generate"},
    "convert": LAYERS_UNDER_MODELS | {"models", "train", "interop", "cli_args", "generate"},
    "cli": {"cli_args"},  # sub-commands are imported by name, when chosen
    "mtjax": {"config", "backend", "ops"},  # importing mtjax registers the ops
}

# The directions issue 19 names explicitly (implied by MAY_IMPORT; checked on their own so a loosened
# table cannot let them back in).
FORBIDDEN: dict[str, set[str]] = {
    "kernels": {"ops", "fp8", "flax", "models", "train", "sharding", "inference"},
    "ops": {"fp8", "flax", "models", "train", "inference"},
    "backend": {"kernels", "ops", "fp8", "flax", "models", "train", "sharding", "inference"},
    "sharding": {"models", "train", "inference"},
    "flax": {"models", "train", "inference"},
    "models": {"train", "inference", "interop"},
    "interop": {"train", "inference"},
    "train": {"inference"},
    "inference": {"train"},
}


def _source_roots() -> dict[str, pathlib.Path]:
    """``{package: folder}`` as pyproject.toml maps them (kernels/, sharding/, train/ live at the root)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {package: ROOT / folder for package, folder in setuptools["package-dir"].items()}


def _modules() -> dict[str, pathlib.Path]:
    """``{module name: source file}`` of every mtjax module (a package by its ``__init__.py``)."""
    roots = _source_roots()
    nested = set(roots.values())
    modules = {}
    for package, folder in roots.items():
        for path in folder.rglob("*.py"):
            if any(parent in nested and parent != folder for parent in path.parents):
                continue  # another mapped root inside this one
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def component(module: str) -> str:
    """``mtjax.ops.normalization`` -> ``ops``; ``mtjax`` -> ``mtjax``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if module in PACKAGES else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class Import:
    """One import of an mtjax module: which module imports what, how, at which line."""

    def __init__(self, source: str, target: str, name: str | None, line: int):
        self.source, self.target, self.name, self.line = source, target, name, line

    def __repr__(self) -> str:
        what = self.target + (f" ({self.name})" if self.name else "")
        return f"{self.source}:{self.line} imports {what}"


def _imports(module: str, tree: ast.AST) -> tuple[list[Import], dict[str, str]]:
    """The module's imports of mtjax modules (also inside functions and ``TYPE_CHECKING`` blocks), and
    ``{local name: module}`` for the names bound to mtjax modules."""
    found, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mtjax":
                    found.append(Import(module, alias.name, None, node.lineno))
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "mtjax"
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, node)
            if base.split(".")[0] != "mtjax":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    found.append(Import(module, submodule, None, node.lineno))
                    bound[alias.asname or alias.name] = submodule
                else:
                    found.append(Import(module, base, alias.name, node.lineno))
    return found, bound


def _private_attributes(module: str, tree: ast.AST, bound: dict[str, str]) -> list[Import]:
    """``backend._get(...)``-style uses: a private attribute of an imported mtjax module."""
    uses = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            uses.append(Import(module, bound[node.value.id], node.attr, node.lineno))
    return uses


def _parse_all() -> tuple[list[Import], list[Import]]:
    imports, attributes = [], []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found, bound = _imports(module, tree)
        imports += found
        attributes += _private_attributes(module, tree, bound)
    return imports, attributes


IMPORTS, PRIVATE_ATTRIBUTES = _parse_all()


def _is_private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or with a self-loop), by Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            scc = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                scc.append(top)
                if top == node:
                    break
            if len(scc) > 1 or node in edges.get(node, ()):
                cycles.append(sorted(scc))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def test_the_sources_are_found():
    assert {"mtjax.backend", "mtjax.ops", "mtjax.fp8", "mtjax.kernels.common", "mtjax.train.step"} <= set(MODULES)
    assert any(i.source == "mtjax.ops.normalization" and i.target == "mtjax.backend" for i in IMPORTS)


def test_every_component_declares_what_it_may_import():
    undeclared = sorted({component(m) for m in MODULES} - set(MAY_IMPORT))
    assert not undeclared, f"add these packages/modules of mtjax to MAY_IMPORT in {__file__}: {undeclared}"


def test_no_import_cycles():
    edges: dict[str, set[str]] = {}
    for imp in IMPORTS:
        if imp.target in MODULES and imp.target != imp.source:
            edges.setdefault(imp.source, set()).add(imp.target)
    assert _cycles(edges) == []


@pytest.mark.parametrize("table", ["MAY_IMPORT", "FORBIDDEN"])
def test_imports_point_one_way(table):
    wrong = []
    for imp in IMPORTS:
        src, dst = component(imp.source), component(imp.target)
        if src == dst:
            continue
        if table == "MAY_IMPORT" and dst not in MAY_IMPORT.get(src, set()):
            wrong.append(f"{imp} ({src} may import {sorted(MAY_IMPORT.get(src, set()))})")
        if table == "FORBIDDEN" and dst in FORBIDDEN.get(src, set()):
            wrong.append(f"{imp} ({src} must not import {dst})")
    assert wrong == []


def test_the_backend_knows_nothing_of_the_ops():
    assert [imp for imp in IMPORTS if imp.source == "mtjax.backend"] == [
        imp for imp in IMPORTS if imp.source == "mtjax.backend" and imp.target == "mtjax.config"]


def test_no_private_module_or_name_is_used_across_packages():
    wrong = []
    for imp in IMPORTS + PRIVATE_ATTRIBUTES:
        if component(imp.source) == component(imp.target):
            continue
        if _is_private(imp.target) or (imp.name and imp.name.startswith("_") and not imp.name.startswith("__")):
            wrong.append(repr(imp))
    assert wrong == []


def test_the_checks_catch_what_they_are_for():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from mtjax import backend\nfrom mtjax.kernels._x import y\nbackend._get('op', 'xla')\n")
    found, bound = _imports("mtjax.bench.attention", tree)
    assert [i.target for i in found] == ["mtjax.backend", "mtjax.kernels._x"]
    assert [i.name for i in _private_attributes("mtjax.bench.attention", tree, bound)] == ["_get"]
    assert _is_private("mtjax.kernels._x") and not _is_private("mtjax.kernels.common")


def test_importing_mtjax_registers_the_ops_and_leaves_jax_backends_alone():
    """``import mtjax`` registers every op through `mtjax.ops` (the backend imports none of them), and
    starts no jax backend, so `mtjax.backend.load_plugin` still works after it."""
    code = ("import mtjax\nfrom jax._src import xla_bridge\n"
            "assert not xla_bridge.backends_are_initialized()\n"
            "print(' '.join(mtjax.backend.ops()))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) >= {"layernorm", "norm_fp8", "residual_norm", "cast_transpose", "fp8_gemm",
                                          "attention", "softmax", "activation"}
