"""Pipeline parallelism over the ``pp`` mesh axis: schedules and one executor for all of them.

The model is cut into ``num_stages * num_chunks`` *virtual stages* of consecutive layers; virtual
stage ``v`` runs on device ``v % num_stages`` (chunk ``v // num_stages``), so with several chunks
per device ("circular" / "interleaved") a micro-batch goes around the ring of devices
``num_chunks`` times. Each micro-batch goes forward (F) through every virtual stage, its loss is
taken on the last one, and its gradient goes backward (B) through them in reverse.

A `Schedule` only decides *the order* in which each device runs its F and B actions. From that
order `Schedule.timeline` derives, by a lockstep simulation (each tick a device runs at most one F
and one B, then neighbours exchange activations and gradients with ``ppermute``), the tick of
every action and the buffer slots holding activations in flight; it also yields the schedule's
bubble fraction and peak live activations. The executor (`pipeline_loss`) replays that table
inside ``shard_map`` (manual over ``pp`` only; ``dp``/``fsdp``/``tp`` stay automatic, so the
layers can be data-, FSDP- and tensor-parallel inside a stage). In a tick where any device runs an
F (a B, a loss), every device runs one, idle ones on a placeholder whose result is dropped: the
collectives XLA puts inside a stage must be reached by all devices (the tick's length, set by its
busiest device, is unchanged).

Backward is explicit for every schedule: a B action recomputes its stage from the stashed input
and applies ``jax.vjp`` there (the stash holds one activation per micro-batch in flight, never a
scan's residuals), so the memory is what the schedule's order allows: GPipe stashes all
micro-batches, 1F1B about ``2 * num_stages`` whatever their number. `pipeline_loss` is a
``jax.custom_vjp`` whose forward pass runs the whole schedule and keeps the gradients, so it
composes with ``jax.grad`` of a larger model (embedding before, nothing after the loss); without
differentiation it runs only the F actions.

Schedules here: `GPipe`, `Circular` (GPipe order, several chunks per device, smaller bubble),
`OneFOneB` (bounded memory; interleaved with several chunks). A bidirectional DualPipe-style
schedule is a new `Schedule` with its own order and `device_of` (virtual stages placed from both
ends of the ring); the executor would then add the hand-offs in the opposite ring direction,
which `Schedule.timeline` currently rejects.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mtjax.fp8 import accumulate_gradients, map_param_gradients
from mtjax.sharding.mesh import PP

# Relative costs of a forward and a backward action (the usual estimate: backward = 2 forward).
# Used for the bubble fraction only.
FORWARD_COST, BACKWARD_COST = 1.0, 2.0


class Action(NamedTuple):
    """One unit of pipeline work: ``kind`` "F" or "B" of micro-batch ``microbatch`` at virtual stage ``stage``."""

    kind: str
    stage: int
    microbatch: int


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A schedule laid out in lockstep ticks for ``num_stages`` devices (all arrays ``[ticks, num_stages]``).

    Attributes:
      f_chunk, f_mb: the chunk and micro-batch of the device's F action at each tick (``f_mb`` -1: none).
      f_src: activation slot holding the F input (-1: the pipeline input itself, virtual stage 0).
      f_loss: the F action is on the last virtual stage: take the loss, put its gradient in ``f_dy``.
      f_dy: gradient slot written by the loss.
      b_chunk, b_mb, b_src: the B action (``b_mb`` -1: none) and the slot of its stashed input.
      b_dy: gradient slot holding the B action's output gradient.
      b_first: the B action is on virtual stage 0: its input gradient is a result, not sent on.
      recv_f, recv_b: slot receiving the activation / gradient arriving after the tick (-1: none).
      num_act_slots, num_dy_slots: buffer sizes per device.
      bubble_fraction: idle share of device time (F costs 1, B costs 2; a tick lasts as long as
        its slowest device).
      peak_live_activations: most micro-batches in flight on a device at once (forward done,
        backward not yet), each holding one stashed activation at a chunk boundary.
    """

    f_chunk: np.ndarray
    f_mb: np.ndarray
    f_src: np.ndarray
    f_loss: np.ndarray
    f_dy: np.ndarray
    b_chunk: np.ndarray
    b_mb: np.ndarray
    b_src: np.ndarray
    b_dy: np.ndarray
    b_first: np.ndarray
    recv_f: np.ndarray
    recv_b: np.ndarray
    num_act_slots: int
    num_dy_slots: int
    bubble_fraction: float
    peak_live_activations: int

    @property
    def num_ticks(self) -> int:
        return self.f_mb.shape[0]

    def table(self) -> dict[str, np.ndarray]:
        """The per-tick arrays, to be scanned over."""
        names = ("f_chunk", "f_mb", "f_src", "f_loss", "f_dy", "b_chunk", "b_mb", "b_src", "b_dy",
                 "b_first", "recv_f", "recv_b")
        return {name: getattr(self, name) for name in names}


