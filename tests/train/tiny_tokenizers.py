"""Tokenizer files trained in-process on a tiny corpus (no downloads), for the tokenizer and CLI tests."""

from __future__ import annotations

import json
import os

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "the quick brown fox jumps over the lazy dog. ",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
] * 20


def write_bpe_tokenizer(folder: str | os.PathLike, vocab_size: int = 64, eos_in_config: str | None = None) -> str:
    """A BPE ``tokenizer.json`` (Metaspace pre-tokenizer, ``<s>`` prepended like Llama's) in ``folder``;
    ``eos_in_config`` also writes a ``tokenizer_config.json`` naming that end-of-text token. Returns the
    file's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size,
                                                              special_tokens=["<unk>", "<s>", "</s>", "<|eot|>"]))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    tokenizer.save(path)
    if eos_in_config is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": {"content": eos_in_config}}, f)
    return path


def write_sentencepiece(folder: str | os.PathLike, vocab_size: int = 60) -> str:
    """A SentencePiece BPE model ``tokenizer.model`` in ``folder``; returns its path."""
    import sentencepiece

    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, "tokenizer")
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=prefix,
                                             vocab_size=vocab_size, model_type="bpe", minloglevel=2)
    return prefix + ".model"
