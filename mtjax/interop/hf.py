"""Hugging Face checkpoints: a local model folder (``config.json`` + ``*.safetensors``, sharded or not) to an
`mtjax.models` config and parameters, and back.

    config, params = load_hf_checkpoint("Llama-3.2-1B", dtype=jnp.bfloat16)
    logits = GPT(config).apply({"params": params}, tokens)
    save_hf_checkpoint(config, params, "out", model_type="llama")

Supported ``model_type`` values: `SUPPORTED_MODEL_TYPES` (decoders become a `GPTConfig`, BERT a
`BertConfig`). Every conversion is a reshape or transpose of whole tensors, so a round trip gives the
same bytes. Loading reads one layer's tensors at a time (the host never holds two copies of the
model) and, with a mesh, places each parameter in its sharding as it is read. docs/interop.md has the
mapping tables and the limits.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtjax.interop.hf_architectures import (
    ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    Architecture,
    config_from_hf,
    config_to_hf,
    dtype_name,
    infer_model_type,
)
from mtjax.models import GPT, BertConfig, BertEncoder, GPTConfig
from mtjax.sharding import logical_shardings, use_mesh

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# config.json fields copied from ``extra_config`` into a saved folder (mtjax's configs do not hold them).
PASS_THROUGH_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id",
                       "initializer_range")
# Buffers some checkpoints store that are not parameters (causal masks, rotary tables, position ids).
_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|\.attention\.(masked_)?bias|\.rotary_emb\.inv_freq|"
                      r"embeddings\.position_ids)$")
Array = np.ndarray


def _fail(path: str, message: str) -> ValueError:
    return ValueError(f"{path}: {message}")


# ---------------------------------------------------------------------------------------------- config.json


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of the model folder ``path``.

    Raises:
      FileNotFoundError: no such folder or no config.json in it.
      ValueError: config.json is not a JSON object.
    """
    path = os.fspath(path)
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such folder")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a Hugging Face model folder)")
    try:
        with open(file) as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a config.json and safetensors weights."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, CONFIG_FILE)) and any(
        name.endswith(".safetensors") for name in os.listdir(path))


# --------------------------------------------------------------------------------------------- safetensors


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ImportError("Hugging Face checkpoints need the safetensors package: pip install 'mtjax[hf]'") from None
    return safetensors


def _weight_files(path: str) -> dict[str, str]:
    """``{tensor name: file}`` of the folder's safetensors (through the index when there is one)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise _fail(path, f"{INDEX_FILE} has no readable weight_map ({err})") from None
        missing = sorted({file for file in weight_map.values() if not os.path.isfile(os.path.join(path, file))})
        if missing:
            raise _fail(path, f"{INDEX_FILE} names files that are missing: {', '.join(missing)}")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not files:
        raise _fail(path, "no *.safetensors file (only safetensors weights are read; convert .bin files with "
                          "transformers' save_pretrained(safe_serialization=True))")
    safetensors = _safetensors()
    names: dict[str, str] = {}
    for file in files:
        with safetensors.safe_open(os.path.join(path, file), framework="numpy") as f:
            for name in f.keys():
                names[name] = os.path.join(path, file)
    return names


class _TensorReader:
    """Reads tensors one at a time from the folder's safetensors files, in mtjax's names (prefix resolved),
    checking shapes and recording which were read."""

    def __init__(self, path: str, arch: Architecture, dtype: Any):
        self.path, self.arch, self.dtype = path, arch, jnp.dtype(dtype)
        self.files = _weight_files(path)
        self.used: set[str] = set()
        self._open: dict[str, Any] = {}
        self.prefix = next((p for p in arch.prefixes if p + arch.anchor in self.files), arch.prefixes[0])

    def name(self, name: str) -> str:
        """A leading ``/`` marks a name outside the base model's prefix (a head)."""
        return name[1:] if name.startswith("/") else self.prefix + name

    def __call__(self, name: str, shape: tuple[int, ...]) -> Array:
        full = self.name(name)
        if full not in self.files:
            raise _fail(self.path, f"the checkpoint has no tensor {full!r} (config.json model_type="
                                   f"{self.arch.model_type!r} needs it)")
        file = self.files[full]
        if file not in self._open:
            self._open[file] = _safetensors().safe_open(file, framework="numpy")
        array = self._open[file].get_tensor(full)
        if tuple(array.shape) != tuple(shape):
            raise _fail(self.path, f"tensor {full!r} has shape {list(array.shape)}; config.json implies {list(shape)}")
        self.used.add(full)
        return array.astype(self.dtype, copy=False)

    def unexpected(self, tied: bool) -> list[str]:
        ignored = tuple(self.arch.skipped)
        return sorted(name for name in self.files if name not in self.used and not _BUFFERS.search(name)
                      and not name.startswith(ignored) and not (tied and name == "lm_head.weight"))

    def close(self) -> None:
        for handle in self._open.values():
            if hasattr(handle, "__exit__"):
                handle.__exit__(None, None, None)
        self._open.clear()


