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

from sweep.definitions import Sweep


def series_key(record: dict) -> tuple:
  """Points of one series share everything but their device count."""
  return (record["sweep_config"], record["scaling"], record["hardware"])


def annotate(record: dict, baseline: dict | None, sweep: Sweep) -> dict:
  """`record` with its scaling efficiency against `baseline` (None: `record` is the
  baseline, efficiency 1) and its time to train when the sweep sets a token budget."""
  if record["status"] != "ok":
    return record
  base = baseline or record
  record["scaling_baseline_devices"] = base["devices"]
  record["scaling_efficiency"] = record["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
  if "time_to_train_min" not in record and sweep.token_budget:
    record["token_budget"] = sweep.token_budget
    record["token_budget_label"] = sweep.token_budget_label
    record["time_to_train_min"] = sweep.token_budget / record["tokens_per_s"] / 60
  return record
