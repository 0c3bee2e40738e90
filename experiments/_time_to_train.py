"""A time-to-train benchmark as data: how many steps a global batch needs to converge, how
often the run evaluates, and the arithmetic that turns a projected step time into minutes.

time to train = steps to converge x step time + evaluations x one evaluation's time

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
    table = sorted(self.steps_by_global_batch.items())
    sizes = [g for g, _ in table]
    if not sizes[0] <= global_batch <= sizes[-1]:
      raise UserInputError(
        f"train.global_batch = {global_batch}: {self.name} has convergence "
        f"data for global batches {sizes[0]}-{sizes[-1]} only"
      )
    tokens = {g: g * s * self.seq_len for g, s in table}
    if global_batch in tokens:
      return float(tokens[global_batch])
    i = bisect.bisect(sizes, global_batch)
    lo, hi = sizes[i - 1], sizes[i]
    w = (global_batch - lo) / (hi - lo)
    return (1 - w) * tokens[lo] + w * tokens[hi]

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
    eval_batches = math.ceil(self.eval_sequences / global_batch)
    eval_s = eval_batches * step_time_s * forward_fraction
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