class _Slots:
    """Lowest-free-index allocator of one device's buffer slots."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.size = 0

    def take(self) -> int:
        if self.free:
            slot = min(self.free)
            self.free.remove(slot)
            return slot
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


@dataclasses.dataclass(frozen=True)
class Schedule(abc.ABC):
    """The order of each device's F and B actions; everything else follows from it.

    Attributes:
      num_microbatches: micro-batches the batch is split into (the batch must divide by it).
      num_chunks: layer chunks per device (virtual stages = ``num_stages * num_chunks``).
    """

    num_microbatches: int
    num_chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("num_microbatches", "num_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}({name}={value!r}): expected a positive int")

    @abc.abstractmethod
    def order(self, num_stages: int) -> list[list[Action]]:
        """For each device, its F and B actions in the order it runs them."""

    def device_of(self, stage: int, num_stages: int) -> int:
        """The device running virtual stage ``stage``."""
        return stage % num_stages

    def _forward_order(self, device: int, num_stages: int) -> list[Action]:
        """F actions of ``device``: micro-batches in groups of ``num_stages``, each group through every chunk."""
        m, p = self.num_microbatches, num_stages
        return [Action("F", c * p + device, mb)
                for start in range(0, m, p) for c in range(self.num_chunks) for mb in range(start, min(start + p, m))]

    def _backward_order(self, device: int, num_stages: int) -> list[Action]:
        """B actions of ``device``: the same groups, chunks in reverse."""
        m, p = self.num_microbatches, num_stages
        return [Action("B", c * p + device, mb)
                for start in range(0, m, p) for c in reversed(range(self.num_chunks))
                for mb in range(start, min(start + p, m))]

    @functools.cache  # noqa: B019 - schedules are few, frozen and hashable: caching per instance is the intent
    def timeline(self, num_stages: int, backward: bool = True) -> Timeline:
        """Lay the order out in ticks (only the F actions when ``backward`` is False)."""
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"timeline(num_stages={num_stages!r}): expected a positive int")
        p, m = num_stages, self.num_microbatches
        v_last = p * self.num_chunks - 1
        for v in range(v_last):
            if self.device_of(v + 1, p) != (self.device_of(v, p) + 1) % p:
                raise NotImplementedError(
                    f"{type(self).__name__}: virtual stage {v + 1} is not on the ring successor of stage "
                    f"{v}'s device; the executor hands activations to the next device only"
                )
        orders = [[a for a in actions if backward or a.kind == "F"] for actions in self.order(p)]
        expected = {Action(k, v, mb) for k in ("FB" if backward else "F") for v in range(v_last + 1) for mb in range(m)}
        given = [a for actions in orders for a in actions]
        if len(given) != len(expected) or set(given) != expected or any(
                self.device_of(a.stage, p) != d for d, actions in enumerate(orders) for a in actions):
            raise ValueError(f"{type(self).__name__}.order: each action must appear once, on its stage's device")

        done: dict[Action, int] = {}
        ticks: list[list[list[Action]]] = []
        position = [0] * p
        while any(position[d] < len(orders[d]) for d in range(p)):
            t = len(ticks)
            if t > 4 * len(given) + 4 * p:
                raise ValueError(f"{type(self).__name__}.order deadlocks (an action waits for a later one)")
            row: list[list[Action]] = []
            for d in range(p):
                kinds: list[Action] = []
                while position[d] < len(orders[d]):
                    a = orders[d][position[d]]
                    if any(b.kind == a.kind for b in kinds) or not self._ready(a, t, done, v_last):
                        break
                    kinds.append(a)
                    done[a] = t
                    position[d] += 1
                row.append(kinds)
            ticks.append(row)
        return self._lay_out(ticks, p, v_last)

    @staticmethod
    def _ready(a: Action, t: int, done: dict[Action, int], v_last: int) -> bool:
        if a.kind == "F":
            return a.stage == 0 or done.get(Action("F", a.stage - 1, a.microbatch), t) < t
        if a.stage == v_last:  # the loss is taken right after the F, in the same tick
            return done.get(Action("F", a.stage, a.microbatch), t + 1) <= t
        return done.get(Action("B", a.stage + 1, a.microbatch), t) < t

    def _lay_out(self, ticks: list[list[list[Action]]], p: int, v_last: int) -> Timeline:
        num_ticks = len(ticks)
        arrays = {name: np.full((num_ticks, p), -1, np.int32)
                  for name in ("f_chunk", "f_mb", "f_src", "f_dy", "b_chunk", "b_mb", "b_src", "b_dy",
                               "recv_f", "recv_b")}
        f_loss = np.zeros((num_ticks, p), bool)
        b_first = np.zeros((num_ticks, p), bool)
        act = [_Slots() for _ in range(p)]
        dys = [_Slots() for _ in range(p)]
        act_slot: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> slot of its input
        dy_slot: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> slot of its output gradient
        in_flight = [0] * p
        peak_in_flight = 0
        busy = 0.0
        length = 0.0
        for t, row in enumerate(ticks):
            freed: list[tuple[int, str, int]] = []
            arrivals: list[tuple[int, str, tuple[int, int]]] = []
            tick_length = 0.0
            for d, actions in enumerate(row):
                cost = 0.0
                for a in actions:
                    key = (a.stage, a.microbatch)
                    chunk = a.stage // p
                    if a.kind == "F":
                        cost += FORWARD_COST
                        in_flight[d] += 1
                        peak_in_flight = max(peak_in_flight, in_flight[d])
                        arrays["f_chunk"][t, d], arrays["f_mb"][t, d] = chunk, a.microbatch
                        arrays["f_src"][t, d] = act_slot.get(key, -1)
                        if a.stage == v_last:
                            f_loss[t, d] = True
                            dy_slot[key] = arrays["f_dy"][t, d] = dys[d].take()
                        else:
                            arrivals.append(((d + 1) % p, "f", (a.stage + 1, a.microbatch)))
                    else:
                        cost += BACKWARD_COST
                        in_flight[d] -= 1
                        arrays["b_chunk"][t, d], arrays["b_mb"][t, d] = chunk, a.microbatch
                        arrays["b_src"][t, d] = act_slot.get(key, -1)
                        arrays["b_dy"][t, d] = dy_slot[key]
                        if key in act_slot:
                            freed.append((d, "f", act_slot.pop(key)))
                        freed.append((d, "b", dy_slot.pop(key)))
                        if a.stage == 0:
                            b_first[t, d] = True
                        else:
                            arrivals.append(((d - 1) % p, "b", (a.stage - 1, a.microbatch)))
                busy += cost
                tick_length = max(tick_length, cost)
            length += tick_length
            for d, kind, slot in freed:  # read during this tick, reusable by what arrives after it
                (act if kind == "f" else dys)[d].give(slot)
            for d, kind, key in arrivals:
                if kind == "f":
                    act_slot[key] = arrays["recv_f"][t, d] = act[d].take()
                else:
                    dy_slot[key] = arrays["recv_b"][t, d] = dys[d].take()
        return Timeline(
            **arrays, f_loss=f_loss, b_first=b_first,
            num_act_slots=max(1, max(s.size for s in act)), num_dy_slots=max(1, max(s.size for s in dys)),
            bubble_fraction=1.0 - busy / (p * length), peak_live_activations=peak_in_flight,
        )


@dataclasses.dataclass(frozen=True)
class Circular(Schedule):
    """All forwards, then all backwards, with ``num_chunks`` layer chunks per device (a micro-batch
    circles the ring ``num_chunks`` times): the fill/drain bubble shrinks about ``num_chunks``
    times, at the price of ``num_chunks`` times more hand-offs and stashed activations."""

    def order(self, num_stages: int) -> list[list[Action]]:
        return [self._forward_order(d, num_stages) + self._backward_order(d, num_stages) for d in range(num_stages)]


@dataclasses.dataclass(frozen=True)
class GPipe(Circular):
    """`Circular` with one chunk per device: all forwards, then all backwards; stashes every
    micro-batch (peak live = micro-batches)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_chunks != 1:
            raise ValueError(f"GPipe(num_chunks={self.num_chunks}): GPipe has one chunk per device; use Circular")


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
    """One-forward-one-backward: after a warm-up, each device alternates a backward and a forward,
    so the activations it stashes stay bounded by the warm-up (about ``2 * num_stages`` in lockstep,
    plus ``(num_chunks - 1) * num_stages`` when interleaved) however many micro-batches there are.
    Same bubble as `GPipe` / `Circular` with the same chunks. Interleaved (``num_chunks > 1``), the
    micro-batches must be a multiple of the stages (as in Megatron)."""

    def warmup(self, device: int, num_stages: int) -> int:
        """Forwards ``device`` runs before its first backward: enough that it never waits for one."""
        p = num_stages
        return min(self.num_microbatches * self.num_chunks, 2 * (p - 1 - device) + 1 + (self.num_chunks - 1) * p)

    def order(self, num_stages: int) -> list[list[Action]]:
        if self.num_chunks > 1 and self.num_microbatches % num_stages:
            # The interleaved warm-up assumes whole groups of num_stages micro-batches per chunk.
            raise ValueError(
                f"OneFOneB(num_microbatches={self.num_microbatches}, num_chunks={self.num_chunks}): interleaved "
                f"1F1B needs micro-batches in multiples of the {num_stages} stages"
            )
        orders = []
        for d in range(num_stages):
            forward, backward = self._forward_order(d, num_stages), self._backward_order(d, num_stages)
            w = self.warmup(d, num_stages)
            steady = [a for pair in zip(backward, forward[w:]) for a in pair]
            orders.append(forward[:w] + steady + backward[len(forward) - w:])
        return orders


