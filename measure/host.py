"""This machine as a `Hardware` entry: its identity, the cache of its measured profiles
(one per active-device count), and a profile's figures mapped onto the catalog's type.

A host profile lets the projection be checked end to end on CPU: compile a small model
for N emulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count), predict
its step with the profile for N active devices, and compare with the measured step
(benchmarks/closing_the_loop.py). measure/host_programs.py runs and times the
micro-benchmark programs a profile is made of; measure/host_calibration.py turns their
times into the figures stored here, counting each program's work as the projection's HLO
reader does.

Active devices. XLA:CPU's devices share the host's cores and thread pools: one device
alone gets the whole machine, N busy devices share it. So every figure is per device with
N devices busy, and a profile is measured and cached per active-device count N. It does
not depend on how many CPU devices the process has (project mode may create 512), only on
how many a run uses. Profiles are cached as JSON keyed by machine identity and N.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from hardware.catalog import Hardware, Protocol

FORMAT_VERSION = 4  # of the cache file; a file of another version is measured afresh
CACHE_ENV = "JAX_SCALING_HOST_PROFILE"  # overrides the cache file path
DEFAULT_CACHE = Path.home() / ".cache" / "jax-scaling" / "host_profile.json"

# ---------------------------------------------------------------------------
# Profiles: the cache and the Hardware entry
# ---------------------------------------------------------------------------


def cache_file(cache_path: str | os.PathLike | None = None) -> Path:
  """The cache file: `cache_path`, else $JAX_SCALING_HOST_PROFILE, else
  ~/.cache/jax-scaling/host_profile.json."""
  return Path(cache_path or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def cached_entry(
  devices: int, cache_path: str | os.PathLike | None = None
) -> dict[str, Any] | None:
  """This machine's cached profile entry for `devices` active devices, or None."""
  key = f"{_identity_key(machine_identity())}|devices={devices}"
  return _read_cache(cache_file(cache_path))["profiles"].get(key)


def store(
  cache_path: str | os.PathLike | None,
  devices: int,
  quick: bool,
  figures: dict[str, Any],
  duration_s: float,
) -> dict[str, Any]:
  """A cache entry for these figures, written to the cache file; returns the entry."""
  path, identity = cache_file(cache_path), machine_identity()
  entry = {
    "identity": identity,
    "devices": devices,
    "quick": quick,
    "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    "duration_s": round(duration_s, 2),
    "figures": figures,
  }
  cache = _read_cache(path)  # another process may have added entries meanwhile
  cache["profiles"][f"{_identity_key(identity)}|devices={devices}"] = entry
  _write_cache(path, cache)
  return entry


def machine_identity() -> dict[str, Any]:
  """What a cached profile is valid for: cpu model, cores, jax version."""
  import jax

  return {
    "cpu_model": _cpu_model(),
    "cpu_count": os.cpu_count() or 1,
    "jax_version": jax.__version__,
  }


