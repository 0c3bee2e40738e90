"""Composed (projection/compose.py) against full-compile (projection/project.py) projections of
MLPerf GPT-3 175B on H100 (and GB200): step time, memory per GPU and the worst errors.

The check set: both published calibration configurations (eos_10752, eos_512) and
configurations from the valid 512-GPU space on H100 (1f1b; tensor, pipeline, virtual stages,
micro-batch as listed in CHECKS), and the published 512-GPU one on GB200; with --random=N,
instead, N configurations drawn at random (--seed) from the search's valid 1f1b candidates
at 512 GPUs of each --hardware that the search's prior expects to fit (projection/search.py
rank). Targets: step within 3%, memory within 5%.

  python benchmarks/compose_check.py [--only=NAME,NAME]
  python benchmarks/compose_check.py --random=10 --hardware=h100,gb200 [--seed=0]

Each configuration costs two full compiles (the step, then with its latency profile) and,
unless its pieces are cached (projection/compose.py), two compiles of each of its 2-3
pieces.
"""

import argparse
import os
import random
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
from measure import host_calibration  # noqa: E402
from projection import project, search  # noqa: E402
from projection.plan import check_gpus, plan  # noqa: E402
from records.points import to_json  # noqa: E402

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


def random_checks(hardware: list[str], count: int, seed: int) -> list[tuple]:
  """`count` CHECKS-like rows per GPU of `hardware`, drawn from the 512-GPU search space."""
  draw = random.Random(seed)
  exp = _exp(512, ())
  rows = []
  for hw_name in hardware:
    hw = host_calibration.hardware(hw_name, 512)
    check_gpus(hw, 512)
    capacity_gb = hw.hbm_bytes / 1e9
    valid = [
      c
      for c, prior, _ in search.rank(exp, hw, 512).survivors
      if c.one_f_one_b
      and prior.memory_gb <= capacity_gb
      and exp.model.num_layers % (c.pipeline_parallel * c.virtual_stages) == 0
    ]
    print(
      f"{hw_name}: {len(valid)} valid 1f1b candidates of whole chunks expected to fit",
      flush=True,
    )
    for c in draw.sample(valid, min(count, len(valid))):
      name = (
        f"tp{c.tensor_parallel}_pp{c.pipeline_parallel}_vs{c.virtual_stages}"
        f"_mb{c.micro_batch}_{c.remat}"
      )
      rows.append((name, hw_name, 512, c.assignments()))
  return rows


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", default="", help="comma-separated names from CHECKS")
  parser.add_argument("--random", type=int, default=0, help="configurations per GPU drawn")
  parser.add_argument("--hardware", default="h100,gb200", help="GPUs drawn for (--random)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  only = {n for n in args.only.split(",") if n}
  checks = CHECKS
  if args.random:
    checks = random_checks(args.hardware.split(","), args.random, args.seed)
  rows = []
  print(
    f"{'configuration':<34} {'GPU':>5} {'GPUs':>6} {'full s':>7} {'composed s':>10} "
    f"{'step err':>8} {'full GB':>7} {'comp GB':>7} {'mem err':>7} {'full wall s':>11} "
    f"{'comp wall s':>11}"
  )
  for name, hw_name, gpus, sets in checks:
    if only and name not in only:
      continue
    exp = _exp(gpus, sets)
    start = time.perf_counter()
    target = plan(exp, host_calibration.hardware(hw_name, gpus), gpus)
    composed = to_json(project.project(exp, target, "composed"))
    composed_wall = time.perf_counter() - start
    start = time.perf_counter()
    reference = to_json(project.project(exp, target, "full"))
    full_wall = time.perf_counter() - start
    # A configuration over capacity is left untimed.
    full_s = reference.get("step_time_s", float("nan"))
    composed_s = composed.get("step_time_s", float("nan"))
    step_err = composed_s / full_s - 1
    mem_err = composed["memory_per_gpu_gb"] / reference["memory_per_gpu_gb"] - 1
    rows.append((name, step_err, mem_err))
    print(
      f"{name:<34} {hw_name:>5} {gpus:>6} {full_s:>7.3f} {composed_s:>10.3f} "
      f"{step_err:>+8.1%} {reference['memory_per_gpu_gb']:>7.1f} "
      f"{composed['memory_per_gpu_gb']:>7.1f} {mem_err:>+7.1%} {full_wall:>11.1f} "
      f"{composed_wall:>11.1f}{'  (pieces cached)' if composed['composition']['cached'] else ''}",
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
