"""Experiments: one file per experiment, each with `get_config() -> ExperimentConfig`."""

import dataclasses
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from errors import UserInputError
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


def names() -> list[str]:
  return sorted(
    m.name
    for m in pkgutil.iter_modules(__path__)
    if not m.name.startswith("_") and m.name != "overrides"
  )


def load(name: str) -> ExperimentConfig:
  if name not in names():
    raise UserInputError(f"--experiment must be one of {', '.join(names())}, got {name!r}")
  return importlib.import_module(f"experiments.{name}").get_config()


def variant(exp: ExperimentConfig, name: str) -> ExperimentConfig:
  if name not in exp.variants:
    allowed = ", ".join(exp.variants) or "none"
    raise UserInputError(f"--set variant: {exp.name} has variants {allowed}, got {name!r}")
  # The chosen variant keeps its siblings selectable.
  return dataclasses.replace(
    exp.variants[name], variants=exp.variants, variant_by_gpus=exp.variant_by_gpus
  )


def at_target(exp: ExperimentConfig, gpus: int, hardware: str | None = None) -> ExperimentConfig:
  """The configuration `gpus` GPUs (of `hardware`) run by default: a published one the
  count selects (`variant_by_gpus`), else the experiment module's own rule for the target
  (its `for_target(exp, hardware, gpus)`, where it has one), else `exp`."""
  if gpus in exp.variant_by_gpus:
    return variant(exp, exp.variant_by_gpus[gpus])
  rule = getattr(importlib.import_module(f"experiments.{exp.name}"), "for_target", None)
  if hardware is None or rule is None:
    return exp
  return rule(exp, hardware, gpus)
