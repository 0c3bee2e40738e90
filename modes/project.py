"""project mode: the experiment compiled and costed on every --hardware x --gpus point."""

import os

import tqdm

from modes.options import Options, projection_points
from projection import project
from records.points import ProjectedPoint
from report import points as printers
from report import results


def run(options: Options) -> list[ProjectedPoint]:
  """Project every point (all planned and checked first), appending each record as it is
  made."""
  targets = projection_points(options)
  records = []
  progress = tqdm.tqdm(targets, desc="projecting", unit="point", disable=len(targets) < 2)
  for exp, target in progress:
    progress.set_postfix_str(f"{target.hardware.name} x {target.gpus}")
    record = project.project(exp, target, options.how)
    results.append(options.output_dir, record, stamp=True)
    records.append(record)
  print(printers.projection_table(records))
  print(f"\nappended to {os.path.join(options.output_dir, results.FILE)}")
  return records
