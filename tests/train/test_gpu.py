"""``mtjax train`` on a GPU preset (runs only where a GPU is present: ``JAX_PLATFORMS=cuda pytest -m gpu``)."""

import json
import os

import pytest

from mtjax.cli import main


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpt_125m_trains_and_reports_mfu(tmp_path, fp8):
    argv = ["train", "--preset", "gpt-125m", "--steps", "30", "--log-every", "10", "--eval-batches", "0",
            "--save-every", "0", "--no-progress", "--workdir", str(tmp_path)]
    assert main(argv + (["--fp8"] if fp8 else [])) == 0
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert records[-1]["mfu"] > 0.05, records[-1]
