"""Project an experiment's train step onto N GPUs of a given generation.

1. Lay the experiment's mesh over the target cluster (projection/layout.py) and shrink
   its data axis and its gradient accumulation to get a program that compiles here.
2. Compile the real train step for that mesh: for the target GPU itself, deviceless,
   through JAX's CUDA plugin (projection/targets.py), or on host CPU devices when the
   plugin or a target config is missing.
3. Read the optimized program (projection/hlo.py), run its gradient-accumulation loop as
   many times as the target has micro-batches, place each collective's replica group on
   the full cluster and cost it (projection/collectives.py), and run the two-stream cost
   model (projection/cost_model.py).

Compiles are cached by everything they depend on. The compiled program's data axis and
micro-batch count do not depend on the GPU count, so every GPU count of one experiment
(with fixed fsdp and tensor sizes) on one GPU generation shares one compile. An
experiment with `latency_profile` is compiled once more per GPU count, with the latency
profile of the first compile's program on the target (`latency_profile`).
"""

import atexit
import contextlib
import dataclasses
import functools
import math
import os
import re
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
from model.flops import param_count, train_flops_per_token
from parallelism.mesh import AXES
from parallelism import one_f_one_b, pipeline, sharding
from projection import collectives, cost_model, hlo, host_calibration, layout, targets
from train import step as train_step

GB = 1e9

# Backend settings for deviceless compiles. They change only the kernels' machine code
# (how hard LLVM and ptxas optimize it), never the optimized HLO, its schedule or its
# buffer assignment (checked: identical HLO text and memory analysis for GPT-3 175B on
# H100), and the projection never runs that code; they cut a 175B compile by a quarter.
FAST_BACKEND = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                "xla_gpu_disable_gpuasm_optimizations": True}


# XLA's kernel cache for deviceless compiles, kept between runs. Compiles of one model on
# other meshes or GPU generations share most kernels, and a compile whose kernels are
# cached takes ~5-10 s instead of 15-30 s. It holds only machine code, which the
# projection never runs, so a reused kernel cannot change a projection (checked:
# identical HLO with and without it, even across generations).
KERNEL_CACHE_ENV = "JAX_SCALING_KERNEL_CACHE"  # overrides the file's path
DEFAULT_KERNEL_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jax-scaling",
                                    f"xla-kernels-jax-{jax.__version__}.bin")


@functools.cache
def _kernel_cache_file() -> str:
  """This process's copy of the kernel cache: XLA appends to the file it is given, so
  concurrent runs each work on a copy and replace the shared file whole at exit."""
  shared = os.environ.get(KERNEL_CACHE_ENV) or DEFAULT_KERNEL_CACHE
  directory = tempfile.mkdtemp(prefix="projection-kernels-")
  private = os.path.join(directory, "kernels.bin")
  if os.path.isfile(shared):
    shutil.copyfile(shared, private)
  atexit.register(_save_kernel_cache, private, shared)
  return private


def _save_kernel_cache(private: str, shared: str) -> None:
  try:
    if os.path.isfile(private):
      os.makedirs(os.path.dirname(shared), exist_ok=True)
      partial = f"{shared}.{os.getpid()}"
      shutil.copyfile(private, partial)
      os.replace(partial, shared)  # atomic: readers see the old file or the new one
  except OSError:
    pass  # a cache that cannot be written costs time, not correctness
  finally:
    shutil.rmtree(os.path.dirname(private), ignore_errors=True)


# The gradient-accumulation loop is the while op that train/step.py's named scope names.
# Vmapped over data-parallel replicas when it runs pipeline passes: "vmap(grad_accumulation)".
_ACCUMULATION_OP = re.compile(
  rf"(^|[/(]){re.escape(train_step.GRAD_ACCUMULATION_SCOPE)}\)*/while$")
