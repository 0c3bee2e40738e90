"""Program analysis of optimized (scheduled) XLA HLO text.

`analyze(compiled.as_text())` reads the module's text (projection/hlo_text.py) and turns
it into a `Program` (the node types: projection/hlo_nodes.py): the entry computation's work
in schedule order (the instruction order of a scheduled module is its execution order),
with while loops kept as `Loop` nodes carrying their trip count so a cost model can
multiply. XLA's own `cost_analysis()` counts
a loop body once; this does not.

Conventions (per device, since an SPMD program is one device's program):
  FLOPs  dot: 2 * (product of output dims, batch dims included) * (product of lhs
         contracting dims). convolution: 2 * output elements * kernel elements / kernel
         output features. cuBLAS gemm custom-calls: as dot, from their backend_config.
         cuDNN flash-attention custom-calls: their matmuls over the scores' shape in their
         backend_config (see _fused_attention_flops), counted as dot FLOPs.
         Elementwise ops (arithmetic, compare, select, convert, and transcendentals such as
         exp/tanh/log, which are not weighted extra): 1 FLOP per output element.
         reduce: 1 FLOP per input element; reduce-window: output elements * window size.
         Data movement and bookkeeping (copy, slice, transpose, broadcast, gather, sort, ...)
         and other custom-calls: 0 FLOPs.
  Bytes  what touches HBM: operands read and outputs written at a top-level instruction.
         A fusion counts FLOPs of everything inside it but bytes only at its boundary. A
         fusion parameter used only through (dynamic-)slice/gather reads only the slices; a
         buffer updated in place by dynamic-update-slice/scatter costs only the update, so a
         layer scan's per-iteration weight slice is not charged the whole stacked array.
         Bookkeeping ops (parameter, constant, tuple, get-tuple-element, bitcast, ...) are
         free and are left out of the program.
  Collectives  bytes = operand bytes per device for all-reduce, reduce-scatter (its input),
         all-to-all, collective-permute; = output bytes per device for all-gather, summed
         over its operands (operands = how many arrays). Groups are explicit lists of
         partition ids (SPMD programs have one replica).
Control flow: while -> Loop (trip count from backend_config "known_trip_count", else from
the condition's compare-with-constant; op_name from its metadata: the jax.named_scope path
that says what the loop is); call and async compute are inlined; conditional inlines its
branch with the most FLOPs (an upper bound). An async fusion (fusion-start / fusion-done)
is costed as the fusion it calls. A while condition is not costed.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Iterable, Iterator

from projection import hlo_text
from projection.hlo_nodes import AsyncDone, Collective, Compute, Loop, Node, Program
from projection.hlo_text import (
  Computation,
  Groups,
  Instr,
  arrays,
  backend_json,
  bytes_of,
  dtype_of,
  elements,
  ints,
  parse_module,
  parse_replica_groups,
)

# Ops that move no data through HBM and compute nothing: bookkeeping only.
_FREE = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "after-all",
  "partition-id",
  "replica-id",
  "opt-barrier",
  "optimization-barrier",
  "add-dependency",
  "domain",
  "get-dimension-size",
  "async-update",
  "async-done",
  "copy-done",
  "fusion-done",
}
# cuDNN's block-scaled (MXFP8 / NVFP4) matmul, as XLA's BlockScalingRewriter emits it for
# Blackwell (docs/blackwell_formats.md).
_BLOCK_SCALED = ("__cudnn$blockScaledDot",)
# Ops that compute nothing (0 FLOPs) but may move data.
_NO_FLOPS = _FREE | {
  "copy",
  "copy-start",
  "reshape",
  "broadcast",
  "transpose",
  "slice",
  "dynamic-slice",
  "dynamic-update-slice",
  "concatenate",
  "pad",
  "gather",
  "scatter",
  "iota",
  "reverse",
  "sort",
  "custom-call",
  "send",
  "recv",
  "send-done",
  "recv-done",
  "bitcast-convert",
  "infeed",
  "outfeed",
  "rng-get-and-update-state",
  "while",
  "call",
  "conditional",
  "async-start",
}
_COLLECTIVES = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "ragged-all-to-all",
  "collective-permute",
  "collective-broadcast",
)


# ----------------------------------------------------------------------------- analysis
class _Analyzer:
  def __init__(self, text: str) -> None:
    self.comps, self.entry, self.name, self.num_partitions = parse_module(text)
    self._nodes: dict[str, tuple[Node, ...]] = {}
    self._flops: dict[str, tuple[float, float]] = {}

  # --- FLOPs of one instruction, recursing into fused computations
  def instr_flops(self, ins: Instr, comp: Computation) -> tuple[float, float]:
    op = ins.opcode
    if op == "fusion":
      return self.comp_flops(ins.attrs["calls"].lstrip("%"))
    if op == "dot":
      lhs = arrays(comp.by_name[ins.operands[0]].shape)[0][1]
      contracting = ints(ins.attrs.get("lhs_contracting_dims"))
      f = 2.0 * elements(ins.shape) * math.prod(lhs[d] for d in contracting)
      return f, f
    if op == "convolution":
      kernel = arrays(comp.by_name[ins.operands[1]].shape)[0][1]
      labels = ins.attrs.get("dim_labels", "_01io->").split("_")[1].split("->")[0]
      f = 2.0 * elements(ins.shape) * math.prod(kernel) / kernel[labels.index("o")]
      return f, f
    if op == "custom-call" and "gemm_backend_config" in ins.attrs.get("backend_config", ""):
      gemm = backend_json(ins.attrs["backend_config"])["gemm_backend_config"]
      dnums = gemm["dot_dimension_numbers"]
      lhs = arrays(comp.by_name[ins.operands[0]].shape)[0][1]
      out = arrays(ins.shape)[0][1]  # cublasLt returns (result, workspace)
      contracting = [int(d) for d in dnums["lhs_contracting_dimensions"]]
      f = 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)
      return f, f
    if op == "custom-call" and ins.attrs.get("custom_call_target", "").strip('"') in _BLOCK_SCALED:
      # cuDNN's block-scaled GEMM: operands [B, M, K] and [B, N, K], result (out [B, M, N],
      # workspace); the scales (operands 2 and 3) add no FLOPs.
      lhs = arrays(comp.by_name[ins.operands[0]].shape)[0][1]
      f = 2.0 * math.prod(arrays(ins.shape)[0][1]) * lhs[-1]
      return f, f
    if op == "custom-call" and "cudnn_fmha_backend_config" in ins.attrs.get("backend_config", ""):
      return self._fused_attention_flops(ins, comp)
    if op == "reduce":
      n_in = len(ins.operands) // 2  # operands are inputs then init values
      return float(sum(elements(comp.by_name[o].shape) for o in ins.operands[:n_in])), 0.0
    if op == "reduce-window":
      size = re.search(r"size=([\dx]+)", ins.attrs.get("window", ""))
      window = math.prod(ints(size.group(1).replace("x", ","))) if size else 1
      return float(elements(ins.shape) * window), 0.0
    if op in _NO_FLOPS or any(op.startswith(c) for c in _COLLECTIVES):
      return 0.0, 0.0
    return float(elements(ins.shape)), 0.0  # elementwise, transcendental, compare, select...

  @staticmethod
  def _fused_attention_flops(ins: Instr, comp: Computation) -> tuple[float, float]:
    """cuDNN flash attention: the forward runs two matmuls over the [B, H, Tq, Tk] scores,
    Q.K^T over the query-key head dims and P.V over the value head dims (2 x scores x
    (K_qk + K_v) FLOPs); the backward five: Q.K^T again, dQ and dK over K_qk, dP = dO.V^T
    and dV over K_v (2 x scores x (3 K_qk + 2 K_v)). The two are equal but with latent
    attention, whose values are narrower (model/attention.py). A causal mask skips the
    upper triangle's blocks, half the work."""
    config = backend_json(ins.attrs["backend_config"])["cudnn_fmha_backend_config"]
    scores = math.prod(int(d) for d in config["intermediate_tensor_shape"]["dimensions"])
    # Operands: q, k, v first, forward and backward alike.
    qk_dim = arrays(comp.by_name[ins.operands[0]].shape)[0][1][-1]
    v_dim = arrays(comp.by_name[ins.operands[2]].shape)[0][1][-1]
    backward = "Backward" in ins.attrs.get("custom_call_target", "")
    head_dims = 3 * qk_dim + 2 * v_dim if backward else qk_dim + v_dim
    causal = 0.5 if config.get("mask_type") == "CAUSAL" else 1.0
    f = 2.0 * scores * head_dims * causal
    return f, f

  def dot_dtype(self, ins: Instr, comp: Computation) -> str:
    """Element type of the first matmul's lhs, looking inside fusions."""
    if ins.opcode == "fusion":
      fused = self.comps[ins.attrs["calls"].lstrip("%")]
      return next((t for t in (self.dot_dtype(i, fused) for i in fused.instrs) if t), "")
    if ins.opcode in ("dot", "convolution", "custom-call") and ins.operands:
      lhs = comp.by_name.get(ins.operands[0])
      return dtype_of(lhs.shape) if lhs and self.instr_flops(ins, comp)[1] else ""
    return ""

  def comp_flops(self, name: str) -> tuple[float, float]:
    if name not in self._flops:
      comp = self.comps[name]
      pairs = [self.instr_flops(i, comp) for i in comp.instrs]
      self._flops[name] = (sum(p[0] for p in pairs), sum(p[1] for p in pairs))
    return self._flops[name]

  # --- bytes at a kernel boundary
  def instr_bytes(self, ins: Instr, comp: Computation) -> tuple[int, int]:
    op = ins.opcode
    if op in ("dynamic-slice", "slice"):
      return bytes_of(ins.shape), bytes_of(ins.shape)
    if op == "gather":
      indices = bytes_of(comp.by_name[ins.operands[1]].shape)
      return bytes_of(ins.shape) + indices, bytes_of(ins.shape)
    if op in ("dynamic-update-slice", "scatter"):  # in place: only the update moves
      update = ins.operands[-1] if op == "scatter" else ins.operands[1]
      return (
        sum(bytes_of(comp.by_name[o].shape) for o in ins.operands[1:]),
        bytes_of(comp.by_name[update].shape),
      )
    read = sum(bytes_of(comp.by_name[o].shape) for o in ins.operands if o in comp.by_name)
    if op == "copy-start":  # its output is a (destination, source, context) tuple
      return read, read
    if op != "fusion":
      return read, bytes_of(ins.shape)
    fused = self.comps[ins.attrs["calls"].lstrip("%")]
    params = {int(i.args): i for i in fused.instrs if i.opcode == "parameter"}
    read = sum(
      self._param_read(fused, params[k], bytes_of(comp.by_name[o].shape))
      for k, o in enumerate(ins.operands)
      if k in params and o in comp.by_name
    )
    root = fused.root
    outs = [fused.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    written = 0
    for out in outs:
      while out.opcode == "bitcast" and out.operands[0] in fused.by_name:
        out = fused.by_name[out.operands[0]]
      if out.opcode == "dynamic-update-slice":
        written += bytes_of(fused.by_name[out.operands[1]].shape)
      elif out.opcode == "scatter":
        written += bytes_of(fused.by_name[out.operands[-1]].shape)
      else:
        written += bytes_of(out.shape)
    return read, written

  @staticmethod
  def _param_read(fused: Computation, param: Instr, full: int) -> int:
    """Bytes of a fusion operand actually read: slices only, if it is only sliced."""
    total, todo = 0, [param.name]
    while todo:
      name = todo.pop()
      for user in fused.users.get(name, []):
        if user.opcode == "bitcast":
          todo.append(user.name)
        elif user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == name:
          total += bytes_of(user.shape)
        elif user.opcode in ("dynamic-update-slice", "scatter") and user.operands[0] == name:
          pass  # the in-place buffer itself is not read
        else:
          return full
    return min(total, full)

  # --- schedule-ordered nodes of a computation
  def comp_nodes(self, name: str) -> tuple[Node, ...]:
    if name not in self._nodes:
      self._nodes[name] = tuple(self._build(self.comps[name]))
    return self._nodes[name]

  def _build(self, comp: Computation) -> list[Node]:
    nodes: list[Node] = []
    open_starts: dict[str, int] = {}  # async start name -> index in nodes
    for ins in comp.instrs:
      if ins.opcode == "fusion-start":
        # An async fusion (XLA's GPU compiler in jax 0.11 runs dynamic slices and in-place
        # updates of stacked layers so): the fusion it calls, costed once; its done is free.
        fused = self.comps[ins.attrs["calls"].lstrip("%")]
        ins = replace(ins, opcode="fusion", shape=fused.root.shape)
      op = ins.opcode
      coll = self._collective(ins, comp)
      if coll is not None:
        if coll.is_async:
          open_starts[ins.name] = len(nodes)
        nodes.append(coll)
      elif (op.endswith("-done")) and ins.operands and ins.operands[0] in open_starts:
        i = open_starts.pop(ins.operands[0])
        between = tuple(n.name for n in nodes[i + 1 :] if not isinstance(n, AsyncDone))
        nodes[i] = replace(nodes[i], done=ins.name, overlapped=between)
        nodes.append(AsyncDone(ins.name, nodes[i].name))
      elif op in _FREE:
        continue
      elif op == "while":
        nodes.append(self._loop(ins, comp))
      elif op == "call":
        nodes.extend(self.comp_nodes(ins.attrs["to_apply"].lstrip("%")))
      elif op == "async-start":  # async compute that is not a collective: run it here
        nodes.extend(self.comp_nodes(ins.attrs["calls"].lstrip("%")))
      elif op == "conditional":
        branches = re.findall(
          r"%([\w.\-]+)",
          ins.attrs.get("branch_computations", "")
          + ins.attrs.get("true_computation", "")
          + ","
          + ins.attrs.get("false_computation", ""),
        )
        best = max((self.comp_nodes(b) for b in branches), key=lambda ns: total_flops(ns))
        nodes.extend(best)
      else:
        flops, dflops = self.instr_flops(ins, comp)
        read, written = self.instr_bytes(ins, comp)
        nodes.append(
          Compute(
            ins.name,
            op,
            flops,
            dflops,
            read,
            written,
            dtype_of(ins.shape),
            hlo_text.kind(ins),
            self.dot_dtype(ins, comp) if dflops else "",
            hlo_text.op_name(ins),
            hlo_text.scheduling_name(ins),
          )
        )
    return nodes

  def _collective(self, ins: Instr, comp: Computation) -> Collective | None:
    op, is_async = ins.opcode, False
    if op == "async-start":  # async wrapper: the collective is inside the computation
      inner = self.comps[ins.attrs["calls"].lstrip("%")]
      found = [i for i in inner.instrs if i.opcode in _COLLECTIVES]
      if not found:
        return None
      return replace(
        self._collective(found[0], inner),
        name=ins.name,
        is_async=True,
        scheduling_name=hlo_text.scheduling_name(ins),
      )
    if op.endswith("-start") and op[:-6] in _COLLECTIVES:
      op, is_async = op[:-6], True
    if op not in _COLLECTIVES:
      return None
    operand_bytes = sum(bytes_of(comp.by_name[o].shape) for o in ins.operands if o in comp.by_name)
    groups: Groups = ()
    pairs: tuple[tuple[int, int], ...] = ()
    if op == "collective-permute":
      ids = ints(ins.attrs.get("source_target_pairs"))
      pairs = tuple(zip(ids[::2], ids[1::2]))
    else:
      groups = parse_replica_groups(ins.attrs.get("replica_groups", "{}"), self.num_partitions)
    size = operand_bytes * (len(groups[0]) if op == "all-gather" and groups else 1)
    first = comp.by_name.get(ins.operands[0]) if ins.operands else None
    dtype = dtype_of(first.shape if first else ins.shape)
    sync = '"is_sync":true' in ins.attrs.get("backend_config", "")
    return Collective(
      ins.name,
      op,
      size,
      dtype,
      groups,
      pairs,
      is_async,
      xla_sync=sync,
      operands=max(1, len(ins.operands)),
      scheduling_name=hlo_text.scheduling_name(ins),
    )

  def _loop(self, ins: Instr, comp: Computation) -> Loop:
    body = self.comp_nodes(ins.attrs["body"].lstrip("%"))
    op_name = hlo_text.op_name(ins)
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs.get("backend_config", ""))
    if m:
      return Loop(ins.name, int(m.group(1)), body, "backend_config", op_name)
    n = self._trip_from_condition(ins, comp)
    return Loop(ins.name, n or 1, body, "condition" if n else "unknown", op_name)

  def _trip_from_condition(self, ins: Instr, comp: Computation) -> int | None:
    """Match `iv < N` (or <=) where iv is a tuple element that starts at a constant."""
    cond = self.comps[ins.attrs["condition"].lstrip("%")]
    cmp_comp, cmp, outer = cond, cond.root, None
    if cmp is not None and cmp.opcode == "fusion":  # XLA CPU wraps the compare in a fusion
      cmp_comp, outer = self.comps[cmp.attrs["calls"].lstrip("%")], cmp
      cmp = cmp_comp.root
    if cmp is None or cmp.opcode != "compare" or len(cmp.operands) != 2:
      return None

    def resolve(name: str, c: Computation) -> tuple[str, int] | None:
      i = c.by_name.get(name)
      while i is not None and i.opcode in ("copy", "convert", "bitcast"):
        i = c.by_name.get(i.operands[0])
      if i is None:
        return None
      if i.opcode == "parameter" and c is cmp_comp and outer is not None:
        return resolve(outer.operands[int(i.args)], cond)
      if i.opcode == "constant" and ints(i.args):
        return "const", ints(i.args)[0]
      if i.opcode == "get-tuple-element":
        return "iv", int(i.attrs["index"])
      return None

    lhs, rhs = resolve(cmp.operands[0], cmp_comp), resolve(cmp.operands[1], cmp_comp)
    direction = cmp.attrs.get("direction", "")
    if not (lhs and rhs and lhs[0] == "iv" and rhs[0] == "const" and direction in ("LT", "LE")):
      return None
    init, init_ins = 0, comp.by_name.get(ins.operands[0])
    if init_ins is not None and init_ins.opcode == "tuple":
      got = resolve(init_ins.operands[lhs[1]], comp) if lhs[1] < len(init_ins.operands) else None
      init = got[1] if got and got[0] == "const" else 0
    trips = rhs[1] - init + (1 if direction == "LE" else 0)
    return trips if trips > 0 else None