# --------------------------------------------------------------------------------------------------
# Executor
# --------------------------------------------------------------------------------------------------


def _split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[batch, ...] -> [m, batch // m, ...] with micro-batch i = rows i, i + m, ...: a batch split
    into contiguous blocks over the data-parallel devices stays split the same way, no data moves."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _merge_microbatches(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def pipeline_loss(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    layer_params: Any,
    inputs: jax.Array,
    loss_fn: Callable[[Any, jax.Array, Any], jax.Array],
    loss_params: Any,
    targets: Any,
    *,
    mesh: Mesh,
    schedule: Schedule,
) -> jax.Array:
    """Mean over micro-batches of ``loss_fn(loss_params, layers(inputs_mb), targets_mb)``, pipelined over ``pp``.

    Differentiable (`jax.grad`) in ``layer_params``, ``inputs`` and ``loss_params``; the gradients
    are computed by the schedule during the forward pass. ``layer_fn`` and ``loss_fn`` must not
    close over values being differentiated (pass them as parameters).

    Args:
      layer_fn: ``layer_fn(params_of_one_layer, x) -> x`` with ``x`` of the shape of one
        micro-batch of ``inputs``.
      layer_params: the layers' parameters stacked on a leading axis (as ``nn.scan`` makes them),
        whose length divides by ``pp * schedule.num_chunks``; virtual stage ``v`` gets the ``v``-th
        consecutive block of layers. With one chunk, layers split over ``pp`` (the ``"layers"``
        rule) are already where they run. May be a variables dict with an FP8 meta
        (``{"params": ..., "fp8_meta": ...}``): the meta's "gradient" is its next value, combined
        over micro-batches by max (`mtjax.fp8.accumulate_gradients`), never scaled or averaged.
        Amaxes need no reduction over ``pp`` (each layer lives on one stage); over the data and
        tensor axes, automatic inside the stages, ``jnp.max`` is already global.
      inputs: ``[batch, ...]`` float activations entering the first layer; ``batch`` divides by
        ``schedule.num_microbatches``. Micro-batch ``i`` is rows ``i, i + M, i + 2M, ...``.
      loss_fn: ``loss_fn(loss_params, y, targets_mb) -> scalar`` taken on the last stage (e.g. the
        final norm, the LM head and the cross-entropy). With the vocabulary split over ``tp``, pick
        the targets' log-probabilities with a one-hot product: a gather along a ``tp``-split
        dimension inside this ``shard_map`` crashes XLA's SPMD partitioner (jax 0.11.2).
      loss_params: parameters of ``loss_fn`` (may carry an FP8 meta too).
      targets: pytree of ``[batch, ...]`` arrays split like ``inputs`` (not differentiated).
      mesh: a mesh with a ``"pp"`` axis; its other axes stay automatic inside the stages.
      schedule: a `Schedule` (`GPipe`, `Circular`, `OneFOneB`).
    """
    if not isinstance(schedule, Schedule):
        raise TypeError("pipeline_loss(schedule=...): expected a Schedule (GPipe, Circular, OneFOneB), got "
                        f"{schedule!r}")
    if PP not in mesh.axis_names:
        raise ValueError(f"pipeline_loss(mesh=...): the mesh has no {PP!r} axis (axes: {mesh.axis_names})")
    num_stages, m, c = mesh.shape[PP], schedule.num_microbatches, schedule.num_chunks
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    if num_layers % (num_stages * c):
        raise ValueError(
            f"pipeline_loss(layer_params=...): {num_layers} layers do not split into pp={num_stages} "
            f"stages x num_chunks={c}"
        )
    if inputs.shape[0] % m:
        raise ValueError(f"pipeline_loss(inputs=...): batch {inputs.shape[0]} does not divide into {m} micro-batches")

    run = functools.partial(_run_schedule, layer_fn, loss_fn, mesh, schedule)

    @jax.custom_vjp
    def loss(layer_params, inputs, loss_params, targets):
        return run(layer_params, inputs, loss_params, targets, backward=False)[0]

    def loss_fwd(layer_params, inputs, loss_params, targets):
        value, grads = run(layer_params, inputs, loss_params, targets, backward=True)
        return value, grads

    def loss_bwd(grads, g):
        def scale(tree):  # the FP8 meta riding on a gradient is the new meta, not a derivative
            return map_param_gradients(lambda x: (g * x).astype(x.dtype), tree)

        layer_grads, input_grads, loss_grads = grads
        return scale(layer_grads), scale(input_grads), scale(loss_grads), None

    loss.defvjp(loss_fwd, loss_bwd)
    return loss(layer_params, inputs, loss_params, targets)


