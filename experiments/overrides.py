"""`--set KEY=VALUE` overrides of any configuration field.

KEY is a dotted path into the experiment (`model.num_layers`, `mesh.tensor`,
`train.global_batch`); VALUE is parsed by the field's type. `model=NAME` swaps in a
named model size (model/config.py PRESETS).
"""

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from errors import UserInputError
from model.config import preset

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
  if name not in fields or name in ("name", "description"):
    allowed = ", ".join(n for n in fields if n not in ("name", "description"))
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


def apply(cfg: Any, assignments: Sequence[str]) -> Any:
  """Apply `KEY=VALUE` strings in order to a frozen dataclass config."""
  for assignment in assignments:
    key, sep, text = assignment.partition("=")
    if not sep or not key:
      raise UserInputError(f"--set expects KEY=VALUE, got {assignment!r}")
    cfg = _replace(cfg, key.strip().split("."), text.strip(), key.strip())
  return cfg
