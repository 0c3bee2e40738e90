"""The compiled step's loops, found by the named scopes around them: extended to the
target's micro-batch count, and the pipeline's idle trips among them costed.

A projection compiles the reduced mesh's program (projection/layout.py) and runs it as the
target would: the gradient-accumulation loop or the pipeline loops get the target's
micro-batch count (`with_micro_batches`), and `bubble_s` is the share of the pipeline
loops' time spent in fill and drain trips. The loops are while ops whose metadata op_name
ends in the scope that train/step.py, parallelism/pipeline.py or parallelism/one_f_one_b.py
put around them.
"""

import dataclasses
import re
from collections.abc import Callable

from hardware.catalog import Hardware
from parallelism import gradients, one_f_one_b, pipeline
from projection import cost_model, hlo

# The gradient-accumulation loop is the while op that train/step.py's named scope names.
# Vmapped over data-parallel replicas when it runs pipeline passes: "vmap(grad_accumulation)".
_ACCUMULATION_OP = re.compile(rf"(^|[/(]){re.escape(gradients.ACCUMULATION_SCOPE)}\)*/while$")
# The pipeline's loops: the forward one ("jvp(pipeline)/while") and its transpose
# ("transpose(jvp(pipeline))/while"), one trip each per schedule step
# (parallelism/pipeline.py); not the loops inside a trip (".../while/body/.../while").
_PIPELINE_OP = re.compile(rf"(^|[/(]){re.escape(pipeline.PIPELINE_SCOPE)}\)*/while$")
# The 1f1b schedule's loops (parallelism/one_f_one_b.py): forward-only (its first trips
# apart when they gather the next chunk's kernels), backward-only (its last trips apart
# when they reduce gradients), and the steady one inside the loop over micro-batch groups.
_FILL_OP, _GATHER_OP, _DRAIN_OP, _REDUCE_OP, _STEADY_OP = (
  re.compile(rf"(^|[/(]){re.escape(scope)}\)*/while$")
  for scope in (
    one_f_one_b.FILL_SCOPE,
    one_f_one_b.FILL_GATHER_SCOPE,
    one_f_one_b.DRAIN_SCOPE,
    one_f_one_b.DRAIN_REDUCE_SCOPE,
    one_f_one_b.STEADY_SCOPE,
  )
)


def pipeline_loops(program: hlo.Program) -> list[int]:
  """Entry positions of the pipeline's loops (forward and backward) at the top of the
  program (one pipeline pass)."""
  return [i for i, n in enumerate(program.entry) if _is_pipeline_loop(n)]


def reduces_in_drain(program: hlo.Program) -> bool:
  """Whether the 1f1b drain reduces gradients (one_f_one_b.DRAIN_REDUCE_SCOPE): its loop,
  or the ops of its one iteration where XLA inlined it."""
  return any(one_f_one_b.DRAIN_REDUCE_SCOPE in getattr(n, "op_name", "") for n in program.entry)


def gathers_in_fill(program: hlo.Program) -> bool:
  """Whether the 1f1b fill gathers the next chunk's kernels (one_f_one_b.FILL_GATHER_SCOPE):
  its loop, or the ops of its one iteration where XLA inlined it."""
  return any(one_f_one_b.FILL_GATHER_SCOPE in getattr(n, "op_name", "") for n in program.entry)


def fill_gather_loops(program: hlo.Program) -> list[hlo.Loop]:
  """The 1f1b fill's gathering loop at the top of the program (one_f_one_b.
  FILL_GATHER_SCOPE); none where XLA inlined its one iteration or the fill does not gather."""
  return _top_loops(program, _GATHER_OP)


def drain_reduce_loops(program: hlo.Program) -> list[hlo.Loop]:
  """The 1f1b drain's reducing loop at the top of the program (one_f_one_b.
  DRAIN_REDUCE_SCOPE), not the loops inside its trips; none where XLA inlined its one
  iteration or the drain does not reduce."""
  return _top_loops(program, _REDUCE_OP)


def _top_loops(program: hlo.Program, op_name: re.Pattern) -> list[hlo.Loop]:
  return [n for n in program.entry if isinstance(n, hlo.Loop) and op_name.search(n.op_name)]


def _is_pipeline_loop(node: hlo.Node) -> bool:
  return isinstance(node, hlo.Loop) and bool(_PIPELINE_OP.search(node.op_name))


def pipeline_passes(program: hlo.Program) -> list[tuple[hlo.Loop, int]]:
  """The pipeline's loops with how many times each runs: once at the top of the program,
  or once per pass inside the top-level gradient-accumulation loop that runs several
  passes (train.pipeline_passes); for 1f1b, its fill and drain loops once and its steady
  loop once per trip of the loop over groups around it, in program order."""
  found = [(program.entry[i], 1) for i in pipeline_loops(program)]
  for outer in program.entry:
    if not isinstance(outer, hlo.Loop):
      continue
    # (A loop over one group has been inlined: its steady loop is at the top.)
    if any(
      op.search(outer.op_name) for op in (_FILL_OP, _GATHER_OP, _STEADY_OP, _DRAIN_OP, _REDUCE_OP)
    ):
      found.append((outer, 1))
    inner = [n for n in outer.body if isinstance(n, hlo.Loop)]
    if _ACCUMULATION_OP.search(outer.op_name):
      found += [(n, outer.trip_count) for n in inner if _is_pipeline_loop(n)]
    found += [(n, outer.trip_count) for n in inner if _STEADY_OP.search(n.op_name)]
  return found


