"""The target of a projection: the GPU generation and the experiment's mesh laid over its
cluster, with the reduced mesh that compiles here (projection/layout.py). A mode plans a
point once and hands the `Target` to projection/project.py's `project`."""

import dataclasses

from errors import UserInputError
from hardware import catalog
from hardware.catalog import Hardware
from parallelism.mesh import MeshConfig
from projection import layout


@dataclasses.dataclass(frozen=True)
class Target:
  """`gpus` GPUs of `hardware`, the experiment laid out on them as `reduced.target` and
  compiled as `reduced`."""

  hardware: Hardware
  reduced: layout.ReducedMesh

  @property
  def gpus(self) -> int:
    return self.reduced.target.devices


def plan(exp, hw: Hardware, gpus: int) -> Target:
  """`exp` on `gpus` GPUs of `hw`; bad input raises before anything compiles."""
  formats = exp.model.block_scaling
  if formats != "none" and hw.name in catalog.names() and formats not in hw.block_scaled_formats:
    blackwell = [h for h in catalog.names() if formats in catalog.get(h).block_scaled_formats]
    raise UserInputError(
      f"model.block_scaling = {formats}: {hw.name} has no block-scaled tensor cores "
      f"(GPUs that do: {', '.join(blackwell)}); use precision=fp8 or bf16"
    )
  try:
    domain = layout.rack_aligned_domain(exp.mesh, gpus, hw.gpus_per_node, hw.nvlink_domain_size)
    target = layout.target_layout(exp.mesh, gpus, hw.gpus_per_node, domain)
    return Target(hw, layout.reduce(target, exp.train))
  except UserInputError as e:
    raise UserInputError(f"--gpus {gpus} on {hw.name}: {e}") from None


def check_gpus(hw: Hardware, gpus: int) -> None:
  """`gpus` is a whole number of `hw`'s nodes (whatever the mesh laid over them)."""
  layout.target_layout(MeshConfig(), gpus, hw.gpus_per_node, hw.nvlink_domain_size)
