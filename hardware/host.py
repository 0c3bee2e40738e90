"""Profile of this machine for a run on N of its CPU devices, as a `Hardware` entry.

Lets the projection be checked end to end on CPU: compile a small model for N emulated
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count), predict its step with
the profile for N active devices, and compare with the measured step
(benchmarks/closing_the_loop.py).

Active devices. XLA:CPU's devices share the host's cores and thread pools: one device
alone gets the whole machine, N busy devices share it. So every figure is measured with
the first N CPU devices all running the same program at once and is reported per
device, and a profile is measured and cached per active-device count N. It does not
depend on how many CPU devices the process has (project mode may create 512), only on
how many a run uses. Throughputs come out close to the one-device figure / N, but not
exactly (closing_the_loop.py prints them), so they are measured, not divided.

What is measured, so that the cost model (projection/cost_model.py: max(FLOPs / matmul
rate, bytes / bandwidth) + a per-op overhead; collectives by projection/collectives.py)
fits the small ops of a CPU step. Every figure is a program's work as projection/hlo.py
counts it (ops, bytes, dot FLOPs, collective bytes) over the program's run time:
  - matmul FLOP/s at a small GPT's dense-layer shapes ([m, k] @ [k, k2] @ [k2, k], e.g.
    1024 tokens x d_model 64 x 4 d_model), not a large GEMM's peak;
  - memory bandwidth of an elementwise op on 1 MiB slices of a stack, read and written
    as a layer scan does (a large copy would measure DRAM and page faults instead);
  - all-reduce and all-gather over groups of 2 and of all N devices at 4 KiB and 512 KiB,
    fitted to a latency (base + per ring step, as projection/collectives models one
    domain) and a bus bandwidth. Between CPU devices of one process a collective is a
    rendezvous plus memory copies;
  - the latency each operand of a multi-operand all-reduce adds (XLA combines a step's
    small gradient all-reduces into one of up to ~26 operands, and XLA:CPU runs it as
    one rendezvous per operand, each about one collective latency): an 8-operand
    all-reduce against a one-operand one of the same bytes, as a fraction of the
    latency above;
  - the per-op overhead (the cost model's kernel launch): a chain of tiny dependent ops
    (~1 us an op);
  - the bandwidth a step's own ops get ("achievable", against the streaming op's
    "peak"): the ops of a real step (transposes, reductions, broadcasts, layout copies)
    move their bytes several times slower than the streaming op. A reference program -
    train steps of a small decoder written here (not the project's model: embeddings,
    attention, MLP, cross-entropy, AdamW) - is timed, and the step bandwidth is the one
    at which the cost model's time for it (the overhead and matmul rates above) equals
    its measured time. The excess is charged per byte, not per op: on 2 devices each
    device's ops move half the bytes and take about half the time, which a per-op charge
    (this profile's earlier form) cannot follow. Its op mix (biases, norm scales,
    per-parameter optimizer updates) was matched to a small GPT step's while developing
    closing_the_loop.py; no figure is fitted to a measured step.
Each program loops long enough (~20-40 ms, like a small model's step) that its fixed
cost per call is negligible. All programs run in interleaved rounds and each keeps its
median time: on a machine shared with other processes that is what a step of that length
sees (the minimum would be a quiet machine's figure, which loaded steps do not reach).
`Profiler` runs the rounds one at a time, so that they can also be interleaved with the
steps they profile (a step hook: benchmarks/closing_the_loop.py), and the load that
other processes put on the 2 cores falls on both alike.
Results are cached as JSON keyed by machine identity and N.
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

FORMAT_VERSION = 4  # 4: latency per collective operand; 3: per-op overhead, step bandwidth
CACHE_ENV = "JAX_SCALING_HOST_PROFILE"  # overrides the cache file path
DEFAULT_CACHE = Path.home() / ".cache" / "jax-scaling" / "host_profile.json"

# Matmul shapes (m, k, k2), run as [m, k] @ [k, k2] @ [k2, k]: a small GPT's MLP at 1024
# and at 256 tokens (tokens x d_model 64 x 4 d_model), and a square one.
_FULL = dict(
  matmul_float32=((1024, 64, 256), (256, 64, 256), (256, 256, 256)),
  matmul_bfloat16=((256, 256, 256),),
  coll_kib=(4, 512),
  rounds=13,
)
_QUICK = dict(
  matmul_float32=((1024, 64, 256), (256, 256, 256)),
  matmul_bfloat16=((256, 256, 256),),
  coll_kib=(4, 512),
  rounds=5,
)
_MEMORY_KIB = 1024  # elementwise bandwidth on arrays of this size (per device)
_SCAN = 4  # slices in a scanned stack
_OPERANDS = 8  # operands of the multi-operand all-reduce


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def host_profile(
  refresh: bool = False,
  *,
  devices: int = 1,
  cache_path: str | os.PathLike | None = None,
  quick: bool = False,
) -> Hardware:
  """This machine as a `Hardware` (name 'host') for a run on `devices` CPU devices,
  measured once per device count and cached.

  refresh: measure again even if cached. cache_path: JSON file (default
  $JAX_SCALING_HOST_PROFILE or ~/.cache/jax-scaling/host_profile.json). quick: a
  smaller, noisier benchmark for tests; a cached full profile satisfies a quick
  request, not the other way round.
  """
  if devices < 1:
    raise ValueError(f"a host profile needs at least 1 active device, got {devices}")
  path = _cache_file(cache_path)
  key = f"{_identity_key(machine_identity())}|devices={devices}"
  entry = _read_cache(path)["profiles"].get(key)
  if refresh or entry is None or (entry.get("quick") and not quick):
    t0 = time.perf_counter()
    figures = _measure(quick, devices)
    entry = _store(path, devices, quick, figures, time.perf_counter() - t0)
  return profile_to_hardware(entry)


def _cache_file(cache_path: str | os.PathLike | None) -> Path:
  return Path(cache_path or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _store(
  cache_path: str | os.PathLike | None,
  devices: int,
  quick: bool,
  figures: dict[str, Any],
  duration_s: float,
) -> dict[str, Any]:
  """A cache entry for these figures, written to the cache file; returns the entry."""
  path, identity = _cache_file(cache_path), machine_identity()
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
    f"measured by hardware/host.py with {n} active CPU devices at "
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


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def _measure(quick: bool, devices: int) -> dict[str, Any]:
  profiler = Profiler(devices, quick)
  for _ in range(profiler.cfg["rounds"]):
    profiler.round()
  return profiler.figures()


class Profiler:
  """The micro-benchmarks for `devices` active devices, run one round (one call of each
  program) at a time, so that they can be interleaved with the run they profile: as a
  train/loop.py step hook, a round runs before each step, outside the step's clock, and
  other processes' load falls on the profile and on the steps alike
  (benchmarks/closing_the_loop.py). `figures()` / `hardware()` use the median of each
  program's times over the rounds run since the last `reset()`."""

  def __init__(self, devices: int, quick: bool = False) -> None:
    import jax

    cpu = jax.devices("cpu")
    if devices > len(cpu):
      raise ValueError(
        f"a host profile for {devices} active devices needs {devices} CPU "
        f"devices; this process has {len(cpu)} (launch.py: --devices={devices})"
      )
    self.devices, self.quick = devices, quick
    self.cfg = _QUICK if quick else _FULL
    self.bench = _Programs(cpu[:devices])
    self.bench.add_all(self.cfg)
    for fn, x in self.bench.jobs.values():  # warm-up
      jax.block_until_ready(fn(x))
    self.reset()

  def reset(self) -> None:
    self.times: dict[str, list[float]] = {name: [] for name in self.bench.jobs}
    self.started = time.perf_counter()

  def round(self) -> None:
    import jax

    for name, (fn, x) in self.bench.jobs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x))
      self.times[name].append(time.perf_counter() - t0)

  def figures(self) -> dict[str, Any]:
    if not self.times["reference"]:
      raise RuntimeError("no profile round has run since the last reset")
    return self.bench.figures(self.cfg, {k: float(np.median(t)) for k, t in self.times.items()})

  def hardware(self, cache_path: str | os.PathLike | None = None) -> Hardware:
    """The profile of the rounds so far, stored in the cache as host_profile() would."""
    return profile_to_hardware(
      _store(
        cache_path, self.devices, self.quick, self.figures(), time.perf_counter() - self.started
      )
    )

  # train/loop.py's StepHook: a round before each step.
  def before_step(self, step: int) -> None:
    self.round()

  def after_step(self, step: int, metrics: dict, step_time_s: float) -> None:
    pass

  def close(self) -> None:
    pass


