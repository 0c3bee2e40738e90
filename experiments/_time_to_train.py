"""A time-to-train benchmark as data: how many steps a global batch needs to converge, how
often the run evaluates, and the arithmetic that turns a projected step time into minutes.

time to train = steps to converge x step time + evaluations x one evaluation's time

Two forms: `TimeToTrain`, the wall clock of a run that converges in the published runs'
typical steps (MLPerf GPT-3 175B); `RcpNormalizedTimeToTrain`, the score MLPerf publishes
from round v5.0 on, a run's wall clock scaled to the reference runs' mean samples to
converge (the RCP) at its global batch.

One evaluation is a forward pass over the validation set. It is costed at the training
step's own rate per FLOP: eval_s = validation sequences x (step time / global batch) x
forward FLOPs / compiled step FLOPs, the FLOP ratio coming from the compiled program
(forward = a third of the model's training FLOPs; the step also pays for recomputation).
Basis: the same kernels, parallelism and pipeline run both, and the forward pass has no
weight-gradient reduction to expose; the validation batch is padded to whole global
batches, as the reference implementations pad it.
"""

import bisect
import dataclasses
import math
from collections.abc import Mapping

from errors import UserInputError
from experiments import _rcp


def interpolate(table: Mapping[int, float], global_batch: int, name: str) -> float:
  """table's value at global_batch, linear in the batch between its rows; a batch outside
  the rows raises UserInputError."""
  sizes = sorted(table)
  if not sizes[0] <= global_batch <= sizes[-1]:
    raise UserInputError(
      f"train.global_batch = {global_batch}: {name} has convergence "
      f"data for global batches {sizes[0]}-{sizes[-1]} only"
    )
  if global_batch in table:
    return float(table[global_batch])
  i = bisect.bisect(sizes, global_batch)
  lo, hi = sizes[i - 1], sizes[i]
  w = (global_batch - lo) / (hi - lo)
  return (1 - w) * table[lo] + w * table[hi]


def evaluation_s(
  eval_sequences: int, global_batch: int, step_time_s: float, forward_fraction: float
) -> float:
  """One evaluation: the validation set padded to whole global batches, each a forward
  pass at the training step's rate per FLOP."""
  return math.ceil(eval_sequences / global_batch) * step_time_s * forward_fraction


@dataclasses.dataclass(frozen=True)
class TimeToTrain:
  name: str
  seq_len: int
  eval_interval_sequences: int  # evaluate after this many trained sequences
  eval_sequences: int  # validation set size, in sequences
  # Steps to reach the target, by global batch (sequences): published runs' typical values.
  steps_by_global_batch: Mapping[int, int]

  def eval_interval_steps(self, global_batch: int) -> int:
    return math.ceil(self.eval_interval_sequences / global_batch)

  def tokens_to_converge(self, global_batch: int) -> float:
    """Tokens to the target: the table's, linear in the global batch between its rows."""
    tokens = {g: g * s * self.seq_len for g, s in self.steps_by_global_batch.items()}
    return interpolate(tokens, global_batch, self.name)

  def steps_to_converge(self, global_batch: int) -> int:
    """Steps to the target; a run stops at an evaluation, so whole evaluation intervals."""
    if global_batch in self.steps_by_global_batch:
      return self.steps_by_global_batch[global_batch]
    interval = self.eval_interval_steps(global_batch)
    steps = self.tokens_to_converge(global_batch) / (global_batch * self.seq_len)
    return math.ceil(steps / interval) * interval

  def evaluations(self, global_batch: int) -> int:
    return self.steps_to_converge(global_batch) // self.eval_interval_steps(global_batch)

  def estimate(self, step_time_s: float, global_batch: int, forward_fraction: float) -> dict:
    """Time to train for a step time; `forward_fraction` is forward FLOPs over the
    compiled step's FLOPs (what an evaluation costs relative to a training step)."""
    steps = self.steps_to_converge(global_batch)
    evals = self.evaluations(global_batch)
    eval_s = evaluation_s(self.eval_sequences, global_batch, step_time_s, forward_fraction)
    train_s = steps * step_time_s
    return {
      "steps_to_converge": steps,
      "tokens_to_converge": steps * global_batch * self.seq_len,
      "evaluations": evals,
      "eval_s_each": eval_s,
      "train_s": train_s,
      "eval_s": evals * eval_s,
      "time_to_train_min": (train_s + evals * eval_s) / 60,
    }


