"""``mtjax train`` / ``mtjax generate`` end to end on a small corpus, bad flags, and SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mtjax.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--seq-len", "32", "--batch-size", "8", "--eval-batches", "1", "--no-progress"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    lines = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)]
    (folder / "a.py").write_text("".join(lines[:100]))
    (folder / "b.txt").write_text("".join(lines[100:]))
    return str(folder)


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_resume_on_another_mesh_and_generate(tmp_path, corpus, capsys):
    workdir = str(tmp_path / "run")
    args = ["train", "--data", corpus, "--workdir", workdir, *SMALL, "--log-every", "1", "--save-every", "2",
            "--eval-every", "2"]
    assert main([*args, "--steps", "4", "--tp", "2", "--grad-accum", "2"]) == 0
    records = _records(workdir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert "tokens_per_s" not in train[0] and train[-1]["tokens_per_s"] > 0 and train[-1]["model_tflops"] > 0
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
    assert os.path.getsize(os.path.join(workdir, "loss.png")) > 0

    assert main([*args, "--steps", "6"]) == 2  # existing checkpoints and no --resume
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "--steps", "6", "--resume"]) == 0  # restored from dp=4 x tp=2 onto dp=8
    assert [r["step"] for r in _records(workdir) if "loss" in r][-2:] == [5, 6]
    capsys.readouterr()

    assert main(["generate", "--checkpoint", workdir, "--prompt", "def f", "--max-new-tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def f") and len(text.rstrip("\n")) > len("def f")
    assert main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert main(["generate", "--checkpoint", workdir, "--prompt", "x", "--max-new-tokens", "500"]) == 2
    assert "max_seq_len" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps: expected a positive integer"),
    (["--preset", "gpt-9"], "invalid choice"),
    (["--lr", "-1"], "--lr: expected a positive number"),
    (["--tp", "3"], "MeshConfig"),
    (["--batch-size", "4"], "divisible by dp * fsdp"),
    (["--data", "/no/such/folder"], "no such file or folder"),
    (["--tokenizer", "bpe"], "--tokenizer"),
    (["--eval-batches", "100"], "too few"),
    (["--num-processes", "2"], "coordinator_address"),
])
def test_bad_flags_get_a_clear_message(flags, message, corpus, tmp_path, capsys):
    argv = ["train", "--data", corpus, "--workdir", str(tmp_path), "--seq-len", "32", "--no-progress", *flags]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    assert status == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, corpus):
    workdir = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-m", "mtjax.cli", "train", "--data", corpus, "--workdir", str(workdir), *SMALL,
         "--steps", "100000", "--log-every", "1", "--eval-batches", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        assert child.poll() is None, child.communicate()
        time.sleep(0.2)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "SIGTERM: saved step" in out
    step = int(out.split("SIGTERM: saved step ")[1].split()[0])
    assert os.listdir(workdir / "checkpoints") == [str(step)] and step >= 2
