"""Closing the loop on this machine: projected against measured host-CPU step times.

For small GPT configurations on 1, 2, 4 and 8 emulated CPU devices (data, fsdp and
tensor meshes) this measures the train step with the project's own code (the steps of
`launch.py --mode=benchmark`: parallelism/mesh.py, train/step.py, train/loop.py) and
projects it with the `host` profile for that many active devices (projection/project.py,
measure/host_programs.py, measure/host_calibration.py: `launch.py --mode=project
--hardware=host --gpus=N`), then prints measured median, projected time and error for
each.

  python benchmarks/closing_the_loop.py             # every configuration, ~5-10 minutes
  python benchmarks/closing_the_loop.py --only=fsdp --cached

The host profile of each configuration is measured alongside its steps, in the same
process: one round of the profile's micro-benchmarks (measure/host_calibration.py's
`Profiler`, a train/loop.py step hook) before every step, outside the step's clock, and
the medians of both. Load from other processes on the shared cores then falls on the profile and the
steps alike, instead of on whichever ran when the machine was busier. Each profile is
stored in the cache (~/.cache/jax-scaling/host_profile.json or
$JAX_SCALING_HOST_PROFILE), so `launch.py --mode=project --hardware=host` uses the latest;
--cached projects with the cached profiles instead of measuring them now.
"""

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import platform_env  # noqa: E402

if __name__ == "__main__":
  platform_env.configure(8)

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import numpy as np  # noqa: E402

import experiments  # noqa: E402
from hardware.catalog import Hardware  # noqa: E402
from measure import host_calibration  # noqa: E402
from measure.point import PointOptions, run_point  # noqa: E402
from parallelism.mesh import MeshConfig  # noqa: E402
from projection import project  # noqa: E402
from projection.plan import plan  # noqa: E402

TARGET_ERROR = 0.25


@dataclasses.dataclass(frozen=True)
class Point:
  name: str
  devices: int
  mesh: MeshConfig


# The tiny experiment's model (2 layers, d_model 64, 16 x 64 tokens) on every mesh kind.
# On 2 devices launch.py's emulated nodes hold one device each, so tensor = 2 needs
# devices_per_node = 2 (one node) to stay inside an "NVLink" domain.
POINTS = (
  Point("1 device", 1, MeshConfig(data=1)),
  Point("data 2", 2, MeshConfig(data=2)),
  Point("fsdp 2", 2, MeshConfig(data=1, fsdp=2)),
  Point("tensor 2", 2, MeshConfig(data=1, tensor=2, devices_per_node=2)),
  Point("data 4", 4, MeshConfig(data=4)),
  Point("fsdp 4", 4, MeshConfig(data=1, fsdp=4)),
  Point("data 2 x tensor 2", 4, MeshConfig(data=2, tensor=2)),
  Point("data 8", 8, MeshConfig(data=8)),
  Point("fsdp 8", 8, MeshConfig(data=1, fsdp=8)),
  Point("data 2 x fsdp 2 x tensor 2", 8, MeshConfig(data=2, fsdp=2, tensor=2)),
)


@dataclasses.dataclass(frozen=True)
class Result:
  point: Point
  measured_s: float  # median step time
  measured_min_s: float
  projected_s: float
  profile: Hardware  # the host profile it was projected with

  @property
  def error(self) -> float:
    """Projected over measured median, minus one: +0.10 projects 10% slow."""
    return self.projected_s / self.measured_s - 1

  @property
  def error_vs_min(self) -> float:
    """Against the fastest step: what the steps take when other processes let them."""
    return self.projected_s / self.measured_min_s - 1


def experiment(point: Point, steps: int = 10) -> experiments.ExperimentConfig:
  exp = experiments.load("tiny")
  train = dataclasses.replace(exp.train, task="synthetic", steps=steps)
  return dataclasses.replace(exp, mesh=point.mesh, train=train)


def measure(exp: experiments.ExperimentConfig, devices: int, hooks=()) -> list[float]:
  """Step times as `launch.py --mode=benchmark --devices=N` measures them (its run_point)."""
  options = PointOptions(output_dir=None, hooks=tuple(hooks))
  return run_point(exp, "benchmark", jax.devices()[:devices], options).result.step_times_s


