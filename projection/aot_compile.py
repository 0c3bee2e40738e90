"""The train step compiled ahead of time for a projection's target, and read.

In named steps: the devices to compile on (`_compile_devices`: abstract target GPUs
through JAX's CUDA plugin, projection/targets.py, else host CPU devices), the compile
options (`FAST_BACKEND`, the kernel cache of projection/kernel_cache.py, the scheduler's
memory limit `_scheduler_memory`), the step lowered once (`_lowered_step`), the compile
itself with its memory and program read back (`compile_step`, cached by everything it
depends on), and, for an experiment with `latency_profile`, a second compile with the
first program's projected latency profile (`latency_profile`, `compiled_program`), kept on
disk for a CUDA target (`cached_program`, projection/disk_cache.py).
"""

import contextlib
import dataclasses
import functools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

import platform_env
from errors import UserInputError
from hardware import catalog
from hardware.catalog import Hardware
from parallelism import sharding
from parallelism.mesh import AXES
from projection import cost_model, disk_cache, hlo, kernel_cache, layout, targets
from train import step as train_step

# Backend settings for deviceless compiles. They change only the kernels' machine code
# (how hard LLVM and ptxas optimize it), never the optimized HLO, its schedule or its
# buffer assignment (checked: identical HLO text and memory analysis for GPT-3 175B on
# H100), and the projection never runs that code; they cut a 175B compile by a quarter.
FAST_BACKEND = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
  "xla_gpu_disable_gpuasm_optimizations": True,
}


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  program: hlo.Program
  memory_per_device_bytes: int
  compile_target: str  # "cuda" or "host"
  compile_s: float
  note: str  # why the host was used, when it was
  # Of memory_per_device_bytes, the train state split over `data` (train.shard_optimizer)
  # and the gradients the 1F1B drain reduces (TrainProgram.drain_reduced_bytes): the part
  # that shrinks as the data axis grows from the reduced mesh to the target.
  data_sharded_state_bytes: int = 0
  cached: bool = False  # read from the compile cache (cached_program), not compiled


def _compile_devices(hw_name: str, devices: int, gpus_per_node: int) -> tuple[list, str, str]:
  """Devices to compile on: abstract target GPUs if possible, else host CPU devices."""
  ok, reason = targets.cuda_available()
  if ok and hw_name in targets.HARDWARE:
    per_node = math.gcd(devices, gpus_per_node)
    return targets.target_devices(hw_name, devices // per_node, per_node), "cuda", ""
  if ok:
    reason = f"no CUDA target config for {hw_name}"
  host = jax.devices("cpu")
  if len(host) < devices:
    raise UserInputError(
      f"--gpus: the reduced mesh needs {devices} host CPU devices to compile "
      f"on and only {len(host)} exist ({reason})"
    )
  return host[:devices], "host", reason


@dataclasses.dataclass(frozen=True)
class _Lowered:
  program: train_step.TrainProgram
  lowered: jax.stages.Lowered
  target: str  # "cuda" or "host"
  note: str
  lower_s: float


@functools.lru_cache(maxsize=1)
def _lowered_step(
  model_cfg,
  train_cfg,
  sizes: tuple[tuple[str, int], ...],
  hw_name: str,
  gpus_per_node: int,
  adapters,
) -> _Lowered:
  """The train step traced and lowered for `sizes` on `hw_name`. The lowering does not depend
  on the latency profile, so a point's two compiles share it (DeepSeek-V3 671B on 2 cores:
  55 s, against about 130 s a compile); one is kept, a point's compiles being consecutive."""
  shape = [dict(sizes)[a] for a in AXES]
  devices, target, note = _compile_devices(hw_name, math.prod(shape), gpus_per_node)
  mesh = Mesh(
    np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES)
  )
  start = time.perf_counter()
  if target != "cuda" and model_cfg.attention == "cudnn":
    model_cfg = dataclasses.replace(model_cfg, attention="xla")
    note = f"{note}; attention compiled as xla (cuDNN attention needs a CUDA target)"
  program = train_step.build(model_cfg, train_cfg, mesh, adapters)
  with _cudnn(target, hw_name):
    lowered = program.lower(train_cfg.global_batch, model_cfg.seq_len)
  return _Lowered(program, lowered, target, note, time.perf_counter() - start)


