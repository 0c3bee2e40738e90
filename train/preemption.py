"""SIGTERM / SIGINT as a request to save and stop between steps.

A scheduler's SIGTERM (Slurm sends it before killing a preempted or timed-out job) and
Ctrl-C are recorded instead of ending the process; the loop checks after each step. On a
multi-process run all processes must stop after the same step, or their checkpoints
would disagree, so the request is all-gathered each step and any process's signal
stops them all. A second signal gets the default action (the process ends at once).

Before the first step (restoring a checkpoint, lowering, compiling) nothing is being
written, and the main thread may sit in one long C++ call (XLA's compile) where Python
runs no signal handler; `ExitOnSignal` ends the process from a watcher thread instead,
with one line. Letting a KeyboardInterrupt unwind out of the compile leaves XLA's compile
threads running into interpreter shutdown, which can crash the process.
"""

import os
import signal
import sys
import threading

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


class ExitOnSignal:
  """Context manager: while inside, SIGTERM or SIGINT prints one line on stderr and ends
  the process at once with 128 + signal (130 for Ctrl-C), whatever the main thread is
  doing. Only for phases where nothing is being written."""

  def __init__(self, when: str):
    self._when = when
    self._previous = {}
    self._previous_fd = -1
    self._fds = (-1, -1)
    self._watcher = None

  def __enter__(self) -> "ExitOnSignal":
    if threading.current_thread() is not threading.main_thread():
      return self  # signals reach only the main thread's handlers
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    self._fds = (read_fd, write_fd)
    # Python's C-level handler writes the signal number to the wakeup fd at once, even
    # while the main thread is inside C++; the Python-level handler itself does nothing.
    # The fd first: a signal between the two then meets the old handler (Ctrl-C's
    # KeyboardInterrupt) or the fd, where the other order lost it (the run went on).
    self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    self._previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in SIGNALS}
    self._watcher = threading.Thread(target=self._watch, name="exit-on-signal", daemon=True)
    self._watcher.start()
    return self

  def _watch(self) -> None:
    data = os.read(self._fds[0], 1)
    if not data:  # the block ended: the write end was closed
      return
    signum = data[0]
    sys.stdout.flush()
    sys.stderr.write(f"stopped: signal {signum} {self._when}\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE_BASE + signum)  # pylint: disable=protected-access

  def __exit__(self, *exc) -> None:
    if self._watcher is None:
      return
    for sig, handler in self._previous.items():  # the handlers first, for the same reason
      signal.signal(sig, handler)
    signal.set_wakeup_fd(self._previous_fd)
    os.close(self._fds[1])
    self._watcher.join()
    os.close(self._fds[0])
