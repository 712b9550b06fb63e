"""What distinguishes the mtjax rows of the layer and train suites: FP8 on or off, and settings.

``--variant layernorm=xla,activation=xla`` adds mtjax rows (bf16 and FP8) traced with those kernel
choices forced through `mtjax.config.override`; ``--variant xla_gpu_enable_triton_gemm=false``
adds rows compiled with that XLA option (``Lowered.compile(compiler_options=...)``, so one process
compares several); ``--variant scan_layers=false`` (any `mtjax.models.GPTConfig` field) changes
the trained model and ``--variant compute_params=false`` trains without the compute-dtype copy of
the weights (`mtjax.train.state.compute_copy`) (both train suite only: the layer suite skips such
settings); ``--variant recipe=block`` runs the FP8 row under another recipe (`mtjax.fp8.RECIPE_NAMES`: ``delayed``,
the default, ``current`` or ``block``, `mtjax.fp8.BlockScaling`), with no bf16 row of its own (its
speed-up is over the bf16 row of the same settings without the recipe); ``--variant
fold_into_gemm=true`` (a name of `SWITCHES`) sets one of the kernels' module switches while tracing
(all three suites), so an option that is off until measured is timed against its default in one
run. Rows are labelled
``"mtjax [activation=xla,layernorm=xla]"``; the peers always run with defaults, so each such row
shows what the setting does to a whole layer or train step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from mtjax import backend
from mtjax.config import override
from mtjax.fp8 import RECIPE_NAMES, recipe_by_name


@dataclasses.dataclass(frozen=True)
class Setting:
    """Changes of one extra mtjax row.

    Attributes:
      kernels: ``{op: implementation}`` forced while tracing.
      xla_options: XLA compiler options (``{"xla_gpu_...": value}``) for this row's compilation.
      model: `mtjax.models.GPTConfig` fields overridden (``{"scan_layers": False}``), train suite only.
      train: train-state options (`TRAIN_OPTIONS`: ``{"compute_params": False}``), train suite only.
      recipe: the FP8 recipe of the FP8 row, a name of `mtjax.fp8.RECIPE_NAMES` (``None``: `fp8_autocast`'s default).
      switches: ``{name of SWITCHES: bool}`` set while tracing.
    """

    kernels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    xla_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    train: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    recipe: str | None = None
    switches: Mapping[str, bool] = dataclasses.field(default_factory=dict)

    def label(self) -> str:
        items = {**self.kernels, **self.xla_options, **self.model, **self.train, **self.switches,
                 **({} if self.recipe is None else {"recipe": self.recipe})}
        return ",".join(f"{k}={_text(v)}" for k, v in sorted(items.items()))


DEFAULT = Setting()
# compute_params: keep the weights' compute-dtype copy in the train state (default true).
TRAIN_OPTIONS = ("compute_params",)
# Module switches of kernels and ops, read at trace time: ``--variant name=true|false``.
SWITCHES = {
    "fold_into_gemm": ("mtjax.ops.normalization", "FOLD_INTO_GEMM"),
    "gelu_ptx_sigmoid": ("mtjax.kernels.activation", "GELU_PTX_SIGMOID"),
    "tma_row_limits": ("mtjax.kernels.triton.flash_attention", "TMA_ROW_LIMITS"),
}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse(spec: str) -> Setting:
    """``"op=implementation,xla_option=value,config_field=value,..."`` -> `Setting`; ops are checked
    against the registry, model fields against `mtjax.models.GPTConfig` (XLA option names are
    checked by XLA when the row compiles)."""
    from mtjax.models import GPTConfig

    model_fields = {f.name for f in dataclasses.fields(GPTConfig)}
    kernels, options, model, train, recipe, switches = {}, {}, {}, {}, None, {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not value:
            raise ValueError(f"--variant {spec!r}: {item!r} is not key=value")
        if key.startswith("xla_"):
            options[key] = _value(value)
        elif key in backend.ops():
            if value not in backend.implementations(key):
                raise ValueError(f"--variant {spec!r}: op {key!r} has no implementation {value!r}; "
                                 f"registered: {backend.implementations(key)}")
            kernels[key] = value
        elif key in model_fields:
            model[key] = _value(value)
        elif key == "recipe":
            if value not in RECIPE_NAMES:
                raise ValueError(f"--variant {spec!r}: recipe={value!r}; accepted: {RECIPE_NAMES}")
            recipe = value
        elif key in TRAIN_OPTIONS or key in SWITCHES:
            flag = _value(value)
            if not isinstance(flag, bool):
                raise ValueError(f"--variant {spec!r}: {key}={value!r}; expected true or false")
            (train if key in TRAIN_OPTIONS else switches)[key] = flag
        else:
            raise ValueError(f"--variant {spec!r}: {key!r} is neither an op {backend.ops()}, an xla_* option, "
                             f"a GPTConfig field {sorted(model_fields)}, a train option {TRAIN_OPTIONS}, a switch "
                             f"{sorted(SWITCHES)} nor recipe={'|'.join(RECIPE_NAMES)}")
    if not (kernels or options or model or train or recipe or switches):
        raise ValueError(f"--variant {spec!r}: expected op=implementation, xla_option=value, "
                         "config_field=value, train_option=value or switch=true|false, comma-separated")
    return Setting(kernels, options, model, train, recipe, switches)


def label(fp8: bool, setting: Setting) -> str:
    """``"mtjax"``, ``"mtjax fp8"``, ``"mtjax [layernorm=xla]"``, ..."""
    name = "mtjax fp8" if fp8 else "mtjax"
    return f"{name} [{setting.label()}]" if setting != DEFAULT else name


@contextlib.contextmanager
def mtjax_context(fp8: bool, setting: Setting) -> Iterator[None]:
    """Enter around tracing (and init) of an mtjax row: ``fp8_autocast``, the kernel choices and the
    module switches (restored on exit)."""
    from mtjax.fp8 import fp8_autocast

    recipe = None if setting.recipe is None else recipe_by_name(setting.recipe)
    with fp8_autocast(enabled=fp8, recipe=recipe), override(implementations=dict(setting.kernels)), \
            _switched(setting.switches):
        yield


@contextlib.contextmanager
def _switched(switches: Mapping[str, bool]) -> Iterator[None]:
    modules = {name: importlib.import_module(SWITCHES[name][0]) for name in switches}
    saved = {name: getattr(modules[name], SWITCHES[name][1]) for name in switches}
    try:
        for name, value in switches.items():
            setattr(modules[name], SWITCHES[name][1], value)
        yield
    finally:
        for name, value in saved.items():
            setattr(modules[name], SWITCHES[name][1], value)


def mtjax_xla_options(fp8: bool, setting: Setting) -> dict[str, Any]:
    """XLA options of an mtjax row: FP8 rows compile as mtjax's FP8 steps do
    (`mtjax.fp8.compiler_options`), then the setting's own options on top."""
    from mtjax.fp8 import compiler_options

    return {**(compiler_options() if fp8 else {}), **setting.xla_options}


def mtjax_variants(settings: list[Setting]) -> list[tuple[bool, Setting]]:
    """``(fp8, setting)`` of every mtjax row: the defaults, then each setting, bf16 and FP8 (FP8 only
    for a setting with a recipe: its bf16 row would be the one without it)."""
    return [(fp8, setting) for setting in [DEFAULT, *settings] for fp8 in (False, True)
            if fp8 or setting.recipe is None]


def bf16_label(setting: Setting) -> str:
    """The label of the bf16 row an FP8 row of ``setting`` is compared with (the recipe dropped)."""
    return label(False, dataclasses.replace(setting, recipe=None))
