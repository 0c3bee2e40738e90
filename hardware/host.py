"""Profile of this machine for a run on N of its CPU devices, as a `Hardware` entry.

Lets the projection be checked end to end on CPU: compile a small model for N emulated
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count), predict its step with
the profile for N devices, and compare with the measured step (benchmarks/
closing_the_loop.py).

Active devices. XLA:CPU's devices share the host's cores and thread pools: one device
alone gets the whole machine, N busy devices share it. So every figure is measured with
the first N CPU devices all running the same micro-benchmark at once and is reported per
device, and a profile is measured and cached per active-device count N. It does not
depend on how many CPU devices the process has (project mode may create 512), only on
how many a run uses. Measured figures fall roughly as 1/N beyond one device per core
(benchmarks/closing_the_loop.py prints them), but not exactly, so they are measured.

What is measured, chosen so that the cost model's max(FLOPs / rate, bytes / bandwidth)
+ per-op overhead fits the small, overhead- and memory-bound ops of a CPU step:
  - per-op overhead: a chain of tiny dependent ops inside one program, the time per op
    counted by projection/hlo.py (what the cost model charges per op as a launch);
  - matmul FLOP/s at the shapes of a small model's dense layers (tokens x d_model x
    4 d_model), not the peak of a large GEMM; peak = the best shape;
  - memory bandwidth: one elementwise op on a 1 MiB array (a small model's activation
    size), its bytes as the cost model counts them over its time less the time of the
    same program on 4 KiB (the call's fixed cost). A large copy would measure DRAM and
    page faults on freshly allocated buffers instead;
  - all-reduce and all-gather over all N devices: chains of dependent collectives in
    one program at a few sizes, fitted to t = alpha + beta * bytes (bytes per device
    as in projection/collectives). Between CPU devices of one process a collective is
    a rendezvous plus memory copies.
A program's fixed cost per call (dispatch) is subtracted everywhere: the cost model has
no such term. Timings are the minimum over repeats, the least noisy estimate of the cost
on a shared machine. Results are cached as JSON keyed by machine identity and N.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hardware.catalog import Hardware, Protocol

FORMAT_VERSION = 2
CACHE_ENV = "JAX_SCALING_HOST_PROFILE"  # overrides the cache file path
DEFAULT_CACHE = Path.home() / ".cache" / "jax-scaling" / "host_profile.json"

# Matmul shapes (m, k, n): a small GPT's dense layers, tokens x d_model x 4 d_model,
# both ways round, plus a square one.
_FULL = dict(matmul_float32=((1024, 64, 256), (256, 64, 256), (256, 256, 256)),
             matmul_bfloat16=((256, 256, 256),), coll_kib=(4, 512), rounds=9)
_QUICK = dict(matmul_float32=((1024, 64, 256), (256, 256, 256)),
              matmul_bfloat16=((256, 256, 256),), coll_kib=(4, 512), rounds=5)
_MEMORY_KIB = 1024  # elementwise bandwidth on arrays of this size (per device)
_SCAN = 4           # slices in a scanned stack


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def host_profile(refresh: bool = False, *, devices: int = 1,
                 cache_path: str | os.PathLike | None = None, quick: bool = False) -> Hardware:
  """This machine as a `Hardware` (name 'host') for a run on `devices` CPU devices,
  measured once per device count and cached.

  refresh: measure again even if cached. cache_path: JSON file (default
  $JAX_SCALING_HOST_PROFILE or ~/.cache/jax-scaling/host_profile.json). quick: a
  smaller, noisier benchmark for tests; a cached full profile satisfies a quick
  request, not the other way round.
  """
  if devices < 1:
    raise ValueError(f"a host profile needs at least 1 active device, got {devices}")
  path = Path(cache_path or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
  identity = machine_identity()
  key = f"{_identity_key(identity)}|devices={devices}"
  cache = _read_cache(path)
  entry = cache["profiles"].get(key)
  if refresh or entry is None or (entry.get("quick") and not quick):
    t0 = time.perf_counter()
    figures = _measure(quick, devices)
    entry = {"identity": identity, "devices": devices, "quick": quick,
             "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
             "duration_s": round(time.perf_counter() - t0, 2), "figures": figures}
    cache = _read_cache(path)  # another process may have added entries meanwhile
    cache["profiles"][key] = entry
    _write_cache(path, cache)
  return profile_to_hardware(entry)


def machine_identity() -> dict[str, Any]:
  """What a cached profile is valid for: cpu model, cores, jax version."""
  import jax

  return {"cpu_model": _cpu_model(), "cpu_count": os.cpu_count() or 1,
          "jax_version": jax.__version__}


def profile_to_hardware(entry: dict[str, Any]) -> Hardware:
  """Map a cache entry (identity, active devices, measured figures) onto the catalog's type."""
  ident, f, n = entry["identity"], entry["figures"], int(entry["devices"])
  ar_busbw = _busbw_from_beta(f["allreduce_beta_s_per_byte"], 2.0 * (n - 1) / n, f)
  ag_busbw = _busbw_from_beta(f["allgather_beta_s_per_byte"], (n - 1) / n, f)
  mm = {dt: f[f"matmul_{dt}_gflops"] for dt in ("float32", "bfloat16")}
  src = (f"measured by hardware/host.py with {n} active CPU devices at "
         f"{entry['measured_at']} ({entry['duration_s']} s)")
  measured = {name: src for name in (
      "peak_bf16_tflops", "achievable_bf16_tflops", "peak_f32_tflops",
      "achievable_f32_tflops", "hbm_peak_tb_s", "nvlink_gb_s", "allreduce_ring_busbw_gb_s",
      "allgather_busbw_gb_s", "nic_gbit_s", "nic_achievable_gb_s", "protocols",
      "kernel_launch_us")}
  return Hardware(
      name="host",
      description=f"{ident['cpu_model']}, {ident['cpu_count']} cores, shared by {n} "
                  f"active JAX CPU devices (jax {ident['jax_version']})",
      # launch.py splits N CPU devices into 2 emulated nodes; all share one memory, so
      # the whole run is one "NVLink" domain and collectives are costed flat.
      gpus_per_node=n // 2 if n > 1 and n % 2 == 0 else n, nvlink_domain_size=n,
      # Peak = the best shape; achievable = all the model-size shapes together
      # (total FLOPs over total time).
      peak_bf16_tflops=max(mm["bfloat16"].values()) / 1e3, peak_fp8_tflops=None,
      achievable_bf16_tflops=_combined(mm["bfloat16"]) / 1e3, achievable_fp8_tflops=None,
      peak_f32_tflops=max(mm["float32"].values()) / 1e3,
      achievable_f32_tflops=_combined(mm["float32"]) / 1e3,
      hbm_gib=f["memory_per_device_gib"], hbm_peak_tb_s=f["memory_gb_s"] / 1e3,
      hbm_achievable_fraction=1.0,  # already a measurement
      nvlink_gb_s=ar_busbw, nvlink_sharp=False,
      allreduce_ring_busbw_gb_s=ar_busbw, allreduce_nvls_busbw_gb_s=None,
      allgather_busbw_gb_s=ag_busbw,
      # No real network: the devices of the other emulated "node" are in the same
      # process, reached through the same memory, so the "NIC" is the in-process link.
      nics_per_gpu=1, nic_gbit_s=ar_busbw * 8, nic_achievable_gb_s=ar_busbw,
      # Latency: a base plus a cost per ring step, fitted over groups of 2 and of all
      # active devices (one domain: no network steps).
      protocols=(Protocol("measured", base_us=f["collective_base_s"] * 1e6,
                          nvlink_hop_us=f["collective_hop_s"] * 1e6, net_hop_us=0.0,
                          tree_net_hop_us=0.0, bandwidth_fraction=1.0),),
      nvls_latency_us=None, kernel_launch_us=f["op_overhead_us"],
      sources={**measured,
               "gpus_per_node": "launch.py's emulated node: half the active CPU devices",
               "nvlink_domain_size": "active CPU devices: they share one memory",
               "hbm_gib": "physical memory / active devices",
               "hbm_achievable_fraction": "1.0: the bandwidth is measured",
               "nvlink_sharp": "no in-network reduction on a CPU",
               "nics_per_gpu": "in-process link stands in for a NIC",
               "nvls_latency_us": "no NVLS"},
  )


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def _measure(quick: bool, devices: int) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  cfg = _QUICK if quick else _FULL
  cpu = jax.devices("cpu")
  if devices > len(cpu):
    raise ValueError(f"a host profile for {devices} active devices needs {devices} CPU "
                     f"devices; this process has {len(cpu)} (launch.py: --devices={devices})")
  n = devices
  # Mesh axes (other, group): collectives run over "g", in n / g groups at once.
  meshes = {g: Mesh(np.array(cpu[:n]).reshape(n // g, g), ("o", "g")) for g in {2, n}
            if n % g == 0}
  spec = P(("o", "g"))

  def per_device(fn: Callable, g: int = n) -> Callable:
    # The same local computation on every active device at once.
    return jax.jit(jax.shard_map(fn, mesh=meshes[g], in_specs=spec, out_specs=spec,
                                 check_vma=False))  # a psum's result is per-device here

  def local(shape: tuple[int, ...], dtype=jnp.float32, value: float = 1.0, g: int = n):
    return jnp.full((n * shape[0], *shape[1:]), value, dtype,
                    device=NamedSharding(meshes[g], spec))

  # Every figure is a program's work, as projection/hlo.py counts it (ops, bytes, dot
  # FLOPs, collectives), over its typical (median) run time. The program repeats a body
  # in a loop long enough (~20-40 ms, per-device work about 1/n) that its fixed cost per
  # call is negligible and that it sees what a small model's step of that length sees on
  # a machine shared with other processes (see _typical_times).
  jobs: dict[str, tuple[Callable, Any]] = {}
  work: dict[str, dict[str, float]] = {}

  def repeated(name: str, body: Callable, x, repeats: int, g: int = n) -> None:
    """`body` (which keeps its argument's shape) `repeats` times in a loop."""
    program = per_device(lambda v: jax.lax.fori_loop(0, max(1, repeats), lambda i, u: body(u),
                                                    v), g).lower(x).compile()
    jobs[name], work[name] = (program, x), _counts(program)

  def chain(op: Callable, steps: int) -> Callable:
    def body(v):
      for _ in range(steps):
        v = op(v)
      return v
    return body

  def scan(op: Callable) -> Callable:
    # As the model's layer scan runs its layers: a slice read, the op, its result
    # written into the output stack.
    return lambda v: jax.lax.scan(lambda c, row: (c, op(row)), 0.0, v[0])[1][None]

  # Per-op overhead: a chain of tiny dependent dots (dots do not fuse).
  repeated("overhead", chain(lambda v: jnp.tanh(v @ v), 32), local((8, 8), value=0.1), 2048 // n)
  # Matmuls: a dense layer pair, [m, k] @ [k, k2] @ [k2, k], on each slice of a stack.
  for dtype in ("float32", "bfloat16"):
    for m, k, k2 in cfg[f"matmul_{dtype}"]:
      w1, w2 = jnp.full((k, k2), 0.01, dtype), jnp.full((k2, k), 0.01, dtype)
      repeated(f"matmul_{dtype}/{m}x{k}x{k2}", scan(lambda row, w1=w1, w2=w2: row @ w1 @ w2),
               local((1, _SCAN, m, k), dtype), round(3e7 / (m * k * k2) / n))
  repeated("memory", scan(lambda row: row * 1.5 + 1.0),
           local((1, _SCAN, _MEMORY_KIB * 256)), 48 // n)
  collective_ops = {
      "allreduce": lambda v: jax.lax.psum(v, "g"),
      # The first shard of the result is sliced out to chain the next one.
      "allgather": lambda v: jax.lax.all_gather(v, "g", tiled=True)[:v.shape[0]]}
  for g in meshes if n > 1 else ():
    for kind, op in collective_ops.items():
      for kib in cfg["coll_kib"]:
        elems = kib * 256 // g * g  # float32, a multiple of g: all-gather shards evenly
        x = local((elems if kind == "allreduce" else elems // g,), value=1.0 / g, g=g)
        # A small collective's latency grows about as n, its bandwidth term as 1 / n.
        repeated(f"{kind}/{g}/{kib}", chain(op, 8), x, 512 // n**2 if kib < 64 else 64 // n, g)

  seconds = _typical_times(jobs, cfg["rounds"])
  overhead = seconds["overhead"] / max(work["overhead"]["ops"], 1)
  figures: dict[str, Any] = {"op_overhead_us": overhead * 1e6}

  def busy_s(name: str) -> float:  # the run time less the cost model's per-op overhead
    return max(seconds[name] - work[name]["ops"] * overhead, 1e-9)

  for dtype in ("float32", "bfloat16"):
    figures[f"matmul_{dtype}_gflops"] = {
        f"{m}x{k}x{k2}": work[f"matmul_{dtype}/{m}x{k}x{k2}"]["dot_flops"]
        / busy_s(f"matmul_{dtype}/{m}x{k}x{k2}") / 1e9 for m, k, k2 in cfg[f"matmul_{dtype}"]}
  figures["memory_gb_s"] = work["memory"]["bytes"] / busy_s("memory") / 1e9
  figures["memory_per_device_gib"] = _physical_memory_bytes() / n / 2**30

  if n > 1:
    alphas = []  # (kind, group size, alpha)
    for kind in collective_ops:
      for g in meshes:
        names = [f"{kind}/{g}/{kib}" for kib in cfg["coll_kib"]]
        sizes = [work[m]["collective_bytes"] / work[m]["collectives"] for m in names]
        # Less the ops the chain adds around them (all-gather: the slice), as costed.
        times = [max(busy_s(m) - work[m]["bytes"] / (figures["memory_gb_s"] * 1e9), 1e-9)
                 / work[m]["collectives"] for m in names]
        alpha, beta = _fit_alpha_beta(sizes, times)
        alphas.append((kind, g, alpha))
        figures[f"{kind}_points_group_{g}"] = [[s, t] for s, t in zip(sizes, times)]
        if g == n:  # bandwidth from the group of all active devices
          figures[f"{kind}_alpha_s"], figures[f"{kind}_beta_s_per_byte"] = alpha, beta
    figures["collective_base_s"], figures["collective_hop_s"] = _fit_latency(alphas)
  else:  # one device: nothing to communicate; a "collective" is a memory copy
    for name in ("allreduce", "allgather"):
      figures[f"{name}_alpha_s"] = overhead
      figures[f"{name}_beta_s_per_byte"] = 1.0 / (figures["memory_gb_s"] * 1e9)
    figures["collective_base_s"], figures["collective_hop_s"] = overhead, 0.0
  return figures


def _counts(compiled) -> dict[str, float]:
  """What the cost model sees in a program: compute ops, their bytes and dot FLOPs, and
  collectives with their bytes (projection/collectives conventions)."""
  from projection import hlo  # lazy: hardware/ does not otherwise need projection/

  program = hlo.analyze(compiled.as_text())
  c = {"ops": 0, "bytes": 0, "dot_flops": 0.0, "collectives": 0, "collective_bytes": 0}
  for node, times in hlo.walk(program):
    if isinstance(node, hlo.Compute):
      c["ops"] += times
      c["bytes"] += (node.bytes_read + node.bytes_written) * times
      c["dot_flops"] += node.dot_flops * times
    elif isinstance(node, hlo.Collective):
      c["collectives"] += times
      c["collective_bytes"] += node.bytes * times
  return c


def _typical_times(jobs: dict[str, tuple[Callable, Any]], rounds: int) -> dict[str, float]:
  """Median wall time of each job over `rounds` rounds of one call per job, after one
  warm-up call each. Interleaving spreads each job's calls over the whole measurement,
  so load from other processes hits every job alike, and the median of calls as long as
  a small model's step is what such a step sees: on a shared machine it takes longer
  than on a quiet one, and a profile of the quiet machine (minimum times) would project
  the quiet machine's steps, which the measured medians do not reach."""
  for fn, x in jobs.values():
    fn(x).block_until_ready()
  times: dict[str, list[float]] = {name: [] for name in jobs}
  for _ in range(rounds):
    for name, (fn, x) in jobs.items():
      t0 = time.perf_counter()
      fn(x).block_until_ready()
      times[name].append(time.perf_counter() - t0)
  return {name: float(np.median(t)) for name, t in times.items()}


def _fit_latency(alphas: list[tuple[str, int, float]]) -> tuple[float, float]:
  """Collective latency as projection/collectives models it inside one domain: a base
  per call plus a cost per ring step, 2(g-1) steps for an all-reduce over g devices and
  g-1 for an all-gather. Least squares over the measured alphas, both terms >= 0."""
  steps = np.array([2.0 * (g - 1) if kind == "allreduce" else g - 1.0 for kind, g, _ in alphas])
  t = np.array([a for _, _, a in alphas])
  (base, hop), *_ = np.linalg.lstsq(np.c_[np.ones_like(steps), steps], t, rcond=None)
  if hop < 0:
    return float(t.mean()), 0.0
  if base < 0:
    return 0.0, float((t * steps).sum() / (steps * steps).sum())
  return float(base), float(hop)


def _fit_alpha_beta(sizes: list[int], times: list[float]) -> tuple[float, float]:
  """Least-squares t = alpha + beta * bytes; clamped positive (noise on a loaded
  machine can tilt the line; a collective never gets cheaper with more bytes)."""
  beta, alpha = np.polyfit(np.asarray(sizes, float), np.asarray(times, float), 1)
  if beta <= 0:  # flat or noisy: bandwidth from the largest point
    beta = times[-1] / sizes[-1]
  alpha = max(float(alpha), 1e-7)
  return alpha, float(beta)


def _busbw_from_beta(beta_s_per_byte: float, factor: float, f: dict[str, Any]) -> float:
  """Bus bandwidth (GB/s) implied by the fitted slope: t = factor x S / B."""
  if factor <= 0:  # one device: no link; use memory bandwidth
    return f["memory_gb_s"]
  return factor / beta_s_per_byte / 1e9


def _combined(by_shape: dict[str, float]) -> float:
  """GFLOP/s of all the shapes run one after another: total FLOPs over total time."""
  flops = {s: float(np.prod([int(d) for d in s.split("x")])) if "x" in s else 1.0
           for s in by_shape}
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


def _physical_memory_bytes() -> int:
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
