"""Where each device of a target cluster sits, and the reduced program that stands in for it.

A 10,752-GPU mesh does not compile on this machine, and it need not: every device of a
data-parallel replica runs the same program. So the step is compiled on a *reduced*
mesh that keeps every model-parallel axis (fsdp, tensor) at its target size and shrinks
the data axis to `REDUCED_DATA` replicas (or one, if the target has one), with the global
batch shrunk alike so each device's work is unchanged. Collectives whose replica groups
run along the data axis are then re-placed on the full cluster (`target_group_domains`).

With gradient accumulation the compiled program runs `COMPILED_MICRO_BATCHES`
micro-batches, not the target's count: the accumulation loop's body is the same program
whatever its trip count, so the projection sets the trip count to the target's
(projection/step_loops.py). Every GPU count of one experiment and GPU generation then
shares one compile.

Devices of the target are numbered node-major (node n holds n * gpus_per_node ...), as
`parallelism.mesh.device_grid` lays them out; a device's NVLink domain is its number
divided by the domain size (a node on HGX, 18 nodes of 4 on NVL72).
"""

import dataclasses
import math

import numpy as np

from errors import UserInputError
from parallelism.mesh import AXES, NUMBERING, MeshConfig, MeshLayout, plan
from projection.hlo_text import Groups
from train.config import TrainConfig

# Two replicas keep the data-axis collectives in the compiled program (one would drop
# them) at the smallest compile cost, and every target data size from 2 up (odd ones too)
# grows from two. A target with one replica compiles with one, since its program is not
# the two-replica one minus the data collectives: XLA fuses and schedules the gradient
# reduction differently without them (step time 0.5% apart for GPT-3 175B on 64 H100s,
# 10% for a small model whose step is mostly kernel launches).
REDUCED_DATA = 2
# Two micro-batches keep gradient accumulation a loop (one would be a straight-line step
# with no loop to extend) at the smallest compile cost.
COMPILED_MICRO_BATCHES = 2


@dataclasses.dataclass(frozen=True)
class ReducedMesh:
  target: MeshLayout
  sizes: dict[str, int]  # the compiled mesh: data shrunk, the rest as the target
  global_batch: int  # the compiled program's batch (same per-device micro-batch)
  micro_batches: int  # accumulated micro-batches per step on the target (1: none)
  compiled_micro_batches: int  # and in the compiled program

  @property
  def devices(self) -> int:
    return math.prod(self.sizes.values())


def target_layout(
  mesh_cfg: MeshConfig, gpus: int, gpus_per_node: int, nvlink_domain: int
) -> MeshLayout:
  if gpus % gpus_per_node:
    raise UserInputError(f"--gpus {gpus} is not a whole number of {gpus_per_node}-GPU nodes")
  cfg = dataclasses.replace(mesh_cfg, devices_per_node=gpus_per_node, nvlink_domain=nvlink_domain)
  return plan(cfg, gpus)


def rack_aligned_domain(
  mesh_cfg: MeshConfig, gpus: int, gpus_per_node: int, nvlink_domain: int
) -> int:
  """GPUs used per NVLink domain so that model replicas do not straddle racks.

  On HGX the domain is a node and nothing straddles. An NVL72 rack holds 18 trays of 4;
  numbering devices rack after rack, 64-GPU model replicas would straddle racks (rack 1
  holds the end of replica 1 and the start of replica 2), and a straddling replica's
  fsdp and tensor collectives cross InfiniBand (GPT-3 175B, fsdp 8 x tensor 8 on 512
  GB200: 44.5 s a step straddling, 15.5 s aligned). So each rack runs as many whole
  trays as make its GPU count a multiple or a divisor of one model replica (every axis
  but data; a replica's devices are consecutive when data has no NVLink part, as on
  4-GPU trays), the most such trays, leaving the rest of the rack idle (64 of 72 GPUs
  for 32- or 64-GPU replicas; all 72 for tensor 8 alone). A layout decision of this
  project (a scheduler can place jobs this way), not a published deployment rule.
  """
  if nvlink_domain <= gpus_per_node:
    return nvlink_domain
  # The axis sizes only; target_layout checks the layout on the domain chosen here.
  sizes = plan(
    dataclasses.replace(
      mesh_cfg,
      devices_per_node=gpus_per_node,
      nvlink_domain=nvlink_domain,
      allow_tensor_beyond_nvlink=True,
      allow_expert_beyond_nvlink=True,
    ),
    gpus,
  ).sizes
  block = math.prod(sizes.values()) // sizes["data"]
  return max(
    d
    for d in range(gpus_per_node, nvlink_domain + 1, gpus_per_node)
    if d % block == 0 or block % d == 0
  )


