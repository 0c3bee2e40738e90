"""Scaling efficiency and time to train of one sweep point, from the points before it.

Both efficiencies compare per-device throughput with the series' smallest point that ran
(its *baseline*, the same hardware and scaling rule):

  efficiency(N) = (tokens/s per device at N) / (tokens/s per device at N0)

For a weak series (the global batch grows with N) that is the weak scaling efficiency.
For a strong series (fixed global batch, so fixed tokens per step) it equals
(T(N0) / T(N)) / (N / N0), the speed-up over the baseline divided by the device ratio:
the strong scaling efficiency. A configured series (each count's own batch) gets the
same per-device throughput ratio.
"""

from records.sweeps import ScalingFigures
from sweep.definitions import Sweep


def series_key(record: dict) -> tuple:
  """Points of one series share everything but their device count."""
  return (record["sweep_config"], record["scaling"], record["hardware"])


def scaling(record: dict, baseline: dict | None, sweep: Sweep) -> ScalingFigures:
  """The scaling figures of a point that ran (`record`, its JSON object) against
  `baseline` (None: `record` is the baseline, efficiency 1), and its time to train when
  the sweep sets a token budget and the point has none of its own."""
  base = baseline or record
  efficiency = record["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
  if "time_to_train_min" in record or not sweep.token_budget:
    return ScalingFigures(base["devices"], efficiency)
  return ScalingFigures(
    base["devices"],
    efficiency,
    sweep.token_budget,
    sweep.token_budget_label,
    sweep.token_budget / record["tokens_per_s"] / 60,
  )
