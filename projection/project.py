"""Project an experiment's train step onto N GPUs of a given generation.

1. Lay the experiment's mesh over the target cluster (projection/layout.py) and shrink
   its data axis to get a mesh that compiles here.
2. Compile the real train step for that mesh: for the target GPU itself, deviceless,
   through JAX's CUDA plugin (projection/targets.py), or on host CPU devices when the
   plugin or a target config is missing.
3. Read the optimized program (projection/hlo.py), place each collective's replica
   group on the full cluster and cost it (projection/collectives.py), and run the
   two-stream cost model (projection/cost_model.py).

Compiles are cached by everything they depend on, so points that share a reduced
mesh and compile target (one model across GPU counts) compile once.
"""

import dataclasses
import functools
import math
import time

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from errors import UserInputError
from hardware import catalog
from hardware.catalog import Hardware
from model.flops import param_count, train_flops_per_token
from parallelism.mesh import AXES
from projection import collectives, cost_model, hlo, layout, targets
from train import step as train_step

GB = 1e9


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  program: hlo.Program
  memory_per_device_bytes: int
  compile_target: str          # "cuda" or "host"
  compile_s: float
  note: str                    # why the host was used, when it was


def hardware(name: str) -> Hardware:
  try:
    return catalog.get(name)
  except ValueError as e:
    raise UserInputError(f"--hardware: {e}") from None


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
                 gpus_per_node: int) -> CompiledStep:
  shape = [dict(sizes)[a] for a in AXES]
  devices, target, note = _compile_devices(hw_name, math.prod(shape), gpus_per_node)
  mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES,
              axis_types=(AxisType.Auto,) * len(AXES))
  start = time.perf_counter()
  program = train_step.build(model_cfg, train_cfg, mesh)
  compiled = program.lower(train_cfg.global_batch, model_cfg.seq_len).compile()
  memory = compiled.memory_analysis()
  per_device = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  analysis = hlo.analyze(compiled.as_text())
  return CompiledStep(analysis, per_device, target, time.perf_counter() - start, note)


def _collective_time(node: hlo.Collective, reduced: layout.ReducedMesh, hw: Hardware,
                     cache: dict) -> float:
  if node.kind == "collective-permute":
    groups = tuple(node.pairs[:1])
  else:
    groups = node.groups[:1]  # mesh collectives are symmetric: every group alike
  if not groups:
    return 0.0
  group = tuple(groups[0])
  growth = layout.group_growth(group, reduced)
  # An all-gather's output grows with its group; the other kinds' per-device bytes don't.
  size = int(node.bytes * growth) if node.kind == "all-gather" else node.bytes
  key = (node.kind, size, group)
  if key not in cache:
    domains = layout.target_group_domains(group, reduced)
    cache[key] = collectives.collective_time_s(node.kind, size, domains, hw)
  return cache[key]


def plan(exp, hw: Hardware, gpus: int) -> layout.ReducedMesh:
  """The target layout and its reduced mesh; bad input raises before anything compiles."""
  try:
    target = layout.target_layout(exp.mesh, gpus, hw.gpus_per_node, hw.nvlink_domain_size)
    return layout.reduce(target, exp.train.global_batch)
  except UserInputError as e:
    raise UserInputError(f"--gpus {gpus} on {hw.name}: {e}") from None


def project(exp, hw_name: str, gpus: int) -> dict:
  """One projection record for `exp` on `gpus` GPUs of `hw_name`."""
  hw = hardware(hw_name)
  reduced = plan(exp, hw, gpus)
  target = reduced.target
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  step = compile_step(exp.model, train_cfg, tuple(reduced.sizes.items()), hw.name,
                      hw.gpus_per_node)

  tokens_per_step = exp.train.global_batch * exp.model.seq_len
  memory_gb = step.memory_per_device_bytes / GB
  capacity_gb = hw.hbm_bytes / GB
  record = {
      "mode": "project", "experiment": exp.name, "model": exp.model.name,
      "params": param_count(exp.model), "hardware": hw.name, "gpus": gpus,
      "devices": gpus, "nodes": target.nodes, "mesh": target.sizes,
      "mesh_nvlink": target.nvlink, "mesh_infiniband": target.infiniband,
      "compiled_mesh": reduced.sizes, "global_batch": exp.train.global_batch,
      "seq_len": exp.model.seq_len, "tokens_per_step": tokens_per_step,
      "compute_dtype": exp.model.compute_dtype, "remat": exp.model.remat,
      "compile_target": step.compile_target, "compile_note": step.note,
      "compile_s": round(step.compile_s, 3),
      "hlo_flops_per_device": hlo.total_flops(step.program),
      "hlo_flops_per_step": hlo.total_flops(step.program) * gpus,
      "memory_per_gpu_gb": memory_gb, "hbm_capacity_gb": capacity_gb,
      "fits": memory_gb <= capacity_gb,
      "peak_tflops_per_device": hw.peak_tflops("bf16"),
  }
  if not record["fits"]:
    record["over_capacity_gb"] = memory_gb - capacity_gb
    return record

  cache: dict = {}
  cost = cost_model.simulate(step.program.entry, hw,
                             lambda node: _collective_time(node, reduced, hw, cache))
  tokens_per_s = tokens_per_step / cost.step_s
  model_tflops = tokens_per_s * train_flops_per_token(exp.model) / gpus / 1e12
  record.update({
      "step_time_s": cost.step_s,
      "tokens_per_s": tokens_per_s,
      "tokens_per_s_per_gpu": tokens_per_s / gpus,
      "tokens_per_s_per_device": tokens_per_s / gpus,
      "model_tflops_per_device": model_tflops,
      "mfu": model_tflops / hw.peak_tflops("bf16"),
      "breakdown": {"compute_s": cost.compute_s, "exposed_comm_s": cost.exposed_comm_s,
                    "other_s": cost.other_s},
      "comm_s": cost.comm_s,
  })
  return record