def _cudnn(target: str, hw_name: str):
  return targets.cudnn_version_of(hw_name) if target == "cuda" else contextlib.nullcontext()


@functools.lru_cache(maxsize=64)
def compile_step(
  model_cfg,
  train_cfg,
  sizes: tuple[tuple[str, int], ...],
  hw_name: str,
  gpus_per_node: int,
  profile: tuple[tuple[str, float], ...] = (),
  adapters=None,
) -> CompiledStep:
  """The train step compiled for `sizes` on `hw_name`; with a latency `profile`
  (latency_profile) XLA's scheduler plans with those durations (CUDA targets only)."""
  # The lowering's seconds count toward the compile that lowered, not the one that reused it.
  reused = _lowered_step.cache_info().hits
  step = _lowered_step(model_cfg, train_cfg, sizes, hw_name, gpus_per_node, adapters)
  lower_s = 0.0 if _lowered_step.cache_info().hits > reused else step.lower_s
  program, target = step.program, step.target
  start = time.perf_counter()
  options = None
  if target == "cuda":
    options = {**FAST_BACKEND, "xla_gpu_kernel_cache_file": kernel_cache.path()}
    options.update(_scheduler_memory(hw_name, sharding.bytes_per_device(program.abstract_state)))
  # A GPU compile logs from C++ what only XLA's developers need (how many instructions a
  # latency profile matched; rematerialization that cannot bring a step under the
  # device's memory, which the projection reports itself): shown only if it fails.
  quiet = platform_env.captured_stderr() if target == "cuda" else contextlib.nullcontext()
  with _cudnn(target, hw_name), _profile_file(profile if target == "cuda" else ()) as path, quiet:
    if path:
      options["xla_gpu_pgle_profile_file_or_directory_path"] = path
    compiled = step.lowered.compile(compiler_options=options)
  memory = compiled.memory_analysis()
  per_device = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )
  analysis = hlo.analyze(compiled.as_text())
  return CompiledStep(
    analysis,
    per_device,
    target,
    lower_s + time.perf_counter() - start,
    step.note,
    # The drain's reduced gradients shrink with `data` as the split state does.
    sharding.bytes_per_device(program.abstract_state, split_over="data")
    + program.drain_reduced_bytes,
  )


def latency_profile(
  program: hlo.Program, hw: Hardware, collective_s: Callable[[hlo.Collective], float]
) -> tuple[tuple[str, float], ...]:
  """(instruction, microseconds) for every kernel and collective of `program` on `hw`: the
  profile a tuned run gives XLA's scheduler.

  XLA's latency-hiding scheduler decides what to overlap with each collective by how long
  it guesses the collective and the work around it take; without a profile those guesses
  are fixed per kind of op. A tuned GPU run profiles its program once and recompiles with
  the measured durations (XLA's profile-guided latency estimator: jax_enable_pgle, or
  --xla_gpu_pgle_profile_file_or_directory_path). The projection does the same with the
  durations it projects, keyed by the names XLA scheduled the instructions under (for the
  MLPerf step on 512 H100 it halves the tensor-parallel collectives' exposed time)."""
  costs = {}
  for node, _ in hlo.walk(program):
    if isinstance(node, hlo.Compute):
      costs[node.scheduling_name] = cost_model.op_time_s(node, hw) * 1e6
    elif isinstance(node, hlo.Collective):
      costs[node.scheduling_name] = collective_s(node) * 1e6
  return tuple(sorted(costs.items()))


