"""What ``mtjax train`` trains each kind of model on, and how: data, model inputs, loss, evaluation.

`task_for(config)` picks the task of a model config:

- `Task` itself, language modeling (`mtjax.models.GPT`): next-token prediction on text files
  (`PackedDataset`);
- `ImageClassification` (`mtjax.models.ViT`): the shape and cell of one-object procedural scenes
  (`mtjax.train.scenes`), held-out accuracy;
- `Seq2Seq` (`mtjax.models.T5`): restore shuffled lines (`mtjax.train.lines`), held-out token
  accuracy, exact matches and samples of greedy decoding;
- `Captioning` (`mtjax.models.VLM`): caption procedural scenes, loss on the caption tokens only,
  held-out token accuracy, exact captions and samples of greedy decoding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.models import (
    GPTConfig,
    T5Config,
    ViTConfig,
    VLMConfig,
    jitted_t5_generate,
    jitted_vlm_generate,
    until_eos,
)
from mtjax.train.data import PackedDataset, default_corpus
from mtjax.train.lines import ShuffledLines
from mtjax.train.scenes import CLASSES, SceneDataset
from mtjax.train.step import Batch, classification_loss, next_token_loss, weighted_mean
from mtjax.train.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What the data of a run is built from (`Task.datasets`).

    Attributes:
      paths: ``--data`` (None: the task's default source).
      errors: ``--data-errors``.
      tokenizer: the run's tokenizer.
      seq_len: tokens per sequence.
      seed: the run's seed.
      eval_sequences: held-out sequences per evaluation (0: none).
      model_config: the model's config.
    """

    paths: Sequence[str] | None
    errors: str
    tokenizer: Tokenizer
    seq_len: int
    seed: int
    eval_sequences: int
    model_config: Any


def token_accuracy(logits: jax.Array, batch: Batch) -> dict[str, jax.Array]:
    """``{"accuracy"}``: the fraction of target tokens the argmax gets right (padding weighted out)."""
    correct = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
    return {"accuracy": weighted_mean(correct, batch)}


def class_accuracy(logits: jax.Array, batch: Batch) -> dict[str, jax.Array]:
    """``{"accuracy"}``: the fraction of images whose argmax class is the label."""
    return {"accuracy": jnp.mean((jnp.argmax(logits, axis=-1) == batch["labels"]).astype(jnp.float32))}


class Task:
    """Language modeling, and the interface of every task.

    Attributes:
      name: the task's name in logs.
      model_inputs: ``batch -> model keyword arguments`` (None: ``batch["inputs"]`` positionally).
      loss_fn: ``(logits, batch) -> scalar``.
      metrics_fn: ``(logits, batch) -> {name: scalar}`` of held-out evaluations, besides the loss.
      accuracy_name: what the ``"accuracy"`` metric is called in the log.
    """

    name = "language modeling"
    model_inputs = None
    loss_fn = staticmethod(next_token_loss)
    metrics_fn = None
    accuracy_name = "accuracy"

    def example_batch(self, batch_size: int, seq_len: int, config: Any) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of a ``[batch_size, ...]`` batch (what the train state is built from)."""
        tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        return {"inputs": tokens, "targets": tokens}

    def tokens_per_example(self, seq_len: int, config: Any) -> int:
        """The tokens one example counts for in throughput figures (with ``config.flops_per_token``)."""
        return seq_len

    def model_overrides(self, config: Any) -> dict[str, Any]:
        """Fields of a model preset the task's data needs changed (e.g. a classifier's number of classes)."""
        return {}

    def datasets(self, spec: DataSpec) -> tuple[Any, Any]:
        """``(train, held-out or None)``, each a `mtjax.train.data.BatchSource`."""
        errors = spec.errors if spec.paths else "skip"  # the default corpus holds a few legacy-encoded tests
        dataset = PackedDataset.from_paths(spec.paths or default_corpus(), spec.tokenizer, spec.seq_len,
                                           seed=spec.seed, errors=errors, vocab_size=spec.model_config.vocab_size)
        if not spec.eval_sequences:
            return dataset, None
        if spec.eval_sequences * 10 > dataset.num_sequences:
            raise ValueError(f"--data holds {dataset.num_sequences} sequences of {spec.seq_len} tokens: too few to "
                             f"hold {spec.eval_sequences} out for evaluation (use --eval-batches 0 or more data)")
        return dataset.split(spec.eval_sequences)

    def describe_data(self, train: Any, seq_len: int) -> str:
        """The training data in the run's first log line."""
        return f"{train.num_sequences} training sequences of {seq_len} tokens"

    def samples(self, model: Any, variables: Any, held_out: Any, tokenizer: Tokenizer, count: int
                ) -> list[tuple[str, str, str]] | None:
        """``(input, output, reference)`` of ``count`` held-out examples decoded greedily (None: the
        task has no such samples)."""
        return None


