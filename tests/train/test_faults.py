"""Fault injection on ``mtjax train`` at toy size: divergence, failed and killed saves, full disks,
damaged checkpoints, signals and a dead peer. Each test asserts that nothing complete is lost and
that the message names the problem (step, folder, OS error) in one line, without a traceback."""

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.path import atomicity

from mtjax.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--seq-len", "32", "--batch-size", "8", "--eval-batches", "0", "--no-progress", "--log-every", "1"]
BASE_STEPS = 6  # the base run: steps 1..6, checkpoints 2, 4, 6


_CACHE_OPTIONS = {"jax_compilation_cache_dir": None, "jax_persistent_cache_min_compile_time_secs": 0,
                  "jax_persistent_cache_min_entry_size_bytes": 0}


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """Every run here compiles the same tiny model: a persistent compilation cache (shared with the
    child processes) compiles it once instead of once per run."""
    from jax._src import compilation_cache  # reset_cache: the cache is set up once per process

    reset = getattr(compilation_cache, "reset_cache", lambda: None)
    options = {**_CACHE_OPTIONS, "jax_compilation_cache_dir": str(tmp_path_factory.mktemp("jax_cache"))}
    saved = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    reset()
    environ = {name.upper(): str(value) for name, value in options.items()}
    saved_environ = {name: os.environ.get(name) for name in environ}
    os.environ.update(environ)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    reset()
    for name, value in saved_environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module", autouse=True)
def fast_compiles_here_and_in_children(fast_compiles):
    """`fast_compiles` in the child processes too: the runs compared with each other (the base run,
    resumed runs, children) all compile the same way."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.py").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)))
    return str(folder)


def _train(corpus, workdir, *flags):
    return main(["train", "--data", corpus, "--workdir", str(workdir), *SMALL, *flags])


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(workdir):
    return {r["step"]: r["loss"] for r in _records(workdir) if "loss" in r}


def _steps(workdir):
    return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


def _error_lines(err):
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("mtjax train: error:")]


@pytest.fixture(scope="module")
def base_run(corpus, tmp_path_factory):
    """An uninterrupted run (its losses are what every resumed run must reproduce)."""
    workdir = tmp_path_factory.mktemp("base") / "run"
    assert _train(corpus, workdir, "--steps", str(BASE_STEPS), "--save-every", "2") == 0
    assert _steps(workdir) == [2, 4, 6]
    return workdir


@pytest.fixture
def copy_of_base(base_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(base_run, workdir)
    return workdir


def test_divergence_stops_without_saving_and_keeps_the_good_checkpoints(corpus, copy_of_base, base_run, capsys):
    workdir = copy_of_base
    status = _train(corpus, workdir, "--resume", "--override", "--lr", "1e9", "--steps", "20")
    err = capsys.readouterr().err
    assert status == 1
    [line] = _error_lines(err)
    assert "the run diverged" in line and "nan" in line and "last good checkpoint is step 6" in line
    step = int(line.split("error: step ")[1].split(":")[0])
    assert BASE_STEPS < step < 10  # named at the step it happened, before the step-8 save
    assert "--override: continuing step 6" in err and "learning_rate" in err
    assert _steps(workdir) == [2, 4, 6]  # nothing non-finite written, nothing good rotated away
    assert any("override" in r for r in _records(workdir))


def test_skipped_nonfinite_steps_are_counted_and_bounded(corpus, tmp_path, capsys):
    status = _train(corpus, tmp_path / "run", "--lr", "1e9", "--warmup-steps", "0", "--steps", "30",
                    "--save-every", "10", "--on-nonfinite", "skip", "--max-skipped-steps", "2")
    err = capsys.readouterr().err
    assert status == 1
    assert err.count("update skipped") == 3
    [line] = _error_lines(err)
    assert "3 steps skipped" in line and "--max-skipped-steps 2" in line
    assert [r["skipped_steps"] for r in _records(tmp_path / "run") if "skipped_steps" in r] == [1, 2, 3]


def _fail_commit_of(step, monkeypatch, error=None):
    """Make the commit of checkpoint ``step`` fail in orbax's background thread (a full disk)."""
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        if self._final_path.name == str(step):
            raise error or OSError(errno.ENOSPC, "No space left on device")
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)


