"""The record a sweep writes for each of its points (sweep/runner.py, results.jsonl).

One flat JSON object per point: the point's own record (a ProjectedPoint or MeasuredPoint,
records/points.py) when it ran, then `status` (and `reason` when it did not run), the
sweep's labels and, for a point that ran, its scaling figures (sweep/metrics.py). A key
the point's record already has (`hardware`, `devices`) keeps its place with the label's
value, which is the same.
"""

import dataclasses
from typing import Any

from records.points import MeasuredPoint, ProjectedPoint, to_json

# A point's status: ran (ok, or projected over capacity), could not run (bad input: the
# mesh does not divide the count...), or failed (a bug; retried on the next run).
STATUSES = ("ok", "does_not_fit", "cannot_run", "failed")


@dataclasses.dataclass(frozen=True)
class SweepLabels:
  """What every sweep record carries, whatever its status."""

  sweep: str  # the experiment's name
  sweep_key: str  # sweep/runner.py point_key: resumes skip the keys already written
  sweep_config: str  # fingerprint of the experiment's configuration
  sweep_mode: str  # "project" or "benchmark"
  scaling: str  # "strong", "weak" or "configured"
  hardware: str  # a generation (project) or the platform (benchmark)
  devices: int
  time: str  # UTC, ISO 8601


@dataclasses.dataclass(frozen=True)
class ScalingFigures:
  """A point that ran, against its series' baseline (sweep/metrics.py); time to train
  when the sweep sets a token budget and the point has no time to train of its own."""

  scaling_baseline_devices: int
  scaling_efficiency: float
  token_budget: int | None = None
  token_budget_label: str | None = None
  time_to_train_min: float | None = None


@dataclasses.dataclass(frozen=True)
class SweepRecord:
  """One sweep point as results.jsonl holds it (`to_json`)."""

  status: str  # STATUSES
  labels: SweepLabels
  experiment: str
  point: ProjectedPoint | MeasuredPoint | None = None  # when it ran
  reason: str | None = None  # when it did not run
  scaling: ScalingFigures | None = None  # when it ran and fits

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
    if (self.point is None) == (self.reason is None):
      raise ValueError("a sweep record has a point (it ran) or a reason (it did not)")

  def to_json(self) -> dict[str, Any]:
    """The flat JSON object results.jsonl holds."""
    out = dict(to_json(self.point)) if self.point is not None else {}
    out["status"] = self.status
    if self.reason is not None:
      out["reason"] = self.reason
    out.update(to_json(self.labels))
    out.setdefault("experiment", self.experiment)
    if self.scaling is not None:
      out.update(to_json(self.scaling))
    return out