class _Programs:
  """The micro-benchmark programs for n active devices, and figures from their times."""

  def __init__(self, devices: list) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    self.jax, self.jnp, self.n = jax, jnp, len(devices)
    # Mesh axes (other, group): collectives run over "g", in n / g groups at once.
    self.meshes = {
      g: Mesh(np.array(devices).reshape(self.n // g, g), ("o", "g"))
      for g in sorted({2, self.n})
      if self.n % g == 0
    }
    self.jobs: dict[str, tuple[Callable, Any]] = {}  # name -> (compiled program, input)
    self.work: dict[str, dict[str, float]] = {}  # name -> _counts of the program

  def per_device(self, fn: Callable, g: int | None = None) -> Callable:
    """`fn` on every active device at once (check_vma off: a psum's result stays local)."""
    from jax.sharding import PartitionSpec as P

    spec = P(("o", "g"))
    return self.jax.jit(
      self.jax.shard_map(
        fn, mesh=self.meshes[g or self.n], in_specs=spec, out_specs=spec, check_vma=False
      )
    )

  def local(
    self, shape: tuple[int, ...], dtype="float32", value: float = 1.0, g: int | None = None
  ):
    """An array of `shape` on each active device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(self.meshes[g or self.n], P(("o", "g")))
    return self.jnp.full((self.n * shape[0], *shape[1:]), value, dtype, device=sharding)

  def add(self, name: str, program: Callable, x) -> None:
    compiled = program.lower(x).compile()
    self.jobs[name], self.work[name] = (compiled, x), _counts(compiled)

  def add_repeated(self, name: str, body: Callable, x, repeats: int, g: int | None = None) -> None:
    """`body` (which keeps its argument's shape) `repeats` times in a loop."""
    loop = lambda v: self.jax.lax.fori_loop(0, max(1, repeats), lambda i, u: body(u), v)
    self.add(name, self.per_device(loop, g), x)

  def add_all(self, cfg: dict[str, Any]) -> None:
    jax, jnp, n = self.jax, self.jnp, self.n

    def chain(op: Callable, steps: int) -> Callable:
      def body(v):
        for _ in range(steps):
          v = op(v)
        return v

      return body

    def scan(op: Callable) -> Callable:  # a slice read, the op, the result written back
      return lambda v: jax.lax.scan(lambda c, row: (c, op(row)), 0.0, v[0])[1][None]

    # Tiny dependent dots (dots do not fuse), to take their overhead out of the rest.
    self.add_repeated(
      "tiny_ops", chain(lambda v: jnp.tanh(v @ v), 32), self.local((8, 8), value=0.1), 2048 // n
    )
    for dtype in ("float32", "bfloat16"):
      for m, k, k2 in cfg[f"matmul_{dtype}"]:
        w1, w2 = jnp.full((k, k2), 0.01, dtype), jnp.full((k2, k), 0.01, dtype)
        self.add_repeated(
          f"matmul_{dtype}/{m}x{k}x{k2}",
          scan(lambda row, w1=w1, w2=w2: row @ w1 @ w2),
          self.local((1, _SCAN, m, k), dtype),
          round(3e7 / (m * k * k2) / n),
        )
    self.add_repeated(
      "memory",
      scan(lambda row: row * 1.5 + 1.0),
      self.local((1, _SCAN, _MEMORY_KIB * 256)),
      48 // n,
    )
    for g in self.meshes if n > 1 else ():
      for kind, op in _COLLECTIVES.items():
        for kib in cfg["coll_kib"]:
          elems = kib * 256 // g * g  # float32, a multiple of g: all-gather shards evenly
          x = self.local((elems if kind == "allreduce" else elems // g,), value=1.0 / g, g=g)
          # A small collective's latency grows about as n, a large one's time as 1 / n.
          self.add_repeated(
            f"{kind}/{g}/{kib}",
            chain(lambda v, op=op: op(jax, v), 8),
            x,
            512 // n**2 if kib < 64 else 64 // n,
            g,
          )
    if n > 1:
      # One all-reduce of _OPERANDS arrays, as XLA combines a step's small gradient
      # all-reduces, moving as many bytes as the smallest single all-reduce above. One
      # a loop iteration: XLA would run a chain of them in one body operand by operand.
      elems = cfg["coll_kib"][0] * 256 // _OPERANDS
      self.add_repeated(
        f"allreduce_operands/{n}",
        lambda v: jax.lax.psum(v, "g"),
        tuple(self.local((elems,), value=1.0 / n) for _ in range(_OPERANDS)),
        8 * 512 // n**2,
      )
    # Train steps of a small decoder on 1024 / n tokens per device.
    tokens = self.local((max(1, 1024 // n // 64), 64), "int32")
    self.add(
      "reference",
      self.per_device(
        lambda t: jax.lax.fori_loop(
          0,
          max(1, 4 // n),
          lambda i, state: _reference_step(jax, jnp, state, t),
          _reference_state(jnp),
        )["params"]["embed"]
      ),
      tokens,
    )

  def operand_fraction(self, f: dict[str, Any], busy_s: Callable[[str], float]) -> float:
    """Latency each operand of a multi-operand all-reduce adds past the first, as a
    fraction of an all-reduce's latency over all n devices. XLA:CPU runs such an
    all-reduce as one rendezvous per operand (a profiler trace of a step shows 12
    rendezvous in a 12-operand all-reduce); the step's gradient all-reduces have up to 26.
    The all-reduce of as many bytes in one operand is the baseline."""
    n, name = self.n, f"allreduce_operands/{self.n}"
    work = self.work[name]
    multi_s = (
      max(busy_s(name) - work["bytes"] / (f["memory_gb_s"] * 1e9), 1e-9) / work["collectives"]
    )
    single_s = f[f"allreduce_points_group_{n}"][0][1]
    operands = work["collective_operands"] / work["collectives"]
    latency_s = f["collective_base_s"] + 2 * (n - 1) * f["collective_hop_s"]
    f["allreduce_operands_s"] = multi_s
    return max(0.0, (multi_s - single_s) / ((operands - 1) * latency_s))

  def figures(self, cfg: dict[str, Any], seconds: dict[str, float]) -> dict[str, Any]:
    n, work = self.n, self.work
    tiny = seconds["tiny_ops"] / max(work["tiny_ops"]["ops"], 1)
    f: dict[str, Any] = {"tiny_op_overhead_us": tiny * 1e6}

    def busy_s(name: str) -> float:  # a program's time less its ops' tiny overhead
      return max(seconds[name] - work[name]["ops"] * tiny, 1e-9)

    for dtype in ("float32", "bfloat16"):
      f[f"matmul_{dtype}_gflops"] = {
        f"{m}x{k}x{k2}": work[f"matmul_{dtype}/{m}x{k}x{k2}"]["dot_flops"]
        / busy_s(f"matmul_{dtype}/{m}x{k}x{k2}")
        / 1e9
        for m, k, k2 in cfg[f"matmul_{dtype}"]
      }
    f["memory_gb_s"] = work["memory"]["bytes"] / busy_s("memory") / 1e9
    f["memory_per_device_gib"] = _physical_memory_bytes() / n / 2**30

    if n > 1:
      alphas = []  # (kind, group size, alpha)
      for kind in _COLLECTIVES:
        for g in self.meshes:
          names = [f"{kind}/{g}/{kib}" for kib in cfg["coll_kib"]]
          sizes = [work[m]["collective_bytes"] / work[m]["collectives"] for m in names]
          # Less the ops around them (all-gather: the slice), as the cost model costs them.
          times = [
            max(busy_s(m) - work[m]["bytes"] / (f["memory_gb_s"] * 1e9), 1e-9)
            / work[m]["collectives"]
            for m in names
          ]
          alpha, beta = _fit_alpha_beta(sizes, times)
          alphas.append((kind, g, alpha))
          f[f"{kind}_points_group_{g}"] = [[s, t] for s, t in zip(sizes, times)]
          if g == n:  # bandwidth from the group of all active devices
            f[f"{kind}_alpha_s"], f[f"{kind}_beta_s_per_byte"] = alpha, beta
      f["collective_base_s"], f["collective_hop_s"] = _fit_latency(alphas)
      f["operand_latency_fraction"] = self.operand_fraction(f, busy_s)
    else:  # one device: nothing to communicate; a "collective" is a memory copy
      for kind in _COLLECTIVES:
        f[f"{kind}_alpha_s"] = tiny
        f[f"{kind}_beta_s_per_byte"] = 1.0 / (f["memory_gb_s"] * 1e9)
      f["collective_base_s"], f["collective_hop_s"] = tiny, 0.0

    # What a step's own ops get. A chain of tiny ops costs ~1 us an op (the per-op
    # overhead), and the matmuls run at about the rates above, but a step's other ops
    # (transposes, reductions, broadcasts, layout copies of ~1 MB, mostly on one thread)
    # move their bytes far slower than the streaming op above: the reference program
    # runs ~2-3x longer than the cost model says at the streaming bandwidth. That
    # excess grows with the bytes the ops move, not with their number (on 2 devices
    # each device's ops move half the bytes and take half the time; a per-op constant
    # would keep them at the one-device time), so it is charged per byte: the step
    # bandwidth is the one at which the cost model's time for the reference program
    # (per-op overhead above, matmuls at the rates above) equals its measured time.
    from projection import cost_model, hlo  # lazy: hardware/ does not otherwise need them

    program = hlo.analyze(self.jobs["reference"][0].as_text())
    f["op_overhead_us"] = tiny * 1e6

    def modelled_s(step_gb_s: float) -> float:
      rates = profile_to_hardware(
        {
          "identity": machine_identity(),
          "devices": n,
          "measured_at": "",
          "duration_s": 0,
          "figures": {**f, "step_memory_gb_s": step_gb_s},
        }
      )
      return cost_model.simulate(program.entry, rates, lambda node: 0.0).step_s

    lo, hi = f["memory_gb_s"] * 1e-4, f["memory_gb_s"]  # never above the streaming op's
    if modelled_s(hi) < seconds["reference"]:
      for _ in range(50):  # bisection in log space: modelled time falls as bandwidth grows
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if modelled_s(mid) > seconds["reference"] else (lo, mid)
    f["step_memory_gb_s"] = hi
    f["reference_s"], f["reference_modelled_s"] = seconds["reference"], modelled_s(hi)
    f["reference_ops"] = work["reference"]["ops"]
    return f


_COLLECTIVES = {
  "allreduce": lambda jax, v: jax.lax.psum(v, "g"),
  # The first shard of the result is sliced out to chain the next one.
  "allgather": lambda jax, v: jax.lax.all_gather(v, "g", tiled=True)[: v.shape[0]],
}


def _reference_state(jnp) -> dict[str, Any]:
  """Parameters and Adam moments of the reference program: vocabulary 256, context 64,
  2 layers, d_model 64, 4 heads of 16, MLP 256, biases and norm scales."""
  shapes = {
    "embed": (256, 64),
    "position": (64, 64),
    "final_scale": (64,),
    "wqkv": (2, 64, 192),
    "bqkv": (2, 192),
    "wo": (2, 64, 64),
    "bo": (2, 64),
    "w1": (2, 64, 256),
    "b1": (2, 256),
    "w2": (2, 256, 64),
    "b2": (2, 64),
    "scale1": (2, 64),
    "scale2": (2, 64),
  }
  params = {name: jnp.full(shape, 0.02, jnp.float32) for name, shape in shapes.items()}
  zeros = {name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()}
  return {"params": params, "m": zeros, "v": dict(zeros)}


def _reference_step(jax, jnp, state: dict[str, Any], tokens) -> dict[str, Any]:
  """One AdamW step, gradients clipped by global norm, of a small pre-LN decoder on
  tokens [batch, 64]: the kinds of op a small GPT's train step runs (embeddings, norms,
  dense layers, causal softmax attention, GELU, tied logits, cross-entropy, their
  gradients, a layer scan, the optimizer's per-parameter updates), written
  independently of model/gpt.py and train/."""

  def norm(h, scale):
    mean = h.mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(jnp.square(h - mean).mean(-1, keepdims=True) + 1e-5) * scale

  def layer(h, p):
    b, t, _ = h.shape
    qkv = norm(h, p["scale1"]) @ p["wqkv"] + p["bqkv"]
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * 4, 16), 3, axis=2)
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / 4.0
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
    attended = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(scores, axis=-1), v)
    h = h + attended.reshape(b, t, 64) @ p["wo"] + p["bo"]
    return h + jax.nn.gelu(norm(h, p["scale2"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], None

  def loss(p):
    layers = {name: w for name, w in p.items() if w.ndim > 1 and w.shape[0] == 2}
    h = jax.lax.scan(layer, p["embed"][tokens] + p["position"], layers)[0]
    logits = norm(h, p["final_scale"]) @ p["embed"].T
    targets = jnp.roll(tokens, -1, axis=1)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1).mean()

  grads = jax.grad(loss)(state["params"])
  norm_sq = sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))
  grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / jnp.sqrt(norm_sq)), grads)
  m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], grads)
  v = jax.tree.map(lambda v, g: 0.95 * v + 0.05 * g * g, state["v"], grads)
  params = jax.tree.map(
    lambda w, m, v: w - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.1 * w), state["params"], m, v
  )
  return {"params": params, "m": m, "v": v}