# The runs below train with the base run's settings where they can: the compilation cache then hits.
BASE = ["--steps", str(BASE_STEPS), "--save-every", "2"]


def test_a_failed_background_save_stops_the_run_at_once_in_one_line(corpus, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "run"
    _fail_commit_of(2, monkeypatch)
    assert _train(corpus, workdir, *BASE) == 1
    [line] = _error_lines(capsys.readouterr().err)
    assert line.startswith(f"mtjax train: error: saving checkpoint step 2 to {workdir}/checkpoints/2 failed: "
                           "[Errno 28] No space left on device")
    assert max(_losses(workdir)) <= 4  # the run stopped: by the next checkpoint boundary at the latest
    assert _steps(workdir) == []


def test_metrics_on_a_full_disk_fail_once_clearly(corpus, tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    os.symlink("/dev/full", workdir / "metrics.jsonl")  # every write: ENOSPC
    assert _train(corpus, workdir, *BASE) == 1
    [line] = _error_lines(capsys.readouterr().err)
    assert line == f"mtjax train: error: writing {workdir}/metrics.jsonl failed: No space left on device"


@pytest.fixture
def tiny_filesystem(tmp_path):
    """Mounts a tmpfs of a given size at a folder (needs root and CAP_SYS_ADMIN; skipped otherwise)."""
    mounted = []

    def mount(path, size_kib):
        path.mkdir(parents=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                                capture_output=True)
        if result.returncode:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


def test_a_disk_holding_exactly_keep_checkpoints_is_enough(corpus, tmp_path, tiny_filesystem, capsys):
    workdir = tmp_path / "run"
    tiny_filesystem(workdir / "checkpoints", 2700)  # two checkpoints of ~1.1 MiB, not three
    assert _train(corpus, workdir, *BASE, "--keep", "2") == 0
    assert _steps(workdir) == [4, 6]


def test_a_full_disk_says_how_much_space_keep_needs(corpus, tmp_path, tiny_filesystem, capsys):
    workdir = tmp_path / "run"
    tiny_filesystem(workdir / "checkpoints", 1700)  # one checkpoint fits
    assert _train(corpus, workdir, *BASE, "--keep", "2") == 1
    [line] = _error_lines(capsys.readouterr().err)
    assert f"saving checkpoint step 4 to {workdir}/checkpoints/4 failed: [Errno 28] No space left on device" in line
    assert "keep=2 needs" in line and "MiB free" in line
    assert _steps(workdir) == [2]


def _truncate_largest_array_file(step_dir):
    files = [os.path.join(root, n) for root, _, names in os.walk(os.path.join(step_dir, "state")) for n in names]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)


DAMAGE = {
    "empty folder": lambda step_dir: (shutil.rmtree(step_dir), os.mkdir(step_dir)),
    "truncated array file": _truncate_largest_array_file,
    "garbled meta": lambda step_dir: open(os.path.join(step_dir, "meta", "metadata"), "wb").write(b"\x80\xff{garbage"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_latest_step_is_skipped_and_the_resume_is_exact(damage, corpus, copy_of_base, base_run, capsys):
    workdir = copy_of_base
    DAMAGE[damage](os.path.join(workdir, "checkpoints", "6"))
    assert _train(corpus, workdir, "--resume", "--steps", str(BASE_STEPS)) == 0
    err = capsys.readouterr().err
    assert f"warning: checkpoint {workdir}/checkpoints/6" in err and "trying step 4" in err
    assert f"resuming from step 4; set aside the newer checkpoint(s) {workdir}/checkpoints/6.unusable" in err
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "6.unusable"))
    assert _steps(workdir) == [2, 4, 6]
    train = [r["step"] for r in _records(workdir) if "loss" in r]
    assert train == list(range(1, BASE_STEPS + 1))  # metrics.jsonl cut back to step 4, then 5 and 6 again
    assert _losses(workdir) == _losses(base_run)  # bit-identical to the uninterrupted run


def test_a_stray_empty_step_folder_does_not_block(corpus, copy_of_base, base_run, capsys):
    workdir = copy_of_base
    shutil.rmtree(os.path.join(workdir, "checkpoints", "6"))
    os.mkdir(os.path.join(workdir, "checkpoints", "25"))
    assert _train(corpus, workdir, "--resume", "--save-every", "2") == 0
    err = capsys.readouterr().err
    assert f"warning: checkpoint {workdir}/checkpoints/25 is incomplete: state, meta, _CHECKPOINT_METADATA missing; " \
           "trying step 4" in err
    assert _losses(workdir) == _losses(base_run) and _steps(workdir) == [2, 4, 6]


def test_resume_step_picks_an_older_checkpoint(corpus, copy_of_base, base_run, capsys):
    workdir = copy_of_base
    assert _train(corpus, workdir, "--resume", "--resume-step", "2", "--save-every", "2") == 0
    err = capsys.readouterr().err
    assert "resuming from step 2; set aside the newer checkpoint(s)" in err and "4.unusable" in err
    assert _losses(workdir) == _losses(base_run) and _steps(workdir) == [2, 4, 6]
    assert _train(corpus, workdir, "--resume", "--resume-step", "3") == 2
    assert "--resume-step 3: no such checkpoint" in capsys.readouterr().err



def test_context_parallelism_continues_the_same_run(corpus, copy_of_base, base_run, capsys):
    """``--cp 2`` (dp=4 x cp=2, ring attention) from the dp=8 run's step 4 takes the same steps 5 and 6."""
    assert _train(corpus, copy_of_base, "--resume", "--resume-step", "4", "--cp", "2") == 0
    assert "'cp': 2" in capsys.readouterr().out
    cp, plain = _losses(copy_of_base), _losses(base_run)
    assert sorted(cp) == sorted(plain) == list(range(1, BASE_STEPS + 1))
    np.testing.assert_allclose([cp[s] for s in (5, 6)], [plain[s] for s in (5, 6)], rtol=1e-5)

# The child: `mtjax train` whose commit of checkpoint 4 never finishes, killed by the parent mid-save.
_HANG_IN_SAVE = """
import asyncio, sys
from orbax.checkpoint._src.path import atomicity
from mtjax.cli import main
original = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self, *args, **kwargs):
    if self._final_path.name == "4":
        print("saving", flush=True)
        await asyncio.sleep(3600)
    return await original(self, *args, **kwargs)
atomicity.AtomicRenameTemporaryPath.finalize = finalize
main(sys.argv[1:])
"""


def test_a_run_killed_during_a_save_resumes_exactly(corpus, base_run, tmp_path, capsys):
    workdir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", _HANG_IN_SAVE, "train", "--data", corpus, "--workdir",
                              str(workdir), *SMALL, *BASE],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        lines = iter(child.stdout.readline, "")
        assert any(line.strip() == "saving" for line in lines), child.stderr.read()
    finally:
        child.kill()
        child.communicate()
    assert _steps(workdir) == [2]
    assert _train(corpus, workdir, "--resume", "--save-every", "2") == 0
    assert _losses(workdir) == _losses(base_run)
    assert _steps(workdir) == [2, 4, 6]