class ImageClassification(Task):
    """`mtjax.models.ViT` on one-object procedural scenes: 16 classes (`mtjax.train.scenes.CLASSES`)."""

    name = "image classification"
    model_inputs = staticmethod(lambda batch: {"images": batch["images"]})
    loss_fn = staticmethod(classification_loss)
    metrics_fn = staticmethod(class_accuracy)

    def example_batch(self, batch_size: int, seq_len: int, config: ViTConfig) -> dict[str, jax.ShapeDtypeStruct]:
        return {"images": jax.ShapeDtypeStruct((batch_size, config.image_size, config.image_size, config.num_channels),
                                               jnp.float32),
                "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}

    def tokens_per_example(self, seq_len: int, config: ViTConfig) -> int:
        return config.seq_len

    def model_overrides(self, config: ViTConfig) -> dict[str, Any]:
        return {} if config.num_classes == len(CLASSES) else {"num_classes": len(CLASSES)}

    def datasets(self, spec: DataSpec) -> tuple[SceneDataset, SceneDataset | None]:
        config = spec.model_config
        if spec.paths:
            raise ValueError("--data: the image presets train on generated scenes (mtjax.train.scenes), not files")
        if config.num_classes != len(CLASSES) or config.num_channels != 3:
            raise ValueError(f"the scenes have {len(CLASSES)} classes and 3 channels; the model has "
                             f"num_classes={config.num_classes}, num_channels={config.num_channels}")
        make = functools.partial(SceneDataset, "classification", image_size=config.image_size, seed=spec.seed)
        return make("train"), make("eval") if spec.eval_sequences else None

    def describe_data(self, train: SceneDataset, seq_len: int) -> str:
        return f"generated {train.image_size}x{train.image_size} scenes of one shape ({len(CLASSES)} classes)"


class Seq2Seq(Task):
    """`mtjax.models.T5` restoring shuffled lines (`mtjax.train.lines`)."""

    name = "sequence to sequence"
    model_inputs = staticmethod(lambda batch: {"encoder_tokens": batch["encoder_inputs"],
                                               "decoder_tokens": batch["inputs"],
                                               "encoder_segment_ids": batch["encoder_segment_ids"]})
    metrics_fn = staticmethod(token_accuracy)
    accuracy_name = "token accuracy"

    def example_batch(self, batch_size: int, seq_len: int, config: T5Config) -> dict[str, jax.ShapeDtypeStruct]:
        tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        return {"encoder_inputs": tokens, "encoder_segment_ids": tokens, "inputs": tokens, "targets": tokens,
                "weights": jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)}

    def datasets(self, spec: DataSpec) -> tuple[ShuffledLines, ShuffledLines | None]:
        train, held_out = ShuffledLines.from_paths(spec.paths, spec.tokenizer, spec.seq_len, seed=spec.seed)
        if not spec.eval_sequences:
            return train, None
        held = 0 if held_out is None else len(held_out.lines)
        if held < spec.eval_sequences:
            raise ValueError(f"--data holds {held} held-out lines, fewer than the {spec.eval_sequences} one "
                             "evaluation reads (use --eval-batches 0 or more data)")
        return train, held_out

    def describe_data(self, train: ShuffledLines, seq_len: int) -> str:
        return f"{len(train.lines)} lines to restore from shuffled words, up to {seq_len} tokens"

    def samples(self, model, variables, held_out, tokenizer, count):
        batch = held_out.batches(count)[0]
        out = jitted_t5_generate(model, variables, jnp.asarray(batch["encoder_inputs"]),
                                 encoder_segment_ids=jnp.asarray(batch["encoder_segment_ids"]),
                                 max_new_tokens=held_out.seq_len, start_id=tokenizer.eos_id, eos_id=tokenizer.eos_id)
        return [(tokenizer.decode(src[segment_ids != 0]), tokenizer.decode(until_eos(row, tokenizer.eos_id)),
                 tokenizer.decode(until_eos(ref, tokenizer.eos_id)))
                for src, segment_ids, row, ref in zip(batch["encoder_inputs"], batch["encoder_segment_ids"],
                                                      np.asarray(out), batch["targets"])]


