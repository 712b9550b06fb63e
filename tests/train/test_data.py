"""Tokenizers and the packed text dataset: packing, the grain pipeline's seeded order, row slices, resume."""

import numpy as np
import pytest

from mtjax.models import until_eos
from mtjax.train.data import (
    DataIterator,
    PackedDataset,
    batch_indices,
    decoder_rows,
    default_corpus,
    list_text_files,
    tokenize_files,
)
from mtjax.train.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 257 and tok.spec == "byte"
    text = "def f(x):\n    return 'é' * x  # ünïcode"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode(list(ids) + [tok.eos_id]) == text  # EOS carries no text


@pytest.mark.parametrize("spec", ["bpe", "sentencepiece:", "sentencepiece:/no/such.model"])
def test_load_tokenizer_rejects_bad_spec(spec):
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(spec)


def test_decoder_rows_batch_indices_and_until_eos():
    rows = decoder_rows(np.array([5, 6, 7]), eos_id=9, seq_len=6)
    np.testing.assert_array_equal(rows["inputs"], [9, 5, 6, 7, 0, 0])
    np.testing.assert_array_equal(rows["targets"], [5, 6, 7, 9, 0, 0])
    np.testing.assert_array_equal(rows["weights"], [1, 1, 1, 1, 0, 0])
    assert rows["weights"].dtype == np.float32 and rows["inputs"].dtype == rows["targets"].dtype == np.int32
    with pytest.raises(ValueError, match="at most seq_len - 1 = 2 tokens"):
        decoder_rows(np.array([5, 6, 7]), eos_id=9, seq_len=3)
    np.testing.assert_array_equal(batch_indices(3, 4), [12, 13, 14, 15])
    np.testing.assert_array_equal(batch_indices(3, 4, slice(2, 4)), [14, 15])
    np.testing.assert_array_equal(until_eos(np.array([4, 9, 2, 9]), 9), [4])
    np.testing.assert_array_equal(until_eos([4, 2], 9), [4, 2])


def test_list_and_tokenize_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.py").write_text("print(1)\n")
    (tmp_path / "b" / "c.txt").write_text("hello")
    (tmp_path / "b" / "skip.bin").write_bytes(b"\0\1")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.py").write_text("cached")
    files = list_text_files([str(tmp_path)])
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.py", "c.txt"]
    tokens = tokenize_files(files, ByteTokenizer())
    assert tokens.dtype == np.uint16
    assert bytes(tokens[tokens < 256].astype(np.uint8)) == b"print(1)\nhello"
    assert list(np.flatnonzero(tokens == 256)) == [9, 15]  # an EOS after each file
    with pytest.raises(ValueError, match="no such file"):
        list_text_files([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="no text files"):
        list_text_files([str(tmp_path / "b")], suffixes=(".md",))


def test_default_corpus_is_the_standard_library():
    (root,) = default_corpus()
    assert any(f.endswith("/os.py") for f in list_text_files([root], suffixes=("os.py",)))


def _dataset(seed=0, length=1000, seq_len=8):
    return PackedDataset(np.arange(length, dtype=np.int32) % 251, seq_len, seed=seed)


def test_packing_inputs_targets_and_epoch_coverage():
    data = _dataset()
    assert data.num_sequences == len(data) == (1000 - 1) // 8
    np.testing.assert_array_equal(data[2]["inputs"], data.tokens[16:24])
    np.testing.assert_array_equal(data[2]["targets"], data.tokens[17:25])
    batch = data.batches(data.num_sequences)[0]
    # Targets are the inputs shifted by one token, and each row is a window of the stream.
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    in_stream_order = np.stack([data.tokens[i * 8: i * 8 + 9] for i in range(data.num_sequences)])
    # One epoch visits every sequence exactly once, in a shuffled order.
    windows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    assert sorted(map(tuple, windows)) == sorted(map(tuple, in_stream_order))
    assert not np.array_equal(windows, in_stream_order)
    unshuffled = PackedDataset(data.tokens, 8, shuffle=False).batches(4)[1]
    np.testing.assert_array_equal(unshuffled["inputs"], in_stream_order[4:8, :-1])


def test_order_is_seeded_and_batches_are_contiguous_slices_of_the_order():
    a, b, c = _dataset(0), _dataset(0), _dataset(1)
    np.testing.assert_array_equal(a.batches(16)[3]["inputs"], b.batches(16)[3]["inputs"])
    assert not np.array_equal(a.batches(16)[3]["inputs"], c.batches(16)[3]["inputs"])
    # Batch 1 of size 16 is rows 16..31 of the order: the second half of batch 0 of size 32.
    np.testing.assert_array_equal(a.batches(16)[1]["inputs"], b.batches(32)[0]["inputs"][16:])
    # Crossing an epoch boundary starts the next permutation: every sequence again, in another order.
    per_epoch = a.num_sequences
    two_epochs = a.batches(per_epoch)
    first, second = two_epochs[0]["inputs"], two_epochs[1]["inputs"]
    assert sorted(map(tuple, first)) == sorted(map(tuple, second)) and not np.array_equal(first, second)


@pytest.mark.parametrize("rows", [slice(4, 8), slice(2, 5)])  # a block of the batch's rows, and any other slice
def test_each_process_reads_its_rows_of_every_global_batch(rows):
    data = _dataset()
    for index in (0, 5, 40):  # 40: past the first epoch
        np.testing.assert_array_equal(data.batches(8, rows)[index]["targets"],
                                      data.batches(8)[index]["targets"][rows])
    with pytest.raises(ValueError, match="rows=slice"):
        data.batches(8, slice(6, 6))


def test_iterator_resumes_from_its_grain_state_and_from_a_position():
    data = _dataset()
    it = DataIterator(data, 8)
    straight = [next(it)["inputs"] for _ in range(6)]
    resumed = DataIterator(data, 8, rows=slice(4, 8))
    for _ in range(3):
        next(resumed)
    assert resumed.state() == {"position": 3} and resumed.iterator.get_state() == {"next_index": 3}
    again = DataIterator(data, 8, rows=slice(4, 8))
    again.iterator.set_state(resumed.iterator.get_state())
    np.testing.assert_array_equal(np.stack([next(again)["inputs"] for _ in range(3)]), np.stack(straight[3:])[:, 4:])
    from_position = DataIterator(data, 8, position=3)
    np.testing.assert_array_equal(next(from_position)["inputs"], straight[3])
    with pytest.raises(ValueError, match="expected {'position': batch index >= 0}"):
        from_position.restore({"position": -1})
    with DataIterator(data, 8) as closed:
        np.testing.assert_array_equal(next(closed)["inputs"], straight[0])
    with pytest.raises(ValueError, match="closed iterator"):  # its read-ahead thread is stopped
        next(closed)
    for iterator in (it, resumed, again, from_position):
        iterator.close()


def test_split_and_bad_arguments():
    train, held_out = _dataset().split(4)
    assert held_out.num_sequences == 4 and train.num_sequences == _dataset().num_sequences - 4
    np.testing.assert_array_equal(held_out.batches(4)[0]["inputs"][0], held_out.tokens[:8])
    with pytest.raises(ValueError, match="seq_len"):
        PackedDataset(np.arange(10), 0)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedDataset(np.arange(5), 8)
    with pytest.raises(ValueError, match="eval_sequences"):
        _dataset().split(0)
    with pytest.raises(ValueError, match="batch_size"):
        DataIterator(_dataset(), 0)
    with pytest.raises(ValueError, match=r"seed=-1: expected an integer in \[0, 2\*\*32\)"):
        _dataset(seed=-1)


class _WordTokenizer:
    """A user's own tokenizer: whitespace-separated words from a fixed list (id 0: unknown, 1: EOS)."""

    def __init__(self, words):
        self.words = ["<unk>", "<eos>", *words]
        self.vocab_size, self.eos_id, self.spec = len(self.words), 1, "words"

    def encode(self, text):
        return np.asarray([self.words.index(w) if w in self.words else 0 for w in text.split()], np.int32)

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids if i > 1)


