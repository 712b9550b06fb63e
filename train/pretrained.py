"""Weights to start from: a Hugging Face model folder or an mtjax checkpoint (a training run's, or one
written by ``mtjax convert``), behind one interface for ``mtjax train --init-from``, ``mtjax generate`` and
``mtjax serve``.

    pretrained = open_pretrained("Llama-3.2-1B")           # reads the configs only
    params = pretrained.load_params(pretrained.config)    # then the weights, in the config's dtype

Converted checkpoints (`save_converted`) hold the parameters and a meta of ``{"model": GPTConfig.to_dict(),
"tokenizer": spec, "weights_only": true, "source": ..., "hf_config": ...}``; training checkpoints hold a
whole `mtjax.train.TrainState` and the run's configuration.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.interop import (
    abstract_params,
    config_from_hf,
    is_hf_checkpoint,
    load_hf_checkpoint,
    param_shardings,
    read_hf_config,
)
from mtjax.models import GPTConfig, gpt_config
from mtjax.train.checkpoint import Checkpointer, CheckpointError
from mtjax.train.tokenizer import HF_TOKENIZER_FILE, SENTENCEPIECE_FILE, find_tokenizer

# The meta key that marks a checkpoint of converted weights (no training state).
WEIGHTS_ONLY = "weights_only"
# Files copied with a tokenizer so that it loads the same from its new folder (end-of-text id included).
TOKENIZER_FILES = (HF_TOKENIZER_FILE, SENTENCEPIECE_FILE, "tokenizer_config.json", "special_tokens_map.json",
                   "config.json")


@dataclasses.dataclass
class Pretrained:
    """A model whose configuration is read and whose weights can be loaded.

    Attributes:
      source: the folder it came from.
      kind: ``"hf"`` (a Hugging Face folder) or ``"mtjax"`` (a checkpoint).
      config: its `GPTConfig` (a Hugging Face folder's in the dtype its config.json names).
      tokenizer: the `mtjax.train.load_tokenizer` spec of its tokenizer, or None when it names none.
      hf_config: the config.json of a Hugging Face source, or the one a converted checkpoint came
        from (None otherwise).
    """

    source: str
    kind: str
    config: GPTConfig
    tokenizer: str | None
    hf_config: dict[str, Any] | None
    _load: Callable[..., Any] = dataclasses.field(repr=False)

    def load_params(self, config: GPTConfig | None = None, *, mesh: jax.sharding.Mesh | None = None,
                    rules: Any = None) -> Any:
        """The unboxed ``"params"`` in ``config``'s parameter dtype (default: `config`; it may differ
        from `config` only in dtypes, remat and the longest sequence), each placed on ``mesh`` by the
        model's logical axes and ``rules`` (without a mesh: the first device)."""
        config = self.config if config is None else config
        shape_fields = ("dtype", "param_dtype", "remat_policy", "max_seq_len")
        if dataclasses.replace(config, **{f: getattr(self.config, f) for f in shape_fields}) != self.config:
            raise ValueError(f"load_params: the config differs from {self.source}'s in more than {shape_fields}")
        return self._load(config, mesh, rules)


def run_model_config(run: Mapping[str, Any]) -> GPTConfig:
    """The model of a run configuration (the fields of `mtjax.train.cli.RunConfig`): its ``model_fields``
    (a run started from pretrained weights) or its preset ``model``, with its ``model_overrides``."""
    overrides = run.get("model_overrides") or {}
    if run.get("model_fields") is not None:
        return GPTConfig.from_dict({**run["model_fields"], **overrides})
    return gpt_config(run["model"], **overrides)


def _hf_dtype(hf_config: dict[str, Any]) -> Any:
    """The dtype a Hugging Face config.json names (``dtype`` or ``torch_dtype``), float32 when none or another."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return getattr(jnp, name) if name in ("float32", "bfloat16", "float16") else jnp.float32


def _abstract_params(config: GPTConfig, mesh: Any, rules: Any) -> Any:
    """The ``"params"`` of `GPT(config)` as ``ShapeDtypeStruct`` leaves with their shardings."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        nn.meta.unbox(abstract_params(config)), param_shardings(config, mesh, rules))


def checkpoint_folder(path: str) -> str | None:
    """The folder of step checkpoints of ``path`` (a workdir with ``checkpoints/``, or that folder), or None."""
    nested = os.path.join(path, "checkpoints")
    if os.path.isdir(nested):
        return nested
    if os.path.isdir(path) and any(name.isdigit() for name in os.listdir(path)):
        return path
    return None


