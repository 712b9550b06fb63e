"""mtjax.train: train state, sharded train step, orbax checkpoints, text data, multi-host, ``mtjax train``.

Typical use (what ``mtjax train`` does, see `mtjax.train.cli`)::

    config = MeshConfig(dp=4, tp=2); mesh, rules = config.make_mesh(), logical_axis_rules(config)
    optimizer, schedule = make_optimizer(3e-4, total_steps=1000, warmup_steps=100)
    abstract = abstract_train_state(model, optimizer, (batch, seq), mesh=mesh, rules=rules)
    state = init_train_state(model, optimizer, jax.random.PRNGKey(0), (batch, seq), mesh=mesh, rules=rules)
    step = make_train_step(model, optimizer, mesh=mesh, rules=rules,
                           state_sharding=tree_shardings(abstract), learning_rate=schedule)
    state, metrics = step(state, {"inputs": tokens, "targets": next_tokens})
"""

from mtjax.train.checkpoint import Checkpointer, CheckpointError, NonFiniteStateError, PreemptionWatcher
from mtjax.train.distributed import global_batch, initialize, process_rows
from mtjax.train.state import TrainState, abstract_train_state, batch_sharding, init_train_state
from mtjax.train.step import (
    check_token_ids,
    classification_loss,
    make_eval_step,
    make_optimizer,
    make_train_step,
    next_token_loss,
    throughput,
)
from mtjax.train.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    find_tokenizer,
    load_tokenizer,
)

__all__ = [
    "CheckpointError", "Checkpointer", "NonFiniteStateError", "PreemptionWatcher",
    "DataIterator", "PackedDataset", "default_corpus",
    "global_batch", "initialize", "process_rows",
    "TrainState", "abstract_train_state", "batch_sharding", "init_train_state",
    "check_token_ids", "classification_loss", "make_eval_step", "make_optimizer", "make_train_step",
    "next_token_loss", "throughput",
    "ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "find_tokenizer", "load_tokenizer",
]

# The data pipeline (grain) loads on first use: inference commands import mtjax.train for its checkpoints
# and tokenizers only.
_DATA_NAMES = ("DataIterator", "PackedDataset", "default_corpus")


def __getattr__(name: str):
    if name in _DATA_NAMES:
        from mtjax.train import data

        return getattr(data, name)
    raise AttributeError(f"module 'mtjax.train' has no attribute {name!r}")