def test_a_user_tokenizer_plugs_into_the_dataset(tmp_path):
    (tmp_path / "a.txt").write_text("the cat sat on the mat " * 10)
    tok = _WordTokenizer(["the", "cat", "sat", "on", "mat"])
    assert isinstance(tok, Tokenizer)
    data = PackedDataset.from_paths([str(tmp_path)], tok, seq_len=6)
    assert data.num_sequences == (60 + 1 - 1) // 6
    batch = data.batches(2)[0]
    assert tok.decode(batch["inputs"][0]).split()[0] in {"the", "cat", "sat", "on", "mat"}


def test_files_that_are_not_utf8_are_an_error_unless_asked(tmp_path):
    """Issue 27 defect 7: a Latin-1 or binary file was read as U+FFFD without a word."""
    good, bad = tmp_path / "good.txt", tmp_path / "latin1.txt"
    good.write_text("plain text\n")
    bad.write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"--data .*latin1.txt: not UTF-8 text \(byte 3: .*--data-errors replace"):
        tokenize_files([str(good), str(bad)], ByteTokenizer())
    replaced = tokenize_files([str(good), str(bad)], ByteTokenizer(), errors="replace")
    assert "\ufffd" in ByteTokenizer().decode(replaced)
    skipped = tokenize_files([str(good), str(bad)], ByteTokenizer(), errors="skip")
    assert ByteTokenizer().decode(skipped) == "plain text\n"
    with pytest.raises(ValueError, match="errors='ignore'"):
        tokenize_files([str(good)], ByteTokenizer(), errors="ignore")


def test_a_token_stream_outside_the_vocabulary_is_refused():
    """Issue 19 item 6: the byte tokenizer's EOS (256) does not fit a 256-word model."""
    tokens = np.asarray([1, 2, 256, 3] * 10, np.int32)
    with pytest.raises(ValueError, match=r"id 256, outside \[0, vocab_size=256\)"):
        PackedDataset(tokens, 4, vocab_size=256)
    assert PackedDataset(tokens, 4, vocab_size=257).num_sequences == 9
