"""Process-wide settings of mtjax.

Configuration is explicit: set a field (``mtjax.config.pallas_interpret = True``), or change fields
for a block with ``with mtjax.config.override(pallas_interpret=True): ...``. The fields live on the
`Config` object `config`; reading or assigning a field name on this module reads or assigns it there.
Environment variables only provide the starting values (read once, at import):

- ``MTJAX_IMPL_<OP>=name``: force the implementation of one op (e.g. ``MTJAX_IMPL_LAYERNORM=xla``).
- ``MTJAX_PALLAS_INTERPRET=1``: run Pallas kernels in interpret mode (lets them run on the CPU).
- ``MTJAX_CUDA_COMPUTE_CAPABILITY=9.0``: the CUDA device assumed when lowering for ``cuda`` on a
  machine without one (e.g. ``jax.export`` on a CPU-only host).
- ``MTJAX_DEBUG_CHECKS=1``: value checks inside jitted code that cost time (token ids in range in the
  train step, through `jax.experimental.checkify`).
- ``MTJAX_PJRT_PLUGINS=name=/path/libpjrt_x.so,...``: PJRT plugins loaded when mtjax is imported.

`mtjax info` prints the values in force and where they came from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from collections.abc import Iterator, Mapping

_IMPL_ENV_PREFIX = "MTJAX_IMPL_"


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name}={value!r}: expected one of 1/0, true/false, yes/no, on/off")


def _env_implementations(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        key[len(_IMPL_ENV_PREFIX):].lower(): value.strip()
        for key, value in environ.items()
        if key.startswith(_IMPL_ENV_PREFIX) and value.strip()
    }


@dataclasses.dataclass
class Config:
    """Settings read by `mtjax.backend` when it picks kernels.

    Attributes:
      implementations: per-op override, ``{op_name: implementation_name}``; used when a call passes
        no ``implementation=``.
      pallas_interpret: run Pallas kernels with ``interpret=True`` (CPU testing and debugging).
      cuda_compute_capability: the device assumed when lowering for ``cuda`` without a CUDA device.
      debug_checks: check values that only the device sees (token ids against the vocabulary) inside
        jitted steps built afterwards, raising ValueError; each checked step waits for its result.
    """

    implementations: dict[str, str] = dataclasses.field(default_factory=dict)
    pallas_interpret: bool = False
    cuda_compute_capability: str = "9.0"
    debug_checks: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        environ = os.environ if environ is None else environ
        return cls(
            implementations=_env_implementations(environ),
            pallas_interpret=_env_flag(environ, "MTJAX_PALLAS_INTERPRET"),
            cuda_compute_capability=environ.get("MTJAX_CUDA_COMPUTE_CAPABILITY", "9.0"),
            debug_checks=_env_flag(environ, "MTJAX_DEBUG_CHECKS"),
        )


config = Config.from_env()


@contextlib.contextmanager
def override(**changes) -> Iterator[Config]:
    """Temporarily change fields of `config`: ``with override(pallas_interpret=True): ...``.

    ``implementations=`` is merged into the current per-op overrides rather than replacing them.
    """
    unknown = set(changes) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise TypeError(
            f"override(): unknown field(s) {sorted(unknown)}; accepted: "
            f"{[f.name for f in dataclasses.fields(Config)]}"
        )
    saved = dataclasses.replace(config, implementations=dict(config.implementations))
    try:
        for name, value in changes.items():
            if name == "implementations":
                value = {**config.implementations, **value}
            setattr(config, name, value)
        yield config
    finally:
        for field in dataclasses.fields(Config):
            setattr(config, field.name, getattr(saved, field.name))


_FIELDS = frozenset(f.name for f in dataclasses.fields(Config))


class _ConfigModule(types.ModuleType):
    """This module, with its `Config` fields forwarded to `config`: ``mtjax.config.implementations``
    reads ``config.implementations`` and ``mtjax.config.debug_checks = True`` sets ``config.debug_checks``;
    assigning any other new name is an error."""

    def __getattr__(self, name: str):  # only names the module itself lacks
        if name in _FIELDS:
            return getattr(config, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; the settings are "
                             f"{sorted(_FIELDS)}")

    def __setattr__(self, name: str, value) -> None:
        if name in _FIELDS:
            setattr(config, name, value)
        elif name.startswith("_") or name in self.__dict__:
            super().__setattr__(name, value)
        else:  # a misspelt setting must not be a silent no-op
            raise AttributeError(f"mtjax.config.{name}: no such setting; the settings are {sorted(_FIELDS)}")


sys.modules[__name__].__class__ = _ConfigModule
