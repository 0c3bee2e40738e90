"""The projection every mode makes (a deviceless compile for the target GPU, jax's CUDA 12
plugin on this machine's CPU) set beside the steps benchmarks/gpu_check.py measured on a
real GPU: the check that the project's projections, not only its cost model, hold.

For each configuration measured in GPU_CHECK_JSONL (the one GPU's records that
gpu_check.py appends), the same experiment is planned on one GPU of the catalog entry the
measured GPU's name names and projected whole (projection/project.py `whole`: compiled
deviceless, costed, recorded). The table gives the measured step beside this projection
and its breakdown. The compilers can differ: the GPU ran the jax it had, this machine
compiles with its pinned jax (the table names the GPU's). With --programs (the hlo.tar.gz
gpu_check.py wrote), the programs the GPU itself compiled are projected again too, with
the HLO reader and cost model as they stand now.

  python benchmarks/gpu_check_deviceless.py docs/gpu_check/h100.jsonl [--only=compute,fp8]
      [--programs=gpu_check/hlo.tar.gz]
"""

from __future__ import annotations

import json
import os
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
import platform_env  # noqa: E402

if __name__ == "__main__":
  os.environ["JAX_PLATFORMS"] = "cpu"  # deviceless: the CUDA target compiles on the CPU
  platform_env.configure(1)

# pylint: disable=wrong-import-position
from benchmarks.gpu_check import Parser, catalog_entry_for, experiment, one_gpu  # noqa: E402
from benchmarks.gpu_check_configs import CONFIGS  # noqa: E402
from benchmarks.gpu_check_report import ms, ratio  # noqa: E402
from hardware import catalog  # noqa: E402
from projection import hlo, project, targets  # noqa: E402
from records.points import ProjectedPoint  # noqa: E402


def measured_records(path: str, only: list[str] | None) -> list[dict]:
  """The last measured record of each configuration in a gpu_check.jsonl (a GPU's, not a
  dry run's), in CONFIGS order."""
  last = {}
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      if r.get("kind") == "config" and "step_time_s" in r and not r.get("dry_run"):
        last[r["config"]] = r
  return [last[c.name] for c in CONFIGS if c.name in last and (not only or c.name in only)]


def _target(record: dict):
  """The record's experiment and its plan on one GPU of the catalog entry it names."""
  config = next(c for c in CONFIGS if c.name == record["config"])
  exp = experiment(config, False, record["timed_steps"], 0, tuple(record.get("fallback_sets", ())))
  return exp, one_gpu(exp, catalog.get(catalog_entry_for(record["device_kind"])))


def deviceless(record: dict) -> ProjectedPoint:
  """The record's experiment projected on one GPU of its catalog entry, compiled deviceless."""
  exp, target = _target(record)
  return project.whole(exp, target)


def gpu_programs(path: str) -> dict[str, str]:
  """Each configuration's optimized HLO from a gpu_check hlo.tar.gz (CONFIG.hlo.txt)."""
  with tarfile.open(path) as tar:
    return {
      m.name.removesuffix(".hlo.txt"): tar.extractfile(m).read().decode()
      for m in tar.getmembers()
      if m.name.endswith(".hlo.txt")
    }


def reprojected(record: dict, hlo_text: str) -> ProjectedPoint:
  """The program the GPU compiled, projected with today's HLO reader and cost model."""
  exp, target = _target(record)
  memory_bytes = record["projected"]["memory_per_gpu_gb"] * 1e9
  return project.of_program(exp, target, hlo.analyze(hlo_text), memory_bytes, 0.0, "cuda")


def table(rows: list[tuple[dict, ProjectedPoint, ProjectedPoint | None]]) -> list[str]:
  """Per record: measured, the deviceless projection and its breakdown, and the GPU's own
  program projected again where it was given."""
  lines = [
    "| configuration | GPU, jax | measured step ms | projected ms | error | compute ms | "
    "memory-bound ms | launches ms | compiled for | GPU's program, projected ms | error |",
    "|" + "---|" * 11,
  ]
  for record, point, own in rows:
    b = point.breakdown
    measured = record["step_time_s"]
    own_s = own.step_time_s if own else None
    lines.append(
      f"| {record['config']} | {record['device_kind']}, {record['jax_version']} | "
      f"{ms(measured)} | {ms(point.step_time_s)} | {ratio(point.step_time_s, measured)} | "
      f"{ms(b['compute_s'])} | {ms(b['memory_bound_s'])} | {ms(b['other_s'])} | "
      f"{point.compile_target} | {ms(own_s)} | {ratio(own_s, measured)} |"
    )
  return lines


def main(argv: list[str]) -> int:
  parser = Parser(description=__doc__.split("\n\n")[0])
  parser.add_argument("measured", help="a gpu_check.jsonl with a GPU's measured records")
  parser.add_argument("--only", default="", help="comma-separated configurations")
  parser.add_argument("--programs", default="", help="the hlo.tar.gz gpu_check.py wrote")
  args = parser.parse_args(argv)
  only = [n.strip() for n in args.only.split(",") if n.strip()] or None
  for path in filter(None, (args.measured, args.programs)):
    if not os.path.isfile(path):
      print(f"error: {path}: no such file", file=sys.stderr)
      return 2
  records = measured_records(args.measured, only)
  if not records:
    print(f"error: {args.measured} holds no measured GPU record", file=sys.stderr)
    return 2
  ok, reason = targets.cuda_available()
  if not ok:
    print(f"error: no deviceless CUDA target here: {reason}", file=sys.stderr)
    return 2
  programs = gpu_programs(args.programs) if args.programs else {}
  rows = []
  for record in records:
    point = deviceless(record)
    text = programs.get(record["config"])
    rows.append((record, point, reprojected(record, text) if text else None))
    print(f"  {record['config']}: {ms(point.step_time_s)} ms projected", flush=True)
  print("\n".join(table(rows)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
