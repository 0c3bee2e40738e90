"""Per-step hooks for the timing loop: TensorBoard scalars and a JAX profiler window.

train/loop.py calls `before_step(step)` before a step's clock starts and
`after_step(step, metrics, step_time_s)` after it stops, for every step (warm-up steps
included, numbered from 0), then `close()`.
"""

import os
from typing import Protocol

import jax

from errors import UserInputError


class StepHook(Protocol):
  def before_step(self, step: int) -> None: ...

  def after_step(self, step: int, metrics: dict, step_time_s: float) -> None: ...

  def close(self) -> None: ...


class TensorBoardHook:
  """Loss, learning rate, step time, tokens/s and MFU as TensorBoard scalars.

  tensorboardX writes the event files TensorBoard reads without TensorFlow (a protobuf
  writer in pure Python), so it installs on Python 3.11 next to JAX with no other weight.
  """

  def __init__(
    self,
    log_dir: str,
    tokens_per_step: int,
    flops_per_token: float,
    devices: int,
    peak_tflops_per_device: float,
  ):
    # Imported here: only this hook needs tensorboardX, and GPU images may lack it.
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

    self.log_dir = log_dir
    self._writer = SummaryWriter(log_dir)
    self._tokens_per_step = tokens_per_step
    self._flops_per_token = flops_per_token
    self._devices = devices
    self._peak_tflops = peak_tflops_per_device

  def before_step(self, step: int) -> None:
    pass

  def after_step(self, step: int, metrics: dict, step_time_s: float) -> None:
    tokens_per_s = self._tokens_per_step / step_time_s
    tflops_per_device = tokens_per_s * self._flops_per_token / self._devices / 1e12
    scalars = {
      "train/loss": float(metrics["loss"]),
      "train/learning_rate": float(metrics["learning_rate"]),
      "perf/step_time_s": step_time_s,
      "perf/tokens_per_s": tokens_per_s,
      "perf/mfu": tflops_per_device / self._peak_tflops,
    }
    for tag, value in scalars.items():
      self._writer.add_scalar(tag, value, step)

  def close(self) -> None:
    self._writer.close()


def parse_profile_steps(text: str, total_steps: int) -> tuple[int, int]:
  """'A:B' -> (A, B): profile steps A to B-1, counted from 0 with the warm-up steps."""
  start, sep, stop = text.partition(":")
  whole = lambda t: t.isascii() and t.isdigit()  # str.isdigit alone passes '²'
  if not sep or not whole(start) or not whole(stop) or int(start) >= int(stop):
    raise UserInputError(f"--profile_steps must be A:B with whole numbers A < B, got {text!r}")
  if int(stop) > total_steps:
    raise UserInputError(
      f"--profile_steps {text}: B must be at most the {total_steps} steps run (warm-up included)"
    )
  return int(start), int(stop)


class ProfileHook:
  """A JAX profiler trace of steps [start, stop), for XProf / TensorBoard's profile tab.

  The trace lands in `log_dir/plugins/profile/<run>/` (*.xplane.pb and *.trace.json.gz).
  Tracing slows the steps it covers; their step times are recorded all the same.
  """

  def __init__(self, log_dir: str, start: int, stop: int):
    self.log_dir = log_dir
    self._start, self._stop = start, stop

  def before_step(self, step: int) -> None:
    if step == self._start:
      os.makedirs(self.log_dir, exist_ok=True)
      jax.profiler.start_trace(self.log_dir)

  def after_step(self, step: int, metrics: dict, step_time_s: float) -> None:
    if step == self._stop - 1:
      jax.profiler.stop_trace()

  def close(self) -> None:
    pass
