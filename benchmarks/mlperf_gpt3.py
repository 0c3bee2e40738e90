"""MLPerf GPT-3 175B: the calibration points, and the H200 question across generations.

  1. Calibration: the two published H100 results (reference/mlperf_gpt3.py), each projected in its
     own published configuration (pipeline 8, interleaved 1F1B, tensor 4 with sequence
     parallelism, FP8, cuDNN flash attention): 10,752 H100 (3.92 min) and 512 H100
     (49.80 min).
  2. Generations: the same configuration on H100, H200, B200, GB200 and GB300, and
     configurations that use more memory or NVL72's larger NVLink domain.

  python benchmarks/mlperf_gpt3.py
  python benchmarks/mlperf_gpt3.py --skip_generations

A projection that does not fit in HBM is untimed (projection/project.py). To show where
its time would go, this script also times every point as if capacity were unlimited
("if it fit"), splits its compute into FLOP-bound and memory-bound time and its exposed
communication by mesh axis, and names the memory-bound work of the pipeline loops
(`memory_bound_by_kind`).

One deviceless compile of the 175B step per (configuration, generation): 10-30 s each
on this 2-core machine with XLA's kernel cache warm (projection/kernel_cache.py), longer on a
first run; the whole run took 2 min 44 s here.
"""

import argparse
import dataclasses
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"

import platform_env  # noqa: E402

platform_env.configure(host_devices=8)

import experiments  # noqa: E402
from errors import UserInputError  # noqa: E402
from experiments import overrides  # noqa: E402
from hardware import catalog  # noqa: E402
from projection import (  # noqa: E402
  aot_compile,
  collective_timing,
  cost_model,
  hlo,
  project,
  step_loops,
)
from reference import mlperf_gpt3  # noqa: E402
from report import table  # noqa: E402

# The published calibration points: (variant, GPUs, published minutes).
_EOS_MINUTES = {gpus: min_ for label, _, gpus, min_ in mlperf_gpt3.RESULTS if "NVIDIA Eos" in label}
CALIBRATION = (("eos_10752", 10752, _EOS_MINUTES[10752]), ("eos_512", 512, _EOS_MINUTES[512]))
# The generations with FP8, which the benchmark trains in.
GENERATIONS = tuple(name for name in catalog.names() if catalog.get(name).peak_fp8_tflops)


def memory_bound_by_kind(program: hlo.Program, hw) -> dict[str, float]:
  """Seconds per step of the pipeline loops' memory-bound ops (their HBM bytes outlast
  their FLOPs), by kind: the last part of the op_name JAX gives the op (e.g.
  convert_element_type and reduce_max: FP8 casts; scatter and slice: a trip's writes into
  and reads from the per-rank stacks), else XLA's fusion name. Largest first."""
  out: dict[str, float] = {}

  def visit(nodes, times: int) -> None:
    for node in nodes:
      if isinstance(node, hlo.Loop):
        visit(node.body, times * node.trip_count)
      elif isinstance(node, hlo.Compute):
        flop_s, byte_s = cost_model.op_times_s(node, hw)
        if byte_s > flop_s:
          kind = node.op_name.rsplit("/", 1)[-1] or re.sub(r"[._]?\d+$", "", node.name)
          out[kind] = out.get(kind, 0.0) + times * byte_s

  for loop, repeats in step_loops.pipeline_passes(program):
    visit(loop.body, repeats * loop.trip_count)
  return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def analyse(exp, hw_name: str, gpus: int) -> dict:
  """The projection record, and its timing and pipeline-loop memory-bound work as if it fit."""
  start = time.perf_counter()
  record = project.project(exp, hw_name, gpus)
  hw = project.hardware(hw_name, gpus)
  unlimited = dataclasses.replace(hw, hbm_gib=1e9)
  reduced = project.plan(exp, hw, gpus)
  if_fit = project.project_on(exp, unlimited, reduced)
  timer = collective_timing.collective_timer(reduced, hw)
  step, _ = aot_compile.compiled_program(exp, hw, reduced, timer)
  virtual = exp.train.virtual_stages if reduced.sizes.get("pipeline", 1) > 1 else 1
  program = step_loops.with_micro_batches(
    step.program, reduced.compiled_micro_batches, reduced.micro_batches, virtual
  )
  return {
    "record": record,
    "if_fit": if_fit,
    "memory_bound": memory_bound_by_kind(program, hw),
    "seconds": time.perf_counter() - start,
  }


