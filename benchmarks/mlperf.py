"""MLPerf's LLM benchmarks projected: the calibration points, and the generations.

  --benchmark=gpt3 (GPT-3 175B, experiments/mlperf_gpt3_175b.py):
    1. Calibration: the two published H100 results (reference/mlperf_gpt3.py), each in
       its own published configuration: 10,752 H100 (3.92 min) and 512 H100 (49.80 min).
    2. Generations: 512 GPUs of each generation in the published 512-H100 configuration.
  --benchmark=llama (Llama 3.1 405B, experiments/mlperf_llama31_405b.py):
    1. Calibration: 8,192 H100 (Eos, 20.81 min) and 2,496 GB200 (Carina, 27.33 min), each
       in its published configuration (reference/mlperf_llama31_405b.py).
    2. Generations: 512 GPUs of each generation in its own published layout (tensor 8 on
       H100, 4 on H200 / B200 / GB200, 2 on GB300), then H100 and H200 like for like in
       each of the two HGX layouts (tensor 8 and tensor 4).
  --benchmark=deepseek (DeepSeek-V3 671B, experiments/mlperf_deepseek_v3_671b.py):
    1. Calibration: 512 GB200 (NVIDIA tyche-hsg, 27.61 min) and 8,192 GB300 (CoreWeave,
       2.02 min), each in its published layout (reference/mlperf_deepseek_v3_671b.py).
    2. Generations: GB200 and GB300 at 512 GPUs in the published GB200 layout.

  python benchmarks/mlperf.py --benchmark=gpt3
  python benchmarks/mlperf.py --benchmark=llama --skip_generations
  python benchmarks/mlperf.py --benchmark=deepseek --skip_generations

A projection that does not fit in HBM is untimed (projection/project.py). To show where
its time would go, this script also times every point as if capacity were unlimited
("if it fit"), splits its compute into FLOP-bound and memory-bound time and its exposed
communication by mesh axis, and names the memory-bound work of the pipeline loops
(`memory_bound_by_kind`). One deviceless compile per (configuration, generation), two
with a latency profile; the "run s" column says what each point took.
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
from experiments import mlperf_deepseek_v3_671b, mlperf_llama31_405b, overrides  # noqa: E402
from hardware import catalog  # noqa: E402
from measure import host_calibration  # noqa: E402
from projection import (  # noqa: E402
  aot_compile,
  collective_timing,
  cost_model,
  hlo,
  project,
  step_loops,
)
from projection.plan import Target, plan  # noqa: E402
from records.points import to_json  # noqa: E402
from reference import mlperf_gpt3  # noqa: E402
from report import table  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Benchmark:
  experiment: str
  # The published calibration points: (variant, hardware, GPUs, published minutes).
  calibration: tuple[tuple[str, str, int, float], ...]
  generations: tuple[str, ...]
  # The generations table's configuration: this variant on every generation, or ("")
  # each generation's own default at 512 GPUs (experiments.at_target).
  generations_variant: str
  # Like-for-like tables: `--set` assignments run on every generation of `like_for_like_hw`.
  like_for_like: tuple[tuple[str, ...], ...] = ()
  like_for_like_hw: tuple[str, ...] = ()


BENCHMARKS = {
  "gpt3": Benchmark(
    "mlperf_gpt3_175b",
    tuple(
      (name, run.hardware, run.gpus, run.minutes) for name, run in mlperf_gpt3.PUBLISHED.items()
    ),
    # The generations with FP8, which the benchmark trains in.
    tuple(name for name in catalog.names() if catalog.get(name).peak_fp8_tflops),
    "eos_512",
  ),
  "llama": Benchmark(
    "mlperf_llama31_405b",
    tuple(
      (name, run.hardware, run.gpus, run.score_min)
      for name, run in mlperf_llama31_405b.PUBLISHED.items()
    ),
    tuple(mlperf_llama31_405b.published.TENSOR_BY_HARDWARE),
    "",
    (("mesh.tensor=8",), ("mesh.tensor=4",)),
    ("h100", "h200"),
  ),
  "deepseek": Benchmark(
    "mlperf_deepseek_v3_671b",
    tuple(
      (name, run.hardware, run.gpus, run.score_min)
      for name, run in mlperf_deepseek_v3_671b.PUBLISHED.items()
    ),
    # The generations MLPerf has DeepSeek-V3 results on (NVL72 racks).
    ("gb200", "gb300"),
    "gb200_512",
  ),
}
GENERATIONS_GPUS = 512


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
  hw = host_calibration.hardware(hw_name, gpus)
  target = plan(exp, hw, gpus)
  reduced = target.reduced
  # The calibration is the reference: the whole step compiled.
  record = to_json(project.project(exp, target, "full"))
  unlimited = dataclasses.replace(hw, hbm_gib=1e9)
  if_fit = to_json(project.project(exp, Target(unlimited, reduced), "full"))
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


def calibration(bench: Benchmark, sets: list[str]) -> None:
  exp = experiments.load(bench.experiment)
  rows, results = [], []
  for name, hw, gpus, published in bench.calibration:
    result = analyse(overrides.apply(experiments.variant(exp, name), sets), hw, gpus)
    row = _row(f"{name} ({gpus})", result)
    rows.append((*row, published, f"{row[-1] / published - 1:+.1%}", f"{result['seconds']:.0f}"))
    results.append((name, result))
  print(f"\nCalibration: the published configurations {' '.join(sets)} (times 'if it fit')")
  print(table.columns((*HEADERS, "published min", "error", "run s"), rows))
  for name, result in results:
    _print_split(name, result)


def _at(bench: Benchmark, hw: str, sets: list[str] | tuple[str, ...]):
  exp = experiments.load(bench.experiment)
  if bench.generations_variant:
    exp = experiments.variant(exp, bench.generations_variant)
  else:
    exp = experiments.at_target(exp, GENERATIONS_GPUS, hw)
  return overrides.apply(exp, list(sets))


def generations(bench: Benchmark, hardware: list[str], sets: list[str]) -> None:
  tables = [(bench.generations_variant or "each generation's own", hardware, ())]
  tables += [(" ".join(extra), bench.like_for_like_hw, extra) for extra in bench.like_for_like]
  for label, hws, extra in tables:
    rows, results = [], []
    for hw in hws:
      result = analyse(_at(bench, hw, [*extra, *sets]), hw, GENERATIONS_GPUS)
      rows.append((*_row(f"{label} {' '.join(sets)}", result), f"{result['seconds']:.0f}"))
      results.append((hw, result))
    print(f"\n{GENERATIONS_GPUS} GPUs, {label} {' '.join(sets)} (times 'if it fit')")
    print(table.columns((*HEADERS, "run s"), rows))
    for hw, result in results:
      _print_split(hw, result)
    for row in rows[1:]:
      print(f"  {row[0]} vs {rows[0][0]}: step {rows[0][4] / row[4]:.2f}x")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--benchmark", default="gpt3", help="gpt3, llama or deepseek")
  parser.add_argument("--skip_generations", action="store_true")
  parser.add_argument("--skip_calibration", action="store_true")
  parser.add_argument("--hardware", default="", help="generations (default: the benchmark's)")
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    help="override of both tables' configurations (launch.py --set)",
  )
  args = parser.parse_args()
  try:  # bad input: one line and exit 2, before the first compile
    if args.benchmark not in BENCHMARKS:
      raise UserInputError(
        f"--benchmark must be one of {', '.join(BENCHMARKS)}, got {args.benchmark!r}"
      )
    bench = BENCHMARKS[args.benchmark]
    hardware = args.hardware.split(",") if args.hardware else list(bench.generations)
    for name in hardware:
      host_calibration.hardware(name)
    exp = overrides.apply(experiments.load(bench.experiment), args.set)
    exp.model.validate()
    exp.train.validate()
  except UserInputError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  if not args.skip_calibration:
    calibration(bench, args.set)
  if not args.skip_generations:
    generations(bench, hardware, args.set)


if __name__ == "__main__":
  main()