def with_micro_batches(
  program: hlo.Program, compiled: int, target: int, virtual_stages: int = 1
) -> hlo.Program:
  """`program`, compiled for `compiled` micro-batches, running `target` of them.

  Sound because every micro-batch runs the same loop body: the work that does not
  depend on the count (the optimizer update, the loss average) sits outside the loop.
  The difference is added to the loop's trip count rather than set, in case XLA peeled
  an iteration out of the loop. Memory is left as compiled: the only buffer that grows
  with the count is the token batch, 8 bytes a token per device (a few MB at most).

  A pipelined program's micro-batches run through its pipeline loops instead, each
  micro-batch `virtual_stages` trips of each (parallelism/pipeline.py); the pipeline's
  fill and drain trips do not depend on the count. (Its embedding and head run outside
  the loops, so projection/layout.py compiles a pipelined step at the target's count.)
  """
  if target == compiled:
    return program
  if len(pipeline_passes(program)) > len(pipeline_loops(program)):
    raise RuntimeError(
      f"{program.name}: a pipeline of several passes or the 1f1b schedule "
      f"is compiled with all its micro-batches ({compiled}), not {target}"
    )
  loops = pipeline_loops(program)
  if loops:
    entry = list(program.entry)
    for i in loops:
      entry[i] = dataclasses.replace(
        entry[i], trip_count=entry[i].trip_count + (target - compiled) * virtual_stages
      )
    return dataclasses.replace(program, entry=tuple(entry))
  found = [
    i
    for i, n in enumerate(program.entry)
    if isinstance(n, hlo.Loop) and _ACCUMULATION_OP.search(n.op_name)
  ]
  if len(found) != 1:
    raise RuntimeError(
      f"expected one gradient-accumulation loop (a while op named "
      f"'{gradients.ACCUMULATION_SCOPE}/while') at the top of "
      f"{program.name}, found {len(found)}"
    )
  loop = program.entry[found[0]]
  trips = loop.trip_count + target - compiled
  if loop.trip_count_source == "unknown" or trips < 1:
    raise RuntimeError(
      f"{loop.name}: cannot run {target} micro-batches from a loop of "
      f"{loop.trip_count} trips ({loop.trip_count_source}) compiled for "
      f"{compiled}"
    )
  entry = list(program.entry)
  entry[found[0]] = dataclasses.replace(loop, trip_count=trips)
  return dataclasses.replace(program, entry=tuple(entry))


def bubble_s(
  program: hlo.Program,
  hw: Hardware,
  collective_s: Callable[[hlo.Collective], float],
  micro_batches: int,
  stages: int,
  virtual_stages: int,
  trip_s: dict[str, float] | None = None,
) -> float:
  """Seconds of the pipeline's idle trips: each pipeline loop runs micro_batches / passes
  x virtual_stages busy trips and stages - 1 idle ones (fill and drain) per pass, every trip the
  same body (ranks compute in lockstep, an idle rank on stale data), so the bubble is
  the idle trips' share of the loops' compiled time.

  The 1f1b schedule's loops run a forward and a backward chunk a trip, and every rank
  idles stages - 1 trips of each kind: as many trips of its fill loop (forward only) and
  of its drain loop (backward only; where the drain's last trips also reduce gradients,
  a trip of its first part, whose cost is the backward's alone).

  `trip_s`: each loop's time per trip as cost_model.simulate of the program wrote it; the
  loops are simulated here without it."""

  def trip(loop: hlo.Loop) -> float:
    if trip_s is not None:
      return trip_s[loop.name]
    return cost_model.simulate(loop.body, hw, collective_s).step_s

  fill, gathering, drain, reducing = (
    _top_loops(program, op) for op in (_FILL_OP, _GATHER_OP, _DRAIN_OP, _REDUCE_OP)
  )
  if fill or drain:
    plan = one_f_one_b.schedule(micro_batches, stages, virtual_stages)
    # A gathering or reducing loop of one iteration (V 2) is inlined by XLA.
    expected = [plan.delay, plan.drain_trips]
    if gathers_in_fill(program):
      expected[0] -= plan.gathering_trips
      expected += [plan.gathering_iterations] if gathering else []
    if reduces_in_drain(program):
      expected[1] -= plan.reducing_trips
      expected += [plan.reducing_iterations] if reducing else []
    found = [n.trip_count for n in fill + drain + gathering + reducing]
    if found != expected:
      raise RuntimeError(
        f"{program.name}: 1f1b fill and drain loops of {found} trips, not the schedule's {expected}"
      )
    return (stages - 1) * (trip(fill[0]) + trip(drain[0]))
  loops = pipeline_passes(program)
  if stages > 1 and not loops:
    raise RuntimeError(
      f"{program.name}: no pipeline loop (a while op named "
      f"'{pipeline.PIPELINE_SCOPE}/while') at the top of the program or of "
      f"its pass loop"
    )
  total = 0.0
  for loop, passes in loops:
    per_pass = micro_batches // passes
    if loop.trip_count != pipeline.trips(per_pass, stages, virtual_stages):
      raise RuntimeError(
        f"{loop.name}: {loop.trip_count} trips, not the "
        f"{per_pass} x {virtual_stages} + {stages} - 1 of the schedule"
      )
    idle = loop.trip_count - per_pass * virtual_stages
    total += passes * idle * trip(loop)
  return total
