"""MLPerf GPT-3 175B: the calibration points, and the H200 question across generations.

  1. Calibration: the two published H100 results (mlperf-gpt3.md), each projected in its
     own published configuration (pipeline 8, interleaved, tensor 4 with sequence
     parallelism, FP8, cuDNN flash attention): 10,752 H100 (3.92 min) and 512 H100
     (49.80 min).
  2. Generations: the same configuration on H100, H200, B200, GB200 and GB300, and
     configurations that use more memory or NVL72's larger NVLink domain.

  python benchmarks/mlperf_gpt3.py
  python benchmarks/mlperf_gpt3.py --skip_generations

A projection that does not fit in HBM is untimed (projection/project.py). To show where
its time would go, this script also times every point as if capacity were unlimited
("if it fit"), and splits the communication by mesh axis; and, as a what-if on the
program (not a projection of it), the step with the data-parallel gradient all-reduce
once per step instead of inside the pipeline loops, where the compiled program has it.

One deviceless compile of the 175B step per (configuration, generation): 45-80 s each
on this loaded 2-core machine; the whole run takes 10-20 minutes.
"""

import argparse
import dataclasses
import math
import os
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
os.environ["JAX_PLATFORMS"] = "cpu"

import platform_env  # noqa: E402

platform_env.configure(host_devices=8)

import experiments  # noqa: E402
from experiments import overrides  # noqa: E402
from model.flops import param_count  # noqa: E402
from parallelism.mesh import AXES  # noqa: E402
from projection import cost_model, hlo, layout, project  # noqa: E402
from report import table  # noqa: E402

# mlperf-gpt3.md "Calibration points": (variant, GPUs, published minutes).
CALIBRATION = (("eos_10752", 10752, 3.92), ("eos_512", 512, 49.80))
GENERATIONS = ("h100", "h200", "b200", "gb200", "gb300")


def _axes_of(node: hlo.Collective, reduced: layout.ReducedMesh) -> str:
  """The mesh axes a collective's groups run along ("data", "tensor", "pipeline", ...)."""
  shape = [reduced.sizes[a] for a in AXES]
  if node.kind == "collective-permute":
    return "pipeline" if reduced.sizes.get("pipeline", 1) > 1 else "?"
  group = node.groups[0]
  coords = [divmod_all(p, shape) for p in group]
  return "+".join(a for i, a in enumerate(AXES) if len({c[i] for c in coords}) > 1) or "none"


def divmod_all(index: int, shape: list[int]) -> tuple[int, ...]:
  out = []
  for size in reversed(shape):
    index, r = divmod(index, size)
    out.append(r)
  return tuple(reversed(out))


