"""Sweeps as data: which points an experiment's sweep visits and how its batch scales.

A sweep runs one or more series per hardware generation, each over ascending device
counts: *strong* scaling keeps the experiment's global batch at every count; *weak*
scaling gives every data-parallel replica (data x fsdp) the same number of sequences, so
the global batch grows with the count; *configured* keeps whatever batch the experiment
sets at each count (the MLPerf experiment's published configurations).
`--mode=sweep --experiment=NAME` runs SWEEPS[NAME].
"""

import dataclasses

from errors import UserInputError
from hardware import catalog
from reference import mlperf_gpt3, mlperf_llama31_405b

# Powers of two from one HGX node up, plus the GPU counts of published MLPerf GPT-3 runs
# (reference/mlperf_gpt3.py).
GPU_COUNTS = tuple(sorted([2**k for k in range(3, 15)] + list(mlperf_gpt3.PUBLISHED_GPU_COUNTS)))
# Llama 3.1 405B from 256 GPUs (two replicas of H100's published TP 8 x PP 8 x CP 2) to
# 8,192 (the largest published run, reference/mlperf_llama31_405b.py).
LLAMA_GPU_COUNTS = tuple(2**k for k in range(8, 14))
# The device counts of this machine's measured sweeps (tests/conftest.py and launch.py
# give a process 8 host CPU devices).
HOST_DEVICE_COUNTS = (1, 2, 4, 8)

# Tokens the MLPerf GPT-3 175B benchmark trains to reach its target at global batch 2,048.
# Time to train is that budget over the throughput.
MLPERF_GPT3_TOKENS = mlperf_gpt3.TOKENS_AT_2048


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


_GPT3 = Sweep(
  mode="project",
  counts=GPU_COUNTS,
  hardware=tuple(catalog.names()),
  # 2 sequences per replica is MLPerf v3.1's global batch of 2,688 at 10,752 GPUs
  # (1,344 replicas of tensor 8); the strong series keeps the GPT-3 paper's 1,536.
  weak_sequences_per_replica=2,
  token_budget=MLPERF_GPT3_TOKENS,
  token_budget_label="1.21 B tokens (MLPerf GPT-3 175B at global batch 2,048)",
)

# Measured sweeps: pure data parallelism, so every device count from 1 up has a mesh.
_HOST = Sweep(
  mode="benchmark",
  counts=HOST_DEVICE_COUNTS,
  overrides=("mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1"),
)

SWEEPS = {
  "gpt3": _GPT3,
  # The MLPerf experiment (experiments/mlperf_gpt3_175b.py) picks a published batch and
  # parallelism by GPU count and reports its own time to train: one series, as configured.
  "mlperf_gpt3_175b": dataclasses.replace(
    _GPT3, scalings=("configured",), token_budget=0, token_budget_label=""
  ),
  # Llama 3 (8B by default) as gpt3: every generation, strong and weak scaling of its FSDP
  # layout; 2 sequences of 8,192 per replica, as GPT-3's 2 of 2,048 (a 4M-token batch at
  # 256 replicas, Meta's Llama 2 recipe).
  "llama3": dataclasses.replace(_GPT3, token_budget=0, token_budget_label=""),
  # The MLPerf Llama experiment picks the published run, or the generation's published
  # layout and batch rule, for each target (experiments/mlperf_llama31_405b.py
  # for_target) and reports its own time to train: the generations MLPerf ran it on.
  "mlperf_llama31_405b": Sweep(
    mode="project",
    counts=LLAMA_GPU_COUNTS,
    hardware=tuple(mlperf_llama31_405b.TENSOR_BY_HARDWARE),
    scalings=("configured",),
  ),
  "tiny": dataclasses.replace(_HOST, overrides=(*_HOST.overrides, "train.steps=5")),
  "cpu_char": dataclasses.replace(_HOST, overrides=(*_HOST.overrides, "train.steps=3")),
}


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


def get(name: str) -> Sweep:
  if name not in SWEEPS:
    raise UserInputError(
      f"--experiment: no sweep is defined for {name!r}; sweeps: "
      f"{', '.join(sorted(SWEEPS))} (sweep/definitions.py)"
    )
  return SWEEPS[name]
