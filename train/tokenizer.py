"""Tokenizers: a byte-level default that needs no files, Hugging Face ``tokenizer.json`` files (the
``tokenizers`` package), SentencePiece models (``sentencepiece``), and the interface for bringing your own.

A tokenizer is anything with ``vocab_size``, ``eos_id``, ``encode(text) -> np.ndarray`` and
``decode(ids) -> str`` (the `Tokenizer` protocol). `load_tokenizer` turns the ``--tokenizer`` flag
(``"byte"``, ``"hf:PATH"``, ``"sentencepiece:PATH"``, or a path: a Hugging Face model folder, a
``tokenizer.json``, a ``.model`` file) into one; its `spec` is stored in checkpoints so ``mtjax generate``
decodes with the tokenizer the model was trained with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What `mtjax.train` needs from a tokenizer.

    Attributes:
      vocab_size: number of token ids; every id is in ``[0, vocab_size)``.
      eos_id: the id that separates documents when they are packed into sequences.
      spec: the string `load_tokenizer` rebuilds this tokenizer from (saved with checkpoints).
    """

    vocab_size: int
    eos_id: int
    spec: str

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids of ``text`` as a 1-D integer array (no EOS appended); ``add_special_tokens``: with
        the tokens the tokenizer puts around a text (a Hugging Face post-processor's BOS), if any."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids``; ids without text (EOS) are dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are bytes, 256 is end-of-sequence (vocab_size 257)."""

    vocab_size = 257
    eos_id = 256
    spec = "byte"

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
        # A sampled byte sequence may cut a multi-byte character; show it rather than fail.
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model file (needs the ``sentencepiece`` package).

    Attributes:
      path: the ``.model`` file.
    """

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError as err:
            raise ValueError(
                f"--tokenizer sentencepiece:{path}: the sentencepiece package is not installed "
                "(pip install sentencepiece)"
            ) from err
        self.path = os.path.abspath(path)
        self._model = sentencepiece.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = int(self._model.vocab_size())
        eos = int(self._model.eos_id())
        self.eos_id = eos if eos >= 0 else 0
        self.spec = f"sentencepiece:{self.path}"

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        return np.asarray(self._model.encode(text), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._model.decode([int(i) for i in np.asarray(ids).reshape(-1)])


# Hugging Face tokenizer files, and the end-of-text tokens tried when no config names one.
HF_TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


def _json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (needs the ``tokenizers`` package).

    ``encode`` adds the special tokens the file's post-processor adds (Llama's begin-of-text, none for
    GPT-2 or Qwen) and never an end-of-text; ``decode`` drops special tokens. The end-of-text id is the
    ``eos_token`` of the ``tokenizer_config.json`` beside the file, else the ``eos_token_id`` of a
    ``config.json`` there, else the first of `_EOS_TOKENS` the vocabulary holds.

    Attributes:
      path: the ``tokenizer.json`` file.
    """

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError as err:
            raise ValueError(f"--tokenizer {path}: the tokenizers package is not installed "
                             "(pip install 'mtjax[tokenizers]')") from err
        self.path = os.path.abspath(path)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(self.path)
        except Exception as err:  # the Rust library raises its own exception type
            raise ValueError(f"--tokenizer {path}: not a readable tokenizer.json ({err})") from None
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos(os.path.dirname(self.path))
        self.spec = f"hf:{self.path}"

    def _find_eos(self, folder: str) -> int:
        token = _json(os.path.join(folder, "tokenizer_config.json")).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and self._tokenizer.token_to_id(token) is not None:
            return int(self._tokenizer.token_to_id(token))
        eos = _json(os.path.join(folder, "config.json")).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and 0 <= eos < self.vocab_size:
            return eos
        for token in _EOS_TOKENS:
            if self._tokenizer.token_to_id(token) is not None:
                return int(self._tokenizer.token_to_id(token))
        raise ValueError(f"--tokenizer {self.path}: no end-of-text token: no eos_token in tokenizer_config.json "
                         f"or eos_token_id in config.json beside it, and none of {', '.join(_EOS_TOKENS)} in its "
                         "vocabulary")

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)


def find_tokenizer(folder: str) -> str | None:
    """The `load_tokenizer` spec of the tokenizer in a model folder (``tokenizer.json``, else
    ``tokenizer.model``), or None when it has neither."""
    if os.path.isfile(os.path.join(folder, HF_TOKENIZER_FILE)):
        return f"hf:{os.path.abspath(os.path.join(folder, HF_TOKENIZER_FILE))}"
    if os.path.isfile(os.path.join(folder, SENTENCEPIECE_FILE)):
        return f"sentencepiece:{os.path.abspath(os.path.join(folder, SENTENCEPIECE_FILE))}"
    return None


_ACCEPTED = ("'byte', 'hf:TOKENIZER_JSON_OR_FOLDER', 'sentencepiece:MODEL_FILE', or a path: a folder holding "
             "tokenizer.json or tokenizer.model, a tokenizer.json file, a .model file")


def load_tokenizer(spec: str) -> Tokenizer:
    """Build a tokenizer from ``"byte"``, ``"hf:PATH"`` (a ``tokenizer.json`` or a folder holding one),
    ``"sentencepiece:PATH"``, or a bare path (a model folder, a ``.json`` or a ``.model`` file).

    Raises:
      ValueError: an unknown spec, a missing file, or a missing tokenizer package.
    """
    if spec == "byte":
        return ByteTokenizer()
    kind, sep, path = spec.partition(":")
    if not sep or kind not in ("hf", "sentencepiece"):
        kind, path = "", spec  # a bare path
    if os.path.isdir(path):
        if kind == "hf":
            path = os.path.join(path, HF_TOKENIZER_FILE)
        else:
            found = find_tokenizer(path)
            if found is None:
                raise ValueError(f"--tokenizer {spec!r}: the folder holds no {HF_TOKENIZER_FILE} or "
                                 f"{SENTENCEPIECE_FILE}")
            return load_tokenizer(found)
    if not kind and not path.endswith((".json", ".model")):
        raise ValueError(f"--tokenizer {spec!r}: expected {_ACCEPTED}")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer {spec!r}: no such file {path!r}")
    if kind == "sentencepiece" or (not kind and path.endswith(".model")):
        return SentencePieceTokenizer(path)
    return HFTokenizer(path)
