"""Text data: files and folders -> one token stream -> fixed-length sequences, batched by grain.

`PackedDataset` is a random-access source of ``seq_len + 1``-token windows; `PackedDataset.batches`
is the grain pipeline over it (``grain.MapDataset``: a seeded shuffle drawn anew every epoch, repeat,
batch), whose order is a pure function of (seed, batch index). `DataIterator` walks it: each process
of a multi-host run reads only its rows of every global batch, and the iterator's grain state goes
into every checkpoint (`mtjax.train.Checkpointer`), so a resumed run continues the exact sequence.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import grain
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
    """Consecutive ``seq_len + 1``-token windows of a token stream: a random-access grain data source.

    Sequence ``i`` (``dataset[i]``) is ``tokens[i * seq_len : (i + 1) * seq_len + 1]``: ``inputs``
    its first ``seq_len`` tokens, ``targets`` the last ``seq_len`` (int32). `batches` visits them in
    a seeded order, a new permutation of all sequences every epoch (or in stream order with
    ``shuffle=False``).

    Attributes:
      tokens: the 1-D token stream.
      seq_len: tokens per training sequence.
      seed: seeds the per-epoch permutations (grain's ``MapDataset.shuffle``).
      shuffle: whether epochs are permuted.

    ``vocab_size``: when given, every token must be in ``[0, vocab_size)`` (checked once, here).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, seed: int = 0, shuffle: bool = True,
                 vocab_size: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: expected a positive integer")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed={seed}: expected an integer in [0, 2**32)")
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

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        window = self.tokens[index * self.seq_len: (index + 1) * self.seq_len + 1].astype(np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}

    def batches(self, batch_size: int, rows: slice | None = None) -> grain.MapDataset:
        """The endless sequence of global batches as a grain ``MapDataset`` (``batches(...)[i]`` is batch ``i``).

        Global batch ``i`` holds sequences ``i * batch_size ... + batch_size - 1`` of the visiting order
        (epoch after epoch), each element ``{"inputs", "targets"}`` int32 ``[rows, seq_len]``. With
        ``rows`` (a process's share of every global batch, `mtjax.train.distributed.process_rows`)
        only those rows are read.
        """
        start, stop = check_rows(rows, batch_size)
        sequences = grain.MapDataset.source(self)
        if self.shuffle:
            sequences = sequences.shuffle(seed=self.seed)  # reshuffled every epoch: the seed + epoch
        sequences = sequences.repeat()
        count = stop - start
        if batch_size % count == 0 and start % count == 0:
            # Blocks of `count` sequences; this process's block of global batch i is block i * ways + start / count.
            ways = batch_size // count
            return sequences.batch(count)[start // count:: ways]
        return sequences.batch(batch_size).map(lambda batch: {k: v[start:stop] for k, v in batch.items()})


def batch_indices(index: int, batch_size: int, rows: slice | None = None) -> np.ndarray:
    """The example indices of rows ``rows`` (default all) of global batch ``index``:
    ``index * batch_size + row``, for sources that build a batch from its examples' indices."""
    return index * batch_size + np.arange(batch_size)[rows if rows is not None else slice(None)]


def decoder_rows(ids: np.ndarray, eos_id: int, seq_len: int) -> dict[str, np.ndarray]:
    """A decoder's teacher-forced rows ``[seq_len]`` for the target ``ids`` (at most ``seq_len - 1``
    tokens): ``inputs`` ``eos_id`` (the start token) then ``ids``; ``targets`` ``ids`` then ``eos_id``;
    ``weights`` 1.0 on those, 0.0 on the padding (id 0) after them.

    Raises:
      ValueError: ``ids`` has more than ``seq_len - 1`` tokens.
    """
    ids = np.asarray(ids, np.int32)
    if ids.ndim != 1 or len(ids) > seq_len - 1:
        raise ValueError(f"decoder_rows: ids has shape {ids.shape}; expected 1-D with at most seq_len - 1 = "
                         f"{seq_len - 1} tokens")
    inputs, targets, weights = (np.zeros(seq_len, dtype) for dtype in (np.int32, np.int32, np.float32))
    inputs[0], inputs[1:len(ids) + 1] = eos_id, ids
    targets[:len(ids)], targets[len(ids)] = ids, eos_id
    weights[:len(ids) + 1] = 1.0
    return {"inputs": inputs, "targets": targets, "weights": weights}


def batches_by_index(batch: Callable[[int], dict[str, np.ndarray]]) -> grain.MapDataset:
    """The endless sequence ``batch(0), batch(1), ...`` as a grain ``MapDataset``, for sources that build
    a whole batch from its index (`mtjax.train.scenes.SceneDataset`, `mtjax.train.lines.ShuffledLines`)."""
    return grain.MapDataset.range(sys.maxsize).map(batch)


class BatchSource(Protocol):
    """What `DataIterator` reads: ``batches(batch_size, rows)``, the endless global batches as a grain
    ``MapDataset`` (``rows``: this process's rows of each)."""

    def batches(self, batch_size: int, rows: slice | None = None) -> grain.MapDataset: ...


def check_rows(rows: slice | None, batch_size: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rows`` (a non-empty, contiguous slice of a batch's rows; None: all)."""
    _check_batch_size(batch_size)
    start, stop, _ = (rows or slice(None)).indices(batch_size)
    if rows is not None and (rows.step not in (None, 1) or stop <= start):
        raise ValueError(f"rows={rows}: expected a non-empty slice of the batch's {batch_size} rows")
    return start, stop


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive integer")


# Batches read ahead of the step by one background thread (the batch after next is ready when asked).
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)


class DataIterator(Iterator[dict[str, np.ndarray]]):
    """Batches of a `BatchSource` (`PackedDataset`, the multimodal tasks' datasets) from batch
    ``position`` on (this process's ``rows`` of each): a grain iterator over its ``batches``, reading
    ahead in a background thread. `close` (or leaving a ``with`` block) stops that thread.

    Attributes:
      dataset: the dataset.
      batch_size: the global batch size (all processes together).
      rows: the rows of every global batch this process loads (default all).
      iterator: the grain ``DatasetIterator`` (its ``get_state()`` is what checkpoints save, through
        ``grain.checkpoint.CheckpointSave``).
    """

    def __init__(self, dataset: BatchSource, batch_size: int, *, position: int = 0, rows: slice | None = None):
        _check_batch_size(batch_size)
        self.dataset, self.batch_size, self.rows = dataset, batch_size, rows
        self.iterator = iter(dataset.batches(batch_size, rows).to_iter_dataset(_READ_OPTIONS))
        if position:
            self.restore({"position": position})

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self.iterator)

    def close(self) -> None:
        """Stop reading ahead and drop the batches read (grain iterators without ``close``: nothing to do)."""
        close = getattr(self.iterator, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> DataIterator:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def position(self) -> int:
        """The index of the next global batch."""
        return int(self.iterator.get_state()["next_index"])

    def state(self) -> dict[str, int]:
        """``{"position": index of the next global batch}``: the same on every process (JSON)."""
        return {"position": self.position}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (`state`'s dict)."""
        position = state.get("position") if isinstance(state, dict) else None
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"DataIterator.restore({state!r}): expected {{'position': batch index >= 0}}")
        self.iterator.set_state({"next_index": position})
