"""launch.py's flags, and the run's options (modes/options.py) read from them."""

from absl import flags

import platform_env
from errors import UserInputError
from hardware import catalog
from modes.options import Options
from projection.search import DEFAULT_BUDGET

MODES = ("train", "benchmark", "project", "search", "sweep")

EXPERIMENT = flags.DEFINE_string("experiment", "tiny", "Experiment name: a file in experiments/.")
LIST = flags.DEFINE_bool("list", False, "List the experiments and exit.")
MODE = flags.DEFINE_enum(
  "mode",
  "train",
  list(MODES),
  "train: run the experiment's task and record losses; "
  "benchmark: time the step on synthetic tokens; "
  "project: compile for --hardware and cost it on --gpus GPUs; "
  "search: the best parallelism configurations for --hardware and "
  "--gpus (projection/search.py); "
  "sweep: the experiment's sweep (experiments/NAME_sweep.py).",
)
STEPS = flags.DEFINE_integer("steps", None, "Timed steps (overrides train.steps).", lower_bound=1)
DEVICES = flags.DEFINE_integer(
  "devices", None, "Use the first N devices of each process (default: all).", lower_bound=1
)
OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs", "Where results.jsonl is appended.")
HARDWARE = flags.DEFINE_list(
  "hardware",
  ["h100"],
  f"project, search: hardware names ({', '.join(catalog.names())}, host), comma-separated; "
  "sweep: only these of the sweep's generations.",
)
GPUS = flags.DEFINE_list(
  "gpus", ["512"], "project, search: GPU counts, comma-separated; sweep: these counts only."
)
TOP = flags.DEFINE_integer("top", 5, "search: how many configurations to print.", lower_bound=1)
SEARCH_BUDGET = flags.DEFINE_integer(
  "search_budget",
  DEFAULT_BUDGET,
  "search: candidates projected (compiled) at most, per hardware and GPU count; sweep: "
  "every point at the best of a search this size (strong and configured series).",
  lower_bound=1,
)
FULL_COMPILE = flags.DEFINE_bool(
  "full_compile",
  False,
  "project, sweep: compile every projected point whole (how=full), not a 1F1B step "
  "composed from cached compiled pieces (projection/compose.py; how=auto). Search mode "
  "compiles its candidates whole.",
)
PROFILE_STEPS = flags.DEFINE_string(
  "profile_steps",
  None,
  "A:B: a JAX profiler trace of steps A..B-1 (from 0, warm-up included) in OUTPUT_DIR/profile.",
)
CHECKPOINT_DIR = flags.DEFINE_string(
  "checkpoint_dir",
  None,
  "Save checkpoints here and resume from the newest one (train and benchmark modes).",
)
CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Save every N steps.")
KEEP_CHECKPOINTS = flags.DEFINE_integer(
  "keep_checkpoints", 3, "Keep the newest N checkpoints (and the newest known good one)."
)
RESUME_FROM = flags.DEFINE_integer(
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
SET = flags.DEFINE_multi_string(
  "set",
  [],
  "KEY=VALUE override of a config field, repeatable "
  "(e.g. model.num_layers=4, mesh.tensor=2, model=gpt3-1.3b).",
)


def options() -> Options:
  """The parsed flags as the run's options; bad combinations raise UserInputError."""
  distributed = [
    n for n in ("coordinator_address", "num_processes", "process_id") if flags.FLAGS[n].present
  ]
  if distributed and len(distributed) < 3:
    raise UserInputError(
      "--coordinator_address, --num_processes, --process_id go together; "
      f"got only --{', --'.join(distributed)}"
    )
  # The train and benchmark modes run on this machine's devices: a target there would be
  # silently ignored.
  targets = [flag.name for flag in (HARDWARE, GPUS) if flag.present]
  if targets and MODE.value in ("train", "benchmark"):
    raise UserInputError(
      f"--{', --'.join(targets)}: for the project, search and sweep modes; "
      f"--mode={MODE.value} runs on this machine's devices (--devices)"
    )
  # A sweep runs its own points, each as configured, unless these are given.
  in_sweep = MODE.value == "sweep"

  def given(flag, unset):
    if flag.present and not flag.value:
      raise UserInputError(f"--{flag.name}: empty; give at least one, comma-separated")
    return unset if in_sweep and not flag.present else flag.value

  return Options(
    experiment=EXPERIMENT.value,
    mode=MODE.value,
    steps=STEPS.value,
    devices=DEVICES.value,
    output_dir=OUTPUT_DIR.value,
    hardware=tuple(given(HARDWARE, [])),
    gpus=tuple(given(GPUS, [])),
    top=TOP.value,
    search_budget=given(SEARCH_BUDGET, 0),
    full_compile=FULL_COMPILE.value,
    profile_steps=PROFILE_STEPS.value,
    checkpoint_dir=CHECKPOINT_DIR.value,
    checkpoint_every=CHECKPOINT_EVERY.value,
    keep_checkpoints=KEEP_CHECKPOINTS.value,
    resume_from=RESUME_FROM.value,
    sets=tuple(SET.value),
  )
