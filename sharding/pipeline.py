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
F (a B, a W, a loss), every device runs one, idle ones on a placeholder whose result is dropped:
the collectives XLA puts inside a stage must be reached by all devices (the tick's length, set by
its busiest device, is unchanged). The timeline is cut into segments (`Segment`), runs of ticks
with the same kinds of action, each one loop whose body runs those kinds with no conditional
between them: in the steady state of 1F1B, ZB-H1 and DualPipeV a tick's F of one micro-batch and B
(and W) of another are one straight-line program, so XLA's scheduler can overlap one's hand-offs
(and the stages' own collectives) with the other's compute, the overlap DualPipe's F&B pairs are
built for.

Backward is explicit for every schedule: a B action recomputes its stage from the stashed input
and applies ``jax.vjp`` there (the stash holds one activation per micro-batch in flight, never a
scan's residuals), so the memory is what the schedule's order allows: GPipe stashes all
micro-batches, 1F1B about ``2 * num_stages`` whatever their number. `pipeline_loss` is a
``jax.custom_vjp`` whose forward pass runs the whole schedule and keeps the gradients, so it
composes with ``jax.grad`` of a larger model (embedding before, nothing after the loss); without
differentiation it runs only the F actions.

Schedules here: `GPipe`, `Circular` (GPipe order, several chunks per device, smaller bubble),
`OneFOneB` (bounded memory; interleaved with several chunks), `ZeroBubbleH1` (1F1B with the
backward split into an input-gradient B and a weight-gradient W action, the W's deferred into the
bubble) and `DualPipeV` (DeepSeek's V-shaped schedule: two chunks per device placed from both ends,
forwards of one chunk paired with backwards of the other, zero-bubble W's; its hand-offs go both
ways round the ring and, at the turn of the V, to the device itself). With split backwards a B
action differentiates the stage in its input only and the W action in its weights, each from the
stash, which then lives until the W.

`simulate` runs the schedules' orders with given forward / backward / weight-gradient costs and
reports each device's bubble and peak activations (the published formulas, see its docstring);
``python -m mtjax.sharding.pipeline`` prints them.
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
    """One unit of pipeline work of micro-batch ``microbatch`` at virtual stage ``stage``: ``kind``
    "F" (forward), "B" (backward; only the input gradient when the schedule also has a "W" for it)
    or "W" (the weight gradient, split from the backward: zero-bubble schedules run it later)."""

    kind: str
    stage: int
    microbatch: int


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive ticks ``[start, stop)`` of a `Timeline` in which the same kinds of action run
    (each on some device at every tick of it): one loop of the executor, whose body runs exactly
    those, with no conditional between them. The loss (on the last virtual stage) is taken
    ``"always"``, ``"never"`` or, where only some ticks have one, ``"sometimes"`` (a conditional)."""

    start: int
    stop: int
    forward: bool
    backward: bool
    weights: bool
    loss: str


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
      w_chunk, w_mb, w_src, w_dy: the W action (``w_mb`` -1: none), its stashed input and gradient slots.
      recv_f, recv_b: slot receiving the activation from the previous device / the gradient from
        the next device after the tick (-1: none).
      recv_f_rev, recv_b_rev: the same from the other ring direction (V-shaped placements).
      recv_f_self, recv_b_self: the slot taking this device's own output (consecutive virtual
        stages on one device).
      num_act_slots, num_dy_slots: buffer sizes per device.
      bubble_fraction: idle share of device time (F costs 1, B costs 2, or 1 + 1 when split into B
        and W; a tick lasts as long as its slowest device).
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
    w_chunk: np.ndarray
    w_mb: np.ndarray
    w_src: np.ndarray
    w_dy: np.ndarray
    recv_f: np.ndarray
    recv_b: np.ndarray
    recv_f_rev: np.ndarray
    recv_b_rev: np.ndarray
    recv_f_self: np.ndarray
    recv_b_self: np.ndarray
    num_act_slots: int
    num_dy_slots: int
    bubble_fraction: float
    peak_live_activations: int

    @property
    def num_ticks(self) -> int:
        return self.f_mb.shape[0]

    def segments(self, merge_ticks: int = 2) -> list[Segment]:
        """The ticks cut into runs with the same kinds of action (F, B, W) anywhere in each tick.

        A run of at most ``merge_ticks`` ticks whose kinds a neighbouring run also has joins it (its
        devices then compute the missing kinds on placeholders for those ticks): every loop is one
        more compiled copy of the stages, and DualPipeV's steady state holds lone F ticks.
        """
        kinds = [frozenset(k for k, present in zip("FBW", flags) if present) for flags in
                 zip((self.f_mb >= 0).any(1), (self.b_mb >= 0).any(1), (self.w_mb >= 0).any(1))]
        runs: list[list[Any]] = []  # [kinds, start, stop]
        for t, k in enumerate(kinds):
            if runs and runs[-1][0] == k:
                runs[-1][2] = t + 1
            else:
                runs.append([k, t, t + 1])
        merged = True
        while merged:
            merged = False
            for i, (k, start, stop) in enumerate(runs):
                neighbours = [j for j in (i - 1, i + 1) if 0 <= j < len(runs) and k <= runs[j][0]]
                if stop - start <= merge_ticks and neighbours:
                    j = max(neighbours, key=lambda j: runs[j][2] - runs[j][1])
                    runs[j] = [runs[j][0], min(start, runs[j][1]), max(stop, runs[j][2])]
                    del runs[i]
                    merged = True
                    break
            for i in range(len(runs) - 1, 0, -1):  # neighbours left with the same kinds become one run
                if runs[i][0] == runs[i - 1][0]:
                    runs[i - 1][2] = runs[i][2]
                    del runs[i]
        losses = self.f_loss.any(1)
        result = []
        for k, start, stop in runs:
            loss = losses[start:stop]
            result.append(Segment(start, stop, "F" in k, "B" in k, "W" in k,
                                  loss="always" if loss.all() else "sometimes" if loss.any() else "never"))
        return result

    def table(self) -> dict[str, np.ndarray]:
        """The per-tick arrays, to be scanned over."""
        names = ("f_chunk", "f_mb", "f_src", "f_loss", "f_dy", "b_chunk", "b_mb", "b_src", "b_dy",
                 "b_first", "w_chunk", "w_mb", "w_src", "w_dy", "recv_f", "recv_b", "recv_f_rev", "recv_b_rev",
                 "recv_f_self", "recv_b_self")
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

    def chunk_of(self, stage: int, num_stages: int) -> int:
        """Which of its device's ``num_chunks`` layer chunks virtual stage ``stage`` is."""
        return stage // num_stages

    @property
    def splits_backward(self) -> bool:
        """The order has "W" actions: every backward is split into B (input) and W (weights)."""
        return False

    def stage_at(self, chunk: int, device: int, num_stages: int) -> int:
        """The virtual stage of ``device``'s chunk ``chunk`` (the inverse of `device_of` / `chunk_of`)."""
        for v in range(num_stages * self.num_chunks):
            if self.device_of(v, num_stages) == device and self.chunk_of(v, num_stages) == chunk:
                return v
        raise ValueError(f"{type(self).__name__}: no virtual stage on device {device}, chunk {chunk}")

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
            if (self.device_of(v + 1, p) - self.device_of(v, p)) % p not in (0, 1, p - 1):
                raise NotImplementedError(
                    f"{type(self).__name__}: virtual stage {v + 1} is neither on stage {v}'s device nor on a "
                    f"ring neighbour of it; the executor hands activations to neighbours only"
                )
        orders = [[a for a in actions if backward or a.kind == "F"] for actions in self.order(p)]
        kinds = ("FBW" if self.splits_backward else "FB") if backward else "F"
        expected = {Action(k, v, mb) for k in kinds for v in range(v_last + 1) for mb in range(m)}
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
        if a.kind == "W":  # reads what its B read: may run in the same tick
            return done.get(Action("B", a.stage, a.microbatch), t + 1) <= t
        if a.stage == v_last:  # the loss is taken right after the F, in the same tick
            return done.get(Action("F", a.stage, a.microbatch), t + 1) <= t
        return done.get(Action("B", a.stage + 1, a.microbatch), t) < t

    def _lay_out(self, ticks: list[list[list[Action]]], p: int, v_last: int) -> Timeline:
        num_ticks = len(ticks)
        names = ("f_chunk", "f_mb", "f_src", "f_dy", "b_chunk", "b_mb", "b_src", "b_dy", "w_chunk", "w_mb", "w_src",
                 "w_dy", "recv_f", "recv_b", "recv_f_rev", "recv_b_rev", "recv_f_self", "recv_b_self")
        arrays = {name: np.full((num_ticks, p), -1, np.int32) for name in names}
        f_loss = np.zeros((num_ticks, p), bool)
        b_first = np.zeros((num_ticks, p), bool)
        act = [_Slots() for _ in range(p)]
        dys = [_Slots() for _ in range(p)]
        act_slot: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> slot of its input
        dy_slot: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> slot of its output gradient
        split = self.splits_backward
        backward_cost = BACKWARD_COST - FORWARD_COST if split else BACKWARD_COST
        in_flight = [0] * p
        peak_in_flight = 0
        busy = 0.0
        length = 0.0

        def direction(src: int, dst: int, kind: str) -> str:
            """The receive table of a hand-off from device ``src`` to ``dst`` of an activation (f) / gradient (b)."""
            step = (dst - src) % p
            if step == 0:
                return f"recv_{kind}_self"
            downstream = 1 if kind == "f" else p - 1  # the usual direction of each kind
            return f"recv_{kind}" if step == downstream else f"recv_{kind}_rev"

        for t, row in enumerate(ticks):
            freed: list[tuple[int, str, int]] = []
            arrivals: list[tuple[int, str, str, tuple[int, int]]] = []
            tick_length = 0.0
            for d, actions in enumerate(row):
                cost = 0.0
                for a in actions:
                    key = (a.stage, a.microbatch)
                    chunk = self.chunk_of(a.stage, p)
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
                            dst = self.device_of(a.stage + 1, p)
                            arrivals.append((dst, "f", direction(d, dst, "f"), (a.stage + 1, a.microbatch)))
                    elif a.kind == "B":
                        cost += backward_cost
                        arrays["b_chunk"][t, d], arrays["b_mb"][t, d] = chunk, a.microbatch
                        arrays["b_src"][t, d] = act_slot.get(key, -1)
                        arrays["b_dy"][t, d] = dy_slot[key]
                        if not split:  # the W reads the stash later otherwise
                            in_flight[d] -= 1
                            if key in act_slot:
                                freed.append((d, "f", act_slot.pop(key)))
                            freed.append((d, "b", dy_slot.pop(key)))
                        if a.stage == 0:
                            b_first[t, d] = True
                        else:
                            dst = self.device_of(a.stage - 1, p)
                            arrivals.append((dst, "b", direction(d, dst, "b"), (a.stage - 1, a.microbatch)))
                    else:
                        cost += BACKWARD_COST - backward_cost
                        in_flight[d] -= 1
                        arrays["w_chunk"][t, d], arrays["w_mb"][t, d] = chunk, a.microbatch
                        arrays["w_src"][t, d] = act_slot.get(key, -1)
                        arrays["w_dy"][t, d] = dy_slot[key]
                        if key in act_slot:
                            freed.append((d, "f", act_slot.pop(key)))
                        freed.append((d, "b", dy_slot.pop(key)))
                busy += cost
                tick_length = max(tick_length, cost)
            length += tick_length
            for d, kind, slot in freed:  # read during this tick, reusable by what arrives after it
                (act if kind == "f" else dys)[d].give(slot)
            for d, kind, table, key in arrivals:
                slots, owner = (act, act_slot) if kind == "f" else (dys, dy_slot)
                owner[key] = arrays[table][t, d] = slots[d].take()
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
        return self.order_with_warmup(num_stages, self.warmup)

    def order_with_warmup(self, num_stages: int, warmup: Callable[[int, int], int]) -> list[list[Action]]:
        """The 1F1B order with ``warmup(device, num_stages)`` forwards before each device's first backward."""
        orders = []
        for d in range(num_stages):
            forward, backward = self._forward_order(d, num_stages), self._backward_order(d, num_stages)
            w = warmup(d, num_stages)
            steady = [a for pair in zip(backward, forward[w:]) for a in pair]
            orders.append(forward[:w] + steady + backward[len(forward) - w:])
        return orders


def _zero_bubble_h1_order(p: int, m: int) -> list[list[Action]]:
    """ZB-H1's order: device ``d`` warms up with ``p - d`` forwards (1F1B's), then runs B, W, F
    with its W's lagging ``d`` micro-batches behind its B's (the last ``d`` W's fill the drain),
    so it holds at most ``p`` micro-batches, 1F1B's peak."""
    orders = []
    for d in range(p):
        warmup = min(m, p - d)
        order = [Action("F", d, mb) for mb in range(warmup)]
        deferred: list[Action] = []
        for mb in range(m):
            order.append(Action("B", d, mb))
            deferred.append(Action("W", d, mb))
            if len(deferred) > d:
                order.append(deferred.pop(0))
            if warmup + mb < m:
                order.append(Action("F", d, warmup + mb))
        orders.append(order + deferred)
    return orders


@dataclasses.dataclass(frozen=True)
class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split into
    the input gradient (B, on the critical path between devices) and the weight gradient (W, which
    nothing waits for); the W's are deferred into the time 1F1B spends waiting, so the bubble
    shrinks from ``(p-1)(F+B)`` to ``(p-1)(F+B-2W)`` (B the whole backward) at 1F1B's memory.
    One chunk per device."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_chunks != 1:
            raise ValueError(f"ZeroBubbleH1(num_chunks={self.num_chunks}): ZB-H1 has one chunk per device")

    @property
    def splits_backward(self) -> bool:
        return True

    def order(self, num_stages: int) -> list[list[Action]]:
        return _zero_bubble_h1_order(num_stages, self.num_microbatches)


@dataclasses.dataclass(frozen=True)
class DualPipeV(Schedule):
    """DeepSeek's DualPipeV: the model cut into ``2 * p`` stages placed as a V over the ``p``
    devices (device ``d`` holds stages ``d`` and ``2p - 1 - d``, so the first and last stage
    share device 0 and the turn of the V is local to device ``p - 1``), with DualPipe's order cut
    in half: forwards of one chunk paired with backwards of the other (``F&B``, whose compute and
    communication overlap on a GPU), and zero-bubble W's in the warm-up and the drain.
    Bubble ``(p - 1)(F&B + B - 3W)`` in the per-stage costs (``PP/2 - 1`` with ``PP = 2p`` stages);
    needs at least ``2p`` micro-batches. ``num_chunks`` is 2 (the V)."""

    num_chunks: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_chunks != 2:
            raise ValueError(f"DualPipeV(num_chunks={self.num_chunks}): the V has two chunks per device")

    @property
    def splits_backward(self) -> bool:
        return True

    def device_of(self, stage: int, num_stages: int) -> int:
        return stage if stage < num_stages else 2 * num_stages - 1 - stage

    def chunk_of(self, stage: int, num_stages: int) -> int:
        return 0 if stage < num_stages else 1

    def units(self, num_stages: int) -> list[list[tuple[Action, ...]]]:
        """Each device's order as units run together: ``(F, B, W)`` an overlapped F&B (a whole
        backward), ``(B, W)`` a whole backward, ``(B,)`` an input gradient whose W is deferred."""
        p, m = num_stages, self.num_microbatches
        if m < 2 * p:
            raise ValueError(f"DualPipeV(num_microbatches={m}): needs at least 2 * pp = {2 * p} micro-batches")
        result = []
        for r in range(p):
            stage = (r, 2 * p - 1 - r)
            next_f, next_b = [0, 0], [0, 0]
            deferred: list[Action] = []
            units: list[tuple[Action, ...]] = []

            def forward(phase):
                next_f[phase] += 1
                return Action("F", stage[phase], next_f[phase] - 1)

            def backward(phase, zero_bubble):
                next_b[phase] += 1
                b, w = Action("B", stage[phase], next_b[phase] - 1), Action("W", stage[phase], next_b[phase] - 1)
                if zero_bubble:
                    deferred.append(w)
                    return (b,)
                return b, w

            units += [(forward(0),) for _ in range(2 * (p - r - 1))]  # 1: chunk-0 warm-up
            for _ in range(r + 1):  # 2: both chunks
                units += [(forward(0),), (forward(1),)]
            for _ in range(p - r - 1):  # 3: zero-bubble 1B1W1F
                units += [backward(1, True), (deferred.pop(0),), (forward(1),)]
            for _ in range(m - 2 * p + r + 1):  # 4: the steady state, F&B pairs of both chunks
                units += [(forward(0), *backward(1, False)), (forward(1), *backward(0, False))]
            for _ in range(p - r - 1):  # 5
                units += [backward(1, False), (forward(1), *backward(0, False))]
            zero_bubble = False
            for i in range(r + 1):  # 6: the drain; its second half defers the W's
                if i == (r + 1) // 2 and r % 2 == 1:
                    zero_bubble = True
                units.append(backward(1, zero_bubble))
                if i == (r + 1) // 2 and r % 2 == 0:
                    zero_bubble = True
                units.append(backward(0, zero_bubble))
            for _ in range(p - r - 1):  # 7
                units += [(deferred.pop(0),), backward(0, True)]
            units += [(w,) for w in deferred]  # 8: the remaining W's
            result.append(units)
        return result

    def order(self, num_stages: int) -> list[list[Action]]:
        return [[a for unit in units for a in unit] for units in self.units(num_stages)]


# --------------------------------------------------------------------------------------------------
# Schedule simulator
# --------------------------------------------------------------------------------------------------

SIMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev")


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What `simulate` found for one schedule.

    Attributes:
      schedule: its name.
      num_stages: pipeline stages the model is cut into (``PP``).
      num_devices: devices they run on.
      num_microbatches: micro-batches.
      makespan: time from the first forward to the last weight gradient.
      bubble: per device, the time it idles within the makespan.
      bubble_fraction: idle share of all devices' time.
      peak_activations: per device, the most (stage, micro-batch) forward activations it holds at
        once (from a forward until that micro-batch's weight gradient at that stage).
    """

    schedule: str
    num_stages: int
    num_devices: int
    num_microbatches: int
    makespan: float
    bubble: tuple[float, ...]
    bubble_fraction: float
    peak_activations: tuple[int, ...]

    def __str__(self) -> str:
        rows = [f"{self.schedule}: {self.num_stages} stages on {self.num_devices} devices, {self.num_microbatches} "
                f"micro-batches: makespan {self.makespan:g}, bubble fraction {self.bubble_fraction:.3f}",
                "  device  bubble  peak activations"]
        rows += [f"  {d:>6}  {b:>6g}  {a:>16}" for d, (b, a) in enumerate(zip(self.bubble, self.peak_activations))]
        return "\n".join(rows)


def _schedule_for(name: str, pp: int, microbatches: int, chunks: int) -> tuple[Schedule, int]:
    """The `Schedule` simulated for ``name`` and the number of devices it runs ``pp`` stages on."""
    def devices(per_device):
        if pp % per_device:
            raise ValueError(f"simulate({name!r}, pp={pp}): {per_device} stages per device need pp divisible by it")
        return pp // per_device

    if name == "gpipe":
        return GPipe(microbatches), pp
    if name == "1f1b":
        return OneFOneB(microbatches), pp
    if name == "interleaved-1f1b":
        return OneFOneB(microbatches, num_chunks=chunks), devices(chunks)
    if name == "zb-h1":
        return ZeroBubbleH1(microbatches), pp
    return DualPipeV(microbatches), devices(2)


def simulate(schedule: str, pp: int, microbatches: int, f: float = 1.0, b: float = 2.0, w: float = 1.0, *,
             f_and_b: float | None = None, chunks: int = 2, verbose: bool = False) -> Simulation:
    """Simulate a pipeline schedule with per-stage costs; returns (and with ``verbose`` prints) its bubble.

    Each device runs its actions in the schedule's order, each as soon as its inputs exist
    (communication is free). ``f``, ``b``, ``w``: the time of one micro-batch's forward, whole
    backward and weight-gradient part of the backward on one stage (zero-bubble schedules run the
    backward as an input gradient of ``b - w`` and a deferred W of ``w``). ``f_and_b``: the time
    of an overlapped forward + backward pair (DualPipeV's F&B; default ``f + b``, no overlap gain).

    Args:
      schedule: one of `SIMULATED_SCHEDULES`: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``
        (``chunks`` stages per device), ``"zb-h1"``, ``"dualpipev"`` (two stages per device).
      pp: pipeline stages the model is cut into (DeepSeek's ``PP``); one per device except for
        interleaved 1F1B (``pp / chunks`` devices) and DualPipeV (``pp / 2`` devices).
      microbatches: micro-batches per step.

    The published bubbles (per device, in these costs) are reproduced: GPipe and 1F1B
    ``(pp-1)(f+b)``, interleaved 1F1B ``(pp/chunks - 1)(f+b)``, ZB-H1 ``(pp-1)(f+b-2w)`` (for
    ``f == b - w == w``, as in the paper), DualPipeV ``(pp/2 - 1)(f_and_b + b - 3w)``.
    """
    check = f"simulate({schedule!r}, pp={pp}, microbatches={microbatches})"
    if schedule not in SIMULATED_SCHEDULES:
        raise ValueError(f"simulate(schedule={schedule!r}): accepted: {', '.join(SIMULATED_SCHEDULES)}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"simulate({name}={value!r}): expected a positive int")
    f_and_b = f + b if f_and_b is None else f_and_b
    if min(f, b, w, f_and_b) < 0 or w > b:
        raise ValueError(f"{check}: costs f={f}, b={b}, w={w}, f_and_b={f_and_b} must be >= 0 with w <= b")
    sched, p = _schedule_for(schedule, pp, microbatches, chunks)
    if isinstance(sched, DualPipeV):
        units = sched.units(p)
    elif isinstance(sched, OneFOneB):
        # One chunk: the classic warm-up of p - d forwards (the lockstep executor's `OneFOneB.warmup`
        # runs about twice that, since its ticks hold an F and a B together).
        def warmup(d, p):
            return min(microbatches, p - d) if sched.num_chunks == 1 else sched.warmup(d, p)

        units = [[(a,) for a in actions] for actions in sched.order_with_warmup(p, warmup)]
    else:
        units = [[(a,) for a in actions] for actions in sched.order(p)]
    split = sched.splits_backward
    v_last = p * sched.num_chunks - 1

    def cost(unit):
        kinds = "".join(a.kind for a in unit)
        if kinds == "FBW":
            return f_and_b
        if kinds == "BW" or (kinds == "B" and not split):
            return b
        return {"F": f, "B": b - w, "W": w}[kinds]

    def dependency(a):
        if a.kind == "F":
            return None if a.stage == 0 else Action("F", a.stage - 1, a.microbatch)
        if a.kind == "W":
            return Action("B", a.stage, a.microbatch)
        return Action("F", a.stage, a.microbatch) if a.stage == v_last else Action("B", a.stage + 1, a.microbatch)

    finish: dict[Action, float] = {}
    position, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    held, peak = [0] * p, [0] * p
    remaining = sum(map(len, units))
    while remaining:
        progressed = False
        for d in range(p):
            while position[d] < len(units[d]):
                unit = units[d][position[d]]
                deps = [dependency(a) for a in unit]
                deps = [x for x in deps if x is not None and x not in unit]
                if any(x not in finish for x in deps):
                    break
                start = max([clock[d]] + [finish[x] for x in deps])
                end = start + cost(unit)
                for a in unit:
                    finish[a] = end
                    if a.kind == "F":
                        held[d] += 1
                        peak[d] = max(peak[d], held[d])
                    elif a.kind == "W" or not split:
                        held[d] -= 1
                clock[d], busy[d] = end, busy[d] + cost(unit)
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise AssertionError(f"{check}: the {schedule} order deadlocks")
    makespan = max(clock)
    result = Simulation(schedule=schedule, num_stages=pp, num_devices=p, num_microbatches=microbatches,
                        makespan=makespan, bubble=tuple(makespan - x for x in busy),
                        bubble_fraction=1.0 - sum(busy) / (p * makespan) if makespan else 0.0,
                        peak_activations=tuple(peak))
    if verbose:
        print(result)
    return result


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
        (``{"params": ..., "fp8_metas": ...}``): the meta's "gradient" is its next value, combined
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
    split = backward and schedule.splits_backward
    # V-shaped placements hand off in both ring directions and to the device itself.
    bidirectional = any((schedule.device_of(v + 1, p) - schedule.device_of(v, p)) % p != 1 for v in range(c * p - 1))
    num_layers = jax.tree.leaves(layer_params)[0].shape[0]
    # [layers, ...] -> [chunks, stages, layers per virtual stage, ...]: virtual stage v = chunk * p + stage.
    # [layers, ...] -> [chunks, stages, layers per virtual stage, ...]: [chunk, device] holds the
    # layers of virtual stage schedule.stage_at(chunk, device) (chunk * p + device but for V shapes).
    placement = np.array([schedule.stage_at(k, d, p) for k in range(c) for d in range(p)])
    identity = bool((placement == np.arange(c * p)).all())

    def to_stages(w):
        blocks = w.reshape(c * p, num_layers // (c * p), *w.shape[1:])
        return (blocks if identity else blocks[placement]).reshape(c, p, *blocks.shape[1:])

    def from_stages(g):
        blocks = g.reshape(c * p, *g.shape[2:])
        return blocks if identity else blocks[np.argsort(placement)]

    staged = jax.tree.map(to_stages, layer_params)
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
        # Each buffer has one extra "dump" row taking the writes of devices with nothing to write,
        # so every tick updates buffers in place.
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

        def put(buffer, slot, dump, value):
            return buffer.at[jnp.where(slot >= 0, slot, dump)].set(value)

        forward_ring, backward_ring = [(i, (i + 1) % p) for i in range(p)], [(i, (i - 1) % p) for i in range(p)]

        def tick(carry, row, *, segment: Segment):
            # Which actions run is static per segment (some device has one at every tick of it):
            # every device runs them, idle ones on a placeholder whose result is dropped, since XLA
            # puts collectives over the automatic axes inside the stages and a collective that only
            # some devices reach never completes. No conditional separates the F, B and W of a
            # tick, so XLA schedules them as one program: one micro-batch's hand-offs (and the
            # stages' own collectives) overlap another's compute.
            any_loss = jnp.any(row["f_loss"])
            row = {k: v[me] for k, v in row.items()}
            carry = dict(carry)
            if segment.forward:
                # Forward: the stage on its stashed input (the pipeline input on virtual stage 0).
                x_f = stage_input(carry["act"], row["f_src"], row["f_mb"])
                y = stage_fn(chunk_of(staged, row["f_chunk"]), x_f).astype(dtype)
                recv_f = lax.ppermute(y, PP, forward_ring)  # in flight while the B and W below compute
                recv_f_rev = lax.ppermute(y, PP, backward_ring) if bidirectional else None
            if segment.loss != "never":
                # On the last virtual stage: the micro-batch's loss and, with backward, its gradients.
                target = chunk_of(ts, row["f_mb"])
                if backward:
                    def with_loss():
                        # The mean over micro-batches is taken here, on the gradient flowing back: FP8
                        # gradient amaxes must see the true gradient, not m times it.
                        value, (g_lp, dy) = jax.value_and_grad(mean_part, argnums=(0, 1))(loss_params, y, target)
                        return value, g_lp, dy.astype(dtype)

                    if segment.loss == "always":
                        value, g_lp, dy = with_loss()
                    else:
                        value, g_lp, dy = lax.cond(any_loss, with_loss, lambda: (zero, loss_grad_zeros, mb_zeros))
                    carry["loss_grads"] = accumulate_gradients(carry["loss_grads"], masked(row["f_loss"], g_lp))
                    carry["dy"] = carry["dy"].at[jnp.where(row["f_loss"], row["f_dy"], dump_dy)].set(dy)
                elif segment.loss == "always":
                    value = mean_part(loss_params, y, target)
                else:
                    value = lax.cond(any_loss, lambda: mean_part(loss_params, y, target), lambda: zero)
                carry["loss"] = carry["loss"] + jnp.where(row["f_loss"], value, 0.0)
            if segment.backward:
                # Backward: recompute the stage from its stashed input and apply its vjp.
                x_b = stage_input(carry["act"], row["b_src"], row["b_mb"])
                dy_b = carry["dy"][jnp.maximum(row["b_dy"], 0)]
                if split:  # the input gradient only; the W action computes the weights' later
                    _, vjp = jax.vjp(lambda h: stage_fn(chunk_of(staged, row["b_chunk"]), h), x_b)
                    g_x = vjp(dy_b)[0].astype(dtype)
                else:
                    _, vjp = jax.vjp(stage_fn, chunk_of(staged, row["b_chunk"]), x_b)
                    g_params, g_x = vjp(dy_b)
                    g_x = g_x.astype(dtype)
                carry["dx"] = carry["dx"].at[jnp.where(row["b_first"], row["b_mb"], m)].set(g_x)
                # Hand-off to the previous device, in flight during the W below (stored after it:
                # an arrival may take the slot the W reads).
                recv_b = lax.ppermute(g_x, PP, backward_ring)
                recv_b_rev = lax.ppermute(g_x, PP, forward_ring) if bidirectional else None
            if segment.weights:
                x_w = stage_input(carry["act"], row["w_src"], row["w_mb"])
                dy_w = carry["dy"][jnp.maximum(row["w_dy"], 0)]
                _, vjp = jax.vjp(lambda prm: stage_fn(prm, x_w), chunk_of(staged, row["w_chunk"]))
                g_params = vjp(dy_w)[0]
            if segment.weights or (segment.backward and not split):
                grad_chunk, grad_mb = (row["w_chunk"], row["w_mb"]) if split else (row["b_chunk"], row["b_mb"])
                chunk = jnp.maximum(grad_chunk, 0)
                acc = accumulate_gradients(chunk_of(carry["grads"], chunk), masked(grad_mb >= 0, g_params))
                carry["grads"] = jax.tree.map(
                    lambda all_chunks, a: lax.dynamic_update_index_in_dim(all_chunks, a, chunk, 0), carry["grads"], acc)
            # Arrivals, after every read of this tick (what a device does not expect goes to its dump slot).
            if segment.backward:
                carry["dy"] = put(carry["dy"], row["recv_b"], dump_dy, recv_b)
                if bidirectional:
                    carry["dy"] = put(carry["dy"], row["recv_b_rev"], dump_dy, recv_b_rev)
                    carry["dy"] = put(carry["dy"], row["recv_b_self"], dump_dy, g_x)
            if segment.forward:
                carry["act"] = put(carry["act"], row["recv_f"], dump_act, recv_f)
                if bidirectional:
                    carry["act"] = put(carry["act"], row["recv_f_rev"], dump_act, recv_f_rev)
                    carry["act"] = put(carry["act"], row["recv_f_self"], dump_act, y)
            return carry, None

        for segment in timeline.segments():
            rows = {k: v[segment.start:segment.stop] for k, v in table.items()}
            carry, _ = lax.scan(functools.partial(tick, segment=segment), carry, rows)
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
    layer_grads = jax.tree.map(lambda g, w: from_stages(g).reshape(w.shape).astype(w.dtype), layer_grads, layer_params)
    return loss, (layer_grads, _merge_microbatches(dx).astype(inputs.dtype), loss_grads)


def main(argv: list[str] | None = None) -> int:
    """``python -m mtjax.sharding.pipeline [SCHEDULE ...] --pp 8 --microbatches 32 --f 1 --b 2 --w 1``:
    print `simulate`'s result for each schedule (default: all of `SIMULATED_SCHEDULES`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mtjax.sharding.pipeline", description=main.__doc__.splitlines()[0])
    parser.add_argument("schedules", nargs="*", choices=[[], *SIMULATED_SCHEDULES], metavar="SCHEDULE",
                        help=f"from {SIMULATED_SCHEDULES} (default: all)")
    parser.add_argument("--pp", type=int, default=8, help="pipeline stages (default %(default)s)")
    parser.add_argument("--microbatches", type=int, default=32, help="micro-batches (default %(default)s)")
    parser.add_argument("--f", type=float, default=1.0, help="forward time of one stage (default %(default)s)")
    parser.add_argument("--b", type=float, default=2.0, help="whole backward time of one stage (default %(default)s)")
    parser.add_argument("--w", type=float, default=1.0, help="weight-gradient part of --b (default %(default)s)")
    parser.add_argument("--f-and-b", type=float, default=None, help="overlapped F&B time (default f + b)")
    parser.add_argument("--chunks", type=int, default=2, help="stages per device of interleaved 1F1B")
    args = parser.parse_args(argv)
    for name in args.schedules or SIMULATED_SCHEDULES:
        try:
            simulate(name, args.pp, args.microbatches, args.f, args.b, args.w, f_and_b=args.f_and_b,
                     chunks=args.chunks, verbose=True)
        except ValueError as err:
            print(f"{name}: {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