def _counts(compiled) -> dict[str, float]:
  """What the cost model sees in a program: compute ops, their bytes and dot FLOPs, and
  collectives with their bytes (projection/collectives conventions)."""
  from projection import hlo  # lazy: hardware/ does not otherwise need projection/

  program = hlo.analyze(compiled.as_text())
  c = {
    "ops": 0,
    "bytes": 0,
    "dot_flops": 0.0,
    "collectives": 0,
    "collective_bytes": 0,
    "collective_operands": 0,
  }
  for node, times in hlo.walk(program):
    if isinstance(node, hlo.Compute):
      c["ops"] += times
      c["bytes"] += (node.bytes_read + node.bytes_written) * times
      c["dot_flops"] += node.dot_flops * times
    elif isinstance(node, hlo.Collective):
      c["collectives"] += times
      c["collective_bytes"] += node.bytes * times
      c["collective_operands"] += node.operands * times
  return c


def _typical_times(jobs: dict[str, tuple[Callable, Any]], rounds: int) -> dict[str, float]:
  """Median wall time of each job over `rounds` rounds of one call per job, after one
  warm-up call each. Interleaving spreads each job's calls over the whole measurement,
  so load from other processes hits every job alike, and the median of calls as long as
  a small model's step is what such a step sees: on a shared machine it takes longer
  than on a quiet one, and a profile of the quiet machine (minimum times) would project
  the quiet machine's steps, which the measured medians do not reach."""
  import jax

  for fn, x in jobs.values():
    jax.block_until_ready(fn(x))
  times: dict[str, list[float]] = {name: [] for name in jobs}
  for _ in range(rounds):
    for name, (fn, x) in jobs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x))
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
