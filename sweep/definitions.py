"""Sweeps as data: which points an experiment's sweep visits and how its batch scales.

A sweep runs one or more series per hardware generation, each over ascending device
counts: *strong* scaling keeps the experiment's global batch at every count; *weak*
scaling gives every data-parallel replica (data x fsdp) the same number of sequences, so
the global batch grows with the count; *configured* keeps whatever batch the experiment
sets at each count (the MLPerf experiment's published configurations).
Each experiment's sweep is beside it, `experiments/NAME_sweep.py` (`experiments.sweep(NAME)`),
and is what `--mode=sweep --experiment=NAME` runs. Imports no jax (modes/host_devices.py
reads a sweep's mode before jax starts).
"""

import dataclasses

from errors import UserInputError

# The device counts of this machine's measured sweeps (tests/conftest.py and launch.py
# give a process 8 host CPU devices).
HOST_DEVICE_COUNTS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Sweep:
  mode: str  # "project" (GPU clusters) or "benchmark" (measured here)
  counts: tuple[int, ...]  # GPUs (project) or local devices (benchmark)
  hardware: tuple[str, ...] = ()  # project: generations; benchmark: none (this machine)
  scalings: tuple[str, ...] = ("strong", "weak")  # each also "configured"
  # Weak scaling: sequences per data-parallel replica per step.
  weak_sequences_per_replica: int = 2
  # `--set` assignments applied before the user's own (which win).
  overrides: tuple[str, ...] = ()
  # Tokens to train for time to train (0: none). Records that carry their own
  # `time_to_train_min` (experiments that define a target) keep theirs.
  token_budget: int = 0
  token_budget_label: str = ""  # for plot titles and records
  # Above 0 (`searched`): every point runs the best configuration a search
  # (projection/search.py) finds for its generation and GPU count, projecting at most this
  # many candidates; the record carries the choice (`search`). Strong or configured
  # scaling only: a weak point's batch would depend on the configuration chosen.
  search_budget: int = 0

  def __post_init__(self):
    if self.search_budget and (self.mode != "project" or "weak" in self.scalings):
      raise ValueError("a searched sweep projects, with strong or configured scaling only")


def measured(*overrides: str) -> Sweep:
  """A sweep measured on this machine's devices: pure data parallelism, so every device
  count from 1 up has a mesh; `overrides` follow the data-parallel ones."""
  return Sweep(
    mode="benchmark",
    counts=HOST_DEVICE_COUNTS,
    overrides=("mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1", *overrides),
  )


def searched(sweep: Sweep, budget: int) -> Sweep:
  """`sweep` with every point at the best configuration a search of `budget` projections
  finds (`--search_budget` in sweep mode); its weak series dropped (Sweep.search_budget)."""
  if sweep.mode != "project":
    raise UserInputError(
      "--search_budget: a measured sweep runs on this machine's devices; only projected "
      "sweeps search their points"
    )
  scalings = tuple(s for s in sweep.scalings if s != "weak")
  return dataclasses.replace(sweep, scalings=scalings, search_budget=budget)


def restricted(sweep: Sweep, hardware: tuple[str, ...], counts: tuple[int, ...]) -> Sweep:
  """`sweep` on these generations and GPU counts only (`--hardware`, `--gpus` in sweep
  mode; () keeps the sweep's own). Their points keep their keys, so a restricted run and
  a whole one resume each other in one directory."""
  if not (hardware or counts):
    return sweep
  if sweep.mode != "project":
    raise UserInputError(
      "--hardware/--gpus: a measured sweep runs on this machine's devices; only projected "
      "sweeps take them"
    )
  for name in hardware:
    if name not in sweep.hardware:
      raise UserInputError(
        f"--hardware: {name!r} is not one of this sweep's generations ({', '.join(sweep.hardware)})"
      )
  for count in counts:
    if count not in sweep.counts:
      raise UserInputError(
        f"--gpus: {count} is not one of this sweep's GPU counts "
        f"({', '.join(str(c) for c in sweep.counts)})"
      )
  return dataclasses.replace(
    sweep, hardware=hardware or sweep.hardware, counts=counts or sweep.counts
  )
