"""Restore shuffled lines: a sequence-to-sequence task made from text the machine already has.

The examples are the lines of some text files (whitespace-normalised, 3 to 12 words, at most
``seq_len - 1`` tokens); the input of one is the line with its words in a random order, the target
the line itself. The split is by a hash of the line, so a line (and every copy of it) is either
training or held-out data, never both. The words' order is drawn from ``(seed, epoch, line)``:
each epoch shows a line shuffled anew, the held-out split always the same way.
"""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
import zlib
from collections.abc import Iterable, Sequence

import grain
import numpy as np

from mtjax.train.data import batch_indices, batches_by_index, check_rows, decoder_rows, list_text_files
from mtjax.train.tokenizer import Tokenizer

MIN_WORDS, MAX_WORDS = 3, 12


def default_line_files() -> list[str]:
    """The Python files at the top of the standard library (not its packages): a few MB of lines."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def read_lines(files: Iterable[str], max_bytes: int) -> list[str]:
    """The distinct whitespace-normalised lines of ``files`` with `MIN_WORDS` to `MAX_WORDS` words and at
    most ``max_bytes`` UTF-8 bytes, in file order (files that are not UTF-8 are skipped)."""
    seen: dict[str, None] = {}
    for name in files:
        try:
            with open(name, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        for raw in text.splitlines():
            words = raw.split()
            line = " ".join(words)
            if MIN_WORDS <= len(words) <= MAX_WORDS and len(line.encode("utf-8")) <= max_bytes:
                seen.setdefault(line)
    return list(seen)


def shuffle_words(line: str, rng: np.random.Generator) -> str:
    """``line`` with its words in an order drawn from ``rng`` (never the original order when the words
    allow another)."""
    words = line.split()
    order = rng.permutation(len(words))
    if len(set(words)) > 1:
        while [words[i] for i in order] == words:
            order = rng.permutation(len(words))
    return " ".join(words[i] for i in order)


class ShuffledLines:
    """Batches of the restore-shuffled-lines task.

    ``batches(batch_size, rows)[index]`` -> ``{"encoder_inputs", "encoder_segment_ids", "inputs",
    "targets", "weights"}``, each ``[b, seq_len]``: the shuffled line's tokens (segment id 1, then
    padding with id 0 and token 0); the decoder's ``inputs`` ``eos_id`` (the start token) then the
    line's tokens; ``targets`` the line's tokens then ``eos_id``; ``weights`` 1.0 on those, 0.0 on the
    padding.

    Attributes:
      lines: the examples.
      tokenizer: encodes them.
      seq_len: tokens per row (every line has at most ``seq_len - 1``).
      seed: seeds the visiting order and the shuffles.
      shuffle: visit the lines in a new random order each epoch (False: in order, the same shuffles
        every epoch: the held-out split).
    """

    def __init__(self, lines: Sequence[str], tokenizer: Tokenizer, seq_len: int, *, seed: int = 0,
                 shuffle: bool = True):
        if not lines:
            raise ValueError("ShuffledLines: no lines (the files hold no line of "
                             f"{MIN_WORDS}-{MAX_WORDS} words that fits seq_len={seq_len})")
        self.lines, self.tokenizer, self.seq_len = list(lines), tokenizer, seq_len
        self.seed, self.shuffle = seed, shuffle
        self.num_sequences = len(self.lines)
        self._orders: dict[int, np.ndarray] = {}

    @classmethod
    def from_paths(cls, paths: Iterable[str] | None, tokenizer: Tokenizer, seq_len: int, *, seed: int = 0,
                   eval_percent: int = 2) -> tuple[ShuffledLines, ShuffledLines | None]:
        """(train, held-out) from the text files in ``paths`` (files or folders; None:
        `default_line_files`); a line is held out when its CRC-32 modulo 100 is below ``eval_percent``
        (held-out None when no line is).

        Lines must fit ``seq_len - 1`` tokens; with a byte tokenizer that is bytes, so lines are first
        cut at that many bytes and then checked in tokens."""
        files = default_line_files() if paths is None else list_text_files(paths)
        lines = [line for line in read_lines(files, max_bytes=4 * seq_len)
                 if len(tokenizer.encode(line)) <= seq_len - 1]
        held = [zlib.crc32(line.encode("utf-8")) % 100 < eval_percent for line in lines]
        train = cls([line for line, h in zip(lines, held) if not h], tokenizer, seq_len, seed=seed)
        held_lines = [line for line, h in zip(lines, held) if h]
        held_out = cls(held_lines, tokenizer, seq_len, seed=seed, shuffle=False) if held_lines else None
        return train, held_out

    def example(self, index: int) -> tuple[str, str]:
        """``(shuffled, line)`` of visit ``index`` (epochs follow one another)."""
        epoch, offset = divmod(index, len(self.lines))
        if self.shuffle and epoch not in self._orders:
            if len(self._orders) > 2:  # batches walk forward: old epochs are not needed again
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.lines))
        line_index = int(self._orders[epoch][offset]) if self.shuffle else offset
        line = self.lines[line_index]
        rng = np.random.default_rng([self.seed, epoch if self.shuffle else 0, line_index, 1])
        return shuffle_words(line, rng), line

    def encode(self, shuffled: str, line: str | None = None) -> dict[str, np.ndarray]:
        """The rows of one example (``line`` None: the encoder's only)."""
        row = {name: np.zeros(self.seq_len, np.int32) for name in ("encoder_inputs", "encoder_segment_ids")}
        source = np.asarray(self.tokenizer.encode(shuffled), np.int32)[:self.seq_len]
        row["encoder_inputs"][:len(source)], row["encoder_segment_ids"][:len(source)] = source, 1
        if line is not None:
            target = np.asarray(self.tokenizer.encode(line), np.int32)[:self.seq_len - 1]
            row.update(decoder_rows(target, self.tokenizer.eos_id, self.seq_len))
        return row

    def batches(self, batch_size: int, rows: slice | None = None) -> grain.MapDataset:
        """The endless global batches as a grain ``MapDataset`` (``batches(n)[i]`` is batch ``i``),
        ``rows`` of each (default all): `mtjax.train.data.BatchSource`."""
        check_rows(rows, batch_size)
        return batches_by_index(functools.partial(self._batch, batch_size=batch_size, rows=rows))

    def _batch(self, index: int, batch_size: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Rows ``rows`` (default all) of batch ``index``: visits ``index * batch_size + row``."""
        encoded = [self.encode(*self.example(int(i))) for i in batch_indices(index, batch_size, rows)]
        return {name: np.stack([e[name] for e in encoded]) for name in encoded[0]}