# ------------------------------------------------------------------------------------- mtjax parameter trees


def _model(config: GPTConfig | BertConfig) -> nn.Module:
    return BertEncoder(config) if isinstance(config, BertConfig) else GPT(config)


def abstract_params(config: GPTConfig | BertConfig) -> Any:
    """The boxed (logical axes) abstract ``"params"`` tree `GPT`/`BertEncoder` creates for ``config``."""
    return jax.eval_shape(lambda: _model(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32)))["params"]


def param_shardings(config: GPTConfig | BertConfig, mesh: jax.sharding.Mesh | None = None, rules: Any = None) -> Any:
    """The sharding of each parameter of ``config``'s model (the unboxed tree's structure): by its logical
    axes and ``rules`` on ``mesh``, or the first device without a mesh."""
    boxed = abstract_params(config)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, nn.meta.unbox(boxed))
    if rules is None:
        raise ValueError("a mesh needs rules= (mtjax.sharding.logical_axis_rules)")
    with use_mesh(mesh, rules):
        return logical_shardings(boxed, mesh, rules)


def _norm(scale: Array, bias: Array | None) -> dict[str, Array]:
    return {"scale": scale} if bias is None else {"scale": scale, "ln_bias": bias}


def _layer_to_params(pieces: Mapping[str, Array], config: GPTConfig | BertConfig) -> dict[str, Any]:
    """One layer's parameter tree (`TransformerLayer`'s names) from its pieces."""
    bert = isinstance(config, BertConfig)
    kv_heads = config.num_heads if bert else config.resolved_num_kv_heads
    fused = True if bert else config.fuse_qkv_params
    norm = {} if bert else _norm(pieces["attn_norm_scale"], pieces.get("attn_norm_bias"))
    biased = "q_bias" in pieces

    def dense(kernel: Array, bias: Array | None = None) -> dict[str, Array]:
        return {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}

    if fused and kv_heads == config.num_heads:
        attention = {"qkv": {**dense(np.stack([pieces["q"], pieces["k"], pieces["v"]], axis=1),
                                     np.stack([pieces["q_bias"], pieces["k_bias"], pieces["v_bias"]])
                                     if biased else None), **norm}}
    else:
        attention = {"query": {**dense(pieces["q"], pieces.get("q_bias")), **norm}}
        if fused:
            attention["kv"] = dense(np.stack([pieces["k"], pieces["v"]], axis=1),
                                    np.stack([pieces["k_bias"], pieces["v_bias"]]) if biased else None)
        else:
            attention["key"] = dense(pieces["k"], pieces.get("k_bias"))
            attention["value"] = dense(pieces["v"], pieces.get("v_bias"))
    attention["out"] = dense(pieces["o"], pieces.get("o_bias"))
    if "q_norm" in pieces:
        attention["query_norm"] = {"scale": pieces["q_norm"]}
        attention["key_norm"] = {"scale": pieces["k_norm"]}
    mlp = {**_norm(pieces["mlp_norm_scale"], pieces.get("mlp_norm_bias")), "wi_kernel": pieces["wi"],
           "wo_kernel": pieces["wo"]}
    if "wi_bias" in pieces:
        mlp.update(wi_bias=pieces["wi_bias"], wo_bias=pieces["wo_bias"])
    layer = {"self_attention": attention, "mlp": mlp}
    if "out_norm_scale" in pieces:
        layer["output_layernorm"] = _norm(pieces["out_norm_scale"], pieces["out_norm_bias"])
    return layer


