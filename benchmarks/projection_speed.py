"""How long projections take on this machine (GPT-3 175B unless told otherwise).

  1. one point end to end, as a user runs it, in a fresh process: first with an empty
     XLA kernel cache (projection/kernel_cache.py keeps one between runs) and an empty
     compile cache (projection/disk_cache.py keeps the compiled step's analysis), then with
     the kernels the first run left and no compile cached, then with both:
       python launch.py --mode=project --experiment=gpt3 --hardware=h100 --gpus=512
  2. in this process, empty caches: GPT-3 on 512 H100 cold (compile included), the same
     point again, and another GPU count that reuses the compile;
  3. a sweep as a user runs it, in a fresh process, empty caches: 8 GPU counts x 6
     generations (--hardware=a100,h100,h200,b200,gb200,gb300), one compile per generation.

  python benchmarks/projection_speed.py
  python benchmarks/projection_speed.py --skip_sweep
  python benchmarks/projection_speed.py --experiment=mlperf_deepseek_v3_671b \
    --hardware=gb200 --gpus=512 --only_launch

Timings are wall-clock seconds; on a machine shared with other jobs they vary by 2x.
"""

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from hardware import catalog  # noqa: E402 (imports no jax)

# projection/kernel_cache.py's KERNEL_CACHE_ENV and aot_compile.py's COMPILE_CACHE_ENV,
# named here so that the script imports no jax before platform_env has configured it.
KERNEL_CACHE_ENV = "JAX_SCALING_KERNEL_CACHE"
COMPILE_CACHE_ENV = "JAX_SCALING_COMPILE_CACHE"
HARDWARE = tuple(catalog.names())
# Every count leaves data >= 2 (64 GPUs per model replica) and divides the 1,536-sequence
# batch, so each generation compiles once (data = 1, at 64 GPUs, would compile again).
GPU_COUNTS = (128, 256, 512, 768, 1024, 1536, 2048, 3072)


def _launch(
  experiment: str, hardware: str, gpus: str, output_dir: str, kernel_cache: str, compiles: str
) -> float:
  """Seconds for one launch.py projection run in a fresh process."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env[KERNEL_CACHE_ENV] = kernel_cache
  env[COMPILE_CACHE_ENV] = compiles
  command = [
    sys.executable,
    "launch.py",
    "--mode=project",
    f"--experiment={experiment}",
    f"--hardware={hardware}",
    f"--gpus={gpus}",
    f"--output_dir={output_dir}",
  ]
  start = time.perf_counter()
  out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  elapsed = time.perf_counter() - start
  if out.returncode:
    sys.exit(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
  return elapsed


def _records(output_dir: str) -> list[dict]:
  with open(os.path.join(output_dir, "results.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _in_process(kernel_cache: str, compiles: str) -> list[tuple[str, float]]:
  """Cold point, repeated point and a second GPU count, timed in this process."""
  os.environ[KERNEL_CACHE_ENV] = kernel_cache
  os.environ[COMPILE_CACHE_ENV] = compiles
  start = time.perf_counter()
  import platform_env  # pylint: disable=import-outside-toplevel

  platform_env.configure(512)  # as launch.py: host devices for a fallback compile
  import experiments  # pylint: disable=import-outside-toplevel
  from measure import host_calibration  # pylint: disable=import-outside-toplevel
  from projection import project  # pylint: disable=import-outside-toplevel
  from projection.plan import plan  # pylint: disable=import-outside-toplevel

  exp = experiments.load("gpt3")
  rows = [("start-up: imports, jax and its devices", time.perf_counter() - start)]
  for label, gpus in (
    ("cold point: h100 x 512, compile included", 512),
    ("same point again (compile cached)", 512),
    ("h100 x 1024 on the same compile", 1024),
  ):
    start = time.perf_counter()
    record = project.project(exp, plan(exp, host_calibration.hardware("h100"), gpus), "full")
    rows.append(
      (
        f"{label} [step {record.step_time_s:.1f} s, compile {record.compile_s:.1f} s]",
        time.perf_counter() - start,
      )
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--experiment", default="gpt3", help="the one point's experiment")
  parser.add_argument("--hardware", default="h100", help="the one point's GPU")
  parser.add_argument("--gpus", default="512", help="the one point's GPU count")
  parser.add_argument("--skip_sweep", action="store_true", help="skip the 48-point sweep")
  parser.add_argument("--only_launch", action="store_true", help="only the fresh-process runs")
  args = parser.parse_args()
  point = (args.experiment, args.hardware, args.gpus)
  name = f"{args.experiment}, {args.hardware} x {args.gpus}"
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    kernels, compiles = os.path.join(tmp, "kernels.bin"), os.path.join(tmp, "compiles")
    for label, compiles_at in (
      ("empty kernel and compile caches", compiles),
      ("kernels cached by the run above, no compile cached", os.path.join(tmp, "none")),
      ("kernels and compile cached by the runs above", compiles),
    ):
      rows.append(
        (
          f"launch.py, one point ({name}), fresh process, {label}",
          _launch(*point, tmp, kernels, compiles_at),
        )
      )
  if args.only_launch:
    _print(rows)
    return
  # This process saves its kernel cache at exit (projection/kernel_cache.py), before this
  # directory is removed: atexit runs the last registered first.
  tmp = tempfile.mkdtemp()
  atexit.register(shutil.rmtree, tmp, ignore_errors=True)
  rows += _in_process(os.path.join(tmp, "kernels.bin"), os.path.join(tmp, "compiles"))
  if not args.skip_sweep:
    with tempfile.TemporaryDirectory() as tmp:
      elapsed = _launch(
        "gpt3",
        ",".join(HARDWARE),
        ",".join(map(str, GPU_COUNTS)),
        tmp,
        os.path.join(tmp, "kernels.bin"),
        os.path.join(tmp, "compiles"),
      )
      records = _records(tmp)
    compiles = {}
    for r in records:  # one compile time per generation; points after the first reuse it
      compiles.setdefault(r["hardware"], r["compile_s"])
    rows.append(
      (
        f"launch.py sweep, {len(GPU_COUNTS)} GPU counts x {len(HARDWARE)} generations "
        f"= {len(records)} points, fresh process, empty kernel cache",
        elapsed,
      )
    )
    rows += [(f"  of which compile, {name}", seconds) for name, seconds in compiles.items()]
  _print(rows)


def _print(rows: list[tuple[str, float]]) -> None:
  width = max(len(label) for label, _ in rows)
  for label, seconds in rows:
    print(f"{label:<{width}}  {seconds:8.2f} s")


if __name__ == "__main__":
  main()
