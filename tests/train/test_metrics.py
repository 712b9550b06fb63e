"""TensorBoard scalars of the metric records (`mtjax.train.metrics`), read back from the event files."""

import pytest

from mtjax.train.metrics import TensorBoardWriter
from tests.train import tensorboard_events


def test_scalars_are_written_and_a_resumed_run_replaces_the_later_steps(tmp_path):
    logdir = str(tmp_path / "tensorboard")
    writer = TensorBoardWriter(logdir)
    for step in range(1, 6):
        writer.write({"step": step, "loss": 10.0 - step, "learning_rate": 1e-3, "moe_expert_load": [1, 2]})
    writer.write({"step": 4, "eval_loss": 6.5})
    writer.write({"step": 5, "override": {"steps": {"checkpoint": 5, "now": 8}}})  # not a scalar: left out
    writer.close()
    found = tensorboard_events.scalars(logdir)
    assert set(found) == {"loss", "learning_rate", "eval_loss"}
    assert found["loss"] == {step: pytest.approx(10.0 - step) for step in range(1, 6)}
    assert found["eval_loss"] == {4: 6.5}

    resumed = TensorBoardWriter(logdir, resumed_step=3)  # the checkpoint of step 3: steps 4 and 5 run again
    resumed.write({"step": 4, "loss": 1.0})
    resumed.close()
    found = tensorboard_events.scalars(logdir)
    assert found["loss"] == {1: 9.0, 2: 8.0, 3: 7.0, 4: 1.0}
    assert found["eval_loss"] == {}
