"""What a measured point is checked against before it runs: the devices asked for, the
memory its activations and state need, and the peak its MFU is quoted against."""

import math
import os

import jax

from errors import UserInputError
from hardware import catalog
from measure import rates
from parallelism import mesh as mesh_lib
from train import step as train_step


def devices(wanted: int | None) -> list:
  """The first `wanted` devices of each process (None: all), process after process.

  --devices counts a process's own devices, so a multi-process run uses wanted x processes
  in all. Every process decides from the same global device list and the same flags, so
  a count that some process lacks is refused on every process before any collective.
  """
  by_process: dict[int, list] = {}
  for device in jax.devices():
    by_process.setdefault(device.process_index, []).append(device)
  fewest = min(len(local) for local in by_process.values())
  wanted = wanted or fewest
  if wanted > fewest:
    where = "per process" if len(by_process) > 1 else "here"
    raise UserInputError(f"--devices must be at most {fewest} {where}, got {wanted}")
  return [d for process in sorted(by_process) for d in by_process[process][:wanted]]


def _capacity_bytes(devices: list) -> int:
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] * len(devices)
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # host devices share it


def check_activation_memory(exp, layout: mesh_lib.MeshLayout, devices: list) -> None:
  """Refuse a batch or sequence whose activations cannot fit, before building the step
  (an absurd one would otherwise exhaust the host's memory while compiling or running).
  The bound is one layer's activations for the sequences in flight, a lower bound
  whatever the remat policy: s*b*h*(34 + 5*a*s/h) bytes at 16 bits (Korthikanti et al.
  2022, arXiv:2205.05198, section 4.1), scaled to the compute dtype."""
  m, t = exp.model, exp.train
  replicas = layout.sizes["data"] * layout.sizes["fsdp"]
  sequences = t.global_batch if not t.micro_batch else min(t.global_batch, t.micro_batch * replicas)
  dtype_bytes = 4 if m.compute_dtype == "float32" else 2
  one_layer = (
    m.seq_len
    * sequences
    * m.d_model
    * (34 + 5 * m.num_heads * m.seq_len / m.d_model)
    * dtype_bytes
    / 2
  )
  capacity = _capacity_bytes(devices)
  if one_layer > 0.8 * capacity:
    raise UserInputError(
      f"train.global_batch x model.seq_len: {sequences:,} sequences of {m.seq_len:,} "
      f"tokens need at least {one_layer / 1e9:,.0f} GB of activations for one layer, "
      f"these {len(devices)} devices have {capacity / 1e9:,.0f} GB; use a smaller batch, "
      f"sequence or train.micro_batch"
    )


def check_state_memory(program: train_step.TrainProgram, model_name: str, devices: list) -> None:
  """Refuse a model whose parameters and optimizer state cannot fit, before allocating."""
  state_bytes = sum(
    math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(program.abstract_state)
  )
  capacity = _capacity_bytes(devices)
  if state_bytes > 0.8 * capacity:
    raise UserInputError(
      f"model: {model_name} needs {state_bytes / 1e9:,.0f} GB for parameters and "
      f"optimizer state, these {len(devices)} devices have {capacity / 1e9:,.0f} GB; "
      f"choose a smaller size, e.g. --set model=gpt3-125m"
    )


def peak_tflops_per_device(devices: list, dtype: str) -> tuple[float, str]:
  """The MFU denominator and where it comes from."""
  if devices[0].platform == "cpu":
    host = rates.measure_matmul_tflops(dtype)
    return host / len(devices), (
      f"measured: {dtype} 2048^3 matmul on this host, "
      f"{host * 1e3:.0f} GFLOP/s shared by {len(devices)} CPU devices"
    )
  kind = devices[0].device_kind.upper()  # e.g. "NVIDIA H100 80GB HBM3"
  # Longest name first: "GB200" must not match as "B200".
  for name in sorted(catalog.names(), key=len, reverse=True):
    if name.upper() in kind:
      hw = catalog.get(name)
      # MFU on GPUs is quoted against dense BF16 peak, whatever the compute dtype.
      return hw.peak_tflops("bf16"), f"{hw.name} dense BF16 peak, hardware/catalog.py"
  raise UserInputError(
    f"--devices: no peak figure for {devices[0].device_kind} in hardware/catalog.py"
  )
