"""The mlperf_gpt3_175b experiment's sweep: gpt3's generations and GPU counts, one series
as configured (the experiment picks a published batch and parallelism by GPU count and
reports its own time to train)."""

import dataclasses

from experiments import gpt3_sweep

SWEEP = dataclasses.replace(
  gpt3_sweep.SWEEP, scalings=("configured",), token_budget=0, token_budget_label=""
)
