"""Tokenizers: a byte-level default that needs no files, and the interface for bringing your own.

A tokenizer is anything with ``vocab_size``, ``eos_id``, ``encode(text) -> np.ndarray`` and
``decode(ids) -> str`` (the `Tokenizer` protocol). `load_tokenizer` turns the ``--tokenizer`` flag
(``"byte"`` or ``"sentencepiece:PATH"``) into one; the same string is stored in checkpoints so
``mtjax generate`` decodes with the tokenizer the model was trained with.
"""

from __future__ import annotations

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

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as a 1-D integer array (no EOS appended)."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids``; ids without text (EOS) are dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are bytes, 256 is end-of-sequence (vocab_size 257)."""

    vocab_size = 257
    eos_id = 256
    spec = "byte"

    def encode(self, text: str) -> np.ndarray:
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
        self.path = path
        self._model = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = int(self._model.vocab_size())
        eos = int(self._model.eos_id())
        self.eos_id = eos if eos >= 0 else 0
        self.spec = f"sentencepiece:{path}"

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._model.encode(text), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._model.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def load_tokenizer(spec: str) -> Tokenizer:
    """Build a tokenizer from ``"byte"`` or ``"sentencepiece:PATH"``.

    Raises:
      ValueError: an unknown spec, or a SentencePiece file that is missing.
    """
    if spec == "byte":
        return ByteTokenizer()
    kind, sep, path = spec.partition(":")
    if kind == "sentencepiece" and sep and path:
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer {spec!r}: no such file {path!r}")
        return SentencePieceTokenizer(path)
    raise ValueError(f"--tokenizer {spec!r}: expected 'byte' or 'sentencepiece:PATH/TO/MODEL.model'")