class Captioning(Task):
    """`mtjax.models.VLM` captioning procedural scenes (`mtjax.train.scenes`); the loss counts caption
    tokens only (the model returns the text's logits, and padding is weighted out)."""

    name = "captioning"
    model_inputs = staticmethod(lambda batch: {"images": batch["images"], "tokens": batch["inputs"]})
    metrics_fn = staticmethod(token_accuracy)
    accuracy_name = "token accuracy"
    max_objects = 2

    def example_batch(self, batch_size: int, seq_len: int, config: VLMConfig) -> dict[str, jax.ShapeDtypeStruct]:
        vision = config.vision
        tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        return {"images": jax.ShapeDtypeStruct((batch_size, vision.image_size, vision.image_size,
                                                vision.num_channels), jnp.float32),
                "inputs": tokens, "targets": tokens, "weights": jax.ShapeDtypeStruct(tokens.shape, jnp.float32)}

    def datasets(self, spec: DataSpec) -> tuple[SceneDataset, SceneDataset | None]:
        if spec.paths:
            raise ValueError("--data: the captioning presets train on generated scenes (mtjax.train.scenes), not files")
        vision = spec.model_config.vision
        if vision.num_channels != 3:
            raise ValueError(f"the scenes have 3 channels; the model's vision.num_channels={vision.num_channels}")
        make = functools.partial(SceneDataset, "captioning", image_size=vision.image_size, seed=spec.seed,
                                 max_objects=self.max_objects, tokenizer=spec.tokenizer, seq_len=spec.seq_len)
        return make("train"), make("eval") if spec.eval_sequences else None

    def describe_data(self, train: SceneDataset, seq_len: int) -> str:
        return (f"generated {train.image_size}x{train.image_size} scenes of 1-{train.max_objects} shapes with "
                f"captions of up to {seq_len} tokens")

    def samples(self, model, variables, held_out, tokenizer, count):
        batch = held_out.batches(count)[0]
        prompt = jnp.full((count, 1), tokenizer.eos_id, jnp.int32)
        out = jitted_vlm_generate(model, variables, jnp.asarray(batch["images"]), prompt,
                                  max_new_tokens=held_out.seq_len, eos_id=tokenizer.eos_id)
        return [("", tokenizer.decode(until_eos(row, tokenizer.eos_id)), held_out.scene(i).caption)
                for i, row in enumerate(np.asarray(out))]


_TASKS: dict[type, Task] = {GPTConfig: Task(), ViTConfig: ImageClassification(), T5Config: Seq2Seq(),
                            VLMConfig: Captioning()}


def task_for(config: Any) -> Task:
    """The task that trains the model of ``config`` (see the module docstring)."""
    task = _TASKS.get(type(config))
    if task is None:
        raise TypeError(f"task_for: no task trains a {type(config).__name__}; accepted: "
                        f"{', '.join(c.__name__ for c in _TASKS)}")
    return task


def exact_matches(samples: Sequence[tuple[str, str, str]]) -> int:
    """How many samples' output equals their reference."""
    return sum(output == reference for _, output, reference in samples)

