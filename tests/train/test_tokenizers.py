"""Hugging Face ``tokenizer.json`` and SentencePiece tokenizers through `load_tokenizer`, trained in the test."""

import json

import numpy as np
import pytest

from mtjax.train.data import PackedDataset
from mtjax.train.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer, find_tokenizer, load_tokenizer
from tests.train.tiny_tokenizers import CORPUS, write_bpe_tokenizer, write_sentencepiece

pytest.importorskip("tokenizers")

TEXT = "def add(a, b):\n    return the fox"


def test_hf_tokenizer_json_by_folder_file_or_spec(tmp_path):
    path = write_bpe_tokenizer(tmp_path)
    tokenizers = [load_tokenizer(str(tmp_path)), load_tokenizer(path), load_tokenizer(f"hf:{path}"),
                  load_tokenizer(f"hf:{tmp_path}")]
    for tok in tokenizers:
        assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
        assert tok.vocab_size == 64 and tok.spec == f"hf:{path}"
    tok = tokenizers[0]
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and ids[0] == 1 and 0 <= ids.min() and ids.max() < 64  # <s> prepended
    assert tok.encode(TEXT, add_special_tokens=False).tolist() == ids[1:].tolist()  # as for a rendered chat
    assert tok.decode(ids) == TEXT and tok.decode(list(ids) + [tok.eos_id]) == TEXT
    assert tok.eos_id == 2  # "</s>", found in the vocabulary
    assert load_tokenizer(tok.spec).encode(TEXT).tolist() == ids.tolist()  # the spec rebuilds it


def test_the_end_of_text_id_comes_from_the_configs_beside_the_file(tmp_path):
    write_bpe_tokenizer(tmp_path / "a", eos_in_config="<|eot|>")
    assert load_tokenizer(str(tmp_path / "a")).eos_id == 3
    write_bpe_tokenizer(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_tokenizer(str(tmp_path / "b")).eos_id == 0


def test_a_tokenizer_without_an_end_of_text_token_is_refused(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models

    RustTokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="no end-of-text token"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_sentencepiece_by_model_file_or_folder(tmp_path):
    pytest.importorskip("sentencepiece")
    path = write_sentencepiece(tmp_path)
    assert find_tokenizer(str(tmp_path)) == f"sentencepiece:{path}"
    for tok in (load_tokenizer(path), load_tokenizer(str(tmp_path)), load_tokenizer(f"sentencepiece:{path}")):
        assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 60
        assert tok.decode(tok.encode("the quick fox")) == "the quick fox"


@pytest.mark.parametrize("spec,match", [("hf:/no/such", "no such file '/no/such'"),
                                        ("/no/such/tokenizer.json", "no such file"),
                                        ("gpt2", "expected 'byte', 'hf:")])
def test_bad_tokenizer_paths_are_named(spec, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load_tokenizer(spec)
    with pytest.raises(ValueError, match="holds no tokenizer.json or tokenizer.model"):
        load_tokenizer(str(tmp_path))


def test_packed_dataset_with_a_hugging_face_tokenizer(tmp_path):
    tok = load_tokenizer(write_bpe_tokenizer(tmp_path / "tok"))
    (tmp_path / "data.txt").write_text("".join(CORPUS))
    dataset = PackedDataset.from_paths([str(tmp_path / "data.txt")], tok, 16, vocab_size=tok.vocab_size)
    assert dataset.num_sequences > 10