@contextlib.contextmanager
def _profile_file(profile: tuple[tuple[str, float], ...]):
  """The profile as a ProfiledInstructionsProto text file for the compile, or None."""
  if not profile:
    yield None
    return
  directory = tempfile.mkdtemp(prefix="projection-profile-")
  path = os.path.join(directory, "profile.pbtxt")
  try:
    with open(path, "w") as f:
      f.writelines(
        f'costs {{ name: "{name}" cost_us: {cost_us:.4f} }}\n' for name, cost_us in profile
      )
    yield path
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def _scheduler_memory(hw_name: str, io_bytes: int) -> dict:
  """The option that lets XLA's scheduler plan with the GPU's whole memory.

  XLA's latency-hiding scheduler overlaps a collective with independent work only while
  the step's live memory stays under (80% of the device memory - the program's inputs and
  outputs) x xla_gpu_memory_limit_slop_factor / 100, 95 by default (gpu_hlo_schedule.cc,
  GetSchedulerMemoryLimit); over it, it schedules to save memory and runs collectives
  without overlap. The projection's fits check allows the whole device memory, as a tuned
  run does (XLA_PYTHON_CLIENT_MEM_FRACTION near 1, a larger slop factor), so the
  scheduler gets the same: GPT-3 175B on 512 H100 as published, 55 GB of temporaries
  under a default limit of 43 GB left every tensor-parallel collective of the pipeline
  loops unoverlapped. The compiled state (arguments, donated to the outputs) is the
  reduced mesh's, at least the target's, so the limit errs low."""
  device_bytes = catalog.get(hw_name).hbm_bytes
  default_limit = 0.8 * device_bytes - io_bytes
  if default_limit <= 0:
    return {}
  return {
    "xla_gpu_memory_limit_slop_factor": max(
      95, math.ceil(100 * (device_bytes - io_bytes) / default_limit)
    )
  }


# The whole step's analyses kept between runs (disk_cache): $JAX_SCALING_COMPILE_CACHE
# moves the folder, "off" turns it off.
COMPILE_CACHE_ENV = "JAX_SCALING_COMPILE_CACHE"
# The cached CompiledStep's layout: a change of it makes new keys.
_FORMAT = 1


def cached_program(
  exp, hw: Hardware, reduced: layout.ReducedMesh, collective_s: Callable[[hlo.Collective], float]
) -> tuple[CompiledStep, float]:
  """compiled_program, a CUDA target's kept on disk (disk_cache), keyed by the model, train
  step, reduced mesh on its target and the GPU's figures (which `collective_s`,
  collective_timing's timer of `reduced` on `hw`, is made of): the same point projected
  again reads it back, and its seconds are the read's. (projection/compose.py keeps its
  pieces in a cache of their own.)"""
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  folder = disk_cache.folder(COMPILE_CACHE_ENV, "compiles")
  parts = (exp.model, train_cfg, getattr(exp, "lora", None), exp.latency_profile, reduced, hw)
  path = folder and os.path.join(folder, disk_cache.key(*parts, _FORMAT))
  start = time.perf_counter()
  cached = disk_cache.read(path, lambda c: isinstance(c, CompiledStep)) if path else None
  if cached is not None:
    return dataclasses.replace(cached, cached=True), time.perf_counter() - start
  step, compile_s = compiled_program(exp, hw, reduced, collective_s)
  if path and step.compile_target == "cuda":
    disk_cache.write(path, step)
  return step, compile_s


def compiled_program(
  exp, hw: Hardware, reduced: layout.ReducedMesh, collective_s: Callable[[hlo.Collective], float]
) -> tuple[CompiledStep, float]:
  """The step the projection costs, and the seconds its compiles took: compiled as
  `reduced` says, then, with exp.latency_profile on a CUDA target, compiled again with the
  latency profile of that program on `hw`."""
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  adapters = getattr(exp, "lora", None)  # LoRA fine-tuning (model/lora.py), or None
  args = (exp.model, train_cfg, tuple(reduced.sizes.items()), hw.name, hw.gpus_per_node)
  step = compile_step(*args, adapters=adapters)
  if not exp.latency_profile:
    return step, step.compile_s
  if step.compile_target != "cuda":
    note = f"{step.note}; no latency profile (a CUDA target's)"
    return dataclasses.replace(step, note=note), step.compile_s
  tuned = compile_step(*args, latency_profile(step.program, hw, collective_s), adapters)
  return tuned, step.compile_s + tuned.compile_s
