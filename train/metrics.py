"""TensorBoard scalars of a run's metric records, beside ``metrics.jsonl`` (`mtjax train`).

Written with tensorboardX (the ``tensorboard`` extra: ``pip install "mtjax[tensorboard]"``), which
writes TensorBoard's event files without TensorFlow or PyTorch. View them with
``tensorboard --logdir runs/`` (the ``tensorboard`` package, installed separately).
"""

from __future__ import annotations

import numbers
import os
import time
from typing import Any

TENSORBOARD_DIR = "tensorboard"


def tensorboard_available() -> bool:
    """Whether the writer (tensorboardX) is installed."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardWriter:
    """Every numeric scalar of a metric record as a TensorBoard scalar at the record's ``step``.

    Tags are the record's keys (``loss``, ``grad_norm``, ``learning_rate``, ``tokens_per_s``,
    ``eval_loss``...); lists (per-expert loads) and nested records are left to ``metrics.jsonl``.

    Attributes:
      logdir: the folder the event files go to.

    ``resumed_step``: a run continued from that checkpoint step; TensorBoard then drops the events
    of steps after it that an earlier run wrote (the run being replaced), as ``metrics.jsonl`` does.
    """

    def __init__(self, logdir: str | os.PathLike, resumed_step: int | None = None):
        from tensorboardX import SummaryWriter

        self.logdir = os.fspath(logdir)
        purge = None if resumed_step is None else resumed_step + 1
        # The file name holds the second it was created in; the nanoseconds keep a run resumed within the
        # same second from overwriting the file of the run before, and sort after it (as TensorBoard reads).
        self._writer = SummaryWriter(self.logdir, purge_step=purge, flush_secs=30,
                                     filename_suffix=f".{time.time_ns()}")

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if step is None:
            return
        for tag, value in record.items():
            if tag != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