# The pipeline's loops: the forward one ("jvp(pipeline)/while") and its transpose
# ("transpose(jvp(pipeline))/while"), one trip each per schedule step
# (parallelism/pipeline.py); not the loops inside a trip (".../while/body/.../while").
_PIPELINE_OP = re.compile(rf"(^|[/(]){re.escape(pipeline.PIPELINE_SCOPE)}\)*/while$")
# The 1f1b schedule's loops (parallelism/one_f_one_b.py): forward-only, backward-only, and
# the steady one inside the loop over micro-batch groups.
_FILL_OP, _DRAIN_OP, _STEADY_OP = (
  re.compile(rf"(^|[/(]){re.escape(scope)}\)*/while$")
  for scope in (one_f_one_b.FILL_SCOPE, one_f_one_b.DRAIN_SCOPE, one_f_one_b.STEADY_SCOPE))


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  program: hlo.Program
  memory_per_device_bytes: int
  compile_target: str          # "cuda" or "host"
  compile_s: float
  note: str                    # why the host was used, when it was
  # Of memory_per_device_bytes, the train state split over `data` (train.shard_optimizer):
  # the part that shrinks as the data axis grows from the reduced mesh to the target.
  data_sharded_state_bytes: int = 0


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
    raise UserInputError(f"--gpus: the reduced mesh needs {devices} host CPU devices to compile "
                         f"on and only {len(host)} exist ({reason})")
  return host[:devices], "host", reason


@functools.lru_cache(maxsize=64)
def compile_step(model_cfg, train_cfg, sizes: tuple[tuple[str, int], ...], hw_name: str,
                 gpus_per_node: int, profile: tuple[tuple[str, float], ...] = ()
                 ) -> CompiledStep:
  """The train step compiled for `sizes` on `hw_name`; with a latency `profile`
  (latency_profile) XLA's scheduler plans with those durations (CUDA targets only)."""
  shape = [dict(sizes)[a] for a in AXES]
  devices, target, note = _compile_devices(hw_name, math.prod(shape), gpus_per_node)
  mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES,
              axis_types=(AxisType.Auto,) * len(AXES))
  start = time.perf_counter()
  options, cudnn = None, contextlib.nullcontext()
  if target == "cuda":
    options = {**FAST_BACKEND, "xla_gpu_kernel_cache_file": _kernel_cache_file()}
    cudnn = targets.cudnn_version_of(hw_name)
  elif model_cfg.attention == "cudnn":
    model_cfg = dataclasses.replace(model_cfg, attention="xla")
    note = f"{note}; attention compiled as xla (cuDNN attention needs a CUDA target)"
  program = train_step.build(model_cfg, train_cfg, mesh)
  if target == "cuda":
    options.update(_scheduler_memory(hw_name, sharding.bytes_per_device(program.abstract_state)))
  # A GPU compile logs from C++ what only XLA's developers need (how many instructions a
  # latency profile matched; rematerialization that cannot bring a step under the
  # device's memory, which the projection reports itself): shown only if it fails.
  quiet = platform_env.captured_stderr() if target == "cuda" else contextlib.nullcontext()
  with cudnn, _profile_file(profile if target == "cuda" else ()) as path, quiet:
    if path:
      options["xla_gpu_pgle_profile_file_or_directory_path"] = path
    lowered = program.lower(train_cfg.global_batch, model_cfg.seq_len)
    compiled = lowered.compile(compiler_options=options)
  memory = compiled.memory_analysis()
  per_device = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  analysis = hlo.analyze(compiled.as_text())
  return CompiledStep(analysis, per_device, target, time.perf_counter() - start, note,
                      sharding.bytes_per_device(program.abstract_state, split_over="data"))


