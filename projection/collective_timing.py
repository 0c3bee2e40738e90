"""The compiled program's collectives on the target cluster: each one's time with its
replica groups placed on the full cluster (projection/layout.py) and costed
(projection/collectives.py), and the step's exposed communication by the mesh axes the
collectives run along.
"""

from collections.abc import Callable

from hardware.catalog import Hardware
from projection import collectives, cost_model, hlo, hlo_text, layout


def collective_timer(
  reduced: layout.ReducedMesh, hw: Hardware
) -> Callable[[hlo.Collective], float]:
  """Seconds for one compiled collective on the target: its slowest replica group's time.
  Placements and times are cached: a program repeats a few collectives many times."""
  domains_of: dict[hlo_text.Groups, list[tuple[int, ...]]] = {}
  times: dict[tuple, float] = {}

  def time_s(node: hlo.Collective) -> float:
    groups = node.pairs if node.kind == "collective-permute" else node.groups
    if not groups:
      return 0.0
    if groups not in domains_of:
      domains_of[groups] = layout.target_group_domains(groups, reduced)
    # Along `data` only the groups grow; per-device bytes stay as compiled: all-reduces and
    # reduce-scatters of gradients, and all-gathers of parameters (train.shard_optimizer),
    # whose output is the whole parameter at any data size.
    key = (node.kind, node.bytes, groups, node.operands)
    if key not in times:
      times[key] = max(
        collectives.collective_time_s(node.kind, node.bytes, group, hw, node.operands)
        for group in domains_of[groups]
      )
    return times[key]

  return time_s


def exposed_comm_by_axis_s(
  program: hlo.Program,
  hw: Hardware,
  reduced: layout.ReducedMesh,
  collective_s: Callable[[hlo.Collective], float],
  step_s: float | None = None,
) -> dict[str, float]:
  """Exposed communication by the mesh axes its collectives run along: how much shorter
  the step would be if that axis's collectives were free (the parts need not add up to
  exposed_comm_s: one collective can hide behind another). `step_s`: the program's step
  as cost_model.simulate gave it, where the caller has simulated it already."""
  axes = {}
  for node, _ in hlo.collectives(program):
    groups = node.pairs if node.kind == "collective-permute" else node.groups
    axes[node.name] = layout.axes_of(groups, reduced) if groups else "none"
  if step_s is None:
    step_s = cost_model.simulate(program.entry, hw, collective_s).step_s
  out = {}
  for axis in sorted(set(axes.values())):
    free = lambda n, axis=axis: 0.0 if axes[n.name] == axis else collective_s(n)
    out[axis] = step_s - cost_model.simulate(program.entry, hw, free).step_s
  return out
