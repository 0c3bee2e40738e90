"""The experiment record: a model, its mesh and training settings, and what a projection
of it reports. Imports jax (through the mesh and LoRA configurations); experiments/__init__.py
gives it out lazily, so that the package and its sweeps import without jax."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from model.config import ModelConfig
from model.lora import LoraConfig
from parallelism.mesh import MeshConfig
from train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  name: str
  description: str
  model: ModelConfig
  mesh: MeshConfig
  train: TrainConfig
  # Named alternatives (e.g. published configurations), selected with `--set variant=NAME`,
  # and the one a GPU count selects by default.
  variants: Mapping[str, "ExperimentConfig"] = dataclasses.field(default_factory=dict)
  variant_by_gpus: Mapping[int, str] = dataclasses.field(default_factory=dict)
  # A time-to-train benchmark (experiments/_time_to_train.py): projections then also
  # report time_to_train_min.
  benchmark: Any = None
  # Projections compile the step a second time with a latency profile of its own program
  # on the target, as a tuned GPU run does (projection/aot_compile.py latency_profile): one
  # more compile per GPU count, and XLA overlaps collectives by their projected durations.
  latency_profile: bool = False
  # LoRA fine-tuning (model/lora.py): rank 0, every parameter trains; `--set lora.rank=16`.
  lora: LoraConfig = LoraConfig()