def latency_profile(program: hlo.Program, hw: Hardware,
                    collective_s: Callable[[hlo.Collective], float]
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
      f.writelines(f'costs {{ name: "{name}" cost_us: {cost_us:.4f} }}\n'
                   for name, cost_us in profile)
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
  return {"xla_gpu_memory_limit_slop_factor":
          max(95, math.ceil(100 * (device_bytes - io_bytes) / default_limit))}


def pipeline_loops(program: hlo.Program) -> list[int]:
  """Entry positions of the pipeline's loops (forward and backward) at the top of the
  program (one pipeline pass)."""
  return [i for i, n in enumerate(program.entry) if _is_pipeline_loop(n)]


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
    if any(op.search(outer.op_name) for op in (_FILL_OP, _STEADY_OP, _DRAIN_OP)):
      found.append((outer, 1))
    inner = [n for n in outer.body if isinstance(n, hlo.Loop)]
    if _ACCUMULATION_OP.search(outer.op_name):
      found += [(n, outer.trip_count) for n in inner if _is_pipeline_loop(n)]
    found += [(n, outer.trip_count) for n in inner if _STEADY_OP.search(n.op_name)]
  return found


def with_micro_batches(program: hlo.Program, compiled: int, target: int,
                       virtual_stages: int = 1) -> hlo.Program:
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
    raise RuntimeError(f"{program.name}: a pipeline of several passes or the 1f1b schedule "
                       f"is compiled with all its micro-batches ({compiled}), not {target}")
  loops = pipeline_loops(program)
  if loops:
    entry = list(program.entry)
    for i in loops:
      entry[i] = dataclasses.replace(entry[i], trip_count=entry[i].trip_count
                                     + (target - compiled) * virtual_stages)
    return dataclasses.replace(program, entry=tuple(entry))
  found = [i for i, n in enumerate(program.entry)
           if isinstance(n, hlo.Loop) and _ACCUMULATION_OP.search(n.op_name)]
  if len(found) != 1:
    raise RuntimeError(f"expected one gradient-accumulation loop (a while op named "
                       f"'{train_step.GRAD_ACCUMULATION_SCOPE}/while') at the top of "
                       f"{program.name}, found {len(found)}")
  loop = program.entry[found[0]]
  trips = loop.trip_count + target - compiled
  if loop.trip_count_source == "unknown" or trips < 1:
    raise RuntimeError(f"{loop.name}: cannot run {target} micro-batches from a loop of "
                       f"{loop.trip_count} trips ({loop.trip_count_source}) compiled for "
                       f"{compiled}")
  entry = list(program.entry)
  entry[found[0]] = dataclasses.replace(loop, trip_count=trips)
  return dataclasses.replace(program, entry=tuple(entry))


def bubble_s(program: hlo.Program, hw: Hardware, collective_s: Callable[[hlo.Collective], float],
             micro_batches: int, stages: int, virtual_stages: int) -> float:
  """Seconds of the pipeline's idle trips: each pipeline loop runs micro_batches / passes
  x virtual_stages busy trips and stages - 1 idle ones (fill and drain) per pass, every trip the
  same body (ranks compute in lockstep, an idle rank on stale data), so the bubble is
  the idle trips' share of the loops' compiled time.

  The 1f1b schedule's loops run a forward and a backward chunk a trip, and every rank
  idles stages - 1 trips of each kind: as many trips of its fill loop (forward only) and
  of its drain loop (backward only)."""
  fill, drain = (_top_loops(program, op) for op in (_FILL_OP, _DRAIN_OP))
  if fill or drain:
    plan = one_f_one_b.schedule(micro_batches, stages, virtual_stages)
    if [n.trip_count for n in fill + drain] != [plan.delay, plan.drain_trips]:
      raise RuntimeError(f"{program.name}: 1f1b fill and drain loops of "
                         f"{[n.trip_count for n in fill + drain]} trips, not the schedule's "
                         f"{plan.delay} and {plan.drain_trips}")
    trip_s = lambda loop: cost_model.simulate(loop.body, hw, collective_s).step_s
    return (stages - 1) * (trip_s(fill[0]) + trip_s(drain[0]))
  loops = pipeline_passes(program)
  if stages > 1 and not loops:
    raise RuntimeError(f"{program.name}: no pipeline loop (a while op named "
                       f"'{pipeline.PIPELINE_SCOPE}/while') at the top of the program or of "
                       f"its pass loop")
  total = 0.0
  for loop, passes in loops:
    per_pass = micro_batches // passes
    if loop.trip_count != pipeline.trips(per_pass, stages, virtual_stages):
      raise RuntimeError(f"{loop.name}: {loop.trip_count} trips, not the "
                         f"{per_pass} x {virtual_stages} + {stages} - 1 of the schedule")
    idle = loop.trip_count - per_pass * virtual_stages
    total += passes * idle * cost_model.simulate(loop.body, hw, collective_s).step_s
  return total


def exposed_comm_by_axis_s(program: hlo.Program, hw: Hardware, reduced: layout.ReducedMesh,
                           collective_s: Callable[[hlo.Collective], float]) -> dict[str, float]:
  """Exposed communication by the mesh axes its collectives run along: how much shorter
  the step would be if that axis's collectives were free (the parts need not add up to
  exposed_comm_s: one collective can hide behind another)."""
  axes = {}
  for node, _ in hlo.collectives(program):
    groups = node.pairs if node.kind == "collective-permute" else node.groups
    axes[node.name] = layout.axes_of(groups, reduced) if groups else "none"
  step_s = cost_model.simulate(program.entry, hw, collective_s).step_s
  out = {}
  for axis in sorted(set(axes.values())):
    free = lambda n, axis=axis: 0.0 if axes[n.name] == axis else collective_s(n)
    out[axis] = step_s - cost_model.simulate(program.entry, hw, free).step_s
  return out


def collective_timer(reduced: layout.ReducedMesh, hw: Hardware
                      ) -> Callable[[hlo.Collective], float]:
  """Seconds for one compiled collective on the target: its slowest replica group's time.
  Placements and times are cached: a program repeats a few collectives many times."""
  domains_of: dict[hlo.Groups, list[tuple[int, ...]]] = {}
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
      times[key] = max(collectives.collective_time_s(node.kind, node.bytes, group, hw,
                                                     node.operands)
                       for group in domains_of[groups])
    return times[key]

  return time_s


def plan(exp, hw: Hardware, gpus: int) -> layout.ReducedMesh:
  """The target layout and its reduced mesh; bad input raises before anything compiles."""
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


def compiled_program(exp, hw: Hardware, reduced: layout.ReducedMesh,
                     collective_s: Callable[[hlo.Collective], float]
                     ) -> tuple[CompiledStep, float]:
  """The step the projection costs, and the seconds its compiles took: compiled as
  `reduced` says, then, with exp.latency_profile on a CUDA target, compiled again with the
  latency profile of that program on `hw`."""
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  args = (exp.model, train_cfg, tuple(reduced.sizes.items()), hw.name, hw.gpus_per_node)
  step = compile_step(*args)
  if not exp.latency_profile:
    return step, step.compile_s
  if step.compile_target != "cuda":
    note = f"{step.note}; no latency profile (a CUDA target's)"
    return dataclasses.replace(step, note=note), step.compile_s
  tuned = compile_step(*args, latency_profile(step.program, hw, collective_s))
  return tuned, step.compile_s + tuned.compile_s


def project_on(exp, hw: Hardware, reduced: layout.ReducedMesh) -> dict:
  """The projection record of `exp` on `reduced.target`, compiled as `reduced` says (tests
  pass a `reduced` equal to the target to compare against a direct compile)."""
  target = reduced.target
  gpus = target.devices
  timer = collective_timer(reduced, hw)
  step, compile_s = compiled_program(exp, hw, reduced, timer)
  stages = target.sizes.get("pipeline", 1)
  virtual = exp.train.virtual_stages if stages > 1 else 1
  program = with_micro_batches(step.program, reduced.compiled_micro_batches,
                               reduced.micro_batches, virtual)

  tokens_per_step = exp.train.global_batch * exp.model.seq_len
  data_growth = target.sizes["data"] / reduced.sizes["data"]
  memory_gb = (step.memory_per_device_bytes
               - step.data_sharded_state_bytes * (1 - 1 / data_growth)) / GB
  capacity_gb = hw.hbm_bytes / GB
  record = {
      "mode": "project", "experiment": exp.name, "model": exp.model.name,
      "params": param_count(exp.model), "hardware": hw.name, "gpus": gpus,
      "devices": gpus, "nodes": target.nodes, "mesh": target.sizes,
      "mesh_nvlink": target.nvlink, "mesh_infiniband": target.infiniband,
      "compiled_mesh": reduced.sizes, "global_batch": exp.train.global_batch,
      "micro_batches": reduced.micro_batches,
      "compiled_micro_batches": reduced.compiled_micro_batches,
      "seq_len": exp.model.seq_len, "tokens_per_step": tokens_per_step,
      "compute_dtype": exp.model.compute_dtype, "remat": exp.model.remat,
      "compile_target": step.compile_target, "compile_note": step.note,
      "compile_s": round(compile_s, 3),
      "hlo_flops_per_device": hlo.total_flops(program),
      "hlo_flops_per_step": hlo.total_flops(program) * gpus,
      "hlo_matmul_flops_per_step": hlo.dot_flops(program) * gpus,
      "memory_per_gpu_gb": memory_gb, "hbm_capacity_gb": capacity_gb,
      "fits": memory_gb <= capacity_gb,
      "peak_tflops_per_device": hw.peak_tflops("bf16"),
  }
  if not record["fits"]:
    record["over_capacity_gb"] = memory_gb - capacity_gb
    return record

  cost = cost_model.simulate(program.entry, hw, timer)
  tokens_per_s = tokens_per_step / cost.step_s
  model_tflops = tokens_per_s * train_flops_per_token(exp.model) / gpus / 1e12
  if hlo.uses_fp8(program) and hw.peak_tflops("fp8"):
    record["mfu_fp8"] = model_tflops / hw.peak_tflops("fp8")
  if exp.benchmark is not None:
    # An evaluation is a forward pass: a third of the model's training FLOPs, against
    # the compiled step's FLOPs (which include recomputation).
    forward = train_flops_per_token(exp.model) / 3 * tokens_per_step / record["hlo_flops_per_step"]
    record["time_to_train"] = exp.benchmark.estimate(cost.step_s, exp.train.global_batch,
                                                     forward)
    record["time_to_train_min"] = record["time_to_train"]["time_to_train_min"]
  record.update({
      "step_time_s": cost.step_s,
      "tokens_per_s": tokens_per_s,
      "tokens_per_s_per_gpu": tokens_per_s / gpus,
      "tokens_per_s_per_device": tokens_per_s / gpus,
      "model_tflops_per_device": model_tflops,
      "mfu": model_tflops / hw.peak_tflops("bf16"),
      # bubble_s: the pipeline's idle trips, a part of the step that the other three
      # also cover (its ops and waits are counted there too).
      # memory_bound_s is the part of compute_s whose time HBM traffic sets, the rest
      # being matmuls (and any op) at the FLOP rate; exposed_comm_by_axis_s splits
      # exposed_comm_s by the mesh axes of its collectives.
      "breakdown": {"compute_s": cost.compute_s, "exposed_comm_s": cost.exposed_comm_s,
                    "other_s": cost.other_s,
                    "bubble_s": bubble_s(program, hw, timer, reduced.micro_batches, stages,
                                         virtual),
                    "memory_bound_s": cost.memory_bound_s,
                    "exposed_comm_by_axis_s": exposed_comm_by_axis_s(program, hw, reduced,
                                                                     timer)},
      "comm_s": cost.comm_s,
  })
  return record