@dataclasses.dataclass(frozen=True)
class RcpNormalizedTimeToTrain:
  """MLPerf's RCP-normalized score (rounds v5.0 on): a run's wall clock, scaled up by
  (reference mean samples / its samples) when it converged in fewer samples than the
  reference runs' mean at its global batch; never scaled down.

  The run costed is the one that reaches the target at the last counted evaluation at or
  before the reference mean (the published calibration runs stop there), so its score is
  its wall clock x mean samples / its samples: the time to train at the reference mean.
  """

  name: str
  seq_len: int
  eval_interval_sequences: int  # evaluate after this many trained sequences
  eval_sequences: int  # each evaluation's validation sequences
  # The reference runs' mean samples (sequences) to converge, by global batch: the RCPs
  # the checker chooses from (experiments/_rcp.py checker_means, where a benchmark has its
  # runs).
  mean_samples_by_global_batch: Mapping[int, float]
  # The first eval_skip_base + floor(eval_skip_per_10k_sequences x GBS / 10,000)
  # evaluations are not run (MLPerf v5.1); 0, 0: every one is.
  eval_skip_base: int = 0
  eval_skip_per_10k_sequences: int = 0

  def eval_interval_steps(self, global_batch: int) -> int:
    return math.ceil(self.eval_interval_sequences / global_batch)

  def skipped_evaluations(self, global_batch: int) -> int:
    return self.eval_skip_base + self.eval_skip_per_10k_sequences * global_batch // 10_000

  def mean_samples(self, global_batch: int) -> float:
    """The reference mean the run is normalized to, chosen as MLPerf's RCP checker chooses
    it (experiments/_rcp.py): its batch's, the linear interpolation between the RCP batches
    either side, below them all the smallest batch's; above them all, refused."""
    return _rcp.reference_mean(self.mean_samples_by_global_batch, global_batch, self.name)

  def steps_to_converge(self, global_batch: int) -> int:
    """Steps of the run costed: whole evaluation intervals up to the reference mean, at
    least to the first evaluation run."""
    interval = self.eval_interval_steps(global_batch)
    intervals = math.floor(self.mean_samples(global_batch) / (global_batch * interval))
    return max(intervals, self.skipped_evaluations(global_batch) + 1) * interval

  def evaluations(self, global_batch: int) -> int:
    intervals = self.steps_to_converge(global_batch) // self.eval_interval_steps(global_batch)
    return intervals - self.skipped_evaluations(global_batch)

  def normalization(self, global_batch: int) -> float:
    """The factor the run's wall clock is scaled by (>= 1)."""
    samples = self.steps_to_converge(global_batch) * global_batch
    return max(1.0, self.mean_samples(global_batch) / samples)

  def estimate(self, step_time_s: float, global_batch: int, forward_fraction: float) -> dict:
    """As TimeToTrain.estimate; time_to_train_min is the normalized score and
    run_time_min the run's own wall clock."""
    steps = self.steps_to_converge(global_batch)
    evals = self.evaluations(global_batch)
    eval_s = evaluation_s(self.eval_sequences, global_batch, step_time_s, forward_fraction)
    train_s = steps * step_time_s
    run_s = train_s + evals * eval_s
    factor = self.normalization(global_batch)
    return {
      "benchmark": self.name,  # with its round, where it has several
      "steps_to_converge": steps,
      "tokens_to_converge": steps * global_batch * self.seq_len,
      "evaluations": evals,
      "eval_s_each": eval_s,
      "train_s": train_s,
      "eval_s": evals * eval_s,
      "run_time_min": run_s / 60,
      "rcp_mean_samples": self.mean_samples(global_batch),
      "rcp_normalization": factor,
      "time_to_train_min": run_s * factor / 60,
    }