# ----------------------------------------------------------------------------- public API
def analyze(hlo_text: str) -> Program:
  """Parse `compiled.as_text()` of an optimized, scheduled module."""
  a = _Analyzer(hlo_text)
  return Program(a.name, a.num_partitions, a.comp_nodes(a.entry))


def walk(nodes: Program | Iterable[Node], multiplicity: int = 1) -> Iterator[tuple[Node, int]]:
  """Every non-Loop node with how many times it runs (loop trip counts multiplied)."""
  for n in nodes.entry if isinstance(nodes, Program) else nodes:
    if isinstance(n, Loop):
      yield from walk(n.body, multiplicity * n.trip_count)
    else:
      yield n, multiplicity


def total_flops(program: Program | Iterable[Node]) -> float:
  return sum(n.flops * m for n, m in walk(program) if isinstance(n, Compute))


def dot_flops(program: Program | Iterable[Node]) -> float:
  return sum(n.dot_flops * m for n, m in walk(program) if isinstance(n, Compute))


def collectives(program: Program | Iterable[Node]) -> Iterator[tuple[Collective, int]]:
  """Each collective with its multiplicity (how many times it runs per step)."""
  return ((n, m) for n, m in walk(program) if isinstance(n, Collective))


def uses_fp4(program: Program | Iterable[Node]) -> bool:
  """Whether any matmul takes FP4 (f4e2m1fn: NVFP4's values) operands."""
  return any(n.dot_dtype.startswith("f4") for n, _ in walk(program) if isinstance(n, Compute))


def uses_fp8(program: Program | Iterable[Node]) -> bool:
  """Whether any matmul takes FP8 (f8e4m3fn, f8e5m2, ...) operands (MXFP8's included)."""
  return any(n.dot_dtype.startswith("f8") for n, _ in walk(program) if isinstance(n, Compute))
