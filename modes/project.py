"""project mode: the experiment compiled and costed on every --hardware x --gpus point."""

import os

import tqdm

from modes.options import Options, experiment, projection_points
from projection import project
from report import points as printers
from report import results


def run(options: Options) -> list[dict]:
  """Project every point (all checked first), appending each record as it is made."""
  points = projection_points(options)
  records = []
  progress = tqdm.tqdm(points, desc="projecting", unit="point", disable=len(points) < 2)
  for name, gpus in progress:
    progress.set_postfix_str(f"{name} x {gpus}")
    record = project.project(experiment(options, "project", gpus=gpus, hardware=name), name, gpus)
    results.append(options.output_dir, record, stamp=True)
    records.append(record)
  print(printers.projection_table(records))
  print(f"\nappended to {os.path.join(options.output_dir, results.FILE)}")
  return records
