"""The projection every mode makes (a deviceless compile for the target GPU, jax's CUDA 12
plugin on this machine's CPU) set beside the steps benchmarks/gpu_check.py measured on a
real GPU: the check that the project's projections, not only its cost model, hold.

For each configuration measured in GPU_CHECK_JSONL (the one GPU's records that
gpu_check.py appends), the same experiment is planned on one GPU of the catalog entry the
measured GPU's name names and projected whole (projection/project.py `whole`: compiled
deviceless, costed, recorded). The table gives the measured step beside this projection
and its breakdown. The compilers can differ: the GPU ran the jax it had, this machine
compiles with its pinned jax (the table names the GPU's).

  python benchmarks/gpu_check_deviceless.py docs/gpu_check/h100.jsonl [--only=compute,fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
import platform_env  # noqa: E402

if __name__ == "__main__":
  os.environ["JAX_PLATFORMS"] = "cpu"  # deviceless: the CUDA target compiles on the CPU
  platform_env.configure(1)

# pylint: disable=wrong-import-position
from benchmarks.gpu_check import catalog_entry_for, experiment  # noqa: E402
from benchmarks.gpu_check_configs import CONFIGS  # noqa: E402
from benchmarks.gpu_check_report import ms, ratio  # noqa: E402
from hardware import catalog  # noqa: E402
from projection import project, targets  # noqa: E402
from projection.plan import plan  # noqa: E402


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


def deviceless(record: dict) -> dict:
  """The record's experiment projected on one GPU of its catalog entry, compiled deviceless."""
  config = next(c for c in CONFIGS if c.name == record["config"])
  exp = experiment(config, False, record["timed_steps"], 0, tuple(record.get("fallback_sets", ())))
  hw = catalog.get(catalog_entry_for(record["device_kind"]))
  alone = dataclasses.replace(hw, gpus_per_node=1, nvlink_domain_size=1)
  point = project.whole(exp, plan(exp, alone, 1))
  return {"hardware": hw.name, "point": point}


def table(rows: list[tuple[dict, dict]]) -> list[str]:
  lines = [
    "| configuration | GPU, jax | measured step ms | projected ms | error | compute ms | "
    "memory-bound ms | launches ms | compiled for |",
    "|" + "---|" * 9,
  ]
  for record, projected in rows:
    point = projected["point"]
    b = point.breakdown
    lines.append(
      f"| {record['config']} | {record['device_kind']}, {record['jax_version']} | "
      f"{ms(record['step_time_s'])} | "
      f"{ms(point.step_time_s)} | {ratio(point.step_time_s, record['step_time_s'])} | "
      f"{ms(b['compute_s'])} | {ms(b['memory_bound_s'])} | {ms(b['other_s'])} | "
      f"{point.compile_target} |"
    )
  return lines


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("measured", help="a gpu_check.jsonl with a GPU's measured records")
  parser.add_argument("--only", default="", help="comma-separated configurations")
  args = parser.parse_args(argv)
  only = [n.strip() for n in args.only.split(",") if n.strip()] or None
  if not os.path.isfile(args.measured):
    print(f"error: {args.measured}: no such file", file=sys.stderr)
    return 2
  records = measured_records(args.measured, only)
  if not records:
    print(f"error: {args.measured} holds no measured GPU record", file=sys.stderr)
    return 2
  ok, reason = targets.cuda_available()
  if not ok:
    print(f"error: no deviceless CUDA target here: {reason}", file=sys.stderr)
    return 2
  rows = []
  for record in records:
    rows.append((record, deviceless(record)))
    print(f"  {record['config']}: {ms(rows[-1][1]['point'].step_time_s)} ms projected", flush=True)
  print("\n".join(table(rows)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