def _signal_once_logged(workdir, signum, records):
    def send():
        path = os.path.join(workdir, "metrics.jsonl")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(path) and sum('"loss"' in line for line in open(path)) >= records:
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_sigint_saves_like_sigterm(corpus, tmp_path, capsys):
    workdir = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)
    sender = _signal_once_logged(workdir, signal.SIGINT, 2)
    assert _train(corpus, workdir, "--steps", "100000", "--save-every", "0") == 0
    sender.join()
    captured = capsys.readouterr()
    assert "press Ctrl-C again to exit without saving" in captured.err
    stopped_at = int(captured.out.split("SIGINT: saved step ")[1].split()[0])
    assert _steps(workdir) == [stopped_at] and max(_losses(workdir)) == stopped_at
    assert signal.getsignal(signal.SIGINT) is handler  # restored


def test_a_signal_during_set_up_is_not_lost(corpus, tmp_path, monkeypatch, capsys):
    from mtjax.train.data import PackedDataset

    original = PackedDataset.from_paths.__func__

    def from_paths(cls, *args, **kwargs):  # reading the corpus is the slow part of the set-up
        os.kill(os.getpid(), signal.SIGTERM)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PackedDataset, "from_paths", classmethod(from_paths))
    assert _train(corpus, tmp_path / "run", "--steps", "5") == 0
    assert "SIGTERM before the first step: nothing trained, nothing saved" in capsys.readouterr().out