def analyse(exp, hw_name: str, gpus: int) -> dict:
  """The projection record, plus its timing if it fit, communication by axis and the
  what-if with one data-parallel gradient all-reduce a step."""
  start = time.perf_counter()
  record = project.project(exp, hw_name, gpus)
  hw = project.hardware(hw_name, gpus)
  unlimited = dataclasses.replace(hw, hbm_gib=1e9)
  reduced = project.plan(exp, hw, gpus)
  if_fit = project.project_on(exp, unlimited, reduced)
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  step = project.compile_step(
    exp.model, train_cfg, tuple(reduced.sizes.items()), hw.name, hw.gpus_per_node
  )
  virtual = exp.train.virtual_stages if reduced.sizes.get("pipeline", 1) > 1 else 1
  program = project.with_micro_batches(
    step.program, reduced.compiled_micro_batches, reduced.micro_batches, virtual
  )
  timer = project.collective_timer(reduced, hw)
  by_axis: dict[str, float] = defaultdict(float)
  for node, times in hlo.collectives(program):
    by_axis[f"{node.kind} {_axes_of(node, reduced)}"] += times * timer(node)

  # What-if: data-axis all-reduces inside the pipeline loops cost nothing, and one
  # all-reduce of every gradient (f32, as compiled) runs once, exposed, at the end.
  in_loops = {
    n.name
    for i in project.pipeline_loops(program)
    for n, _ in hlo.walk(program.entry[i].body)
    if isinstance(n, hlo.Collective)
  }
  data_ars = [
    n
    for n, _ in hlo.collectives(program)
    if n.name in in_loops and n.kind == "all-reduce" and _axes_of(n, reduced) == "data"
  ]
  what_if = None
  if data_ars:
    model_parallel = math.prod(v for a, v in reduced.sizes.items() if a != "data")
    grads = dataclasses.replace(data_ars[0], bytes=4 * param_count(exp.model) // model_parallel)
    hoisted = {n.name for n in data_ars}
    once = cost_model.simulate(program.entry, hw, lambda n: 0.0 if n.name in hoisted else timer(n))
    what_if = once.step_s + timer(grads)
  return {
    "record": record,
    "if_fit": if_fit,
    "by_axis": dict(by_axis),
    "what_if_step_s": what_if,
    "seconds": time.perf_counter() - start,
  }


def mlperf_benchmark():
  return experiments.load("mlperf_gpt3_175b").benchmark


def _row(label: str, result: dict) -> tuple:
  r, f = result["record"], result["if_fit"]
  b = f["breakdown"]
  fit = "yes" if r["fits"] else f"no (+{r['over_capacity_gb']:.0f} GB)"
  what_if = result["what_if_step_s"]
  bench = mlperf_benchmark()
  eval_batches = math.ceil(bench.eval_sequences / f["global_batch"])
  forward = f["time_to_train"]["eval_s_each"] / (f["step_time_s"] * eval_batches)
  what_if_min = (
    bench.estimate(what_if, f["global_batch"], forward)["time_to_train_min"]
    if what_if
    else float("nan")
  )
  return (
    f["hardware"],
    label,
    f"{r['memory_per_gpu_gb']:.0f}",
    fit,
    f["step_time_s"],
    b["compute_s"],
    b["exposed_comm_s"],
    b["bubble_s"],
    f["mfu"],
    f.get("mfu_fp8", ""),
    f["time_to_train_min"],
    what_if or "",
    what_if_min,
  )


HEADERS = (
  "hw",
  "config",
  "GB/GPU",
  "fits",
  "step s",
  "compute s",
  "exposed comm s",
  "bubble s",
  "MFU bf16",
  "MFU fp8",
  "TTT min",
  "what-if step s",
  "what-if TTT min",
)


def _print_axes(label: str, result: dict) -> None:
  top = sorted(result["by_axis"].items(), key=lambda kv: -kv[1])[:5]
  print(
    f"  {label}: communication by kind and mesh axis (s per step, hidden or not): "
    + ", ".join(f"{k} {v:.2f}" for k, v in top)
  )


def calibration(sets: list[str]) -> None:
  exp = experiments.load("mlperf_gpt3_175b")
  rows, results = [], []
  for name, gpus, published in CALIBRATION:
    result = analyse(overrides.apply(experiments.variant(exp, name), sets), "h100", gpus)
    row = _row(f"{name} ({gpus})", result)
    rows.append(
      (
        *row,
        published,
        f"{row[10] / published - 1:+.0%}",
        f"{row[12] / published - 1:+.0%}",
        f"{result['seconds']:.0f}",
      )
    )
    results.append((name, result))
  print(f"\nCalibration: H100 in the published configurations {' '.join(sets)} "
        f"(times 'if it fit')")
  print(table.columns((*HEADERS, "published min", "error", "what-if error", "run s"), rows))
  for name, result in results:
    _print_axes(name, result)


def generations(hardware: list[str], sets: list[str]) -> None:
  base = overrides.apply(experiments.variant(experiments.load("mlperf_gpt3_175b"), "eos_512"), sets)
  rows = []
  for hw in hardware:
    result = analyse(base, hw, 512)
    rows.append(_row("eos_512 " + " ".join(sets), result))
    _print_axes(hw, result)
  print(f"\n512 GPUs, H100's published configuration {' '.join(sets)} (times 'if it fit')")
  print(table.columns(HEADERS, rows))
  h100 = rows[0]
  for row in rows[1:]:
    print(
      f"  {row[0]} vs h100: step {h100[4] / row[4]:.2f}x, what-if step {h100[11] / row[11]:.2f}x"
      if row[11]
      else f"  {row[0]}: {h100[4] / row[4]:.2f}x"
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip_generations", action="store_true")
  parser.add_argument("--skip_calibration", action="store_true")
  parser.add_argument("--hardware", default=",".join(GENERATIONS))
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    help="override of eos_512 for the generations table (launch.py --set)",
  )
  args = parser.parse_args()
  if not args.skip_calibration:
    calibration(args.set)
  if not args.skip_generations:
    generations(args.hardware.split(","), args.set)


if __name__ == "__main__":
  main()
