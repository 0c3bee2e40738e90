"""sweep mode: the experiment's sweep (sweep/definitions.py), resumed, then its report."""

import sys

import jax

from modes.options import Options, experiment, point_options
from sweep import definitions, runner, summary


def run(options: Options) -> list[dict]:
  """Run the points not yet in --output_dir, print the table and write the report; exit 1
  when a point failed (a bug, not bad input: the reasons are in results.jsonl)."""
  definition = definitions.get(options.experiment)
  exp = experiment(options, definition.mode, definition.overrides)
  records = runner.run(
    exp,
    definition,
    options.output_dir,
    jax.devices()[0].platform,
    lambda hardware, n: experiment(options, definition.mode, definition.overrides, n, hardware),
    point_options(options),
    options.full_compile,
  )
  summary.finish(records, options.output_dir)
  failed = [r["sweep_key"] for r in records if r["status"] == "failed"]
  if failed:
    print(
      f"error: {len(failed)} points failed (run again to retry them): {', '.join(failed)}",
      file=sys.stderr,
    )
    sys.exit(1)
  return records