def _params_to_layer(layer: Mapping[str, Any]) -> dict[str, Array]:
    """The inverse of `_layer_to_params` (numpy arrays)."""
    attention, mlp = layer["self_attention"], layer["mlp"]
    pieces: dict[str, Array] = {}
    if "qkv" in attention:
        qkv = attention["qkv"]
        pieces.update(q=qkv["kernel"][:, 0], k=qkv["kernel"][:, 1], v=qkv["kernel"][:, 2])
        if "bias" in qkv:
            pieces.update(q_bias=qkv["bias"][0], k_bias=qkv["bias"][1], v_bias=qkv["bias"][2])
        norm = qkv
    else:
        norm = attention["query"]
        pieces["q"] = attention["query"]["kernel"]
        if "bias" in attention["query"]:
            pieces["q_bias"] = attention["query"]["bias"]
        if "kv" in attention:
            pieces.update(k=attention["kv"]["kernel"][:, 0], v=attention["kv"]["kernel"][:, 1])
            if "bias" in attention["kv"]:
                pieces.update(k_bias=attention["kv"]["bias"][0], v_bias=attention["kv"]["bias"][1])
        else:
            pieces.update(k=attention["key"]["kernel"], v=attention["value"]["kernel"])
            if "bias" in attention["key"]:
                pieces.update(k_bias=attention["key"]["bias"], v_bias=attention["value"]["bias"])
    if "scale" in norm:
        pieces["attn_norm_scale"] = norm["scale"]
        if "ln_bias" in norm:
            pieces["attn_norm_bias"] = norm["ln_bias"]
    pieces["o"] = attention["out"]["kernel"]
    if "bias" in attention["out"]:
        pieces["o_bias"] = attention["out"]["bias"]
    if "query_norm" in attention:
        pieces.update(q_norm=attention["query_norm"]["scale"], k_norm=attention["key_norm"]["scale"])
    pieces.update(mlp_norm_scale=mlp["scale"], wi=mlp["wi_kernel"], wo=mlp["wo_kernel"])
    if "ln_bias" in mlp:
        pieces["mlp_norm_bias"] = mlp["ln_bias"]
    if "wi_bias" in mlp:
        pieces.update(wi_bias=mlp["wi_bias"], wo_bias=mlp["wo_bias"])
    if "output_layernorm" in layer:
        pieces.update(out_norm_scale=layer["output_layernorm"]["scale"],
                      out_norm_bias=layer["output_layernorm"]["ln_bias"])
    return pieces


def _global_to_params(pieces: Mapping[str, Array], config: GPTConfig | BertConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"token_embed": {"embedding": pieces["token_embed"]}}
    if "position_embed" in pieces:
        params["position_embed"] = {"embedding": pieces["position_embed"]}
    norm = _norm(pieces["final_norm_scale"], pieces.get("final_norm_bias"))
    if isinstance(config, BertConfig):
        params.update(type_embed={"embedding": pieces["type_embed"]}, embed_norm=norm)
    else:
        params["final_norm"] = norm
    if "lm_head" in pieces:
        params["logits_dense"] = {"kernel": pieces["lm_head"].T}
    return params


def _params_to_global(params: Mapping[str, Any], config: GPTConfig | BertConfig) -> dict[str, Array]:
    pieces = {"token_embed": params["token_embed"]["embedding"]}
    if "position_embed" in params:
        pieces["position_embed"] = params["position_embed"]["embedding"]
    norm = params["embed_norm" if isinstance(config, BertConfig) else "final_norm"]
    pieces["final_norm_scale"] = norm["scale"]
    if "ln_bias" in norm:
        pieces["final_norm_bias"] = norm["ln_bias"]
    if "type_embed" in params:
        pieces["type_embed"] = params["type_embed"]["embedding"]
    if "logits_dense" in params:
        pieces["lm_head"] = np.ascontiguousarray(params["logits_dense"]["kernel"].T)
    return pieces


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


