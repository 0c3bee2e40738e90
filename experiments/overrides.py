"""`--set KEY=VALUE` overrides of any configuration field.

KEY is a dotted path into the experiment (`model.num_layers`, `mesh.tensor`,
`train.global_batch`); VALUE is parsed by the field's type. `model=NAME` swaps in a
named model size (model/presets.py PRESETS); `variant=NAME` swaps in one of the experiment's
named variants (experiments/mlperf_gpt3_175b.py's published configurations); `round=NAME`
scores it by an MLPerf round of its benchmark (experiments/mlperf_llama31_405b.py ROUNDS).

Shortcuts for the parallelism of a projection, each setting the real field(s):

  tensor_parallel=N    mesh.tensor          pipeline_parallel=N  mesh.pipeline
  virtual_stages=N     train.virtual_stages micro_batch=N        train.micro_batch
  global_batch=N       train.global_batch
  precision=bf16|fp8|mxfp8|nvfp4             model.fp8, model.block_scaling (and _head)
  remat=POLICY         model.remat (none, full, save_dots)
  context_parallel=N   mesh.context         expert_parallel=N    mesh.expert
"""

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

import experiments
from errors import UserInputError
from model.config import REMAT_POLICIES
from model.presets import preset

_NOT_SETTABLE = ("name", "description", "variants", "variant_by_gpus", "benchmark")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _parse(key: str, text: str, kind: Any) -> Any:
  if typing.get_origin(kind) is typing.Literal:
    kind = str
  try:
    if kind is bool:
      if text.lower() not in _TRUE + _FALSE:
        raise ValueError
      return text.lower() in _TRUE
    return kind(text)
  except ValueError:
    raise UserInputError(f"--set {key}: expected {kind.__name__}, got {text!r}") from None


def _replace(cfg: Any, path: list[str], text: str, full_key: str) -> Any:
  fields = {f.name: f for f in dataclasses.fields(cfg)}
  name = path[0]
  if name not in fields or name in _NOT_SETTABLE:
    allowed = ", ".join(n for n in fields if n not in _NOT_SETTABLE)
    raise UserInputError(f"--set {full_key}: unknown key {name!r}; allowed: {allowed}")
  current = getattr(cfg, name)
  if dataclasses.is_dataclass(current):
    if len(path) == 1:
      if name != "model":
        raise UserInputError(f"--set {full_key}: name a field, e.g. {name}.<field>=VALUE")
      return dataclasses.replace(cfg, model=preset(text))
    return dataclasses.replace(cfg, **{name: _replace(current, path[1:], text, full_key)})
  if len(path) > 1:
    raise UserInputError(f"--set {full_key}: {name!r} has no sub-fields")
  return dataclasses.replace(cfg, **{name: _parse(full_key, text, fields[name].type)})


_POSITIVE = {
  "tensor_parallel": "mesh.tensor",
  "context_parallel": "mesh.context",
  "expert_parallel": "mesh.expert",
  "pipeline_parallel": "mesh.pipeline",
  "virtual_stages": "train.virtual_stages",
  "micro_batch": "train.micro_batch",
  "global_batch": "train.global_batch",
}
# Each choice's value: the (field, value) assignments it stands for.
_CHOICES = {
  "precision": {
    "bf16": (
      ("model.fp8", "false"),
      ("model.block_scaling", "none"),
      ("model.block_scaled_head", "false"),
    ),
    "fp8": (
      ("model.fp8", "true"),
      ("model.block_scaling", "none"),
      ("model.block_scaled_head", "false"),
    ),
    "mxfp8": (("model.fp8", "false"), ("model.block_scaling", "mxfp8")),
    "nvfp4": (("model.fp8", "false"), ("model.block_scaling", "nvfp4")),
  },
  "remat": {p: (("model.remat", p),) for p in REMAT_POLICIES},
}
SHORTCUTS = (*_POSITIVE, *_CHOICES, "variant", "round")


def _shortcut(cfg: Any, key: str, text: str) -> Any:
  """A shortcut key's assignment, checked and mapped to the field(s) it stands for."""
  if key == "variant":
    return experiments.variant(cfg, text)
  if key == "round":
    return experiments.mlperf_round(cfg, text)
  if key in _POSITIVE:
    # isdigit alone passes '²'; past 9 digits no mesh axis is that wide (and int() refuses
    # strings of over 4,300 digits).
    if not (text.isascii() and text.isdigit()) or len(text) > 9 or int(text) < 1:
      shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
      raise UserInputError(f"--set {key}: expected a positive whole number, got {shown!r}")
    return _replace(cfg, _POSITIVE[key].split("."), text, key)
  values = _CHOICES[key]
  if text not in values:
    raise UserInputError(f"--set {key}: expected one of {', '.join(values)}, got {text!r}")
  for path, value in values[text]:
    cfg = _replace(cfg, path.split("."), value, key)
  return cfg


def apply(cfg: Any, assignments: Sequence[str]) -> Any:
  """Apply `KEY=VALUE` strings in order to a frozen dataclass config."""
  for assignment in assignments:
    key, sep, text = assignment.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key:
      raise UserInputError(f"--set expects KEY=VALUE, got {assignment!r}")
    if key in SHORTCUTS:
      cfg = _shortcut(cfg, key, text)
    else:
      cfg = _replace(cfg, key.split("."), text, key)
  return cfg