def open_pretrained(source: str | os.PathLike, step: int | None = None) -> Pretrained:
    """The `Pretrained` at ``source``: a Hugging Face model folder (config.json + safetensors) or an mtjax
    checkpoint folder (a ``mtjax train`` workdir, its ``checkpoints/``, or ``mtjax convert``'s output;
    ``step``: which checkpoint, default the latest).

    Raises:
      FileNotFoundError: no such folder, or no checkpoint in it.
      ValueError: neither kind of model folder, an unsupported or non-decoder Hugging Face model, or a
        checkpoint without a model configuration.
    """
    source = os.path.abspath(os.fspath(source))
    if not os.path.isdir(source):
        raise FileNotFoundError(f"{source}: no such folder")
    if is_hf_checkpoint(source):
        hf = read_hf_config(source)
        dtype = _hf_dtype(hf)
        config = config_from_hf(hf, dtype=dtype, where=source)
        if not isinstance(config, GPTConfig):
            raise ValueError(f"{source}: model_type={hf.get('model_type')!r} is not a decoder (mtjax.models.GPT); "
                             "load it with mtjax.interop.load_hf_checkpoint")

        def load_hf(config: GPTConfig, mesh: Any, rules: Any) -> Any:
            return load_hf_checkpoint(source, dtype=config.param_dtype, compute_dtype=config.dtype, mesh=mesh,
                                      rules=rules)[1]

        return Pretrained(source, "hf", config, find_tokenizer(source), hf, load_hf)
    folder = checkpoint_folder(source)
    if folder is None:
        raise ValueError(f"{source}: neither a Hugging Face model folder (config.json and *.safetensors) nor an "
                         "mtjax checkpoint folder (a workdir with checkpoints/, or mtjax convert's output)")
    with Checkpointer(folder) as checkpointer:
        try:
            meta = checkpointer.restore_meta(step)
        except CheckpointError as err:
            raise ValueError(str(err)) from None
        resolved = checkpointer.latest_step() if step is None else step
    try:
        if "model" in meta:
            config, tokenizer = GPTConfig.from_dict(meta["model"]), meta.get("tokenizer")
        else:
            config, tokenizer = run_model_config(meta["run"]), meta["run"]["tokenizer"]
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"the checkpoint in {folder} holds no model configuration") from None

    def load_checkpoint(config: GPTConfig, mesh: Any, rules: Any) -> Any:
        with Checkpointer(folder) as checkpointer:
            try:
                return checkpointer.restore_params(_abstract_params(config, mesh, rules), resolved)
            except CheckpointError as err:
                raise ValueError(str(err)) from None

    return Pretrained(source, "mtjax", config, tokenizer or None, meta.get("hf_config"), load_checkpoint)


def copy_tokenizer(spec: str | None, folder: str, *, model_config: bool = True) -> str | None:
    """Copy the file of a tokenizer spec (``hf:`` or ``sentencepiece:``) into ``folder`` as
    ``tokenizer.json`` / ``tokenizer.model``, with the files beside it that name its special tokens
    (``tokenizer_config.json``, ``special_tokens_map.json``, and with ``model_config`` ``config.json``);
    returns the spec of the copy (None for no spec or ``byte``)."""
    if not spec or spec == "byte":
        return None
    kind, _, path = spec.partition(":")
    source = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    for name in TOKENIZER_FILES[2:] if model_config else TOKENIZER_FILES[2:-1]:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))
    target = os.path.join(folder, HF_TOKENIZER_FILE if kind == "hf" else SENTENCEPIECE_FILE)
    if os.path.abspath(path) != os.path.abspath(target):
        shutil.copyfile(path, target)
    return f"{kind}:{os.path.abspath(target)}"


def save_converted(directory: str, params: Any, config: GPTConfig, *, tokenizer: str | None, source: str,
                   hf_config: dict[str, Any] | None = None) -> str:
    """Write converted weights as step 0 of ``directory/checkpoints`` (what ``mtjax generate --checkpoint
    directory`` and ``mtjax train --init-from directory`` read), the tokenizer's files copied into
    ``directory/tokenizer``; returns the checkpoint's folder.

    Raises:
      ValueError: ``directory`` already holds checkpoints.
    """
    folder = os.path.join(directory, "checkpoints")
    with Checkpointer(folder) as checkpointer:
        if checkpointer.all_steps():
            raise ValueError(f"{directory} already holds checkpoints (steps {checkpointer.all_steps()}); "
                             "write to a new folder")
        spec = copy_tokenizer(tokenizer, os.path.join(directory, "tokenizer"))
        meta = {"model": config.to_dict(), "tokenizer": spec, WEIGHTS_ONLY: True, "source": source,
                "hf_config": hf_config}
        checkpointer.save_params(0, params, meta)
        return checkpointer.step_path(0)
