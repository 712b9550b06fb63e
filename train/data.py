"""Text data: files and folders -> one token stream -> fixed-length sequences in a seeded order.

The order is a pure function of (seed, batch index), so a run resumes exactly from the batch index
alone (`DataIterator.position`, saved with every checkpoint), and each process of a multi-host
run reads only its rows of every global batch.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from mtjax.train.tokenizer import Tokenizer

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
# Folders never read when walking a directory: installed packages and caches are not the corpus.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def default_corpus() -> list[str]:
    """The Python standard library's source tree: text every Python installation already has."""
    return [sysconfig.get_paths()["stdlib"]]


def list_text_files(paths: Iterable[str], suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[str]:
    """Files named in ``paths`` and files under the folders in ``paths`` with one of ``suffixes``.

    The result is sorted within each folder so the corpus (and hence the run) is reproducible.

    Raises:
      ValueError: a path does not exist, or no file was found.
    """
    files: list[str] = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
                files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(tuple(suffixes)))
        else:
            raise ValueError(f"--data {path!r}: no such file or folder")
    if not files:
        raise ValueError(f"--data {list(paths)}: no text files (suffixes {list(suffixes)}) found")
    return files


DATA_ERRORS = ("strict", "replace", "skip")


def tokenize_files(files: Iterable[str], tokenizer: Tokenizer, *, errors: str = "strict") -> np.ndarray:
    """One token stream: every file's tokens followed by ``tokenizer.eos_id``.

    Args:
      errors: what to do with a file that is not UTF-8: ``"strict"`` raises, ``"replace"`` reads
        its bad bytes as U+FFFD (the tokenizer then sees replacement characters), ``"skip"`` leaves
        the file out (``mtjax train``'s default corpus does: the standard library's tests hold a
        few files in legacy encodings on purpose).

    Raises:
      ValueError: a file is not UTF-8 text (with ``errors="strict"``), or cannot be read.
    """
    files = list(files)
    if errors not in DATA_ERRORS:
        raise ValueError(f"tokenize_files(errors={errors!r}): accepted: {', '.join(DATA_ERRORS)}")
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    pieces = []
    for name in files:
        try:
            with open(name, encoding="utf-8", errors="replace" if errors == "replace" else "strict") as f:
                text = f.read()
        except UnicodeDecodeError as err:
            if errors == "skip":
                continue
            raise ValueError(f"--data {name}: not UTF-8 text (byte {err.start}: {err.reason}); leave it out, or "
                             "pass --data-errors replace (errors='replace') to read bad bytes as U+FFFD") from None
        except OSError as err:
            raise ValueError(f"--data {name}: cannot be read: {err.strerror or err}") from None
        pieces.append(tokenizer.encode(text).astype(dtype))
        pieces.append(np.asarray([tokenizer.eos_id], dtype=dtype))
    if not pieces:
        raise ValueError(f"--data: none of the {len(files)} files is UTF-8 text")
    return np.concatenate(pieces)


class PackedDataset:
    """Consecutive ``seq_len + 1``-token windows of a token stream, visited in a seeded order.

    Sequence ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len + 1]``: inputs are its first
    ``seq_len`` tokens, targets the last ``seq_len``. Epoch ``e`` visits all sequences in the order
    of a permutation drawn from ``(seed, e)`` (or in stream order with ``shuffle=False``).

    Attributes:
      tokens: the 1-D token stream.
      seq_len: tokens per training sequence.
      seed: seeds the per-epoch permutations.
      shuffle: whether epochs are permuted.

    ``vocab_size``: when given, every token must be in ``[0, vocab_size)`` (checked once, here).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, seed: int = 0, shuffle: bool = True,
                 vocab_size: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: expected a positive integer")
        if vocab_size is not None and len(tokens):
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= vocab_size:
                raise ValueError(f"the token stream holds id {low if low < 0 else high}, outside "
                                 f"[0, vocab_size={vocab_size}): the tokenizer does not fit the model's vocabulary")
        if tokens.ndim != 1 or len(tokens) < seq_len + 1:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens, fewer than one sequence of seq_len + 1 = {seq_len + 1}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_sequences = (len(tokens) - 1) // seq_len
        self._epoch_orders: dict[int, np.ndarray] = {}

    @classmethod
    def from_paths(cls, paths: Iterable[str], tokenizer: Tokenizer, seq_len: int, *, seed: int = 0,
                   suffixes: Sequence[str] = TEXT_SUFFIXES, errors: str = "strict",
                   vocab_size: int | None = None) -> PackedDataset:
        """Read and tokenize the text files in ``paths`` (files or folders); ``errors`` as `tokenize_files`'s."""
        return cls(tokenize_files(list_text_files(paths, suffixes), tokenizer, errors=errors), seq_len, seed=seed,
                   vocab_size=vocab_size)

    def split(self, eval_sequences: int) -> tuple[PackedDataset, PackedDataset]:
        """(train, eval): the last ``eval_sequences`` sequences of the stream are held out, unshuffled."""
        if not 0 < eval_sequences < self.num_sequences:
            raise ValueError(f"eval_sequences={eval_sequences}: expected 1..{self.num_sequences - 1}")
        cut = (self.num_sequences - eval_sequences) * self.seq_len
        train = PackedDataset(self.tokens[: cut + 1], self.seq_len, seed=self.seed, shuffle=self.shuffle)
        held_out = PackedDataset(self.tokens[cut:], self.seq_len, seed=self.seed, shuffle=False)
        return train, held_out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_orders:
            if len(self._epoch_orders) > 2:  # batches walk forward: old epochs are not needed again
                self._epoch_orders.pop(min(self._epoch_orders))
            self._epoch_orders[epoch] = (
                np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
                if self.shuffle else np.arange(self.num_sequences)
            )
        return self._epoch_orders[epoch]

    def batch(self, index: int, batch_size: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Rows ``rows`` (default all) of global batch ``index``: ``{"inputs", "targets"}``, int32 ``[rows, seq_len]``.

        Global batch ``index`` holds sequences ``index * batch_size ... + batch_size - 1`` of the
        endless visiting order. A process of a multi-host run asks only for the rows its devices
        hold (`mtjax.train.distributed.process_rows`).
        """
        flat = index * batch_size + np.arange(batch_size)[rows if rows is not None else slice(None)]
        epochs, offsets = np.divmod(flat, self.num_sequences)
        sequences = np.asarray([self._order(int(e))[o] for e, o in zip(epochs, offsets)])
        windows = self.tokens[sequences[:, None] * self.seq_len + np.arange(self.seq_len + 1)]
        windows = windows.astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


class DataIterator(Iterator[dict[str, np.ndarray]]):
    """Batches of a `PackedDataset` from batch ``position`` on (this process's ``rows`` of each).

    Attributes:
      dataset: the dataset.
      batch_size: the global batch size (all processes together).
      position: the index of the next global batch; checkpoints save it (`state`/`restore`).
      rows: the rows of every global batch this process loads (default all).
    """

    def __init__(self, dataset: PackedDataset, batch_size: int, *, position: int = 0, rows: slice | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: expected a positive integer")
        self.dataset, self.batch_size, self.position, self.rows = dataset, batch_size, position, rows

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.dataset.batch(self.position, self.batch_size, self.rows)
        self.position += 1
        return batch

    def state(self) -> dict[str, int]:
        return {"position": self.position}

    def restore(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
