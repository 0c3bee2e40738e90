"""The projection's cost model calibrated to this machine: a host profile.

measure/host_programs.py runs and times the micro-benchmark programs; here each program's work is
counted as projection/hlo.py counts it (ops, bytes, dot FLOPs, collective bytes), and
work over median time gives the figures of a `Hardware` entry called 'host':
  - matmul FLOP/s per shape, and the streaming op's memory bandwidth;
  - collective latency and bus bandwidth: per kind and group size a least-squares line
    (latency + bytes / bandwidth), the latencies fitted to a base plus a cost per ring
    step, as projection/collectives.py models one domain;
  - the latency each further operand of a multi-operand all-reduce adds, as a fraction of
    one all-reduce's latency;
  - the per-op overhead (the cost model's kernel launch), from the chain of tiny ops;
  - the bandwidth a step's own ops get ("achievable", against the streaming op's "peak"):
    the ops of a real step (transposes, reductions, broadcasts, layout copies) move their
    bytes several times slower than the streaming op, so the step bandwidth is the one at
    which projection/cost_model.py's time for the reference program (with the overhead
    and matmul rates above) equals its measured time. The excess is charged per byte, not
    per op: on 2 devices each device's ops move half the bytes and take about half the
    time, which a per-op charge cannot follow. No figure is fitted to a measured step of
    the project's model.
`host_profile()` measures, calibrates and caches a profile per active-device count;
`Profiler` is the same as a step hook, interleaved with the steps it profiles
(benchmarks/closing_the_loop.py).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from errors import UserInputError
from hardware import catalog
from hardware.catalog import Hardware
from measure import host, host_programs
from projection import cost_model, hlo


def hardware(name: str, gpus: int = 1) -> Hardware:
  """A catalog entry by name; 'host' is this machine's profile with `gpus` CPU devices
  active, measured here the first time (what a mode hands projection/plan.py's plan)."""
  if name.strip().lower() == "host":
    return host_profile(devices=gpus)
  try:
    return catalog.get(name)
  except ValueError:
    raise UserInputError(
      f"--hardware: unknown hardware {name!r}; known: {', '.join(catalog.names() + ['host'])}"
    ) from None


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
  entry = host.cached_entry(devices, cache_path)
  if refresh or entry is None or (entry.get("quick") and not quick):
    t0 = time.perf_counter()
    figures = _measure(quick, devices)
    entry = host.store(cache_path, devices, quick, figures, time.perf_counter() - t0)
  return host.profile_to_hardware(entry)


def _measure(quick: bool, devices: int) -> dict[str, Any]:
  profiler = Profiler(devices, quick)
  for _ in range(profiler.cfg["rounds"]):
    profiler.round()
  return profiler.figures()


class Profiler(host_programs.MicroBenchmarks):
  """The micro-benchmarks as a train/loop.py step hook (a round before each step), with
  the calibrated figures of the rounds run since the last `reset()`."""

  def __init__(self, devices: int, quick: bool = False) -> None:
    super().__init__(devices, quick)
    # Each program's work, counted once: the programs do not change between rounds.
    self.work = {name: _counts(compiled) for name, (compiled, _) in self.programs.jobs.items()}

  def figures(self) -> dict[str, Any]:
    return _figures(self.programs, self.work, self.cfg, self.median_s())

  def hardware(self, cache_path: str | os.PathLike | None = None) -> Hardware:
    """The profile of the rounds so far, stored in the cache as host_profile() would."""
    return host.profile_to_hardware(
      host.store(
        cache_path, self.devices, self.quick, self.figures(), time.perf_counter() - self.started
      )
    )


def _counts(compiled) -> dict[str, float]:
  """What the cost model sees in a program: compute ops, their bytes and dot FLOPs, and
  collectives with their bytes (projection/collectives conventions)."""
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


def _operand_fraction(
  programs: host_programs.Programs, work: dict, f: dict[str, Any], busy_s: Callable[[str], float]
) -> float:
  """Latency each operand of a multi-operand all-reduce adds past the first, as a
  fraction of an all-reduce's latency over all n devices. XLA:CPU runs such an
  all-reduce as one rendezvous per operand (a profiler trace of a step shows 12
  rendezvous in a 12-operand all-reduce); the step's gradient all-reduces have up to 26.
  The all-reduce of as many bytes in one operand is the baseline."""
  n, name = programs.n, f"allreduce_operands/{programs.n}"
  counts = work[name]
  multi_s = (
    max(busy_s(name) - counts["bytes"] / (f["memory_gb_s"] * 1e9), 1e-9) / counts["collectives"]
  )
  single_s = f[f"allreduce_points_group_{n}"][0][1]
  operands = counts["collective_operands"] / counts["collectives"]
  latency_s = f["collective_base_s"] + 2 * (n - 1) * f["collective_hop_s"]
  f["allreduce_operands_s"] = multi_s
  return max(0.0, (multi_s - single_s) / ((operands - 1) * latency_s))


def _figures(
  programs: host_programs.Programs, work: dict, cfg: dict[str, Any], seconds: dict[str, float]
) -> dict[str, Any]:
  """The profile's figures from each program's work and median time."""
  n = programs.n
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
  f["memory_per_device_gib"] = host.physical_memory_bytes() / n / 2**30

  if n > 1:
    alphas = []  # (kind, group size, alpha)
    for kind in host_programs.COLLECTIVES:
      for g in programs.meshes:
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
    f["operand_latency_fraction"] = _operand_fraction(programs, work, f, busy_s)
  else:  # one device: nothing to communicate; a "collective" is a memory copy
    for kind in host_programs.COLLECTIVES:
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
  program = hlo.analyze(programs.jobs["reference"][0].as_text())
  f["op_overhead_us"] = tiny * 1e6

  def modelled_s(step_gb_s: float) -> float:
    rates = host.profile_to_hardware(
      {
        "identity": host.machine_identity(),
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
