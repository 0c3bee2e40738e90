"""A projected point's record: what it reads of its program (compiled whole or composed of
pieces), the program costed on the target, and the ProjectedPoint they make."""

import dataclasses
from collections.abc import Callable

from hardware.catalog import Hardware
from model.flops import lora_train_flops_per_token, param_count, train_flops_per_token
from projection import collective_timing, cost_model, hlo, layout, step_loops
from records.points import ComposedEstimate, Composition, ProjectedPoint

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What a record reads of the program it projects, compiled whole or composed of pieces
  (projection/compose.py): per device on the target."""

  compile_target: str
  compile_note: str | None
  compile_s: float
  flops: float
  matmul_flops: float
  memory_gb: float
  uses_fp8: bool
  uses_fp4: bool
  cached: bool = False  # the program read from disk (projection/disk_cache.py), not compiled


@dataclasses.dataclass(frozen=True)
class Timing:
  """The program costed on the target: the step, its bubble and its exposed
  communication by mesh axis."""

  cost: cost_model.StepCost
  bubble_s: float
  exposed_comm_by_axis_s: dict[str, float]
  exposed_comm_by_place_s: dict[str, float]  # cost_model.simulate's exposed_at


def target_memory_gb(
  compiled_bytes: float, data_sharded_bytes: float, reduced: layout.ReducedMesh
) -> float:
  """A device's memory on the target from the reduced mesh's: the state split over `data`
  shrinks as the target's data axis is larger."""
  data_growth = reduced.target.sizes["data"] / reduced.sizes["data"]
  return (compiled_bytes - data_sharded_bytes * (1 - 1 / data_growth)) / GB


def costed(
  program: hlo.Program,
  hw: Hardware,
  reduced: layout.ReducedMesh,
  timer: Callable[[hlo.Collective], float],
  micro_batches: int,
  stages: int,
  virtual_stages: int,
) -> Timing:
  """`program` costed on the target by one simulation: the step, and its pipeline bubble
  from the loops' trip times that simulation gives. Exposed communication by mesh axis is
  the step less the step with that axis's collectives free (one more simulation an axis)."""
  trip_s: dict[str, float] = {}
  by_place: dict[str, float] = {}
  cost = cost_model.simulate(program.entry, hw, timer, trip_s, by_place)
  bubble = step_loops.bubble_s(program, hw, timer, micro_batches, stages, virtual_stages, trip_s)
  by_axis = collective_timing.exposed_comm_by_axis_s(program, hw, reduced, timer, cost.step_s)
  return Timing(cost, bubble, by_axis, by_place)


def routing(model) -> str:
  """How a MoE step's routing is costed: the compiled capacity buffers (model/moe.py) give
  every expert the same C slots, whatever a real router picks."""
  if model.capacity_factor <= 0:
    return (
      "dropless: every expert's matmuls over all T tokens of a sequence (E / k times the "
      "balanced work); not a routing any run has"
    )
  return (
    f"taken as balanced: every expert's matmuls at capacity factor {model.capacity_factor:g} "
    f"x k T / E slots a sequence, whatever the router picks (real runs are not "
    f"force-balanced: their busiest expert sets the time)"
  )


