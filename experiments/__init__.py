"""Experiments: one file per experiment, each with `get_config() -> ExperimentConfig`."""

import dataclasses
import importlib
import pkgutil

from errors import UserInputError
from model.config import ModelConfig
from parallelism.mesh import MeshConfig
from train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  name: str
  description: str
  model: ModelConfig
  mesh: MeshConfig
  train: TrainConfig


def names() -> list[str]:
  return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")
                and m.name != "overrides")


def load(name: str) -> ExperimentConfig:
  if name not in names():
    raise UserInputError(f"--experiment must be one of {', '.join(names())}, got {name!r}")
  return importlib.import_module(f"experiments.{name}").get_config()