def _row(label: str, result: dict) -> tuple:
  r, f = result["record"], result["if_fit"]
  b = f["breakdown"]
  fit = "yes" if r["fits"] else f"no (+{r['over_capacity_gb']:.0f} GB)"
  return (
    f["hardware"],
    label,
    f"{r['memory_per_gpu_gb']:.0f}",
    fit,
    f["step_time_s"],
    b["compute_s"],
    b["memory_bound_s"],
    b["exposed_comm_s"],
    b["other_s"],
    b["bubble_s"],
    f.get("mfu_fp8", ""),
    f["time_to_train_min"],
  )


HEADERS = (
  "hw",
  "config",
  "GB/GPU",
  "fits",
  "step s",
  "compute s",
  "of it memory-bound s",
  "exposed comm s",
  "launches s",
  "bubble s",
  "MFU fp8",
  "TTT min",
)


def _print_split(label: str, result: dict) -> None:
  by_axis = result["if_fit"]["breakdown"]["exposed_comm_by_axis_s"]
  axes = sorted(((a, s) for a, s in by_axis.items() if s >= 0.005), key=lambda kv: -kv[1])
  print(
    f"  {label}: exposed comm by mesh axis "
    + ", ".join(f"{a} {s:.2f}" for a, s in axes)
    + " s; memory-bound in the pipeline loops "
    + ", ".join(f"{k} {v:.2f}" for k, v in list(result["memory_bound"].items())[:6])
    + " s"
  )


def calibration(sets: list[str]) -> None:
  exp = experiments.load("mlperf_gpt3_175b")
  rows, results = [], []
  for name, gpus, published in CALIBRATION:
    result = analyse(overrides.apply(experiments.variant(exp, name), sets), "h100", gpus)
    row = _row(f"{name} ({gpus})", result)
    rows.append((*row, published, f"{row[-1] / published - 1:+.1%}", f"{result['seconds']:.0f}"))
    results.append((name, result))
  print(f"\nCalibration: H100 in the published configurations {' '.join(sets)} (times 'if it fit')")
  print(table.columns((*HEADERS, "published min", "error", "run s"), rows))
  for name, result in results:
    _print_split(name, result)


def generations(hardware: list[str], sets: list[str]) -> None:
  base = overrides.apply(experiments.variant(experiments.load("mlperf_gpt3_175b"), "eos_512"), sets)
  rows, results = [], []
  for hw in hardware:
    result = analyse(base, hw, 512)
    rows.append(_row("eos_512 " + " ".join(sets), result))
    results.append((hw, result))
  print(f"\n512 GPUs, H100's published configuration {' '.join(sets)} (times 'if it fit')")
  print(table.columns(HEADERS, rows))
  for hw, result in results:
    _print_split(hw, result)
  for row in rows[1:]:
    print(f"  {row[0]} vs {rows[0][0]}: step {rows[0][4] / row[4]:.2f}x")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip_generations", action="store_true")
  parser.add_argument("--skip_calibration", action="store_true")
  parser.add_argument("--hardware", default=",".join(GENERATIONS))
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    help="override of both tables' configurations (launch.py --set)",
  )
  args = parser.parse_args()
  hardware = args.hardware.split(",")
  try:  # bad input: one line and exit 2, before the first compile
    for name in hardware:
      project.hardware(name)
    exp = overrides.apply(experiments.load("mlperf_gpt3_175b"), args.set)
    exp.model.validate()
    exp.train.validate()
  except UserInputError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if not args.skip_calibration:
    calibration(args.set)
  if not args.skip_generations:
    generations(hardware, args.set)


if __name__ == "__main__":
  main()
