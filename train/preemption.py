"""SIGTERM / SIGINT as a request to save and stop between steps.

A scheduler's SIGTERM (Slurm sends it before killing a preempted or timed-out job) and
Ctrl-C are recorded instead of ending the process; the loop checks after each step. On a
multi-process run all processes must stop after the same step, or their checkpoints
would disagree, so the request is all-gathered each step and any process's signal
stops them all. A second signal gets the default action (the process ends at once).
"""

import signal

import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Exit code of a run stopped by a signal after saving: the shell's 128 + signal number.
EXIT_CODE_BASE = 128


class StopRequest:
  """Context manager: while inside, SIGTERM and SIGINT set `signal_number`."""

  def __init__(self, process_count: int):
    self._process_count = process_count
    self._received = 0
    self._previous = {}

  def _handle(self, signum: int, frame) -> None:
    del frame
    self._received = signum
    for sig, handler in self._previous.items():  # a second signal acts at once
      signal.signal(sig, handler)

  def __enter__(self) -> "StopRequest":
    self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def signal_number(self) -> int:
    """The signal that stops the run after this step (0: none); the same on every process."""
    if self._process_count == 1:
      return self._received
    return int(np.max(multihost_utils.process_allgather(np.int32(self._received))))
