"""MLPerf GPT-3 175B: the calibration points, and the H200 question across generations.

  1. Calibration: the two published H100 results (mlperf-gpt3.md), each projected in its
     own published configuration: 10,752 H100 (3.92 min) and 512 H100 (49.80 min).
  2. Generations at 512 GPUs: H100, H200, B200, GB200, GB300, each in H100's published
     configuration and at its own best of a few configurations (more memory allows less
     recomputation, larger micro-batches or fewer pipeline stages; NVL72 allows tensor
     parallelism past 8), with the speed-up over H100 and the breakdown that explains it.

  python benchmarks/mlperf_gpt3.py
  python benchmarks/mlperf_gpt3.py --skip_generations
  python benchmarks/mlperf_gpt3.py --hardware=h100,h200

Every configuration of one generation is one deviceless compile of the 175B step (10-30 s
each here with the kernel cache warm); the whole run takes 5-15 minutes.
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
from errors import UserInputError  # noqa: E402
from experiments import overrides  # noqa: E402
from projection import project  # noqa: E402
from report import table  # noqa: E402

# mlperf-gpt3.md "Calibration points": (variant, GPUs, published minutes).
CALIBRATION = (("eos_10752", 10752, 3.92), ("eos_512", 512, 49.80))
GPUS = 512
# Candidate configurations at 512 GPUs and global batch 2,048, as --set overrides on
# the published eos_512 (TP 4, PP 8, 6 virtual stages, micro-batch 2): more memory buys
# larger micro-batches or fewer stages; NVL72 racks take tensor parallelism past 8.
CANDIDATES = {
    "published": (),
    "mb 4": ("micro_batch=4",),
    "PP 4, VS 12": ("pipeline_parallel=4", "virtual_stages=12"),
    "PP 4, VS 12, mb 4": ("pipeline_parallel=4", "virtual_stages=12", "micro_batch=4"),
    "TP 8, PP 4, VS 12": ("tensor_parallel=8", "pipeline_parallel=4", "virtual_stages=12"),
}
NVL72_CANDIDATES = {
    "TP 16, PP 2, VS 24": ("tensor_parallel=16", "pipeline_parallel=2", "virtual_stages=24"),
}
NVL72 = ("gb200", "gb300")


def _row(label: str, r: dict, reference: dict | None) -> tuple:
  mesh = "x".join(str(r["mesh"][a]) for a in ("data", "tensor", "pipeline") if a in r["mesh"])
  if not r["fits"]:
    return (r["hardware"], label, mesh, f"over by {r['over_capacity_gb']:.0f} GB",
            "", "", "", "", "", f"{r['memory_per_gpu_gb']:.0f}", "", "")
  b = r["breakdown"]
  speedup = reference["time_to_train_min"] / r["time_to_train_min"] if reference else ""
  return (r["hardware"], label, mesh, r["step_time_s"], b["compute_s"], b["exposed_comm_s"],
          b.get("bubble_s", 0.0), r["mfu"], r.get("mfu_fp8", ""),
          f"{r['memory_per_gpu_gb']:.0f}", r["time_to_train_min"], speedup)


HEADERS = ("hw", "config", "data x TP x PP", "step s", "compute s", "exposed comm s",
           "bubble s", "MFU bf16", "MFU fp8", "GB/GPU", "TTT min", "vs H100")


def calibration() -> None:
  exp = experiments.load("mlperf_gpt3_175b")
  rows = []
  for name, gpus, published in CALIBRATION:
    start = time.perf_counter()
    r = project.project(experiments.variant(exp, name), "h100", gpus)
    row = _row(name, r, None)
    error = r["time_to_train_min"] / published - 1 if r["fits"] else float("nan")
    rows.append((*row[:-1], published, f"{error:+.1%}", f"{time.perf_counter() - start:.0f}"))
  print("\nCalibration (H100, published configurations)")
  print(table.columns((*HEADERS[:-1], "published min", "error", "s"), rows))


def generations(hardware: list[str]) -> None:
  base = experiments.variant(experiments.load("mlperf_gpt3_175b"), "eos_512")
  same, best = [], []
  reference = None
  for hw in hardware:
    candidates = {**CANDIDATES, **(NVL72_CANDIDATES if hw in NVL72 else {})}
    results = {}
    for label, sets in candidates.items():
      try:
        exp = overrides.apply(base, list(sets))
        results[label] = project.project(exp, hw, GPUS)
      except UserInputError as e:
        print(f"{hw} {label}: skipped: {e}")
    if reference is None:
      reference = results["published"]
    same.append(_row("published", results["published"], reference))
    fitting = {k: r for k, r in results.items() if r["fits"]}
    label = min(fitting, key=lambda k: fitting[k]["time_to_train_min"])
    best.append(_row(label, fitting[label], reference))
    for k, r in results.items():
      print(table.columns(HEADERS, [_row(k, r, reference)]).splitlines()[-1])
  print(f"\nAt {GPUS} GPUs, H100's published configuration (TP 4, PP 8, VS 6, mb 2)")
  print(table.columns(HEADERS, same))
  print(f"\nAt {GPUS} GPUs, each generation's best of {len(CANDIDATES)} (NVL72: "
        f"{len(CANDIDATES) + len(NVL72_CANDIDATES)}) configurations")
  print(table.columns(HEADERS, best))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip_generations", action="store_true")
  parser.add_argument("--skip_calibration", action="store_true")
  parser.add_argument("--hardware", default="h100,h200,b200,gb200,gb300")
  args = parser.parse_args()
  if not args.skip_calibration:
    calibration()
  if not args.skip_generations:
    generations(args.hardware.split(","))


if __name__ == "__main__":
  main()
