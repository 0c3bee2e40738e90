"""A device mesh laid over the two networks of a GPU cluster.

Each mesh axis (data, fsdp, context, tensor, pipeline) is split into a part inside a node,
where the GPUs share NVLink, and a part across nodes, over InfiniBand. Axes are placed
innermost first - tensor, then context, then fsdp, then data, then pipeline - because
tensor parallelism sends the most bytes per step, and pipeline parallelism only one
micro-batch's activations per stage boundary, so the fastest network goes to the most
demanding axis (the Megatron-LM and MaxText convention: pipeline stages across nodes).
Context parallelism (parallelism/context.py) comes next to tensor: its K/V all-gather
and the reduce-scatter of their gradients sit inside every layer's attention, on the
critical path like tensor parallelism's collectives though with fewer bytes (2 G K per
token against tensor's few D), while FSDP's weight gathers can be issued a layer ahead.
Megatron-Core orders its groups the same way ("tp-cp-ep-dp-pp",
megatron/core/parallel_state.py `initialize_model_parallel`).

On a multi-process run the process is the node (`create_hybrid_device_mesh` with
`process_is_granule=True`). On one host the local devices are grouped into emulated
nodes, so the same two-level layout is exercised on CPU.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from errors import UserInputError

# pipeline is last so that data stays axis 0, which projection/layout.py relies on.
AXES = ("data", "fsdp", "expert", "context", "tensor", "pipeline")
# Filled from the innermost (fastest network) axis outwards. Expert parallelism's
# all-to-alls (every routed layer, forward and backward, on the critical path) go next to
# context, inside fsdp: Megatron-Core's "tp-cp-ep-dp-pp".
_INNER_FIRST = ("tensor", "context", "expert", "fsdp", "data", "pipeline")
# How devices are numbered over the mesh, slowest-varying axis first, node after node (the
# axes' InfiniBand parts) and inside a node (their NVLink parts): data outermost, so that
# a model replica (every axis but data) holds consecutive nodes (projection/layout.py's
# rack alignment), and inside a replica the axes innermost-first as _INNER_FIRST places
# them on NVLink, pipeline outermost. It decides which nodes share an NVLink domain that
# spans nodes (an NVL72 rack of 18 trays of 4): in AXES order pipeline would be the
# fastest-varying node axis, and a rack of 16 trays would hold the 4 pipeline stages of a
# quarter of an expert group of 32 x tensor 2 (DeepSeek-V3 on 512 GB200) instead of the
# whole group, putting every expert all-to-all across four racks over InfiniBand.
NUMBERING = ("data", "pipeline", "fsdp", "expert", "context", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # -1: every device the other axes leave
  fsdp: int = 1
  # Expert parallelism: the routed experts split over this many ranks, which are
  # data-parallel for everything else (the batch splits over data x fsdp x expert).
  expert: int = 1
  # Context parallelism: each sequence split over this many ranks (parallelism/context.py).
  context: int = 1
  tensor: int = 1
  pipeline: int = 1  # pipeline stages (train.pipeline_schedule runs them)
  # Devices per node (the InfiniBand granule); 0: the local device count of one process
  # on GPUs, half the devices (two emulated nodes) on a single host.
  devices_per_node: int = 0
  # Devices that share one NVLink domain; 0: a node (HGX). NVL72 racks span nodes.
  nvlink_domain: int = 0
  # Tensor parallelism over InfiniBand is almost always a mistake: refuse it unless asked.
  allow_tensor_beyond_nvlink: bool = False
  # Likewise expert parallelism, whose all-to-alls run in every routed layer.
  allow_expert_beyond_nvlink: bool = False


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """Axis sizes and how each splits over NVLink (inside a node) and InfiniBand."""

  sizes: dict[str, int]
  nvlink: dict[str, int]
  infiniband: dict[str, int]
  devices_per_node: int
  nvlink_domain: int

  @property
  def devices(self) -> int:
    return math.prod(self.sizes.values())

  @property
  def nodes(self) -> int:
    return self.devices // self.devices_per_node

  def describe(self) -> list[str]:
    return [
      f"{axis:>8} {self.sizes[axis]:>5} = {self.nvlink[axis]} NVLink x "
      f"{self.infiniband[axis]} InfiniBand"
      for axis in AXES
    ]


def default_devices_per_node(num_devices: int) -> int:
  if jax.process_count() > 1:
    # A process is a node; each brings the same share of the devices (--devices is per process).
    return num_devices // jax.process_count()
  if jax.default_backend() == "cpu" and num_devices > 1 and num_devices % 2 == 0:
    return num_devices // 2
  return num_devices


def plan(cfg: MeshConfig, num_devices: int) -> MeshLayout:
  """Resolve -1, check the sizes and split each axis over the two networks."""
  sizes = {axis: getattr(cfg, axis) for axis in AXES}
  for axis, size in sizes.items():
    if size == 0 or size < -1:
      raise UserInputError(f"mesh.{axis} must be a positive integer or -1, got {size}")
  free = [axis for axis, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise UserInputError(f"mesh: only one axis may be -1, got {', '.join(free)}")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if num_devices % fixed:
      raise UserInputError(
        f"mesh.{free[0]}: the other axes ({fixed}) do not divide the {num_devices} devices"
      )
    sizes[free[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise UserInputError(
      f"mesh: data x fsdp x expert x context x tensor x pipeline = "
      f"{math.prod(sizes.values())} "
      f"must equal the {num_devices} devices"
    )

  per_node = cfg.devices_per_node or default_devices_per_node(num_devices)
  if per_node < 1 or num_devices % per_node:
    raise UserInputError(
      f"mesh.devices_per_node must divide the {num_devices} devices, got {per_node}"
    )
  domain = cfg.nvlink_domain or per_node
  if domain % sizes["tensor"] and not cfg.allow_tensor_beyond_nvlink:
    raise UserInputError(
      f"mesh.tensor {sizes['tensor']} does not fit in the NVLink domain "
      f"of {domain} devices (it must divide it); set "
      f"mesh.allow_tensor_beyond_nvlink=true if that is intended"
    )
  # An expert group spans its tensor and context ranks too (they are inner to it).
  expert_span = sizes["expert"] * sizes["context"] * sizes["tensor"]
  if sizes["expert"] > 1 and domain % expert_span and not cfg.allow_expert_beyond_nvlink:
    raise UserInputError(
      f"mesh.expert {sizes['expert']} (x context {sizes['context']} x tensor "
      f"{sizes['tensor']} = {expert_span} devices) does not fit in the NVLink domain of "
      f"{domain} devices (it must divide it); set mesh.allow_expert_beyond_nvlink=true "
      "if that is intended"
    )

  nvlink, remaining = {}, per_node
  for axis in _INNER_FIRST:
    nvlink[axis] = math.gcd(sizes[axis], remaining)
    remaining //= nvlink[axis]
  if remaining != 1:
    shape = ", ".join(f"{axis} {sizes[axis]}" for axis in AXES)
    raise UserInputError(f"mesh: the axes cannot tile a node of {per_node} devices ({shape})")
  infiniband = {axis: sizes[axis] // nvlink[axis] for axis in AXES}
  return MeshLayout(sizes, {a: nvlink[a] for a in AXES}, infiniband, per_node, domain)


def device_grid(layout: MeshLayout, devices: Sequence) -> np.ndarray:
  """Arrange devices, node after node, into the mesh's shape.

  devices are ordered node-major: devices[n * per_node + i] is device i of node n; nodes
  and the devices inside a node are numbered in NUMBERING order (slowest axis first).
  Mesh coordinate along an axis = infiniband_index * nvlink_size + nvlink_index,
  the same convention as `create_hybrid_device_mesh`.
  """
  outer = [layout.infiniband[a] for a in NUMBERING]
  inner = [layout.nvlink[a] for a in NUMBERING]
  grid = np.asarray(devices, dtype=object).reshape(outer + inner)  # [o_d, o_p, ..., i_d, i_p, ...]
  n = len(AXES)
  # Back to AXES order, each axis's InfiniBand part before its NVLink part.
  interleaved = [i for a in AXES for i in (NUMBERING.index(a), NUMBERING.index(a) + n)]
  return grid.transpose(interleaved).reshape([layout.sizes[a] for a in AXES])


def process_grid(layout: MeshLayout, devices: Sequence) -> np.ndarray:
  """As device_grid on a multi-process run, each process a node (`create_hybrid_device_mesh`,
  which numbers its granules in the order of the shapes given: NUMBERING's)."""
  grid = mesh_utils.create_hybrid_device_mesh(
    [layout.nvlink[a] for a in NUMBERING],
    [layout.infiniband[a] for a in NUMBERING],
    devices,
    process_is_granule=True,
  )
  return grid.transpose([NUMBERING.index(a) for a in AXES])


def build_mesh(layout: MeshLayout, devices: Sequence | None = None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices()[: layout.devices])
  if jax.process_count() > 1:
    grid = process_grid(layout, devices)
  else:
    grid = device_grid(layout, devices)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
