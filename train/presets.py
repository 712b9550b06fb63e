"""Training presets of ``mtjax train``: a model preset (`mtjax.models.model_config`) plus run settings.

``tiny`` is the default: it runs on the CPU in a few minutes with a clearly falling loss, as do
``vit-tiny``, ``t5-tiny`` and ``vlm-tiny`` (their tasks: `mtjax.train.tasks`). The GPU presets use
the shapes of the whole-step benchmark (docs/performance.md) (batch 8 x 2048 tokens for the 1B
models), so their tokens/s and MFU compare directly with the stock-Flax peer.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainPreset:
    """Defaults of one ``mtjax train --preset``; every field can be overridden by a flag.

    Attributes:
      model: the `mtjax.models.model_config` preset.
      batch_size: sequences (or images) per optimizer step (all devices and micro-batches together).
      seq_len: tokens per sequence (the image presets: the encoder's tokens per image, fixed by the model).
      steps: optimizer steps.
      learning_rate: peak learning rate (AdamW, warmup then cosine decay to a tenth).
      warmup_steps: linear warmup steps.
      save_every: checkpoint interval in steps.
      eval_every: held-out evaluation interval in steps.
      log_every: metrics interval in steps.
    """

    model: str
    batch_size: int
    seq_len: int
    steps: int
    learning_rate: float
    warmup_steps: int
    save_every: int
    eval_every: int
    log_every: int


PRESETS: dict[str, TrainPreset] = {
    "tiny": TrainPreset("tiny", batch_size=32, seq_len=128, steps=400, learning_rate=3e-3, warmup_steps=40,
                        save_every=100, eval_every=100, log_every=10),
    "gpt-125m": TrainPreset("gpt-125m", batch_size=32, seq_len=1024, steps=2000, learning_rate=6e-4,
                            warmup_steps=200, save_every=500, eval_every=250, log_every=10),
    "gpt-1.3b": TrainPreset("gpt-1.3b", batch_size=8, seq_len=2048, steps=1000, learning_rate=2e-4,
                            warmup_steps=100, save_every=250, eval_every=250, log_every=10),
    "llama-1b": TrainPreset("llama-1b", batch_size=8, seq_len=2048, steps=1000, learning_rate=3e-4,
                            warmup_steps=100, save_every=250, eval_every=250, log_every=10),
    # Mixtures of experts (the metrics add the auxiliary losses and expert loads).
    "moe-tiny": TrainPreset("moe-tiny", batch_size=32, seq_len=128, steps=200, learning_rate=3e-3, warmup_steps=20,
                            save_every=100, eval_every=100, log_every=10),
    "moe-mixtral-1b": TrainPreset("moe-mixtral-1b", batch_size=8, seq_len=2048, steps=1000, learning_rate=3e-4,
                                  warmup_steps=100, save_every=250, eval_every=250, log_every=10),
    "moe-deepseek-1b": TrainPreset("moe-deepseek-1b", batch_size=8, seq_len=2048, steps=1000, learning_rate=3e-4,
                                   warmup_steps=100, save_every=250, eval_every=250, log_every=10),
    # Multimodal and encoder-decoder presets (mtjax.train.tasks): CPU-sized, then the benchmark's shapes.
    "vit-tiny": TrainPreset("vit-tiny", batch_size=64, seq_len=16, steps=1500, learning_rate=3e-3, warmup_steps=50,
                            save_every=500, eval_every=500, log_every=50),
    "t5-tiny": TrainPreset("t5-tiny", batch_size=32, seq_len=48, steps=600, learning_rate=3e-3, warmup_steps=50,
                           save_every=300, eval_every=200, log_every=20),
    "vlm-tiny": TrainPreset("vlm-tiny", batch_size=32, seq_len=64, steps=1500, learning_rate=2e-3, warmup_steps=50,
                            save_every=500, eval_every=500, log_every=50),
    # GPU: the train benchmark's models on the same tasks (vit-l16 at 224x224 scenes, its head cut to their
    # 16 classes; t5-base on lines of up to 128 tokens).
    "vit-l16": TrainPreset("vit-l16", batch_size=64, seq_len=197, steps=1000, learning_rate=1e-3, warmup_steps=100,
                           save_every=250, eval_every=250, log_every=10),
    "t5-base": TrainPreset("t5-base", batch_size=32, seq_len=128, steps=1000, learning_rate=1e-3, warmup_steps=100,
                           save_every=250, eval_every=250, log_every=10),
}

# Dense bf16 peak TFLOP/s of one device, by a substring of jax's ``device_kind``: the MFU denominator
# (FP8 runs are reported against it too, so MFUs of bf16 and FP8 runs compare).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "MI300X": 1307.0}


def peak_tflops(device_kind: str) -> float | None:
    """The bf16 peak of a device from its ``device_kind``, or None when unknown (e.g. a CPU)."""
    return next((tflops for name, tflops in PEAK_BF16_TFLOPS.items() if name in device_kind), None)
