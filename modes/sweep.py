"""sweep mode: the experiment's sweep (experiments/NAME_sweep.py), resumed, then its report."""

import sys

import jax

import experiments
from modes.options import Options, experiment, gpu_counts, hardware_names, point_options
from sweep import definitions, runner, summary


def run(options: Options) -> list[dict]:
  """Run the points not yet in --output_dir (those of --hardware and --gpus when given;
  each at the best of a search of --search_budget projections when given), print the
  table and write the report; exit 1 when a point failed (a bug, not bad input: the
  reasons are in results.jsonl)."""
  definition = definitions.restricted(
    experiments.sweep(options.experiment), hardware_names(options), gpu_counts(options)
  )
  if options.search_budget:
    definition = definitions.searched(definition, options.search_budget)
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
