"""MLPerf's reference convergence points (RCPs) as its checker uses them to score a run:
which reference mean samples to converge a global batch is normalized to.

The rules are those of github.com/mlcommons/logging, mlperf_logging/rcp_checker/
rcp_checker.py, as the result summarizer and the package checker run it (rcp_pass
"pruned_rcps"):

- An RCP's mean is the olympic mean of its reference runs: the fastest and the slowest run
  dropped (compute_rcp_stats).
- The RCPs are pruned before any is chosen (_prune_rcps): every batch below the one with
  the lowest mean is dropped, so that the smallest batch kept converges fastest; then,
  from the second to the next-to-last, an RCP whose mean is above the linear interpolation
  of its two neighbours is dropped, the walk going on from the same position.
- A batch with an RCP takes it; a batch between two takes their linear interpolation in
  the batch (_create_interp_rcp, numpy.interp); a batch below them all takes the smallest
  batch's ("RCP not found but slower convergence on smaller batch size"); a batch above
  them all has none ("Missing RCP, please submit RCP with BS = ..."), refused here.
  (check_directory)

Mean samples only: the checker's acceptance test (a run's mean samples at least the
RCP's minimum acceptable mean) is not modelled, as the run costed stops at the last
evaluation at or before the mean (experiments/_time_to_train.py).
"""

import bisect
from collections.abc import Mapping, Sequence

from errors import UserInputError


def olympic_mean(runs: Sequence[float]) -> float:
  """The mean of the reference runs without the fastest and the slowest."""
  kept = sorted(runs)[1:-1]
  return sum(kept) / len(kept)


def _interp(global_batch: int, lo: tuple[int, float], hi: tuple[int, float]) -> float:
  """numpy.interp's arithmetic between two points (slope x offset + low value), so that a
  pruning comparison falls as the checker's does."""
  slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
  return slope * (global_batch - lo[0]) + lo[1]


def pruned(means: Mapping[int, float]) -> dict[int, float]:
  """The RCPs the checker chooses from, by global batch."""
  rows = sorted(means.items())
  # min keeps the first of equal means, as the checker's min over batch-sorted RCPs does.
  fastest = min(rows, key=lambda row: row[1])[0]
  rows = [row for row in rows if row[0] >= fastest]
  i = 1
  while i < len(rows) - 1:
    if rows[i][1] > _interp(rows[i][0], rows[i - 1], rows[i + 1]):
      del rows[i]
    else:
      i += 1
  return dict(rows)


def checker_means(runs_by_batch: Mapping[int, Sequence[float]]) -> dict[int, float]:
  """Reference runs' samples to converge by global batch -> the pruned RCP means."""
  return pruned({gbs: olympic_mean(runs) for gbs, runs in runs_by_batch.items()})


def reference_mean(means: Mapping[int, float], global_batch: int, name: str) -> float:
  """The mean samples a run at `global_batch` is normalized to, from the pruned RCPs."""
  if global_batch in means:
    return float(means[global_batch])
  sizes = sorted(means)
  if global_batch > sizes[-1]:
    raise UserInputError(
      f"train.global_batch = {global_batch}: {name} has no reference convergence point at "
      f"or above it (largest {sizes[-1]}); MLPerf asks for a new RCP"
    )
  if global_batch < sizes[0]:
    return float(means[sizes[0]])
  i = bisect.bisect(sizes, global_batch)
  lo, hi = sizes[i - 1], sizes[i]
  return _interp(global_batch, (lo, means[lo]), (hi, means[hi]))