def test_a_second_ctrl_c_exits_at_once(corpus, tmp_path):
    workdir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-m", "mtjax.cli", "train", "--data", corpus, "--workdir", str(workdir),
                              *SMALL, "--steps", "100000", "--save-every", "0"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        path = os.path.join(workdir, "metrics.jsonl")
        deadline = time.monotonic() + 120
        while not (os.path.exists(path) and os.path.getsize(path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        for line in iter(child.stderr.readline, ""):
            if "SIGINT: saving" in line:
                break
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130, err
    assert "second SIGINT: exiting now without saving" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(corpus, workdir, *flags):
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    return [subprocess.Popen(
        [sys.executable, "-m", "mtjax.cli", "train", "--data", corpus, "--workdir", str(workdir), *SMALL,
         "--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i),
         "--peer-timeout", "5", *flags],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_dead_peer_ends_the_other_process_with_a_clear_message(corpus, tmp_path):
    """Issue 27 defect 8: the survivor aborted in C++ (jax's coordination service) instead.
    (A normal two-process finish with the peer watch: tests/train/test_distributed.py.)"""
    workers = _two_processes(corpus, tmp_path / "run", "--steps", "100000", "--save-every", "2")
    try:
        path, checkpoint = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "checkpoints" / "2"
        deadline = time.monotonic() + 300
        while not (checkpoint.exists() and path.read_text().count("\n") >= 3) and time.monotonic() < deadline:
            assert all(w.poll() is None for w in workers), workers[0].stderr.read()[-3000:]
            time.sleep(0.1)
        workers[1].kill()
        killed = time.monotonic()
        _, err = workers[0].communicate(timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        for w in workers:
            w.kill()
    assert workers[0].returncode == 1, err[-3000:]
    assert "died or became unreachable" in err and re.search(r"the last good checkpoint is step \d*[02468] in ", err)
    assert "Check failure" not in err and "Traceback" not in err


def test_resume_with_changed_settings_needs_override(corpus, copy_of_base, capsys):
    """Issue 27 defect 7: another --batch-size/--seq-len/--lr/--steps on resume changed the run silently."""
    workdir = copy_of_base
    for flags, named in ((["--batch-size", "16"], "--batch-size 16"), (["--lr", "0.1"], "--lr 0.1"),
                         (["--seq-len", "16"], "--seq-len 16"), (["--steps", "9"], "--steps 9")):
        assert _train(corpus, workdir, "--resume", *flags) == 2
        [line] = _error_lines(capsys.readouterr().err)
        assert f"--resume with {named}, but the checkpoint's run has" in line and "--override" in line
    assert _train(corpus, workdir, "--resume") == 2  # the run is complete
    assert "--steps 6: the checkpoint is at step 6 already; nothing to train" in capsys.readouterr().err
    assert _steps(workdir) == [2, 4, 6]