def _run_schedule(layer_fn, loss_fn, mesh, schedule, layer_params, inputs, loss_params, targets, *, backward):
    """Replay ``schedule``'s timeline; returns (loss, (layer grads, input grads, loss-param grads))."""
    p, m, c = mesh.shape[PP], schedule.num_microbatches, schedule.num_chunks
    timeline = schedule.timeline(p, backward)
    table = {k: jnp.asarray(v) for k, v in timeline.table().items()}
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    # [layers, ...] -> [chunks, stages, layers per virtual stage, ...]: virtual stage v = chunk * p + stage.
    staged = jax.tree.map(lambda w: w.reshape(c, p, num_layers // (c * p), *w.shape[1:]), layer_params)
    xs = _split_microbatches(inputs, m)
    ts = jax.tree.map(lambda t: _split_microbatches(t, m), targets)

    def mean_part(loss_params, y, target):
        return loss_fn(loss_params, y, target).astype(jnp.float32) / m

    def stage_fn(chunk_params, h):
        return lax.scan(lambda h, w: (layer_fn(w, h), None), h, chunk_params)[0]

    def per_device(staged, xs, loss_params, ts, table):
        me = lax.axis_index(PP)
        staged = jax.tree.map(lambda w: w[:, 0], staged)  # [chunks, layers per virtual stage, ...]
        mb_shape, dtype = xs.shape[1:], xs.dtype
        mb_zeros = jnp.zeros(mb_shape, dtype)
        zero = jnp.zeros((), jnp.float32)
        loss_grad_zeros = jax.tree.map(jnp.zeros_like, loss_params)
        chunk_grad_zeros = jax.tree.map(lambda w: jnp.zeros(w.shape[1:], w.dtype), staged)
        # Each buffer has one extra "dump" row taking the writes of devices with nothing to write,
        # so every tick updates buffers in place; the conditionals return only per-action values.
        dump_act, dump_dy = timeline.num_act_slots, timeline.num_dy_slots
        carry = dict(act=jnp.zeros((dump_act + 1, *mb_shape), dtype), loss=zero)
        if backward:
            carry.update(
                dy=jnp.zeros((dump_dy + 1, *mb_shape), dtype),
                grads=jax.tree.map(jnp.zeros_like, staged),
                loss_grads=loss_grad_zeros,
                dx=jnp.zeros((m + 1, *mb_shape), dtype),
            )

        def chunk_of(tree, i):
            return jax.tree.map(lambda w: lax.dynamic_index_in_dim(w, jnp.maximum(i, 0), keepdims=False), tree)

        def stage_input(act, src, mb):
            return jnp.where(src >= 0, act[jnp.maximum(src, 0)], xs[jnp.maximum(mb, 0)])

        def masked(keep, tree):
            return jax.tree.map(lambda a: jnp.where(keep, a, jnp.zeros_like(a)), tree)

        def tick(carry, row):
            # The branches below are taken by every device or by none (the predicate looks at all
            # stages' actions): XLA inserts collectives over the automatic axes inside the stages,
            # and a collective in a branch that only some devices take never completes. A device
            # without the action computes on a placeholder and its result is discarded.
            any_f, any_loss, any_b = jnp.any(row["f_mb"] >= 0), jnp.any(row["f_loss"]), jnp.any(row["b_mb"] >= 0)
            row = {k: v[me] for k, v in row.items()}
            carry = dict(carry)
            # Forward: the stage on its stashed input (the pipeline input on virtual stage 0).
            x_f = stage_input(carry["act"], row["f_src"], row["f_mb"])
            y = lax.cond(any_f, lambda: stage_fn(chunk_of(staged, row["f_chunk"]), x_f).astype(dtype),
                         lambda: mb_zeros)
            # On the last virtual stage: the micro-batch's loss and, with backward, its gradients.
            target = chunk_of(ts, row["f_mb"])
            if backward:
                def with_loss():
                    # The mean over micro-batches is taken here, on the gradient flowing back: FP8
                    # gradient amaxes must see the true gradient, not m times it.
                    value, (g_lp, dy) = jax.value_and_grad(mean_part, argnums=(0, 1))(loss_params, y, target)
                    return value, g_lp, dy.astype(dtype)

                value, g_lp, dy = lax.cond(any_loss, with_loss, lambda: (zero, loss_grad_zeros, mb_zeros))
                carry["loss_grads"] = accumulate_gradients(carry["loss_grads"], masked(row["f_loss"], g_lp))
                carry["dy"] = carry["dy"].at[jnp.where(row["f_loss"], row["f_dy"], dump_dy)].set(dy)
            else:
                value = lax.cond(any_loss, lambda: mean_part(loss_params, y, target), lambda: zero)
            carry["loss"] = carry["loss"] + jnp.where(row["f_loss"], value, 0.0)
            # Hand-off to the next device (what it does not expect goes to its dump slot).
            recv_f = lax.ppermute(y, PP, [(i, (i + 1) % p) for i in range(p)])
            if backward:
                # Backward: recompute the stage from its stashed input and apply its vjp.
                x_b = stage_input(carry["act"], row["b_src"], row["b_mb"])
                dy_b = carry["dy"][jnp.maximum(row["b_dy"], 0)]

                def backward_step():
                    _, vjp = jax.vjp(stage_fn, chunk_of(staged, row["b_chunk"]), x_b)
                    g_params, g_x = vjp(dy_b)
                    return g_params, g_x.astype(dtype)

                g_params, g_x = lax.cond(any_b, backward_step, lambda: (chunk_grad_zeros, mb_zeros))
                chunk = jnp.maximum(row["b_chunk"], 0)
                acc = accumulate_gradients(chunk_of(carry["grads"], chunk), masked(row["b_mb"] >= 0, g_params))
                carry["grads"] = jax.tree.map(
                    lambda all_chunks, a: lax.dynamic_update_index_in_dim(all_chunks, a, chunk, 0), carry["grads"], acc)
                carry["dx"] = carry["dx"].at[jnp.where(row["b_first"], row["b_mb"], m)].set(g_x)
                recv_b = lax.ppermute(g_x, PP, [(i, (i - 1) % p) for i in range(p)])
                carry["dy"] = carry["dy"].at[jnp.where(row["recv_b"] >= 0, row["recv_b"], dump_dy)].set(recv_b)
            carry["act"] = carry["act"].at[jnp.where(row["recv_f"] >= 0, row["recv_f"], dump_act)].set(recv_f)
            return carry, None

        carry, _ = lax.scan(tick, carry, table)
        loss = lax.psum(carry["loss"], PP)
        if not backward:
            return loss, None
        grads = jax.tree.map(lambda g: g[:, None], carry["grads"])  # [chunks, 1 stage, ...]
        return loss, (grads, lax.psum(carry["dx"][:m], PP), lax.psum(carry["loss_grads"], PP))

    stage_spec = jax.tree.map(lambda _: P(None, PP), staged)
    out_specs = (P(), None if not backward else (stage_spec, P(), jax.tree.map(lambda _: P(), loss_params)))
    # check_vma=False: the ops' dispatch traces their Pallas kernels too, whose outputs do not declare
    # how they vary over manual axes. Nothing here relies on implicit psums: each device accumulates
    # its own gradients and they are psummed over pp once, after the loop.
    loss, grads = jax.shard_map(
        per_device, mesh=mesh, axis_names={PP}, check_vma=False,
        in_specs=(stage_spec, P(), jax.tree.map(lambda _: P(), loss_params), jax.tree.map(lambda _: P(), ts),
                  jax.tree.map(lambda _: P(), table)),
        out_specs=out_specs,
    )(staged, xs, loss_params, ts, table)
    if not backward:
        return loss, None
    layer_grads, dx, loss_grads = grads
    layer_grads = jax.tree.map(lambda g, w: g.reshape(w.shape).astype(w.dtype), layer_grads, layer_params)
    return loss, (layer_grads, _merge_microbatches(dx).astype(inputs.dtype), loss_grads)
