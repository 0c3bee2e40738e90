"""The two records a run writes to results.jsonl: a measured point and a projected point.

One key per quantity. A point's device count is `devices` (GPUs for a projection, local
devices for a measurement) and its per-device throughput `tokens_per_s_per_device`, the
keys the sweep's scaling arithmetic reads for both kinds. A field whose default is None
is left out of the JSON when it is None (a measured point without a pipeline has no
pipeline keys; a projection that does not fit has no timing keys).
"""

import dataclasses
from typing import Any

# Keys older results.jsonl files carry as duplicates of another key: read as that key.
OLD_KEYS = {"gpus": "devices", "tokens_per_s_per_gpu": "tokens_per_s_per_device"}


def to_json(record: Any) -> dict:
  """The record as the JSON object results.jsonl holds (a dict passes through); records
  nested in it become objects too."""
  if isinstance(record, dict):
    return record
  out = {}
  for field in dataclasses.fields(record):
    value = getattr(record, field.name)
    if value is None and field.default is None:
      continue
    out[field.name] = _plain(value)
  return out


def _plain(value: Any) -> Any:
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return to_json(value)
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def from_json(cls: type, obj: dict) -> Any:
  """A record of type `cls` from a JSON object (keys of other records left out)."""
  names = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in obj.items() if k in names})


def upgrade(record: dict) -> dict:
  """A record read from results.jsonl with the old duplicate keys folded into the kept
  ones (the values were equal: the old key only supplies a missing new one)."""
  for old, new in OLD_KEYS.items():
    if old in record:
      value = record.pop(old)
      record.setdefault(new, value)
  return record


@dataclasses.dataclass(frozen=True)
class MeasuredPoint:
  """One run of the train step on this machine's devices (train or benchmark mode)."""

  mode: str  # "train" or "benchmark"
  experiment: str
  model: str
  params: int
  devices: int
  nodes: int
  mesh: dict[str, int]
  mesh_nvlink: dict[str, int]
  mesh_infiniband: dict[str, int]
  global_batch: int
  seq_len: int
  tokens_per_step: int
  timed_steps: int
  compute_dtype: str
  remat: str
  platform: str
  device_kind: str
  compile_s: float  # lowering and compiling
  lower_s: float
  step_time_s: float  # median of the timed steps
  step_time_p90_s: float
  tokens_per_s: float
  tokens_per_s_per_device: float
  model_tflops_per_device: float
  peak_tflops_per_device: float
  mfu: float
  peak_source: str
  tensorboard_dir: str
  time: str  # UTC, ISO 8601
  # With a pipeline (more than one stage) only.
  pipeline_schedule: str | None = None
  virtual_stages: int | None = None
  micro_batches: int | None = None
  pipeline_passes: int | None = None
  pipeline_trips: int | None = None
  bubble_fraction: float | None = None
  profile_dir: str | None = None  # with --profile_steps
  losses: list[float] | None = None  # train mode
  resumed_from_step: int | None = None  # resumed from a checkpoint


@dataclasses.dataclass(frozen=True)
class Composition:
  """A step composed from compiled pieces (projection/compose.py): the pieces' (virtual
  stages, groups), the layers per chunk, whether the pieces came from the disk cache."""

  pieces: list[list[int]]
  layers_per_chunk: int
  cached: bool


@dataclasses.dataclass(frozen=True)
class ComposedEstimate:
  """What the composition said of a point that `how="auto"` then compiled whole."""

  step_time_s: float | None
  memory_per_gpu_gb: float
  why_compiled_whole: str


@dataclasses.dataclass(frozen=True)
class SearchProjected:
  """One configuration a best-configuration sweep point's search projected."""

  set: list[str]
  included: bool
  fits: bool
  step_time_s: float | None
  memory_per_gpu_gb: float


@dataclasses.dataclass(frozen=True)
class SearchChoice:
  """The configuration a search projected (projection/search.py): its `--set`
  assignments, its place in the prior's order and the prior's estimates, and the search's
  counts (candidates enumerated, pruned by reason, valid, the budget)."""

  prior_rank: int
  included: bool  # the configuration the caller included (a sweep point's own)
  set: list[str]
  tensor_parallel: int
  context_parallel: int
  pipeline_parallel: int
  virtual_stages: int
  micro_batch: int
  pipeline_passes: int
  schedule: str
  remat: str
  prior_step_s: float
  prior_memory_gb: float
  prior_bubble_fraction: float
  candidates: int
  pruned: dict[str, int]
  valid: int
  budget: int
  # A best-configuration sweep's point: every configuration its search projected.
  projected: list[SearchProjected] | None = None
  # mesh.expert, for a mixture of experts (searched there); absent for a dense model.
  expert_parallel: int | None = None


@dataclasses.dataclass(frozen=True)
class ProjectedPoint:
  """One experiment's train step compiled and costed on `devices` GPUs of `hardware`."""

  mode: str  # "project"
  experiment: str
  model: str
  params: int
  hardware: str
  devices: int  # GPUs of the target cluster
  nodes: int
  mesh: dict[str, int]
  mesh_nvlink: dict[str, int]
  mesh_infiniband: dict[str, int]
  compiled_mesh: dict[str, int]  # the reduced mesh that was compiled
  global_batch: int
  micro_batches: int
  compiled_micro_batches: int
  seq_len: int
  tokens_per_step: int
  compute_dtype: str
  remat: str
  compile_target: str
  compile_note: str | None
  compile_s: float  # the seconds this run spent compiling (0 or about it when cached)
  compile_cached: bool  # the program (or its pieces) read from disk, not compiled
  how: str  # "full" (compiled whole) or "composed" (projection/project.py)
  hlo_flops_per_device: float
  hlo_flops_per_step: float
  hlo_matmul_flops_per_step: float
  memory_per_gpu_gb: float
  hbm_capacity_gb: float
  fits: bool
  peak_tflops_per_device: float  # dense BF16
  over_capacity_gb: float | None = None  # when it does not fit
  composition: Composition | None = None
  composed_estimate: ComposedEstimate | None = None
  search: SearchChoice | None = None
  # When it fits:
  mfu_fp8: float | None = None  # against the FP8 peak, for programs with FP8 matmuls
  mfu_fp4: float | None = None  # against the FP4 peak, for programs with NVFP4 matmuls
  time_to_train: dict | None = None  # experiments with a benchmark target
  time_to_train_min: float | None = None
  step_time_s: float | None = None
  tokens_per_s: float | None = None
  tokens_per_s_per_device: float | None = None
  model_tflops_per_device: float | None = None
  mfu: float | None = None
  # compute_s, exposed_comm_s, other_s, bubble_s, memory_bound_s, exposed_comm_by_axis_s,
  # exposed_comm_by_place_s (their meaning: projection/record.py).
  breakdown: dict | None = None
  comm_s: float | None = None
  # A mixture of experts: how the projection takes the routing (projection/record.py).
  routing: str | None = None
