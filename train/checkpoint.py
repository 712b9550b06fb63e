"""Checkpoints with orbax: async, atomic, keep-the-last-K, validated on restore, restorable onto another mesh.

Each checkpoint (one folder per step) holds two items: ``state``, the `TrainState` (params, FP8
meta, optimizer state, step, RNG; not ``compute_params``, the compute-dtype copy of the weights,
which a restore derives from the params again) written as sharded arrays, and ``meta``, a JSON dict with the
data iterator's position and the run's configuration (what ``mtjax generate`` needs to rebuild the
model and tokenizer). Orbax writes into a temporary folder and renames it when complete, so a run
killed during a save restores from the last complete checkpoint. A restore lays the arrays out as
the abstract state passed in says, whatever mesh or device count wrote them.

Failures are reported where they happen, in one line naming the checkpoint folder and the OS
error (`CheckpointError`): a background write that failed surfaces at the next `poll` (call it
every step), `wait` or `save`; a checkpoint that cannot be read names its folder. A state holding
NaN or Inf is refused (`NonFiniteStateError`) rather than written, so a diverged run never rotates
its good checkpoints away. Rotation deletes the oldest checkpoint *before* writing a new one when
``keep >= 2``, so ``keep`` checkpoints' worth of disk space is enough (``keep=1`` needs two while
a save is in flight).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from mtjax.train.state import TrainState, cast_like

# Files and item folders every complete checkpoint folder holds.
_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ITEMS = ("state", "meta")
# Suffix of step folders moved aside because they cannot be restored (see `Checkpointer.set_aside`).
SET_ASIDE_SUFFIX = ".unusable"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names its folder and the cause."""


class NonFiniteStateError(ValueError):
    """`Checkpointer.save` refused a state whose parameters or optimizer state hold NaN or Inf."""


