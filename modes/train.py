"""train and benchmark modes: one measured point on this machine's devices."""

import jax

from measure import fit
from measure.point import run_point
from modes.options import Options, experiment, point_options
from records.points import MeasuredPoint
from report import points as printers
from report import results


def run(options: Options) -> list[MeasuredPoint]:
  """Train (or time, in benchmark mode) the experiment; append and print its record
  (process 0 of a multi-process run only)."""
  exp = experiment(options, options.mode)
  run = run_point(exp, options.mode, fit.devices(options.devices), point_options(options))
  if not run.result.step_times_s:
    print(
      f"\nnothing left to run: the checkpoint in {options.checkpoint_dir} is at step "
      f"{run.result.first_step}, the run has {exp.train.warmup_steps + exp.train.steps}"
    )
  record = run.record
  if record is None or jax.process_index() != 0:
    return []
  path = results.append(options.output_dir, record)
  print(printers.measured_table(record))
  print(f"\nappended to {path}")
  return [record]
