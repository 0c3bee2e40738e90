"""Composed (projection/compose.py) against full-compile (projection/project.py) projections of
MLPerf GPT-3 175B on H100 (and GB200): step time, memory per GPU and the worst errors.

The check set: both published calibration configurations (eos_10752, eos_512) and
configurations from the valid 512-GPU space on H100 (1f1b; tensor, pipeline, virtual stages,
micro-batch as listed in CHECKS), and the published 512-GPU one on GB200. Targets: step
within 3%, memory within 5%.

  python benchmarks/compose_check.py [--only=NAME,NAME]

Each configuration costs two full compiles (the step, then with its latency profile) and,
unless its pieces are cached (projection/compose.py), two compiles of each of its 2-3
pieces.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"

import platform_env  # noqa: E402

platform_env.configure(host_devices=8)

import experiments  # noqa: E402
from experiments import overrides  # noqa: E402
from projection import compose, project  # noqa: E402

# (name, hardware, GPUs, --set overrides on the experiment at that GPU count).
CHECKS = (
  ("eos_10752", "h100", 10752, ()),
  ("eos_512", "h100", 512, ()),
  ("tp4_pp16_vs6_mb2", "h100", 512, ("pipeline_parallel=16", "virtual_stages=6")),
  ("tp4_pp8_vs12_mb2", "h100", 512, ("virtual_stages=12",)),
  ("tp8_pp8_vs6_mb2", "h100", 512, ("tensor_parallel=8",)),
  ("tp4_pp8_vs6_mb1", "h100", 512, ("micro_batch=1",)),
  (
    "tp2_pp16_vs3_mb1",
    "h100",
    512,
    ("tensor_parallel=2", "pipeline_parallel=16", "virtual_stages=3", "micro_batch=1"),
  ),
  ("pp6_vs8_10752", "h100", 10752, ("pipeline_parallel=6", "virtual_stages=8")),
  ("tp4_pp16_vs2_mb1", "h100", 512, ("pipeline_parallel=16", "virtual_stages=2", "micro_batch=1")),
  ("gb200_eos_512", "gb200", 512, ()),
)


def _exp(gpus: int, sets: tuple[str, ...]):
  exp = experiments.at_target(experiments.load("mlperf_gpt3_175b"), gpus)
  return overrides.apply(exp, list(sets))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", default="", help="comma-separated names from CHECKS")
  args = parser.parse_args()
  only = {n for n in args.only.split(",") if n}
  rows = []
  print(
    f"{'configuration':<20} {'GPU':>5} {'GPUs':>6} {'full s':>7} {'composed s':>10} "
    f"{'step err':>8} {'full GB':>7} {'comp GB':>7} {'mem err':>7} {'full wall s':>11} "
    f"{'comp wall s':>11}"
  )
  for name, hw_name, gpus, sets in CHECKS:
    if only and name not in only:
      continue
    exp = _exp(gpus, sets)
    start = time.perf_counter()
    composed = compose.project(exp, hw_name, gpus)
    composed_wall = time.perf_counter() - start
    start = time.perf_counter()
    reference = project.project(exp, hw_name, gpus)
    full_wall = time.perf_counter() - start
    # The full projection leaves a configuration over capacity untimed.
    full_s = reference.get("step_time_s", float("nan"))
    step_err = composed["step_time_s"] / full_s - 1
    mem_err = composed["memory_per_gpu_gb"] / reference["memory_per_gpu_gb"] - 1
    rows.append((name, step_err, mem_err))
    print(
      f"{name:<20} {hw_name:>5} {gpus:>6} {full_s:>7.3f} {composed['step_time_s']:>10.3f} "
      f"{step_err:>+8.1%} {reference['memory_per_gpu_gb']:>7.1f} "
      f"{composed['memory_per_gpu_gb']:>7.1f} {mem_err:>+7.1%} {full_wall:>11.1f} "
      f"{composed_wall:>11.1f}{'  (pieces cached)' if composed['pieces_cached'] else ''}",
      flush=True,
    )
  timed = [r for r in rows if r[1] == r[1]]  # NaN: the full projection did not fit
  if timed:
    worst_step = max(timed, key=lambda r: abs(r[1]))
    print(f"worst step error: {worst_step[1]:+.1%} ({worst_step[0]}; target 3%)")
  if rows:
    worst_mem = max(rows, key=lambda r: abs(r[2]))
    print(f"worst memory error: {worst_mem[2]:+.1%} ({worst_mem[0]}; target 5%)")


if __name__ == "__main__":
  main()