def _os_error(err: BaseException) -> OSError | None:
    """The first OS error in ``err``'s chain of causes, or None: an OSError, or a TensorStore error
    carrying one (``... [os_error_code='28']``, how the array writer reports a full disk)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        code = re.search(r"os_error_code='?(\d+)", str(err))
        if code:
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _one_line(err: BaseException) -> str:
    os_error = _os_error(err)
    if os_error is not None:
        text = os.strerror(os_error.errno) if os_error.errno else str(os_error)
        code = f"[Errno {os_error.errno}] " if os_error.errno else ""
        where = f": {os_error.filename}" if os_error.filename else ""
        return f"{code}{text}{where}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
              if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


class Checkpointer:
    """Save and restore `TrainState` + metadata under ``directory``.

    Attributes:
      directory: the folder holding one sub-folder per saved step.
      save_every: `save` writes only on steps that are multiples of this (unless ``force``); None:
        only forced saves.
      keep: the number of most recent checkpoints kept; older ones are deleted (the oldest before
        a new one is written, when ``keep >= 2``).
      async_save: write in a background thread; `save` returns once the arrays are copied off
        the devices. Its outcome is checked by `poll` (cheap; call it every step), `wait`, `close`
        and the next `save`, which raise `CheckpointError` for a write that failed.
      check_finite: refuse (`NonFiniteStateError`) to save a state whose params or optimizer
        state hold NaN or Inf.
    """

    def __init__(self, directory: str | os.PathLike, *, save_every: int | None = 1000, keep: int = 3,
                 async_save: bool = True, check_finite: bool = True):
        if (save_every is not None and save_every < 1) or keep < 1:
            raise ValueError(f"Checkpointer(save_every={save_every}, keep={keep}): expected positive ints "
                             "(save_every=None: forced saves only)")
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"Checkpointer: {self.directory} is a file, not a folder")
        self.save_every, self.keep, self.async_save = save_every, keep, async_save
        self.check_finite = check_finite
        # Retention is done here (`_rotate`), before a save rather than after it.
        options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._in_flight: int | None = None

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state: TrainState, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Save ``state`` and the JSON-serialisable ``meta`` as checkpoint ``step``; True if it saved.

        ``step`` is the host's copy of ``state.step`` (reading the device scalar would wait for the step).

        Raises:
          NonFiniteStateError: ``check_finite`` and the state holds NaN or Inf (nothing is written
            and no checkpoint is deleted).
          CheckpointError: this save, or the previous background one, failed.
        """
        if not force and (self.save_every is None or step % self.save_every):
            return False
        self.wait()
        if self.check_finite and not bool(_all_finite((state.params, state.opt_state))):
            raise NonFiniteStateError(
                f"step {step}: the parameters or optimizer state hold NaN or Inf; not saving a checkpoint "
                f"over the last good one in {self.directory} (latest: step {self.latest_step()})")
        if step in self.all_steps():
            return False
        self._rotate(self.keep - 1 if self.keep >= 2 else self.keep)
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state.replace(compute_params=None)),
                                  meta=ocp.args.JsonSave(meta))
        self._in_flight = step
        try:
            saved = self._manager.save(step, args=args, force=True)
            if not self.async_save:
                self._in_flight = None
        except Exception as err:
            self._in_flight = None
            raise self._save_error(step, err) from err
        return saved

    def save_params(self, step: int, params: Any, meta: dict[str, Any]) -> None:
        """Save only ``params`` (a ``"params"`` tree, e.g. converted weights) and ``meta`` as checkpoint
        ``step``, synchronously: `restore_params` and ``mtjax generate`` read it; `restore` cannot (there
        is no training state).

        Raises:
          NonFiniteStateError: ``params`` hold NaN or Inf.
          CheckpointError: the write failed.
        """
        self.wait()
        if self.check_finite and not bool(_all_finite(params)):
            raise NonFiniteStateError(f"step {step}: the parameters hold NaN or Inf; not saving them in "
                                      f"{self.directory}")
        args = ocp.args.Composite(state=ocp.args.PyTreeSave({"params": params}), meta=ocp.args.JsonSave(meta))
        try:
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._save_error(step, err) from err

    def _rotate(self, keep: int) -> None:
        steps = self.all_steps()
        for old in steps[: max(len(steps) - keep, 0)]:
            try:
                self._manager.delete(old)
            except (OSError, FileNotFoundError) as err:
                raise CheckpointError(f"could not delete the old checkpoint {self.step_path(old)}: "
                                      f"{_one_line(err)}") from err

    def _save_error(self, step: int, err: BaseException) -> CheckpointError:
        message = f"saving checkpoint step {step} to {self.step_path(step)} failed: {_one_line(err)}"
        os_error = _os_error(err)
        if os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            complete = [s for s in self.all_steps() if s != step]
            size = _folder_bytes(self.step_path(complete[-1])) if complete else 0
            try:
                free = shutil.disk_usage(self.directory).free
            except OSError:
                free = None
            if size:
                held = max(self.keep, 2)
                message += (f" (one checkpoint takes {size / 2**20:.1f} MiB; keep={self.keep} needs "
                            f"{held * size / 2**20:.1f} MiB"
                            + (f", {free / 2**20:.1f} MiB free" if free is not None else "") + ")")
        return CheckpointError(message)

    def poll(self) -> None:
        """Raise `CheckpointError` if a background save has failed; returns at once otherwise."""
        if self._in_flight is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until the background write (if any) is complete; `CheckpointError` if it failed."""
        step, self._in_flight = self._in_flight, None
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._save_error(step if step is not None else -1, err) from err
        if step is not None:
            self._rotate(self.keep)

    def latest_step(self) -> int | None:
        """The newest checkpoint folder's step (not checked: see `verify`), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every checkpoint folder, oldest first."""
        return sorted(self._manager.all_steps())

    def verify(self, step: int) -> dict[str, Any]:
        """The ``meta`` of checkpoint ``step`` after checking its folder is complete.

        The arrays themselves are checked only by reading them (`restore`).

        Raises:
          CheckpointError: the folder lacks an item or its metadata, or the meta cannot be read.
        """
        path = self.step_path(step)
        missing = [name for name in (*ITEMS, _CHECKPOINT_METADATA) if not os.path.exists(os.path.join(path, name))]
        if missing:
            raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing")
        try:
            return self.restore_meta(step)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"checkpoint {path}: its meta cannot be read: {_one_line(err)}") from err

    def restore(self, abstract_state: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """(state, meta) of checkpoint ``step`` (default: the latest), laid out as ``abstract_state``.

        Args:
          abstract_state: `mtjax.train.state.abstract_train_state` for the mesh to restore onto
            (its leaves' ``.sharding`` decide where each array goes). With ``compute_params`` the
            copy is rebuilt from the restored params, whether or not the run that saved kept one.

        Raises:
          FileNotFoundError: no checkpoint ``step``.
          CheckpointError: it cannot be read (incomplete, damaged, or of another structure).
        """
        step = self._resolve(step)
        copy = abstract_state.compute_params
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=_pytree_restore(abstract_state.replace(compute_params=None)), meta=ocp.args.JsonRestore()))
        except Exception as err:
            raise CheckpointError(f"checkpoint {self.step_path(step)} cannot be restored: {_one_line(err)}") from err
        state = restored.state
        if copy is not None:
            shardings = jax.tree.map(lambda c: c.sharding, copy)
            cast = jax.jit(lambda params: cast_like(params, copy), out_shardings=shardings)
            state = state.replace(compute_params=cast(state.params))
        return state, restored.meta

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the ``meta`` item of checkpoint ``step`` (default: the latest)."""
        step = self._resolve(step)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as err:
            raise CheckpointError(f"checkpoint {self.step_path(step)}: its meta cannot be read: "
                                  f"{_one_line(err)}") from err
        if not isinstance(meta, dict):
            raise CheckpointError(f"checkpoint {self.step_path(step)}: its meta is not a JSON object")
        return meta

    def restore_params(self, abstract_params: Any, step: int | None = None) -> Any:
        """Only the parameters of checkpoint ``step``, laid out as ``abstract_params`` (inference)."""
        step = self._resolve(step)
        item = _pytree_restore({"params": abstract_params}, partial_restore=True)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(state=item)).state["params"]
        except Exception as err:
            raise CheckpointError(f"checkpoint {self.step_path(step)} cannot be restored: {_one_line(err)}") from err

    def restore_newest(self, abstract_state: TrainState, steps: list[int] | None = None, *,
                       accept: Callable[[int, dict[str, Any]], None] | None = None,
                       warn: Callable[[str], None] | None = None) -> tuple[TrainState, dict[str, Any], int]:
        """(state, meta, step) of the newest restorable checkpoint among ``steps`` (default: all).

        A checkpoint that cannot be read is skipped with a warning naming it and the step tried
        next (``warn``, default stderr); ``accept(step, meta)`` may raise `CheckpointError` to skip
        one the same way (e.g. one of another model).

        Raises:
          CheckpointError: none of ``steps`` can be restored (the message lists why, per step).
        """
        warn = warn or (lambda text: print(f"warning: {text}", file=sys.stderr, flush=True))
        candidates = sorted(self.all_steps() if steps is None else steps, reverse=True)
        reasons = []
        for i, step in enumerate(candidates):
            try:
                meta = self.verify(step)
                if accept is not None:
                    accept(step, meta)
                state, meta = self.restore(abstract_state, step)
                return state, meta, step
            except CheckpointError as err:
                reasons.append(str(err))
                older = candidates[i + 1] if i + 1 < len(candidates) else None
                warn(f"{err}; " + (f"trying step {older}" if older is not None else "no older checkpoint left"))
        raise CheckpointError(f"no usable checkpoint in {self.directory}: " + ("; ".join(reasons) or "none saved"))

    def set_aside(self, steps: list[int]) -> list[str]:
        """Rename the folders of ``steps`` to ``<step>.unusable`` so later saves can use those steps;
        returns the new paths. Nothing is deleted (process 0 renames; every process waits)."""
        moved = []
        for step in steps:
            target = self.step_path(step) + SET_ASIDE_SUFFIX
            suffix = 1
            while os.path.exists(target):
                suffix += 1
                target = f"{self.step_path(step)}{SET_ASIDE_SUFFIX}{suffix}"
            if jax.process_index() == 0:
                os.rename(self.step_path(step), target)
            moved.append(target)
        if moved and jax.process_count() > 1:
            multihost_utils.sync_global_devices("mtjax checkpoint set_aside")
        self._manager.reload()
        return moved

    def _resolve(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint {'' if step is None else f'for step {step} '}in {self.directory}")
        return step

    def close(self) -> None:
        """Wait for the background write and release the manager (`CheckpointError` if the write failed)."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _pytree_restore(abstract: Any, partial_restore: bool = False) -> ocp.args.PyTreeRestore:
    # Every leaf restores as a jax.Array in the sharding of its abstract leaf.
    return ocp.args.PyTreeRestore(item=abstract, partial_restore=partial_restore,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


class PreemptionWatcher:
    """Turns SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) into a request to save and stop.

    Create it before anything slow starts (it touches no jax backend); call `should_stop(step)`
    after every step and, when it returns True, save and exit. A second SIGINT exits the process at
    once (status 130) without saving. With one process the Python handlers set the request. With
    several, jax's preemption service (started by ``jax.distributed.initialize``) owns SIGTERM and
    agrees on a step that every process reaches, so all of them save the same step; a SIGINT (or
    a SIGTERM that arrived before that service started) is handed to it as a SIGTERM.

    Attributes:
      signal_name: the first signal received (``"SIGTERM"`` or ``"SIGINT"``), or None.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._forwarded = False
        self._previous = {signum: signal.signal(signum, self._on_signal) for signum in self.SIGNALS}

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and signum == signal.SIGINT:
            print(f"\nmtjax: second {name}: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        if self.signal_name is None:
            self.signal_name = name
            hint = "; press Ctrl-C again to exit without saving" if signum == signal.SIGINT else ""
            print(f"\nmtjax: {name}: saving a checkpoint after this step, then stopping{hint}",
                  file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        """Whether a signal asked this process to stop."""
        return self.signal_name is not None

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            if self.requested and not self._forwarded:
                self._forwarded = True
                os.kill(os.getpid(), signal.SIGTERM)  # to jax's preemption service, which now owns SIGTERM
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def close(self) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)