def record(
  exp,
  hw: Hardware,
  reduced: layout.ReducedMesh,
  compiled: Compiled,
  timing: Callable[[], Timing],
  how: str,
  composition: Composition | None = None,
  composed_estimate: ComposedEstimate | None = None,
) -> ProjectedPoint:
  """The ProjectedPoint of `compiled` on `reduced.target`; `timing` is called only when the
  program fits in HBM."""
  target = reduced.target
  gpus = target.devices
  tokens_per_step = exp.train.global_batch * exp.model.seq_len
  capacity_gb = hw.hbm_bytes / GB
  point = dict(
    mode="project",
    experiment=exp.name,
    model=exp.model.name,
    params=param_count(exp.model),
    hardware=hw.name,
    devices=gpus,
    nodes=target.nodes,
    mesh=target.sizes,
    mesh_nvlink=target.nvlink,
    mesh_infiniband=target.infiniband,
    compiled_mesh=reduced.sizes,
    global_batch=exp.train.global_batch,
    micro_batches=reduced.micro_batches,
    compiled_micro_batches=reduced.compiled_micro_batches,
    seq_len=exp.model.seq_len,
    tokens_per_step=tokens_per_step,
    compute_dtype=exp.model.compute_dtype,
    remat=exp.model.remat,
    compile_target=compiled.compile_target,
    compile_note=compiled.compile_note,
    compile_s=round(compiled.compile_s, 3),
    compile_cached=compiled.cached,
    how=how,
    hlo_flops_per_device=compiled.flops,
    hlo_flops_per_step=compiled.flops * gpus,
    hlo_matmul_flops_per_step=compiled.matmul_flops * gpus,
    memory_per_gpu_gb=compiled.memory_gb,
    hbm_capacity_gb=capacity_gb,
    fits=compiled.memory_gb <= capacity_gb,
    peak_tflops_per_device=hw.peak_tflops("bf16"),
    composition=composition,
    composed_estimate=composed_estimate,
  )
  if exp.model.moe:
    point["routing"] = routing(exp.model)
  if not point["fits"]:
    return ProjectedPoint(**point, over_capacity_gb=compiled.memory_gb - capacity_gb)

  timed = timing()
  cost = timed.cost
  tokens_per_s = tokens_per_step / cost.step_s
  # LoRA: no weight gradients for the frozen base (model/flops.py lora_train_flops_per_token).
  model_tflops = tokens_per_s * lora_train_flops_per_token(exp.model, exp.lora) / gpus / 1e12
  if compiled.uses_fp8 and hw.peak_tflops("fp8"):
    point["mfu_fp8"] = model_tflops / hw.peak_tflops("fp8")
  if compiled.uses_fp4 and hw.peak_tflops("fp4"):
    point["mfu_fp4"] = model_tflops / hw.peak_tflops("fp4")
  if exp.benchmark is not None:
    # An evaluation is a forward pass: a third of the model's training FLOPs, against
    # the compiled step's FLOPs (which include recomputation).
    forward = train_flops_per_token(exp.model) / 3 * tokens_per_step / point["hlo_flops_per_step"]
    point["time_to_train"] = exp.benchmark.estimate(cost.step_s, exp.train.global_batch, forward)
    point["time_to_train_min"] = point["time_to_train"]["time_to_train_min"]
  return ProjectedPoint(
    **point,
    step_time_s=cost.step_s,
    tokens_per_s=tokens_per_s,
    tokens_per_s_per_device=tokens_per_s / gpus,
    model_tflops_per_device=model_tflops,
    mfu=model_tflops / hw.peak_tflops("bf16"),
    # bubble_s: the pipeline's idle trips, a part of the step that the other three
    # also cover (its ops and waits are counted there too).
    # memory_bound_s is the part of compute_s whose time HBM traffic sets, the rest
    # being matmuls (and any op) at the FLOP rate; exposed_comm_by_axis_s splits
    # exposed_comm_s by the mesh axes of its collectives (what freeing an axis saves),
    # exposed_comm_by_place_s by the collective waited for and where it runs ("all-gather
    # in step": outside every loop; it adds up to exposed_comm_s).
    breakdown={
      "compute_s": cost.compute_s,
      "exposed_comm_s": cost.exposed_comm_s,
      "other_s": cost.other_s,
      "bubble_s": timed.bubble_s,
      "memory_bound_s": cost.memory_bound_s,
      "exposed_comm_by_axis_s": timed.exposed_comm_by_axis_s,
      "exposed_comm_by_place_s": timed.exposed_comm_by_place_s,
    },
    comm_s=cost.comm_s,
  )
