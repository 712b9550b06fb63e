"""Device meshes: `MeshConfig` says how many ways each kind of parallelism splits the devices.

Mesh axes (names shared by the whole library, see `AXES`), from the outermost to the innermost:

- ``pp``: pipeline stages (`mtjax.sharding.pipeline`); neighbours exchange activations only.
- ``dp``: data parallelism; the batch is split, weights are replicated (one gradient all-reduce).
- ``fsdp``: fully sharded data parallelism; the batch *and* the weights are split, weights are
  all-gathered layer by layer and their gradients reduce-scattered.
- ``cp``: context parallelism; the sequence of every activation is split, attention passes the
  keys and values between the shards (`mtjax.ops.ring_attention` / `all_gather_attention`).
- ``ep``: expert parallelism; each device holds ``num_experts / ep`` of a mixture-of-experts
  layer's experts and the tokens travel to their experts' devices and back (all-to-all,
  `mtjax.sharding.expert`); the batch is split over ``ep`` as well, so outside the expert MLPs it
  acts as one more data-parallel axis.
- ``tp``: tensor parallelism (Megatron layout); with ``sp`` the sequence of the activations
  between the attention and MLP blocks is split over the same devices.

The innermost axis varies fastest over the device list, so ``tp``, the most communication-hungry
axis, gets neighbouring devices (the same NVLink domain or host) and ``pp`` the farthest ones.

The mesh uses *automatic* axes (``AxisType.Auto``) deliberately: the model code only annotates
parameters and activations with logical names (``nn.with_logical_partitioning`` /
``nn.with_logical_constraint``) and XLA's partitioner propagates the rest, inserting the
collectives. Explicit axes (the default of ``jax.make_mesh`` since jax 0.7) would make every
array's sharding part of its type, so each jnp op of every layer would have to resolve sharding
ambiguities itself, and ``shard_map`` would demand inputs already laid out as its ``in_specs``.
The pipeline's ``shard_map`` makes only ``pp`` manual and leaves the other axes automatic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh

from mtjax.axes import MeshResource

# Mesh axis names, outermost first; the rules in `mtjax.sharding.rules` name axes only through these.
PP, DP, FSDP, EP, CP, TP = "pp", "dp", "fsdp", "ep", "cp", "tp"
AXES = (PP, DP, FSDP, EP, CP, TP)
# The mesh axes that split the batch.
BATCH_AXES = (DP, FSDP, EP)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """How the devices are split between the kinds of parallelism.

    The product ``pp * dp * fsdp * ep * cp * tp`` must equal the number of devices the mesh is built over.

    Attributes:
      dp: data-parallel ways (batch split, weights replicated).
      fsdp: fully-sharded data-parallel ways (batch split, weights split and gathered per layer).
      ep: expert-parallel ways (mixture-of-experts layers: experts split, tokens exchanged
        all-to-all; the batch is split too). Must divide the models' ``num_experts``.
      tp: tensor-parallel ways (Megatron: heads and MLP columns split).
      sp: sequence parallelism on the ``tp`` axis: norms, dropout and residuals keep the sequence
        split over ``tp`` (all-gather before the column-parallel GEMM, reduce-scatter after the
        row-parallel one instead of an all-reduce).
      pp: pipeline stages (the ``layers`` axis of scanned layer parameters is split over them).
      cp: context-parallel ways (the sequence of the activations split; attention through
        ``context_parallel="ring"`` or ``"all_gather"`` of `mtjax.flax.DotProductAttention`).
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    ep: int = 1
    sp: bool = False
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshConfig({name}={value!r}): expected a positive int")
        if not isinstance(self.sp, bool):
            raise TypeError(f"MeshConfig(sp={self.sp!r}): expected a bool")

    @property
    def shape(self) -> dict[str, int]:
        """``{axis name: size}`` in mesh order (outermost first)."""
        return {name: getattr(self, name) for name in AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape.values())

    def mesh_resource(self) -> MeshResource:
        """The roles of this mesh's axes (``tpsp_resource="tp"`` with ``sp``, else ``tp_resource``)."""
        return MeshResource(dp_resource=DP, tp_resource=None if self.sp else TP, tpsp_resource=TP if self.sp else None,
                            fsdp_resource=FSDP, pp_resource=PP, cp_resource=CP, ep_resource=EP)

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        """A `Mesh` with automatic axes ``("pp", "dp", "fsdp", "ep", "cp", "tp")`` over ``devices``.

        Args:
          devices: the devices to use; default ``jax.devices()``, i.e. every device of every host.
        """
        devices = list(jax.devices() if devices is None else devices)
        if self.num_devices != len(devices):
            sizes = " * ".join(f"{name}={size}" for name, size in self.shape.items())
            raise ValueError(
                f"MeshConfig: {sizes} = {self.num_devices} devices, but {len(devices)} are "
                f"available; choose sizes whose product is {len(devices)}"
            )
        return jax.make_mesh(
            tuple(self.shape.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices
        )


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Iterator[Mesh]:
    """Trace under ``mesh`` and the logical-axis ``rules``: what the modules' annotations resolve against.

    Both are read when a function is *traced*, so wrap the first call of a jitted function (or
    use `mtjax.sharding.jit_sharded`, which does this on every call).
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield mesh
