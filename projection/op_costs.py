"""Each compute op of a compiled program with its projected time over one step (the cost
model's op time, loop trips counted): what a profiler trace of the step is set beside
(measure/trace.py)."""

import dataclasses

from hardware.catalog import Hardware
from projection import cost_model, hlo


@dataclasses.dataclass(frozen=True)
class OpCost:
  name: str
  opcode: str
  kind: str
  op_name: str
  runs: int  # executions in one step (loop trips multiplied)
  seconds: float  # projected, all runs, without the launch overhead
  bound: str  # "memory" or "flops"


def projected_ops(program: hlo.Program, hw: Hardware) -> dict[str, OpCost]:
  """Each compute op's projected time over one step, by HLO instruction name."""
  ops: dict[str, OpCost] = {}
  for node, runs in hlo.walk(program):
    if not isinstance(node, hlo.Compute):
      continue
    flops_s, bytes_s = cost_model.op_times_s(node, hw)
    seen = ops.get(node.name)
    ops[node.name] = OpCost(
      node.name,
      node.opcode,
      node.kind,
      node.op_name,
      runs + (seen.runs if seen else 0),
      runs * max(flops_s, bytes_s) + (seen.seconds if seen else 0.0),
      "memory" if bytes_s > flops_s else "flops",
    )
  return ops
