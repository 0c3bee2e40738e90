"""Project an experiment's train step onto N GPUs of a given generation.

1. Lay the experiment's mesh over the target cluster and shrink its data axis and its
   gradient accumulation to get a program that compiles here (`plan`, projection/layout.py).
2. Compile the real train step for that mesh, for the target GPU itself, deviceless, or on
   host CPU devices when JAX's CUDA plugin or a target config is missing; with
   `latency_profile`, once more with the first program's projected latency profile
   (projection/aot_compile.py).
3. Run the compiled program's gradient-accumulation or pipeline loops as many times as the
   target has micro-batches (projection/step_loops.py), place each collective's replica group
   on the full cluster and cost it (projection/collective_timing.py), and run the
   two-stream cost model (projection/cost_model.py).
4. Assemble the record: memory against HBM, and, when it fits, step time, MFU and the
   breakdown, with the pipeline's bubble (`record`, which projection/compose.py's
   composed programs go through too).

Compiles are cached by everything they depend on. The compiled program's data axis and
micro-batch count do not depend on the GPU count, so every GPU count of one experiment
(with fixed fsdp and tensor sizes) on one GPU generation shares one compile.
"""

import dataclasses
from collections.abc import Callable

from errors import UserInputError
from hardware import catalog
from hardware.catalog import Hardware
from model.flops import lora_train_flops_per_token, param_count, train_flops_per_token
from projection import (
  aot_compile,
  collective_timing,
  cost_model,
  hlo,
  host_calibration,
  layout,
  step_loops,
)
from records.points import ProjectedPoint, to_json

GB = 1e9


def hardware(name: str, gpus: int = 1) -> Hardware:
  """A catalog entry; 'host' is this machine's profile with `gpus` CPU devices active."""
  if name.strip().lower() == "host":
    return host_calibration.host_profile(devices=gpus)
  try:
    return catalog.get(name)
  except ValueError:
    raise UserInputError(
      f"--hardware: unknown hardware {name!r}; known: {', '.join(catalog.names() + ['host'])}"
    ) from None


def plan(exp, hw: Hardware, gpus: int) -> layout.ReducedMesh:
  """The target layout and its reduced mesh; bad input raises before anything compiles."""
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
    return layout.reduce(target, exp.train)
  except UserInputError as e:
    raise UserInputError(f"--gpus {gpus} on {hw.name}: {e}") from None


def project(exp, hw_name: str, gpus: int) -> dict:
  """One projection record for `exp` on `gpus` GPUs of `hw_name`."""
  hw = hardware(hw_name, gpus)
  return project_on(exp, hw, plan(exp, hw, gpus))


def project_on(exp, hw: Hardware, reduced: layout.ReducedMesh) -> dict:
  """The projection record of `exp` on `reduced.target`, compiled as `reduced` says (tests
  pass a `reduced` equal to the target to compare against a direct compile): a
  records.points.ProjectedPoint as its JSON object (a dict: the search adds its keys)."""
  target = reduced.target
  timer = collective_timing.collective_timer(reduced, hw)
  step, compile_s = aot_compile.compiled_program(exp, hw, reduced, timer)
  stages = target.sizes.get("pipeline", 1)
  virtual = exp.train.virtual_stages if stages > 1 else 1
  program = step_loops.with_micro_batches(
    step.program, reduced.compiled_micro_batches, reduced.micro_batches, virtual
  )
  memory_gb = target_memory_gb(step.memory_per_device_bytes, step.data_sharded_state_bytes, reduced)

  def timing() -> Timing:
    return Timing(
      cost_model.simulate(program.entry, hw, timer),
      step_loops.bubble_s(program, hw, timer, reduced.micro_batches, stages, virtual),
      collective_timing.exposed_comm_by_axis_s(program, hw, reduced, timer),
    )

  compiled = Compiled(
    step.compile_target,
    step.note,
    compile_s,
    hlo.total_flops(program),
    hlo.dot_flops(program),
    memory_gb,
    hlo.uses_fp8(program),
    hlo.uses_fp4(program),
  )
  return record(exp, hw, reduced, compiled, timing)


def target_memory_gb(
  compiled_bytes: float, data_sharded_bytes: float, reduced: layout.ReducedMesh
) -> float:
  """A device's memory on the target from the reduced mesh's: the state split over `data`
  shrinks as the target's data axis is larger."""
  data_growth = reduced.target.sizes["data"] / reduced.sizes["data"]
  return (compiled_bytes - data_sharded_bytes * (1 - 1 / data_growth)) / GB


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


@dataclasses.dataclass(frozen=True)
class Timing:
  """The program costed on the target: the step, its bubble and its exposed
  communication by mesh axis."""

  cost: cost_model.StepCost
  bubble_s: float
  exposed_comm_by_axis_s: dict[str, float]


def record(
  exp,
  hw: Hardware,
  reduced: layout.ReducedMesh,
  compiled: Compiled,
  timing: Callable[[], Timing],
  composition: dict | None = None,
) -> dict:
  """The ProjectedPoint of `compiled` on `reduced.target` as its JSON object; `timing` is
  called only when the program fits in HBM."""
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
    hlo_flops_per_device=compiled.flops,
    hlo_flops_per_step=compiled.flops * gpus,
    hlo_matmul_flops_per_step=compiled.matmul_flops * gpus,
    memory_per_gpu_gb=compiled.memory_gb,
    hbm_capacity_gb=capacity_gb,
    fits=compiled.memory_gb <= capacity_gb,
    peak_tflops_per_device=hw.peak_tflops("bf16"),
    composition=composition,
  )
  if not point["fits"]:
    return to_json(ProjectedPoint(**point, over_capacity_gb=compiled.memory_gb - capacity_gb))

  timed = timing()
  cost = timed.cost
  tokens_per_s = tokens_per_step / cost.step_s
  # LoRA: no weight gradients for the frozen base (model/flops.py lora_train_flops_per_token).
  per_token = lora_train_flops_per_token(exp.model, getattr(exp, "lora", None))
  model_tflops = tokens_per_s * per_token / gpus / 1e12
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
  return to_json(
    ProjectedPoint(
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
      # exposed_comm_s by the mesh axes of its collectives.
      breakdown={
        "compute_s": cost.compute_s,
        "exposed_comm_s": cost.exposed_comm_s,
        "other_s": cost.other_s,
        "bubble_s": timed.bubble_s,
        "memory_bound_s": cost.memory_bound_s,
        "exposed_comm_by_axis_s": timed.exposed_comm_by_axis_s,
      },
      comm_s=cost.comm_s,
    )
  )
