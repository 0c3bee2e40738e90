"""Experiments: one file per experiment, each with `get_config() -> ExperimentConfig`, and
beside it, for an experiment that has a sweep, `NAME_sweep.py` with `SWEEP` (a
sweep.definitions.Sweep: the points `--mode=sweep --experiment=NAME` visits).

The package and the sweep modules import no jax: launch.py reads a sweep's mode to size
the host platform before jax starts (modes/host_devices.py). ExperimentConfig, whose
fields import jax, is loaded on first use (experiments/_config.py).
"""

import dataclasses
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

from errors import UserInputError

if TYPE_CHECKING:
  from experiments._config import ExperimentConfig
  from sweep.definitions import Sweep

SWEEP_SUFFIX = "_sweep"


def __getattr__(name: str) -> Any:
  """`experiments.ExperimentConfig`, imported on first use (it imports jax)."""
  if name == "ExperimentConfig":
    from experiments._config import ExperimentConfig  # pylint: disable=import-outside-toplevel

    return ExperimentConfig
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> list[str]:
  return sorted(
    m.name
    for m in pkgutil.iter_modules(__path__)
    if not m.name.startswith("_") and m.name != "overrides" and not m.name.endswith(SWEEP_SUFFIX)
  )


def load(name: str) -> "ExperimentConfig":
  if name not in names():
    raise UserInputError(f"--experiment must be one of {', '.join(names())}, got {name!r}")
  return importlib.import_module(f"experiments.{name}").get_config()


def variant(exp: "ExperimentConfig", name: str) -> "ExperimentConfig":
  if name not in exp.variants:
    allowed = ", ".join(exp.variants) or "none"
    raise UserInputError(f"--set variant: {exp.name} has variants {allowed}, got {name!r}")
  # The chosen variant keeps its siblings selectable.
  return dataclasses.replace(
    exp.variants[name], variants=exp.variants, variant_by_gpus=exp.variant_by_gpus
  )


def mlperf_round(exp: "ExperimentConfig", name: str) -> "ExperimentConfig":
  """`exp` scored by round `name` of its benchmark: the experiment module's `ROUNDS`
  (benchmark by round name), where it has one. A round changes the convergence data and
  the evaluation schedule only; the model, mesh and batch stay."""
  module = importlib.import_module(f"experiments.{exp.name}") if exp.name in names() else None
  rounds = getattr(module, "ROUNDS", {})
  if name not in rounds:
    allowed = ", ".join(rounds) or "none"
    raise UserInputError(f"--set round: {exp.name} has rounds {allowed}, got {name!r}")
  return dataclasses.replace(exp, benchmark=rounds[name])


def at_target(
  exp: "ExperimentConfig", gpus: int, hardware: str | None = None
) -> "ExperimentConfig":
  """The configuration `gpus` GPUs (of `hardware`) run by default: a published one the
  count selects (`variant_by_gpus`), else the experiment module's own rule for the target
  (its `for_target(exp, hardware, gpus)`, where it has one), else `exp`."""
  if gpus in exp.variant_by_gpus:
    return variant(exp, exp.variant_by_gpus[gpus])
  rule = getattr(importlib.import_module(f"experiments.{exp.name}"), "for_target", None)
  if hardware is None or rule is None:
    return exp
  return rule(exp, hardware, gpus)


def sweep_names() -> list[str]:
  """The experiments that have a sweep (an `experiments/NAME_sweep.py`)."""
  return sorted(
    m.name.removesuffix(SWEEP_SUFFIX)
    for m in pkgutil.iter_modules(__path__)
    if m.name.endswith(SWEEP_SUFFIX)
  )


def sweep(name: str) -> "Sweep":
  """The sweep of experiment NAME (`experiments/NAME_sweep.py`'s SWEEP); imports no jax."""
  if name not in sweep_names():
    raise UserInputError(
      f"--experiment: no sweep is defined for {name!r}; sweeps: "
      f"{', '.join(sweep_names())} (experiments/NAME{SWEEP_SUFFIX}.py)"
    )
  return importlib.import_module(f"experiments.{name}{SWEEP_SUFFIX}").SWEEP
