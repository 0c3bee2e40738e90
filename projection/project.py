"""Project an experiment's train step onto N GPUs of a given generation: `project`, the one
call every mode, sweep, search and benchmark makes, on a target planned once
(projection/plan.py).

1. Lay the experiment's mesh over the target cluster and shrink its data axis and its
   gradient accumulation to get a program that compiles here (`plan.plan`,
   projection/layout.py).
2. Compile the real train step for that mesh, for the target GPU itself, deviceless, or on
   host CPU devices when JAX's CUDA plugin or a target config is missing; with
   `latency_profile`, once more with the first program's projected latency profile
   (projection/aot_compile.py).
3. Run the compiled program's gradient-accumulation or pipeline loops as many times as the
   target has micro-batches (projection/step_loops.py), place each collective's replica group
   on the full cluster and cost it (projection/collective_timing.py), and run the
   two-stream cost model once (projection/cost_model.py; the bubble is read from the same
   simulation).
4. Assemble the record: memory against HBM, and, when it fits, step time, MFU and the
   breakdown, with the pipeline's bubble (projection/record.py, which projection/compose.py's
   composed programs go through too).

How the program is had (`how`, recorded in the point):
  full      the whole step compiled (steps 2-3): the reference.
  composed  a 1F1B pipelined step composed from compiled pieces cached on disk
            (projection/compose.py): a few small compiles for a what-if.
  auto      composed where the step composes (a 1F1B pipeline of whole chunks) and its
            composed memory is clear of HBM capacity (compose.NEAR_CAPACITY), else full.
            The default of project and sweep mode (a best-configuration sweep's searches
            included: their candidates recur at every GPU count and share pieces);
            `--full_compile` is `full`. Search mode and the calibration
            (benchmarks/mlperf.py) compile whole: a single search's candidates share no
            pieces.

Compiles are cached by everything they depend on. The compiled program's data axis and
micro-batch count do not depend on the GPU count, so every GPU count of one experiment
(with fixed fsdp and tensor sizes) on one GPU generation shares one compile.
"""

import dataclasses

from projection import aot_compile, collective_timing, compose, hlo, step_loops
from projection.plan import Target
from projection.record import GB, Compiled, costed, record, target_memory_gb
from records.points import ComposedEstimate, ProjectedPoint

HOWS = ("auto", "full", "composed")


def project(exp, target: Target, how: str = "auto") -> ProjectedPoint:
  """The projection of `exp` on `target` (projection/plan.py's plan), its program had as
  `how` says (module docstring); the point records the way taken."""
  if how == "full" or (how == "auto" and not compose.composes(exp, target.reduced)):
    return whole(exp, target)
  if how == "composed":
    return compose.composed(exp, target)
  if how != "auto":
    raise ValueError(f"how: one of {', '.join(HOWS)}, got {how!r}")
  point = compose.composed(exp, target)
  if point.memory_per_gpu_gb <= compose.NEAR_CAPACITY * point.hbm_capacity_gb:
    return point
  estimate = ComposedEstimate(
    point.step_time_s,
    point.memory_per_gpu_gb,
    f"composed memory over {compose.NEAR_CAPACITY:.0%} of HBM capacity",
  )
  return dataclasses.replace(whole(exp, target), composed_estimate=estimate)


def whole(exp, target: Target) -> ProjectedPoint:
  """The projection of `exp` on `target` with the whole step compiled (`how="full"`; tests
  pass a target whose reduced mesh is the target itself to compare against a direct
  compile)."""
  hw, reduced = target.hardware, target.reduced
  timer = collective_timing.collective_timer(reduced, hw)
  step, compile_s = aot_compile.cached_program(exp, hw, reduced, timer)
  program = step_loops.with_micro_batches(
    step.program, reduced.compiled_micro_batches, reduced.micro_batches, _virtual(exp, reduced)
  )
  memory_gb = target_memory_gb(step.memory_per_device_bytes, step.data_sharded_state_bytes, reduced)
  compiled = _compiled(
    program, memory_gb, step.compile_target, step.note, compile_s, cached=step.cached
  )
  return _costed_record(exp, target, timer, program, compiled)


def of_program(
  exp,
  target: Target,
  program: hlo.Program,
  memory_bytes: float,
  compile_s: float,
  compile_target: str,
) -> ProjectedPoint:
  """The projection of a program the caller compiled for the target's whole mesh and
  batch (a measured step's own, benchmarks/gpu_check.py): costed and recorded as `whole`
  does, without a deviceless compile (`how="full"`)."""
  timer = collective_timing.collective_timer(target.reduced, target.hardware)
  compiled = _compiled(program, memory_bytes / GB, compile_target, None, compile_s)
  return _costed_record(exp, target, timer, program, compiled)


def _virtual(exp, reduced) -> int:
  return exp.train.virtual_stages if reduced.target.sizes.get("pipeline", 1) > 1 else 1


def _compiled(
  program: hlo.Program,
  memory_gb: float,
  compile_target: str,
  note: str | None,
  compile_s: float,
  cached: bool = False,
) -> Compiled:
  return Compiled(
    compile_target,
    note,
    compile_s,
    hlo.total_flops(program),
    hlo.dot_flops(program),
    memory_gb,
    hlo.uses_fp8(program),
    hlo.uses_fp4(program),
    cached,
  )


def _costed_record(exp, target: Target, timer, program: hlo.Program, compiled: Compiled):
  hw, reduced = target.hardware, target.reduced
  stages = reduced.target.sizes.get("pipeline", 1)
  virtual = _virtual(exp, reduced)
  timing = lambda: costed(program, hw, reduced, timer, reduced.micro_batches, stages, virtual)
  return record(exp, hw, reduced, compiled, timing, "full")