# ------------------------------------------------------------------------------------------------- loading


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: Any = jnp.float32, compute_dtype: Any = None,
                       mesh: jax.sharding.Mesh | None = None, rules: Any = None,
                       ) -> tuple[GPTConfig | BertConfig, dict[str, Any]]:
    """The mtjax config and ``"params"`` of a local Hugging Face model folder.

    Args:
      path: a folder with ``config.json`` and ``model.safetensors`` (or shards named by
        ``model.safetensors.index.json``).
      dtype: the parameters' dtype (tensors are cast as they are read) and the config's ``param_dtype``.
      compute_dtype: the config's ``dtype`` (None: ``dtype``).
      mesh, rules: place every parameter on ``mesh`` as the model's logical axes and ``rules`` say
        (`mtjax.sharding.logical_axis_rules`), each as soon as it is read. Without a mesh every
        parameter goes to the default device.

    Returns:
      ``(config, params)``: a `GPTConfig` (decoders) or `BertConfig` (BERT) and the unboxed parameter
      tree of `mtjax.models.GPT` / `mtjax.models.BertEncoder` (layers unrolled: ``layers_0``, ...).

    Raises:
      FileNotFoundError: no such folder, no config.json.
      ValueError: an unsupported architecture or config value (naming the field and the accepted
        values), a missing tensor, a tensor of the wrong shape, or tensors no parameter takes.
      ImportError: the safetensors package is missing (``pip install 'mtjax[hf]'``).
    """
    path = os.fspath(path)
    if mesh is not None and rules is None:
        raise ValueError("load_hf_checkpoint(mesh=...) needs rules= (mtjax.sharding.logical_axis_rules)")
    hf = read_hf_config(path)
    config = config_from_hf(hf, dtype=dtype, compute_dtype=compute_dtype, where=path)
    arch = ARCHITECTURES[hf["model_type"]]
    abstract = _flatten(nn.meta.unbox(abstract_params(config)))
    shardings = _flatten(param_shardings(config, mesh, rules))
    reader = _TensorReader(path, arch, dtype)
    placed: dict[tuple[str, ...], jax.Array] = {}

    def place(tree: Mapping[str, Any], prefix: tuple[str, ...]) -> None:
        for key, array in _flatten(tree, prefix).items():
            if key not in abstract or abstract[key].shape != array.shape:
                expected = "no such parameter" if key not in abstract else f"expected {list(abstract[key].shape)}"
                raise _fail(path, f"parameter {'/'.join(key)} converts to shape {list(array.shape)}; {expected}")
            placed[key] = jax.make_array_from_callback(array.shape, shardings[key],
                                                       lambda index, array=array: array[index])

    try:
        place(_global_to_params(arch.global_to_pieces(reader, config), config), ())
        for i in range(config.num_layers):
            place(_layer_to_params(arch.layer_to_pieces(reader, i, config), config), (f"layers_{i}",))
        unexpected = reader.unexpected(getattr(config, "tie_embeddings", False))
    finally:
        reader.close()
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        raise _fail(path, f"the checkpoint holds tensors model_type={arch.model_type!r} has no place for: {shown}")
    missing = sorted("/".join(key) for key in abstract if key not in placed)
    if missing:
        raise _fail(path, f"no tensor converted to the parameters {', '.join(missing)}")
    return config, _unflatten(placed)


# -------------------------------------------------------------------------------------------------- saving


def _check_params(params: Mapping[str, Any], config: GPTConfig | BertConfig) -> None:
    """ValueError unless ``params`` (scanned or unrolled) have the names and shapes of the model's."""
    expected = {key: tuple(a.shape) for key, a in
                _flatten(nn.meta.unbox(abstract_params(dataclasses.replace(config, scan_layers=False)))).items()}
    got = {}
    for key, leaf in _flatten(params).items():
        if key[0] == "layers":
            for i in range(config.num_layers):
                got[(f"layers_{i}", *key[1:])] = tuple(leaf.shape[1:])
        else:
            got[key] = tuple(leaf.shape)
    if got != expected:
        wrong = sorted("/".join(k) for k in set(got) ^ set(expected)) or sorted(
            f"{'/'.join(k)} {list(got[k])} (expected {list(expected[k])})" for k in got if got[k] != expected[k])
        raise ValueError(f"params do not fit the config: {', '.join(wrong[:8])}"
                         + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""))


def _host_layers(params: Mapping[str, Any], num_layers: int) -> Iterator[dict[str, Any]]:
    """Each layer's parameters as numpy arrays (from an unrolled or a scanned stack), one layer at a time."""
    if "layers" in params:
        stacked = params["layers"]
        for i in range(num_layers):
            yield jax.tree.map(lambda x, i=i: np.asarray(x[i]), stacked)
    else:
        for i in range(num_layers):
            if f"layers_{i}" not in params:
                raise ValueError(f"save_hf_checkpoint: params have no 'layers_{i}' (nor a scanned 'layers'); "
                                 f"top-level keys: {sorted(params)}")
            yield jax.tree.map(np.asarray, params[f"layers_{i}"])


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(i?)B\s*", str(size).upper().replace("IB", "iB"))
        if not match:
            raise ValueError(f"save_hf_checkpoint: max_shard_size={size!r}; expected bytes (int) or e.g. '5GB', "
                             "'500MB', '2GiB'")
        base = 1024 if match.group(3) else 1000
        value = int(float(match.group(1)) * base ** " KMG".index(match.group(2) or " "))
    if value < 1:
        raise ValueError(f"save_hf_checkpoint: max_shard_size={size!r}; expected a positive size")
    return value


