"""The text of an optimized XLA HLO module, as written: computations and their
instructions (name, shape, opcode, operands, attributes), array shapes and their bytes,
the metadata an instruction carries (op_name, scheduling_name, backend_config), and
replica groups in their three spellings. projection/hlo.py gives the instructions their
FLOPs, bytes and schedule.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import numpy as np

_DTYPE_BITS = {
  "pred": 8,
  "f4e2m1fn": 4,
  "s2": 2,
  "u2": 2,
  "s4": 4,
  "u4": 4,
  "s8": 8,
  "u8": 8,
  "s16": 16,
  "u16": 16,
  "f16": 16,
  "bf16": 16,
  "s32": 32,
  "u32": 32,
  "f32": 32,
  "s64": 64,
  "u64": 64,
  "f64": 64,
  "c64": 64,
  "c128": 128,
  "token": 0,
  "tf32": 32,
}
_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
Groups = tuple[tuple[int, ...], ...]  # replica groups as lists of partition ids


# ----------------------------------------------------------------------------- text parsing
@dataclass(frozen=True)
class Instr:
  """One instruction line: `name = shape opcode(args), attrs`."""

  name: str
  shape: str
  opcode: str
  args: str  # raw text between the opcode's parentheses
  operands: tuple[str, ...]
  attrs: dict[str, str] = field(hash=False)
  is_root: bool = False


@dataclass
class Computation:
  """One computation's instructions in order, by name, and each value's users."""

  name: str
  instrs: list[Instr]
  root: Instr | None = None

  def __post_init__(self) -> None:
    self.by_name = {i.name: i for i in self.instrs}
    self.users: dict[str, list[Instr]] = {}
    for i in self.instrs:
      for o in i.operands:
        self.users.setdefault(o, []).append(i)


def _closing(s: str, i: int) -> int:
  """Index of the bracket closing s[i], skipping quoted strings."""
  depth, quoted = 0, False
  for j in range(i, len(s)):
    c = s[j]
    if c == '"' and s[j - 1] != "\\":
      quoted = not quoted
    elif not quoted and c in "([{":
      depth += 1
    elif not quoted and c in ")]}":
      depth -= 1
      if depth == 0:
        return j
  raise ValueError(f"unbalanced: {s[i : i + 80]}")


def _split_top(s: str) -> list[str]:
  """Split on commas that are outside brackets and quotes."""
  parts, depth, quoted, start = [], 0, False, 0
  for j, c in enumerate(s):
    if c == '"' and (j == 0 or s[j - 1] != "\\"):
      quoted = not quoted
    elif quoted:
      continue
    elif c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and depth == 0:
      parts.append(s[start:j].strip())
      start = j + 1
  parts.append(s[start:].strip())
  return [p for p in parts if p]


def _parse_attrs(s: str) -> dict[str, str]:
  attrs: dict[str, str] = {}
  for part in _split_top(s):
    key, eq, value = part.partition("=")
    if not eq:
      continue
    if key == "device_ids" and "replica_groups" in attrs:
      # The mesh form `mesh[...], device_ids=(...) {axes}` has a top-level comma.
      attrs["replica_groups"] += f", {part}"
      continue
    attrs.setdefault(key.strip(), value.strip())
  return attrs


def _parse_instr(line: str) -> Instr:
  lhs, _, rest = line.partition(" = ")
  name = lhs.replace("ROOT", "").strip().lstrip("%")
  rest = rest.strip()
  if rest.startswith("("):
    end = _closing(rest, 0) + 1
  else:
    end = rest.index(" ")
  shape, rest = rest[:end], rest[end:].strip()
  opcode = rest[: rest.index("(")]
  close = _closing(rest, len(opcode))
  args = rest[len(opcode) + 1 : close]
  operands = tuple(re.findall(r"%([\w.\-]+)", args))
  attrs = _parse_attrs(rest[close + 1 :].lstrip(", "))
  return Instr(name, shape, opcode, args, operands, attrs, lhs.lstrip().startswith("ROOT"))


def parse_module(text: str) -> tuple[dict[str, Computation], str, str, int]:
  """(computations by name, entry computation's name, module name, num_partitions)."""
  text = re.sub(r"/\*.*?\*/", "", text)  # drop /*index=5*/ comments inside tuples
  comps: dict[str, Computation] = {}
  entry, cur, instrs = "", None, []
  header = text[: text.find("\n")]
  name_m = re.match(r"HloModule\s+([\w.\-]+)", header)
  parts_m = re.search(r"num_partitions=(\d+)", header)
  for line in text.splitlines():
    if cur is None:
      if (line.startswith("%") or line.startswith("ENTRY")) and line.rstrip().endswith("{"):
        cur = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", line).group(1)
        entry = cur if line.startswith("ENTRY") else entry
        instrs = []
    elif line.strip() == "}":
      comp = Computation(cur, instrs)
      comp.root = next((i for i in instrs if i.is_root), instrs[-1] if instrs else None)
      comps[cur], cur = comp, None
    elif " = " in line:
      instrs.append(_parse_instr(line))
  return comps, entry, name_m.group(1) if name_m else "", int(parts_m.group(1)) if parts_m else 1


# ----------------------------------------------------------------------------- shapes
def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, dims) of each array in a shape, tuples flattened."""
  out = []
  for dtype, dims in _ARRAY_RE.findall(shape):
    out.append((dtype, tuple(int(d.replace("<=", "")) for d in dims.split(",") if d)))
  return out


def bytes_of(shape: str) -> int:
  """Bytes of all arrays in a shape."""
  return sum(
    math.prod(d) * _DTYPE_BITS.get(t, 8 if t.startswith("f8") else 32) // 8
    for t, d in arrays(shape)
  )


def elements(shape: str) -> int:
  """Elements of all arrays in a shape."""
  return sum(math.prod(d) for _, d in arrays(shape))


def dtype_of(shape: str) -> str:
  """Element type of the first array in a shape, "" if none."""
  found = arrays(shape)
  return found[0][0] if found else ""


def ints(s: str | None) -> list[int]:
  """Every integer written in `s`, in order."""
  return [int(x) for x in re.findall(r"-?\d+", s or "")]


# ----------------------------------------------------------------------------- replica groups
def parse_replica_groups(text: str, num_partitions: int = 1) -> Groups:
  """Explicit `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)`, or mesh-axes
  `mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}` form -> groups of partition ids.
  `{}` means one group of all partitions."""
  text = text.strip()
  if text.startswith("{"):
    groups = tuple(tuple(ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1]))
    return groups or (tuple(range(num_partitions)),)
  m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  if m:
    dims = ints(m.group(2))
    perm = ints(m.group(3)) or list(range(len(dims)))
    ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm)
    return tuple(tuple(int(x) for x in g) for g in ids.reshape(ints(m.group(1))))
  m = re.fullmatch(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^{]*)\))?\s*\{([^}]*)\}", text)
  if m:
    return _mesh_groups(m.group(1), m.group(2), m.group(3))
  raise ValueError(f"unrecognized replica groups: {text}")


def _mesh_groups(axes_text: str, ids_text: str | None, group_text: str) -> Groups:
  # XLA's MeshAxesReplicaGroupList: reshape the mesh's device list to the axis sizes
  # (a sub-axis 'a':(pre)size splits axis a into [pre, size, rest]), move the grouped axes
  # last in the listed order, and cut into groups.
  axes = [(n, int(s)) for n, s in re.findall(r"'?([^',=\s]+)'?=(\d+)", axes_text)]
  n_dev = math.prod(s for _, s in axes)
  if ids_text is None:
    ids = np.arange(n_dev)
  else:
    m = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", ids_text)
    if m and math.prod(ints(m.group(1))) == n_dev and len(ints(m.group(1))) < n_dev:
      dims = ints(m.group(1))
      ids = np.arange(n_dev).reshape(dims).transpose(ints(m.group(2)) or range(len(dims)))
    else:
      ids = np.array(ints(ids_text))
  refs = [
    (n, int(p) if p else None, int(s) if s else None)
    for n, p, s in re.findall(r"'?([^',:\s]+)'?(?::\((\d+)\)(\d+))?", group_text)
  ]
  dims: list[int] = []
  position: dict[tuple[str, int | None], int] = {}  # (axis, pre) -> reshaped dim index
  for name, size in axes:
    subs = sorted((p, s) for n, p, s in refs if n == name and p is not None)
    prefix = 1
    for pre, sub in subs:
      if pre != prefix:
        dims.append(pre // prefix)
      position[(name, pre)] = len(dims)
      dims.append(sub)
      prefix = pre * sub
    if not subs:
      position[(name, None)] = len(dims)
      dims.append(size)
    elif prefix != size:
      dims.append(size // prefix)
  grouped = [position[(n, p)] for n, p, _ in refs]
  rest = [d for d in range(len(dims)) if d not in grouped]
  group_size = math.prod(dims[d] for d in grouped)
  arr = ids.reshape(dims).transpose(rest + grouped).reshape(-1, group_size)
  return tuple(tuple(int(x) for x in g) for g in arr)


# ----------------------------------------------------------------------------- metadata
def op_name(ins: Instr) -> str:
  """The metadata op_name: the jax.named_scope / primitive path it came from."""
  m = re.search(r'op_name="([^"]*)"', ins.attrs.get("metadata", ""))
  return m.group(1) if m else ""


def scheduling_name(ins: Instr) -> str:
  """The name XLA's scheduler and its latency profiles know it by (else its own)."""
  m = re.search(r'scheduling_name="([^"]*)"', ins.attrs.get("metadata", ""))
  return m.group(1) if m else ins.name


def kind(ins: Instr) -> str:
  """Backend fusion kind (__triton_gemm, ...), else fusion kind (kLoop, ...) or call target."""
  m = re.search(r'"kind":"(__\w+)"', ins.attrs.get("backend_config", ""))
  if m:
    return m.group(1)
  return ins.attrs.get("kind", ins.attrs.get("custom_call_target", "").strip('"'))


def backend_json(s: str) -> dict:
  """A backend_config attribute as JSON ({} if it is not)."""
  s = s.strip()
  if s.startswith('"'):  # older XLA prints backend_config as an escaped string
    s = json.loads(s)
  try:
    return json.loads(s)
  except json.JSONDecodeError:
    return {}
