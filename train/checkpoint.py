"""Checkpoints with orbax: async, atomic, keep-the-last-K, restorable onto another mesh.

Each checkpoint (one folder per step) holds two items: ``state``, the `TrainState` (params, FP8
meta, optimizer state, step, RNG; not ``compute_params``, the compute-dtype copy of the weights,
which a restore derives from the params again) written as sharded arrays, and ``meta``, a JSON dict with the
data iterator's position and the run's configuration (what ``mtjax generate`` needs to rebuild the
model and tokenizer). Orbax writes into a temporary folder and renames it when complete, so a run
killed during a save restores from the last complete checkpoint. A restore lays the arrays out as
the abstract state passed in says, whatever mesh or device count wrote them.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from mtjax.train.state import TrainState, cast_like


class Checkpointer:
    """Save and restore `TrainState` + metadata under ``directory``.

    Attributes:
      directory: the folder holding one sub-folder per saved step.
      save_every: `save` writes only on steps that are multiples of this (unless ``force``); None:
        only forced saves.
      keep: the number of most recent checkpoints kept; older ones are deleted.
      async_save: write in a background thread; `save` returns once the arrays are copied off
        the devices, and the next `save` (or `wait`/`close`) waits for the previous write.
    """

    def __init__(self, directory: str | os.PathLike, *, save_every: int | None = 1000, keep: int = 3,
                 async_save: bool = True):
        if (save_every is not None and save_every < 1) or keep < 1:
            raise ValueError(f"Checkpointer(save_every={save_every}, keep={keep}): expected positive ints "
                             "(save_every=None: forced saves only)")
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_every, self.keep, self.async_save = save_every, keep, async_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: TrainState, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Save ``state`` and the JSON-serialisable ``meta`` as checkpoint ``step``; True if it saved.

        ``step`` is the host's copy of ``state.step`` (reading the device scalar would wait for the step).
        """
        if not force and (self.save_every is None or step % self.save_every):
            return False
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state.replace(compute_params=None)),
                                  meta=ocp.args.JsonSave(meta))
        return self._manager.save(step, args=args, force=force)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, abstract_state: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """(state, meta) of checkpoint ``step`` (default: the latest), laid out as ``abstract_state``.

        Args:
          abstract_state: `mtjax.train.state.abstract_train_state` for the mesh to restore onto
            (its leaves' ``.sharding`` decide where each array goes). With ``compute_params`` the
            copy is rebuilt from the restored params, whether or not the run that saved kept one.
        """
        step = self._resolve(step)
        copy = abstract_state.compute_params
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=_pytree_restore(abstract_state.replace(compute_params=None)), meta=ocp.args.JsonRestore()))
        state = restored.state
        if copy is not None:
            shardings = jax.tree.map(lambda c: c.sharding, copy)
            cast = jax.jit(lambda params: cast_like(params, copy), out_shardings=shardings)
            state = state.replace(compute_params=cast(state.params))
        return state, restored.meta

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the ``meta`` item of checkpoint ``step`` (default: the latest)."""
        step = self._resolve(step)
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore_params(self, abstract_params: Any, step: int | None = None) -> Any:
        """Only the parameters of checkpoint ``step``, laid out as ``abstract_params`` (inference)."""
        step = self._resolve(step)
        item = _pytree_restore({"params": abstract_params}, partial_restore=True)
        return self._manager.restore(step, args=ocp.args.Composite(state=item)).state["params"]

    def _resolve(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint {'' if step is None else f'for step {step} '}in {self.directory}")
        return step

    def wait(self) -> None:
        """Block until the background write (if any) is complete."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
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
    """Turns SIGTERM (a scheduler's preemption notice) into a request to save and stop.

    Call `should_stop(step)` after every step; when it returns True, save and exit. With one process
    a Python SIGTERM handler sets the request. With several, jax's preemption service (started by
    ``jax.distributed.initialize``) catches the signal and agrees on a step that every process
    reaches, so all of them save the same step.
    """

    def __init__(self) -> None:
        self._requested = False
        self._multi_process = jax.process_count() > 1
        self._previous = None if self._multi_process else signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._requested = True

    def should_stop(self, step: int) -> bool:
        if self._multi_process:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._requested

    def close(self) -> None:
        if not self._multi_process:
            signal.signal(signal.SIGTERM, self._previous)