def to_hf_tensors(config: GPTConfig | BertConfig, params: Mapping[str, Any], model_type: str | None = None,
                  ) -> Iterator[tuple[str, Array]]:
    """``(name, numpy array)`` of every Hugging Face tensor of ``params`` (or of a tree shaped like them,
    such as their gradients), one layer at a time, as ``model_type`` (default: `infer_model_type`)
    names them.

    Raises:
      ValueError: ``model_type`` cannot express a field of ``config``, or ``params`` do not fit ``config``.
    """
    model_type = model_type or infer_model_type(config)
    config_to_hf(config, model_type)  # checks that model_type expresses config
    arch = ARCHITECTURES[model_type]
    _check_params(params, config)

    def full_name(name: str) -> str:
        return name[1:] if name.startswith("/") else arch.prefixes[0] + name

    global_params = {k: jax.tree.map(np.asarray, v) for k, v in params.items()
                     if k != "layers" and not k.startswith("layers_")}
    for name, array in arch.global_from_pieces(_params_to_global(global_params, config), config).items():
        yield full_name(name), array
    for i, layer in enumerate(_host_layers(params, config.num_layers)):
        for name, array in arch.layer_from_pieces(_params_to_layer(layer), i, config).items():
            yield full_name(name), array


def save_hf_checkpoint(config: GPTConfig | BertConfig, params: Mapping[str, Any], path: str | os.PathLike, *,
                       model_type: str | None = None, dtype: Any = None, max_shard_size: int | str = "5GB",
                       extra_config: Mapping[str, Any] | None = None) -> list[str]:
    """Write ``params`` (of `GPT(config)` or `BertEncoder(config)`) as a Hugging Face model folder.

    Args:
      config: the model's `GPTConfig` or `BertConfig`.
      params: its unboxed ``"params"`` tree (scanned or unrolled layers; on any devices of this process).
      path: the folder to write (created; existing weight files in it are replaced).
      model_type: the Hugging Face architecture to write (`SUPPORTED_MODEL_TYPES`; default:
        `infer_model_type`).
      dtype: the tensors' dtype (default: each parameter's own).
      max_shard_size: bytes per safetensors file (an int, or ``"5GB"``-style); more than one file
        adds ``model.safetensors.index.json``.
      extra_config: a source config.json whose `PASS_THROUGH_FIELDS` (token ids...) are copied.

    Returns:
      The files written (config.json first).

    Raises:
      ValueError: ``model_type`` cannot express a field of ``config`` (naming it), or ``params``
        do not fit ``config``.
    """
    safetensors = _safetensors()
    path = os.fspath(path)
    hf = config_to_hf(config, model_type)
    limit = _parse_size(max_shard_size)
    if dtype is not None:
        hf["torch_dtype"] = dtype_name(dtype)
    for name in PASS_THROUGH_FIELDS:
        if extra_config and name in extra_config:
            hf[name] = extra_config[name]
    tensors = to_hf_tensors(config, params, hf["model_type"])
    first = next(tensors)  # fails before anything is written if params do not fit
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):  # weights of an earlier save would mix with these
        if name.endswith(".safetensors") or name == INDEX_FILE:
            os.remove(os.path.join(path, name))
    shard: dict[str, Array] = {}
    shard_bytes, total = 0, 0
    temporaries: list[str] = []
    weight_map: dict[str, int] = {}

    def flush() -> None:
        temporaries.append(os.path.join(path, f".shard-{len(temporaries):05d}.tmp"))
        safetensors.numpy.save_file(shard, temporaries[-1], metadata={"format": "pt"})

    for name, array in itertools.chain([first], tensors):
        array = np.ascontiguousarray(array if dtype is None else array.astype(jnp.dtype(dtype)))
        if shard and shard_bytes + array.nbytes > limit:
            flush()
            shard, shard_bytes = {}, 0
        shard[name] = array
        shard_bytes += array.nbytes
        total += array.nbytes
        weight_map[name] = len(temporaries)
    flush()
    count = len(temporaries)
    names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for temporary, name in zip(temporaries, names):
        os.replace(temporary, os.path.join(path, name))
    files = [os.path.join(path, CONFIG_FILE)]
    with open(files[0], "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
        f.write("\n")
    if count > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: names[shard] for name, shard in sorted(weight_map.items())}}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        files.append(os.path.join(path, INDEX_FILE))
    return files + [os.path.join(path, name) for name in names]


__all__ = ["CONFIG_FILE", "INDEX_FILE", "PASS_THROUGH_FIELDS", "SUPPORTED_MODEL_TYPES", "abstract_params",
           "param_shardings",
           "config_from_hf", "config_to_hf", "infer_model_type", "is_hf_checkpoint", "load_hf_checkpoint",
           "read_hf_config", "save_hf_checkpoint", "to_hf_tensors"]
