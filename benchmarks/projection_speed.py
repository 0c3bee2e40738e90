"""How long projections of GPT-3 175B take on this machine.

  1. one point end to end, as a user runs it, in a fresh process, first with an empty
     XLA kernel cache (projection/kernel_cache.py keeps one between runs), then again with the
     kernel cache the first run left:
       python launch.py --mode=project --experiment=gpt3 --hardware=h100 --gpus=512
  2. in this process, empty kernel cache: that point cold (compile included), the same
     point again, and another GPU count that reuses the compile;
  3. a sweep as a user runs it, in a fresh process, empty kernel cache: 8 GPU counts x 6
     generations (--hardware=a100,h100,h200,b200,gb200,gb300), one compile per generation.

  python benchmarks/projection_speed.py
  python benchmarks/projection_speed.py --skip_sweep

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

# projection/kernel_cache.py's KERNEL_CACHE_ENV, named here so that the script imports no jax
# before platform_env has configured it.
KERNEL_CACHE_ENV = "JAX_SCALING_KERNEL_CACHE"
HARDWARE = tuple(catalog.names())
# Every count leaves data >= 2 (64 GPUs per model replica) and divides the 1,536-sequence
# batch, so each generation compiles once (data = 1, at 64 GPUs, would compile again).
GPU_COUNTS = (128, 256, 512, 768, 1024, 1536, 2048, 3072)


def _launch(hardware: str, gpus: str, output_dir: str, kernel_cache: str) -> float:
  """Seconds for one launch.py projection run in a fresh process."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env[KERNEL_CACHE_ENV] = kernel_cache
  command = [
    sys.executable,
    "launch.py",
    "--mode=project",
    "--experiment=gpt3",
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


def _in_process(kernel_cache: str) -> list[tuple[str, float]]:
  """Cold point, repeated point and a second GPU count, timed in this process."""
  os.environ[KERNEL_CACHE_ENV] = kernel_cache
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
  parser.add_argument("--skip_sweep", action="store_true", help="skip the 48-point sweep")
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "kernels.bin")
    rows.append(
      (
        "launch.py, one point (h100 x 512), fresh process, empty kernel cache",
        _launch("h100", "512", tmp, cache),
      )
    )
    rows.append(
      (
        "launch.py, the same point, fresh process, kernels cached by the run above",
        _launch("h100", "512", tmp, cache),
      )
    )
  # This process saves its kernel cache at exit (projection/kernel_cache.py), before this
  # directory is removed: atexit runs the last registered first.
  tmp = tempfile.mkdtemp()
  atexit.register(shutil.rmtree, tmp, ignore_errors=True)
  rows += _in_process(os.path.join(tmp, "kernels.bin"))
  if not args.skip_sweep:
    with tempfile.TemporaryDirectory() as tmp:
      elapsed = _launch(
        ",".join(HARDWARE), ",".join(map(str, GPU_COUNTS)), tmp, os.path.join(tmp, "kernels.bin")
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
  width = max(len(label) for label, _ in rows)
  for label, seconds in rows:
    print(f"{label:<{width}}  {seconds:8.2f} s")


if __name__ == "__main__":
  main()
