"""The one exception type for bad user input.

launch.py turns it into a single line on stderr and exit code 2; anything else is a bug
and keeps its traceback.
"""


class UserInputError(ValueError):
  """Bad input from a flag, an override or an experiment: the message names the field."""