def profile_to_hardware(entry: dict[str, Any]) -> Hardware:
  """Map a cache entry (identity, active devices, measured figures) onto the catalog's type."""
  ident, f, n = entry["identity"], entry["figures"], int(entry["devices"])
  ar_busbw = _busbw_from_beta(f["allreduce_beta_s_per_byte"], 2.0 * (n - 1) / n, f)
  ag_busbw = _busbw_from_beta(f["allgather_beta_s_per_byte"], (n - 1) / n, f)
  mm = {dt: f[f"matmul_{dt}_gflops"] for dt in ("float32", "bfloat16")}
  src = (
    f"measured by measure/host_programs.py, calibrated by measure/host_calibration.py, "
    f"with {n} active CPU devices at "
    f"{entry['measured_at']} ({entry['duration_s']} s)"
  )
  measured = {
    name: src
    for name in (
      "peak_bf16_tflops",
      "achievable_bf16_tflops",
      "peak_f32_tflops",
      "achievable_f32_tflops",
      "hbm_peak_tb_s",
      "nvlink_gb_s",
      "allreduce_ring_busbw_gb_s",
      "allgather_busbw_gb_s",
      "nic_gbit_s",
      "nic_achievable_gb_s",
      "protocols",
      "kernel_launch_us",
      "operand_latency_fraction",
    )
  }
  return Hardware(
    name="host",
    description=f"{ident['cpu_model']}, {ident['cpu_count']} cores, shared by {n} "
    f"active JAX CPU devices (jax {ident['jax_version']})",
    # launch.py splits N CPU devices into 2 emulated nodes; all share one memory, so
    # the whole run is one "NVLink" domain and collectives are costed flat.
    gpus_per_node=n // 2 if n > 1 and n % 2 == 0 else n,
    nvlink_domain_size=n,
    # Peak = the best shape; achievable = all the model-size shapes together
    # (total FLOPs over total time), capped at peak: with one shape (quick) the
    # harmonic mean can round one ulp above it.
    peak_bf16_tflops=max(mm["bfloat16"].values()) / 1e3,
    peak_fp8_tflops=None,
    achievable_bf16_tflops=min(_combined(mm["bfloat16"]), max(mm["bfloat16"].values())) / 1e3,
    achievable_fp8_tflops=None,
    peak_f32_tflops=max(mm["float32"].values()) / 1e3,
    achievable_f32_tflops=min(_combined(mm["float32"]), max(mm["float32"].values())) / 1e3,
    # Peak: the streaming elementwise op; achievable: what a step's ops get (the
    # reference program's bandwidth; a profile from before it had none).
    hbm_gib=f["memory_per_device_gib"],
    hbm_peak_tb_s=f["memory_gb_s"] / 1e3,
    hbm_achievable_fraction=f.get("step_memory_gb_s", f["memory_gb_s"]) / f["memory_gb_s"],
    nvlink_gb_s=ar_busbw,
    nvlink_sharp=False,
    allreduce_ring_busbw_gb_s=ar_busbw,
    allreduce_nvls_busbw_gb_s=None,
    allgather_busbw_gb_s=ag_busbw,
    # No real network: the devices of the other emulated "node" are in the same
    # process, reached through the same memory, so the "NIC" is the in-process link.
    nics_per_gpu=1,
    nic_gbit_s=ar_busbw * 8,
    nic_achievable_gb_s=ar_busbw,
    # Latency: a base plus a cost per ring step, fitted over groups of 2 and of all
    # active devices (one domain: no network steps).
    protocols=(
      Protocol(
        "measured",
        base_us=f.get("collective_base_s", f["allreduce_alpha_s"]) * 1e6,
        nvlink_hop_us=f.get("collective_hop_s", 0.0) * 1e6,
        net_hop_us=0.0,
        tree_net_hop_us=0.0,
        bandwidth_fraction=1.0,
      ),
    ),
    nvls_latency_us=None,
    kernel_launch_us=f["op_overhead_us"],
    operand_latency_fraction=f.get("operand_latency_fraction", 0.0),
    sources={
      **measured,
      "gpus_per_node": "launch.py's emulated node: half the active CPU devices",
      "nvlink_domain_size": "active CPU devices: they share one memory",
      "hbm_gib": "physical memory / active devices",
      "hbm_achievable_fraction": "measured: a step's bandwidth (the reference "
      "program's) over the streaming op's",
      "nvlink_sharp": "no in-network reduction on a CPU",
      "nics_per_gpu": "in-process link stands in for a NIC",
      "nvls_latency_us": "no NVLS",
    },
  )


def _busbw_from_beta(beta_s_per_byte: float, factor: float, f: dict[str, Any]) -> float:
  """Bus bandwidth (GB/s) implied by the fitted slope: t = factor x S / B."""
  if factor <= 0:  # one device: no link; use memory bandwidth
    return f["memory_gb_s"]
  return factor / beta_s_per_byte / 1e9


def _combined(by_shape: dict[str, float]) -> float:
  """GFLOP/s of all the shapes run one after another: total FLOPs over total time."""
  flops = {s: float(np.prod([int(d) for d in s.split("x")])) if "x" in s else 1.0 for s in by_shape}
  return sum(flops.values()) / sum(flops[s] / by_shape[s] for s in by_shape)


# ---------------------------------------------------------------------------
# Identity and cache
# ---------------------------------------------------------------------------


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as fh:
      for line in fh:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or "unknown"


def physical_memory_bytes() -> int:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return 0


def _identity_key(identity: dict[str, Any]) -> str:
  return "|".join(f"{k}={identity[k]}" for k in sorted(identity))


def _read_cache(path: Path) -> dict[str, Any]:
  try:
    data = json.loads(path.read_text())
    if data.get("format") == FORMAT_VERSION and isinstance(data.get("profiles"), dict):
      return data
  except (OSError, ValueError):
    pass
  return {"format": FORMAT_VERSION, "profiles": {}}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
  os.replace(tmp, path)  # atomic: concurrent readers never see half a file
