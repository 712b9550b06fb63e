"""``mtjax train`` / ``mtjax generate`` end to end on a small corpus: SIGTERM, resume, generate, bad flags."""

import json
import math
import os
import signal
import threading
import time

import pytest

from mtjax.cli import main
from tests.train import tensorboard_events

pytestmark = pytest.mark.usefixtures("fast_compiles")

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


def _sigterm_once_logged(workdir, train_records):
    """A thread sending this process SIGTERM once ``train_records`` steps are in metrics.jsonl."""
    def watch():
        path = os.path.join(workdir, "metrics.jsonl")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(path) and sum('"loss"' in line for line in open(path)) >= train_records:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_train_sigterm_resume_on_another_mesh_and_generate(tmp_path, corpus, capsys):
    workdir = str(tmp_path / "run")
    args = ["train", "--data", corpus, "--workdir", workdir, *SMALL, "--log-every", "1", "--eval-every", "2", "--fp8"]
    # An endless run on dp=4 x tp=2 with 2 micro-batches, stopped by SIGTERM: it saves and returns 0.
    watcher = _sigterm_once_logged(workdir, 3)
    assert main([*args, "--steps", "100000", "--save-every", "0", "--tp", "2", "--grad-accum", "2"]) == 0
    watcher.join()
    out = capsys.readouterr().out
    stopped_at = int(out.split("SIGTERM: saved step ")[1].split()[0])
    assert stopped_at >= 3 and os.listdir(os.path.join(workdir, "checkpoints")) == [str(stopped_at)]
    records = _records(workdir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, stopped_at + 1))
    assert {"grad_norm", "learning_rate"} <= set(train[0]) and "tokens_per_s" not in train[0]
    assert all(r["tokens_per_s"] > 0 and r["model_tflops"] > 0 for r in train[1:])
    assert [r["step"] for r in records if "eval_loss" in r][0] == 2
    events = tensorboard_events.scalars(os.path.join(workdir, "tensorboard"))  # the same scalars for TensorBoard
    assert events["loss"] == {r["step"]: pytest.approx(r["loss"]) for r in train}
    assert set(events["eval_loss"]) == {r["step"] for r in records if "eval_loss" in r}

    assert main([*args, "--steps", str(stopped_at + 2)]) == 2  # checkpoints exist but no --resume
    assert "--resume" in capsys.readouterr().err
    assert main([*args[:-1], "--steps", str(stopped_at + 2), "--resume"]) == 2  # FP8 state, run without --fp8
    assert "'fp8': True" in capsys.readouterr().err
    assert main([*args, "--steps", str(stopped_at + 2), "--resume"]) == 2  # another schedule: only with --override
    assert f"--resume with --steps {stopped_at + 2}" in capsys.readouterr().err
    # Resume on dp=8: the checkpoint is laid out onto the new mesh.
    assert main([*args, "--steps", str(stopped_at + 2), "--resume", "--override", "--eval-batches", "0"]) == 2
    err = capsys.readouterr().err
    assert f"--warmup-steps 40 (the checkpoint's) must be fewer than --steps {stopped_at + 2}" in err
    assert main([*args, "--steps", str(stopped_at + 2), "--warmup-steps", "1", "--resume", "--override",
                 "--eval-batches", "0"]) == 0
    assert [r["step"] for r in _records(workdir) if "loss" in r][-2:] == [stopped_at + 1, stopped_at + 2]
    assert sorted(tensorboard_events.scalars(os.path.join(workdir, "tensorboard"))["loss"]) == list(
        range(1, stopped_at + 3))
    assert str(stopped_at + 2) in os.listdir(os.path.join(workdir, "checkpoints"))
    assert os.path.getsize(os.path.join(workdir, "loss.png")) > 0
    capsys.readouterr()

    assert main(["generate", "--checkpoint", workdir, "--prompt", "def f", "--max-new-tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def f") and len(text.rstrip("\n")) > len("def f")
    assert main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert main(["generate", "--checkpoint", workdir, "--prompt", "x", "--max-new-tokens", "500"]) == 2
    assert "max_seq_len" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", workdir, "--prompt", "def f", "--max-new-tokens", "4",
                 "--repetition-penalty", "1.3", "--frequency-penalty", "0.5"]) == 0
    assert capsys.readouterr().out.startswith("def f")
    assert main(["generate", "--checkpoint", workdir, "--prompt", "x", "--presence-penalty", "3"]) == 2
    assert "--presence-penalty=3" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps: expected a positive integer"),
    (["--preset", "gpt-9"], "invalid choice"),
    (["--lr", "-1"], "--lr: expected a positive number"),
    (["--tp", "3"], "--tp 3 must divide the model's query heads (4), key/value heads (2)"),
    (["--tp", "4"], "--tp 4 must divide the model's key/value heads (2)"),  # not jax's IndivisibleError
    (["--seed", "-1"], "--seed: expected an integer >= 0"),
    (["--weight-decay", "nan"], "--weight-decay: expected a finite number >= 0"),
    (["--weight-decay", "-5"], "--weight-decay: expected a finite number >= 0"),
    (["--steps", "5", "--warmup-steps", "10"], "--warmup-steps 10 must be fewer than --steps 5"),
    (["--resume-step", "3"], "--resume-step needs --resume"),
    (["--override"], "--override needs --resume"),
    (["--batch-size", "4"], "divisible by dp * fsdp"),
    (["--data", "/no/such/folder"], "no such file or folder"),
    (["--tokenizer", "bpe"], "--tokenizer"),
    (["--eval-batches", "100"], "too few"),
    (["--num-processes", "2"], "coordinator_address"),
    (["--cp", "3"], "--seq-len 32 must be a multiple of 2 * --cp = 6"),
    (["--cp", "16"], "MeshConfig: pp=1 * dp=1 * fsdp=1 * ep=1 * cp=16 * tp=1 = 16 devices, but 8 are available"),
])
def test_bad_flags_get_a_clear_message(flags, message, corpus, tmp_path, capsys):
    argv = ["train", "--data", corpus, "--workdir", str(tmp_path), "--seq-len", "32", "--no-progress", *flags]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_tensorboard_without_its_writer_is_a_clear_error(corpus, tmp_path, capsys, monkeypatch):
    from mtjax.train import metrics

    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    argv = ["train", "--data", corpus, "--workdir", str(tmp_path), *SMALL, "--steps", "1", "--tensorboard"]
    assert main(argv) == 2
    assert "--tensorboard needs tensorboardX: pip install 'mtjax[tensorboard]'" in capsys.readouterr().err


