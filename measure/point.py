"""One measured point: plan -> build_mesh -> build -> loop.run -> record.

launch.py's train and benchmark modes, the measured sweeps (sweep/runner.py) and the
benchmarks that time the step (benchmarks/closing_the_loop.py, benchmarks/gpu_check.py)
all run a point through `run_point`; `build_point` is its first half, for a caller that
steps the compiled program itself (benchmarks/cpu_perf.py).
"""

import dataclasses
import datetime
import importlib.util
import os
import sys
from collections.abc import Callable

from errors import UserInputError
from measure import fit, rates
from model.flops import lora_train_flops_per_token, param_count
from parallelism import mesh as mesh_lib
from parallelism import one_f_one_b, pipeline
from records.points import MeasuredPoint
from train import hooks as hooks_lib
from train import loop
from train import step as train_step
from train.checkpoint import Checkpoints


@dataclasses.dataclass(frozen=True)
class PointOptions:
  """How a point runs and what it leaves (launch.py's flags of the same names)."""

  # TensorBoard scalars go to OUTPUT_DIR/tensorboard/<run>, a trace to OUTPUT_DIR/profile.
  # None: no TensorBoard scalars and no record (a benchmark that reads the step times).
  output_dir: str | None = "runs"
  profile_steps: str | None = None  # "A:B"
  checkpoint_dir: str | None = None  # save here and resume from the newest
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  resume_from: int | None = None  # a checkpoint's step; None: the newest not known bad
  hooks: tuple = ()  # more step hooks, after TensorBoard's
  # Called before compiling with the mesh, the platform, the pipeline's record fields and
  # its trips (modes/ print them there); measuring prints nothing itself.
  announce: Callable[[mesh_lib.MeshLayout, str, dict, str], None] | None = None


@dataclasses.dataclass(frozen=True)
class PointRun:
  # None: no output_dir, or nothing left to run (no step times: the checkpoint is at the
  # run's last step)
  record: MeasuredPoint | None
  result: loop.RunResult
  program: train_step.TrainProgram
  layout: mesh_lib.MeshLayout


def build_point(exp, devices: list) -> tuple[mesh_lib.MeshLayout, train_step.TrainProgram]:
  """The experiment's mesh over `devices` and its train step, checked to fit first."""
  if exp.model.attention == "cudnn" and devices[0].platform != "gpu":
    raise UserInputError(
      f"model.attention=cudnn runs on NVIDIA GPUs only, these devices are "
      f"{devices[0].platform.upper()}; use model.attention=xla (projections "
      f"take cudnn: --mode=project)"
    )
  layout = mesh_lib.plan(exp.mesh, len(devices))
  fit.check_activation_memory(exp, layout, devices)
  mesh = mesh_lib.build_mesh(layout, devices)
  program = train_step.build(exp.model, exp.train, mesh, exp.lora)
  fit.check_state_memory(program, exp.model.name, devices)
  return layout, program


def pipeline_fields(exp, stages: int, micro_batches: int) -> tuple[dict, str]:
  """The pipeline schedule's record fields and its loop trips in words ({} with one stage)."""
  if stages == 1:
    return {}, ""
  virtual, schedule = exp.train.virtual_stages, exp.train.pipeline_schedule
  passes = pipeline.passes(exp.train.pipeline_passes, micro_batches, stages, schedule)
  per_pass = micro_batches // passes
  fields = {
    "pipeline_schedule": schedule,
    "virtual_stages": virtual,
    "micro_batches": micro_batches,
    "pipeline_passes": passes,
    "pipeline_trips": passes * pipeline.trips(per_pass, stages, virtual),
    "bubble_fraction": pipeline.bubble_fraction(per_pass, stages, virtual),
  }
  if schedule == "1f1b":
    plan = one_f_one_b.schedule(micro_batches, stages, virtual)
    trips = (
      f"{plan.delay} forward, {plan.groups - 1} x {plan.group_trips} both, "
      f"{plan.drain_trips} backward; residual slots {plan.slots} chunks"
    )
  else:
    trips = f"{fields['pipeline_trips']} = {passes} x {pipeline.trips(per_pass, stages, virtual)}"
  return fields, trips


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_point(exp, mode: str, devices: list, options: PointOptions = PointOptions()) -> PointRun:
  """Train (`mode` "train") or time (`mode` "benchmark") `exp` on `devices`."""
  profile = None
  if options.profile_steps:
    profile = hooks_lib.parse_profile_steps(
      options.profile_steps, exp.train.warmup_steps + exp.train.steps
    )
  layout, program = build_point(exp, devices)
  stages = layout.sizes["pipeline"]
  pipeline_record, trips = pipeline_fields(exp, stages, program.micro_batches)
  if options.announce is not None:
    options.announce(layout, devices[0].platform, pipeline_record, trips)
  peak, peak_source = 0.0, ""
  if options.output_dir is not None:
    peak, peak_source = fit.peak_tflops_per_device(devices, exp.model.compute_dtype)
  checkpoints = None
  if options.checkpoint_dir is not None:  # before the hooks: a refused one leaves no files
    checkpoints = Checkpoints(
      options.checkpoint_dir,
      options.checkpoint_every,
      options.keep_checkpoints,
      options.resume_from,
    )
  hooks = list(options.hooks)
  tensorboard_dir = profile_dir = None
  if options.output_dir is not None and importlib.util.find_spec("tensorboardX") is None:
    # A GPU image may lack tensorboardX (requirements.txt installs it everywhere else):
    # the run and its record go on without the scalars.
    print("note: tensorboardX is not installed; no TensorBoard scalars", file=sys.stderr)
  elif options.output_dir is not None:
    run_name = (
      f"{exp.name}_{mode}_{layout.devices}dev_"
      f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}"
    )
    tensorboard_dir = os.path.join(options.output_dir, "tensorboard", run_name)
    hooks.insert(
      0,
      hooks_lib.TensorBoardHook(
        tensorboard_dir,
        exp.train.global_batch * exp.model.seq_len,
        lora_train_flops_per_token(exp.model, exp.lora),
        layout.devices,
        peak,
      ),
    )
  if profile:
    profile_dir = os.path.join(options.output_dir or "runs", "profile")
    hooks.append(hooks_lib.ProfileHook(profile_dir, *profile))
  result = loop.run(program, exp.model, exp.train, checkpoints, hooks)
  if not result.step_times_s or options.output_dir is None:
    return PointRun(None, result, program, layout)
  tokens_per_step = exp.train.global_batch * exp.model.seq_len
  record = MeasuredPoint(
    mode=mode,
    experiment=exp.name,
    model=exp.model.name,
    params=param_count(exp.model),
    devices=layout.devices,
    nodes=layout.nodes,
    mesh=layout.sizes,
    mesh_nvlink=layout.nvlink,
    mesh_infiniband=layout.infiniband,
    global_batch=exp.train.global_batch,
    seq_len=exp.model.seq_len,
    tokens_per_step=tokens_per_step,
    timed_steps=exp.train.steps,
    compute_dtype=exp.model.compute_dtype,
    remat=exp.model.remat,
    platform=devices[0].platform,
    device_kind=devices[0].device_kind,
    **rates.summarize(
      result,
      tokens_per_step,
      layout.devices,
      lora_train_flops_per_token(exp.model, exp.lora),
      peak,
    ),
    peak_source=peak_source,
    tensorboard_dir=tensorboard_dir,
    time=_now(),
    **pipeline_record,
    profile_dir=profile_dir,
    losses=result.losses if mode == "train" else None,
    resumed_from_step=result.first_step or None,
  )
  return PointRun(record, result, program, layout)
