"""Where each device of a target cluster sits, and the reduced mesh that stands in for it.

A 10,752-GPU mesh does not compile on this machine, and it need not: every device of a
data-parallel replica runs the same program. So the step is compiled on a *reduced*
mesh that keeps every model-parallel axis (fsdp, tensor) at its target size and shrinks
the data axis to at most `REDUCED_DATA` replicas, with the global batch shrunk alike so
each device's work is unchanged. Collectives whose replica groups run along the data
axis are then re-placed on the full cluster (`target_group_domains`).

Devices of the target are numbered node-major (node n holds n * gpus_per_node ...), as
`parallelism.mesh.device_grid` lays them out; a device's NVLink domain is its number
divided by the domain size (a node on HGX, 18 nodes of 4 on NVL72).
"""

import dataclasses
import math

import numpy as np

from errors import UserInputError
from parallelism.mesh import AXES, MeshConfig, MeshLayout, plan

# Two replicas keep the data-axis collectives in the compiled program (one would drop
# them) at the smallest compile cost.
REDUCED_DATA = 2


@dataclasses.dataclass(frozen=True)
class ReducedMesh:
  target: MeshLayout
  sizes: dict[str, int]          # the compiled mesh: data shrunk, the rest as the target
  global_batch: int              # the compiled program's batch (same per-device batch)

  @property
  def devices(self) -> int:
    return math.prod(self.sizes.values())


def target_layout(mesh_cfg: MeshConfig, gpus: int, gpus_per_node: int,
                  nvlink_domain: int) -> MeshLayout:
  if gpus % gpus_per_node:
    raise UserInputError(f"not a whole number of {gpus_per_node}-GPU nodes")
  cfg = dataclasses.replace(mesh_cfg, devices_per_node=gpus_per_node, nvlink_domain=nvlink_domain)
  return plan(cfg, gpus)


def reduce(target: MeshLayout, global_batch: int) -> ReducedMesh:
  data = target.sizes["data"]
  reduced_data = math.gcd(data, REDUCED_DATA)
  replicas = target.sizes["data"] * target.sizes["fsdp"]
  if global_batch % replicas:
    raise UserInputError(f"train.global_batch = {global_batch} does not divide over the "
                         f"{replicas} data x fsdp replicas of {target.devices} GPUs")
  return ReducedMesh(target, {**target.sizes, "data": reduced_data},
                     global_batch // data * reduced_data)


def _device_index(coords: np.ndarray, layout: MeshLayout) -> np.ndarray:
  """Node-major device numbers of mesh coordinates [..., len(AXES)] on `layout`."""
  nv = np.array([layout.nvlink[a] for a in AXES])
  ib = np.array([layout.infiniband[a] for a in AXES])
  node = np.ravel_multi_index(tuple((coords // nv).T), ib)
  local = np.ravel_multi_index(tuple((coords % nv).T), nv)
  return node * layout.devices_per_node + local


def target_group_domains(group: tuple[int, ...], reduced: ReducedMesh) -> tuple[int, ...]:
  """NVLink domain of each member of one compiled replica group, placed on the target.

  Partition p of the compiled program is the reduced mesh's device p in row-major
  (data, fsdp, tensor) order. A group that runs along the data axis grows from the
  reduced data size to the target's; any other group keeps its members.
  """
  shape = [reduced.sizes[a] for a in AXES]
  coords = np.stack(np.unravel_index(np.asarray(group), shape), axis=-1)  # [members, 3]
  target = reduced.target
  if len(set(coords[:, 0])) > 1 and target.sizes["data"] > reduced.sizes["data"]:
    others = np.unique(coords[:, 1:], axis=0)                              # [m, 2]
    data = np.arange(target.sizes["data"])
    coords = np.concatenate([np.broadcast_to(data[:, None, None], (len(data), len(others), 1)),
                             np.broadcast_to(others, (len(data), *others.shape))],
                            axis=-1).reshape(-1, len(AXES))
  devices = _device_index(coords, target)
  return tuple((devices // target.nvlink_domain).tolist())


def group_growth(group: tuple[int, ...], reduced: ReducedMesh) -> float:
  """Target group size over compiled group size (1 unless the group runs along data)."""
  shape = [reduced.sizes[a] for a in AXES]
  data_coords = np.unravel_index(np.asarray(group), shape)[0]
  if len(set(data_coords.tolist())) > 1:
    return reduced.target.sizes["data"] / reduced.sizes["data"]
  return 1.0