def test_a_workdir_that_is_a_file_is_named(corpus, tmp_path, capsys):
    """Issue 27 defect 6: --workdir pointing at a file gave a NotADirectoryError traceback."""
    path = tmp_path / "a-file"
    path.write_text("x")
    assert main(["train", "--data", corpus, "--workdir", str(path), *SMALL]) == 2
    assert f"--workdir {path}: {path} is a file, not a folder" in capsys.readouterr().err


def test_data_that_is_not_utf8_is_an_error_unless_replace_is_asked(corpus, tmp_path, capsys):
    """Issue 27 defect 7: a Latin-1 --data file trained on U+FFFD without a word."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "latin1.txt").write_bytes(("caf\u00e9 " * 5000).encode("latin-1"))
    argv = ["train", "--data", str(data), "--workdir", str(tmp_path / "run"), *SMALL]
    assert main(argv) == 2
    assert "latin1.txt: not UTF-8 text (byte 3" in capsys.readouterr().err
    assert main([*argv, "--data-errors", "replace", "--steps", "1", "--save-every", "0"]) == 0



def test_fp8_block_scaling_trains_and_a_resume_must_keep_the_recipe(tmp_path, corpus, capsys):
    workdir = str(tmp_path / "run")
    args = ["train", "--data", corpus, "--workdir", workdir, *SMALL, "--log-every", "1", "--eval-batches", "0"]
    assert main([*args, "--steps", "2", "--fp8", "block"]) == 0
    assert "FP8 block scaling" in capsys.readouterr().out
    losses = [r["loss"] for r in _records(workdir) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    # The recipe decides the saved state (delayed scaling keeps amax histories): a resume keeps it.
    assert main([*args, "--steps", "3", "--fp8", "--resume", "--override"]) == 2
    assert "'fp8_recipe': 'block'" in capsys.readouterr().err
    assert main([*args, "--steps", "3", "--fp8", "block", "--resume", "--override"]) == 0
    assert [r["step"] for r in _records(workdir) if "loss" in r] == [1, 2, 3]


def test_fp8_recipe_must_be_known(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--fp8", "mxfp8", "--workdir", str(tmp_path)])
    assert "invalid choice: 'mxfp8'" in capsys.readouterr().err
