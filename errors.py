"""The one exception type for bad user input.

launch.py turns it into a single line on stderr and exit code 2; anything else is a bug
and keeps its traceback.
"""


class UserInputError(ValueError):
  """Bad input from a flag, an override or an experiment: the message names the field."""


class RunStopped(RuntimeError):
  """A run that stopped on purpose (a signal after saving, a non-finite loss): launch.py
  prints the one-line message and exits with `exit_code`."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code