def compare(
  point: Point,
  steps: int = 10,
  profiler: host_calibration.Profiler | None = None,
  cached: bool = False,
) -> Result:
  """Measure the point's steps and project them. The host profile is measured alongside
  the steps (a profile round before each, outside its clock: other processes' load falls
  on both alike) and stored in the cache; `cached` projects with the cached profile."""
  exp = experiment(point, steps)
  if cached:
    times = measure(exp, point.devices)
    hw = host_calibration.hardware("host", point.devices)
  else:
    profiler = profiler or host_calibration.Profiler(point.devices)
    profiler.reset()
    times = measure(exp, point.devices, hooks=[profiler])
    hw = profiler.hardware()
  projected = project.project(exp, plan(exp, hw, point.devices), "full").step_time_s
  return Result(point, float(np.median(times)), float(np.min(times)), projected, hw)


def profile_rows(results: list[Result]) -> list[str]:
  """The host profile each configuration was projected with (per device, with that many
  devices active): matmul rate, streaming and step bandwidth, per-op overhead, collective
  latency, the latency each further operand of a collective adds (as a fraction), and
  bandwidth."""
  lines = [
    f"{'configuration':<28} {'matmul GFLOP/s':>14} {'stream GB/s':>11} {'step GB/s':>9} "
    f"{'op overhead us':>14} {'collective base + hop us':>24} {'per operand':>11} "
    f"{'all-reduce busbw GB/s':>21}"
  ]
  for r in results:
    hw, n = r.profile, r.point.devices
    latency = (
      f"{hw.protocols[0].base_us:.0f} + {hw.protocols[0].nvlink_hop_us:.0f}" if n > 1 else "-"
    )
    busbw = f"{hw.allreduce_ring_busbw_gb_s:.1f}" if n > 1 else "-"
    operand = f"{hw.operand_latency_fraction:.2f}" if n > 1 else "-"
    lines.append(
      f"{r.point.name:<28} {hw.achievable_f32_tflops * 1e3:>14.1f} "
      f"{hw.hbm_peak_tb_s * 1e3:>11.1f} {hw.hbm_achievable_tb_s * 1e3:>9.2f} "
      f"{hw.kernel_launch_us:>14.1f} {latency:>24} {operand:>11} {busbw:>21}"
    )
  return lines


def table(results: list[Result]) -> str:
  rows = [
    f"{'configuration':<28} {'devices':>7} {'measured median s':>18} {'projected s':>12} "
    f"{'error':>8}   {'measured min s':>14} {'error vs min':>12}"
  ]
  for r in results:
    flag = "" if abs(r.error) <= TARGET_ERROR else " *"
    rows.append(
      f"{r.point.name:<28} {r.point.devices:>7} {r.measured_s:>18.4f} "
      f"{r.projected_s:>12.4f} {r.error:>+8.1%}{flag:2} {r.measured_min_s:>14.4f} "
      f"{r.error_vs_min:>+12.1%}"
    )
  return "\n".join(rows) + f"\n* misses the {TARGET_ERROR:.0%} target"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
  parser.add_argument("--only", default="", help="run the configurations whose name has this")
  parser.add_argument(
    "--cached", action="store_true", help="use cached host profiles instead of measuring them now"
  )
  args = parser.parse_args()
  points = [p for p in POINTS if args.only in p.name]
  load = os.getloadavg()[0]
  results, profiler = [], None
  for point in sorted(points, key=lambda p: p.devices):
    if not args.cached and (profiler is None or profiler.devices != point.devices):
      profiler = host_calibration.Profiler(point.devices)  # compiled once per active-device count
    results.append(compare(point, args.steps, profiler, args.cached))
    print(
      f"  {point.name}: measured {results[-1].measured_s:.4f} s, "
      f"projected {results[-1].projected_s:.4f} s (load average "
      f"{os.getloadavg()[0]:.1f})",
      flush=True,
    )
  print("\nhost profiles (per device, with that many devices active):")
  print("\n".join(profile_rows(results)))
  print(
    f"\n{args.steps} timed steps per configuration; load average "
    f"{load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
  )
  print(table(results))
  misses = [r for r in results if abs(r.error) > TARGET_ERROR]
  print(
    f"\n{len(results) - len(misses)} of {len(results)} within {TARGET_ERROR:.0%}"
    + (f"; misses: {', '.join(f'{r.point.name} {r.error:+.0%}' for r in misses)}" if misses else "")
  )


if __name__ == "__main__":
  main()
