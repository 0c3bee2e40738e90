"""Run an experiment: train or benchmark its step, project it, search it or sweep it.

  python launch.py                                  # the default experiment (tiny)
  python launch.py --list
  python launch.py --experiment=cpu_char --mode=benchmark --devices=1
  python launch.py --set model.num_layers=4 --set mesh.tensor=4

The platform set-up and dispatch only: the flags are modes/flags.py's, and each mode is a
function in modes/ from the options to records, importable and tested without this entry.
Every result is appended to OUTPUT_DIR/results.jsonl. Bad input exits with code 2 and one
line on stderr.
"""

import os
import sys

import platform_env
from modes import host_devices

# First: XLA sizes the host platform (and jax joins a multi-process run) at start-up.
platform_env.configure(
  host_devices.from_argv(sys.argv), platform_env.distributed_from_argv(sys.argv)
)

# pylint: disable=wrong-import-position
from absl import app, flags

import experiments
from errors import RunStopped, UserInputError
from modes import flags as run_flags
from modes import project, search, sweep, train
from modes.options import check_paths

MODES = {
  "train": train.run,
  "benchmark": train.run,
  "project": project.run,
  "search": search.run,
  "sweep": sweep.run,
}


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise UserInputError(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  if run_flags.LIST.value:
    for name in experiments.names():
      print(f"{name:<16} {experiments.load(name).description}")
    return
  options = run_flags.options()
  check_paths(options)
  MODES[options.mode](options)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def _main(argv: list[str]) -> None:
  try:
    main(argv)
  except UserInputError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except RunStopped as e:
    print(f"stopped: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
  except KeyboardInterrupt:
    # Outside the loop's own handling (start-up, a projection): nothing half-written is
    # kept by a save then. os._exit: XLA's threads may still be running.
    sys.stdout.flush()
    print("stopped: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    os._exit(130)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(_main, flags_parser=_parse_flags)
