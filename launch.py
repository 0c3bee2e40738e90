"""Run an experiment: train or benchmark its step, project it, search it or sweep it.

  python launch.py                                  # the default experiment (tiny)
  python launch.py --list
  python launch.py --experiment=cpu_char --mode=benchmark --devices=1
  python launch.py --set model.num_layers=4 --set mesh.tensor=4

Flags and dispatch only: each mode is a function in modes/ from the options to records,
importable and tested without this entry. Every result is appended to
OUTPUT_DIR/results.jsonl. Bad input exits with code 2 and one line on stderr.
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
from hardware import catalog
from modes import project, search, sweep, train
from modes.options import Options, check_paths
from projection.search import DEFAULT_BUDGET

MODES = {
  "train": train.run,
  "benchmark": train.run,
  "project": project.run,
  "search": search.run,
  "sweep": sweep.run,
}

_EXPERIMENT = flags.DEFINE_string("experiment", "tiny", "Experiment name: a file in experiments/.")
_LIST = flags.DEFINE_bool("list", False, "List the experiments and exit.")
_MODE = flags.DEFINE_enum(
  "mode",
  "train",
  list(MODES),
  "train: run the experiment's task and record losses; "
  "benchmark: time the step on synthetic tokens; "
  "project: compile for --hardware and cost it on --gpus GPUs; "
  "search: the best parallelism configurations for --hardware and "
  "--gpus (projection/search.py); "
  "sweep: the experiment's sweep (sweep/definitions.py).",
)
_STEPS = flags.DEFINE_integer("steps", None, "Timed steps (overrides train.steps).", lower_bound=1)
_DEVICES = flags.DEFINE_integer(
  "devices", None, "Use the first N local devices (default: all).", lower_bound=1
)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs", "Where results.jsonl is appended.")
_HARDWARE = flags.DEFINE_list(
  "hardware",
  ["h100"],
  f"project, search: hardware names ({', '.join(catalog.names())}, host), comma-separated; "
  "sweep: only these of the sweep's generations.",
)
_GPUS = flags.DEFINE_list(
  "gpus", ["512"], "project, search: GPU counts, comma-separated; sweep: these counts only."
)
_TOP = flags.DEFINE_integer("top", 5, "search: how many configurations to print.", lower_bound=1)
_SEARCH_BUDGET = flags.DEFINE_integer(
  "search_budget",
  DEFAULT_BUDGET,
  "search: candidates projected (compiled) at most, per hardware and GPU count; sweep: "
  "every point at the best of a search this size (strong and configured series).",
  lower_bound=1,
)
_FULL_COMPILE = flags.DEFINE_bool(
  "full_compile",
  False,
  "sweep: compile every projected point whole, not a 1F1B step composed from cached "
  "compiled pieces (projection/compose.py).",
)
_PROFILE_STEPS = flags.DEFINE_string(
  "profile_steps",
  None,
  "A:B: a JAX profiler trace of steps A..B-1 (from 0, warm-up included) in OUTPUT_DIR/profile.",
)
_CHECKPOINT_DIR = flags.DEFINE_string(
  "checkpoint_dir",
  None,
  "Save checkpoints here and resume from the newest one (train and benchmark modes).",
)
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Save every N steps.")
_KEEP_CHECKPOINTS = flags.DEFINE_integer(
  "keep_checkpoints", 3, "Keep the newest N checkpoints (and the newest known good one)."
)
_RESUME_FROM = flags.DEFINE_integer(
  "resume_from",
  None,
  "Resume from the checkpoint of this step (default: the newest not known bad); the "
  "checkpoints after it are moved to CHECKPOINT_DIR/set_aside.",
)
# Read before absl parses them (platform_env.distributed_from_argv): jax joins first.
flags.DEFINE_string("coordinator_address", None, "Multi-process: process 0's HOST:PORT.")
flags.DEFINE_integer("num_processes", None, "Multi-process: the number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's id, 0 .. N-1.")
flags.DEFINE_integer(
  "heartbeat_timeout_s",
  platform_env.DEFAULT_HEARTBEAT_TIMEOUT_S,
  "Multi-process: a process silent this long is dead; the others abort.",
)
_SET = flags.DEFINE_multi_string(
  "set",
  [],
  "KEY=VALUE override of a config field, repeatable "
  "(e.g. model.num_layers=4, mesh.tensor=2, model=gpt3-1.3b).",
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise UserInputError(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  if _LIST.value:
    for name in experiments.names():
      print(f"{name:<16} {experiments.load(name).description}")
    return
  distributed = [
    n for n in ("coordinator_address", "num_processes", "process_id") if flags.FLAGS[n].present
  ]
  if distributed and len(distributed) < 3:
    raise UserInputError(
      "--coordinator_address, --num_processes, --process_id go together; "
      f"got only --{', --'.join(distributed)}"
    )
  # A sweep runs its own points, each as configured, unless these are given.
  in_sweep = _MODE.value == "sweep"

  def given(flag, unset):
    if flag.present and not flag.value:
      raise UserInputError(f"--{flag.name}: empty; give at least one, comma-separated")
    return unset if in_sweep and not flag.present else flag.value

  options = Options(
    experiment=_EXPERIMENT.value,
    mode=_MODE.value,
    steps=_STEPS.value,
    devices=_DEVICES.value,
    output_dir=_OUTPUT_DIR.value,
    hardware=tuple(given(_HARDWARE, [])),
    gpus=tuple(given(_GPUS, [])),
    top=_TOP.value,
    search_budget=given(_SEARCH_BUDGET, 0),
    full_compile=_FULL_COMPILE.value,
    profile_steps=_PROFILE_STEPS.value,
    checkpoint_dir=_CHECKPOINT_DIR.value,
    checkpoint_every=_CHECKPOINT_EVERY.value,
    keep_checkpoints=_KEEP_CHECKPOINTS.value,
    resume_from=_RESUME_FROM.value,
    sets=tuple(_SET.value),
  )
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