def reduce(target: MeshLayout, train_cfg: TrainConfig) -> ReducedMesh:
  """The compiled stand-in for `target`; bad batch sizes raise UserInputError."""
  # Expert-parallel ranks are data-parallel outside the experts (parallelism/rules.py).
  expert = target.sizes.get("expert", 1)
  replicas = target.sizes["data"] * target.sizes["fsdp"] * expert
  if train_cfg.global_batch % replicas:
    raise UserInputError(
      f"train.global_batch = {train_cfg.global_batch} does not divide over "
      f"the {replicas} data x fsdp x expert replicas of {target.devices} GPUs"
    )
  per_replica = train_cfg.global_batch // replicas
  micro_batches, compiled = 1, 1
  if train_cfg.micro_batch:
    if per_replica % train_cfg.micro_batch:
      raise UserInputError(
        f"train.micro_batch = {train_cfg.micro_batch} does not divide the "
        f"{per_replica} sequences per data-parallel replica of "
        f"{target.devices} GPUs"
      )
    micro_batches = per_replica // train_cfg.micro_batch
    # A target without accumulation (one micro-batch) compiles as it runs, loop-free. A
    # pipelined one compiles all its micro-batches: its embedding, head and micro-batch
    # buffer sit outside the pipeline loop and grow with their count (and interleaving
    # needs at least as many as stages); compile time hardly depends on it.
    compiled = micro_batches
    if target.sizes.get("pipeline", 1) == 1:
      compiled = min(micro_batches, COMPILED_MICRO_BATCHES)
    per_replica = train_cfg.micro_batch * compiled
  sizes = {**target.sizes, "data": min(target.sizes["data"], REDUCED_DATA)}
  return ReducedMesh(
    target, sizes, per_replica * sizes["data"] * sizes["fsdp"] * expert, micro_batches, compiled
  )


def _device_index(coords: np.ndarray, layout: MeshLayout) -> np.ndarray:
  """Node-major device numbers of mesh coordinates [..., len(AXES)] on `layout`, nodes and
  the devices inside one numbered in NUMBERING order (`parallelism.mesh.device_grid`)."""
  order = [AXES.index(a) for a in NUMBERING]
  coords = coords[..., order]
  nv = np.array([layout.nvlink[a] for a in NUMBERING])
  ib = np.array([layout.infiniband[a] for a in NUMBERING])
  node = np.ravel_multi_index(tuple(np.moveaxis(coords // nv, -1, 0)), ib)
  local = np.ravel_multi_index(tuple(np.moveaxis(coords % nv, -1, 0)), nv)
  return node * layout.devices_per_node + local


def _coords(groups: Groups, reduced: ReducedMesh) -> np.ndarray:
  """Reduced-mesh coordinates [groups, members, len(AXES)] of one collective's groups.

  Partition p of the compiled program is the reduced mesh's device p in row-major
  AXES order (data first).
  """
  shape = [reduced.sizes[a] for a in AXES]
  return np.stack(np.unravel_index(np.asarray(groups), shape), axis=-1)


def _spans_data(coords: np.ndarray) -> bool:
  """Whether a mesh collective runs along data (its groups all run along the same axes)."""
  return len(np.unique(coords[0, :, 0])) > 1


def target_group_domains(groups: Groups, reduced: ReducedMesh) -> list[tuple[int, ...]]:
  """The NVLink domains of the members of the target's replica groups that one compiled
  collective's `groups` stand for: one tuple (a group's members' domains) per distinct
  placement.

  A group that runs along the data axis grows from the reduced data size to the
  target's; any other group stands for the same group in every target data replica.
  Groups of one collective are not all placed alike when the NVLink domain does not
  align with the mesh (64-GPU replicas on 72-GPU NVL72 racks: some straddle two racks),
  and the slowest one gates the step, so every distinct placement is returned.
  """
  coords = _coords(groups, reduced)  # [g, m, len(AXES)]
  target = reduced.target
  data = np.arange(target.sizes["data"])
  if _spans_data(coords):
    # Each group's other-axis members, as found at data index 0, at every data index.
    rest = len(AXES) - 1
    others = coords[coords[:, :, 0] == 0][:, 1:].reshape(len(coords), -1, 1, rest)
    grid = np.broadcast_to(data[None, None, :, None], (*others.shape[:2], len(data), 1))
    coords = np.concatenate([grid, np.broadcast_to(others, (*grid.shape[:3], rest))], axis=-1)
    coords = coords.reshape(len(others), -1, len(AXES))
  else:
    base = coords[coords[:, 0, 0] == 0]  # data replica 0's
    coords = np.broadcast_to(base, (len(data), *base.shape)).copy()
    coords[..., 0] = data[:, None, None]
    coords = coords.reshape(-1, *base.shape[1:])
  domains = np.sort(_device_index(coords, target) // target.nvlink_domain, axis=-1)
  # A collective's cost depends on how many members share each domain; groups whose
  # sorted domains change at the same positions share that.
  _, first = np.unique(np.diff(domains, axis=-1) != 0, axis=0, return_index=True)
  return [tuple(domains[i].tolist()) for i in sorted(first)]


def axes_of(groups: Groups, reduced: ReducedMesh) -> str:
  """The mesh axes a compiled collective runs along, "+"-joined in AXES order ("data",
  "tensor+pipeline", ...): those on which members of a group (or a permute's source and
  target) differ; "none" for groups of one."""
  coords = [_coords((g,), reduced)[0] for g in groups]
  return (
    "+".join(a for i, a in enumerate(AXES) if any(len(set(c[:, i].tolist())) > 1 for c in coords))
    or "none"
  )
