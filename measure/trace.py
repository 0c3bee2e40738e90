"""A profiler trace of one train step read op by op, and set beside the projection's time
for the same ops (benchmarks/gpu_check.py): the trace's HLO op times from the .xplane.pb
(jax.profiler.ProfileData), or the gzipped Chrome trace where that fails."""

import dataclasses
import glob
import gzip
import json
import os
import re

import jax

from projection.op_costs import OpCost

TOP_KERNELS = 20  # the trace's ops set beside the projection, by measured time


@dataclasses.dataclass(frozen=True)
class TraceOps:
  """Device time by HLO op in a trace of one step."""

  source: str  # the file read and how
  seconds: dict[str, float]  # op -> summed duration
  runs: dict[str, int]  # op -> events
  events: int  # op events read


_HLO_OP = re.compile(r"hlo_op=([^,#:]+)")
# Ops that hold others (a CPU trace nests a loop's ops inside its while event).
_CONTAINERS = re.compile(r"^(while|conditional|call)([._]|$)")
# A CUDA graph XLA built of a run of ops (a command buffer): its kernels' events name the
# graph, not their op.
_COMMAND_BUFFER = re.compile(r"^command_buffer")

# Kernel classes, by the kernel's name in a GPU trace (cuBLAS's nvjet / xmma / gemm, cuDNN's
# attention) and by the op in the program: what a trace of a step in CUDA graphs, whose
# library kernels name no op, can still set beside the projection.
CLASSES = ("gemm", "attention", "copy", "fusion")
_GEMM_KERNEL = re.compile(r"nvjet|gemm|xmma|cutlass|cublas", re.IGNORECASE)
_ATTENTION_KERNEL = re.compile(r"cudnn|sdpa|fmha|flash", re.IGNORECASE)
_COPY_KERNEL = re.compile(r"^(memcpy|memset)", re.IGNORECASE)


def kernel_class(kernel: str) -> str:
  """The class of a traced kernel, by its name."""
  if _ATTENTION_KERNEL.search(kernel):
    return "attention"
  if _GEMM_KERNEL.search(kernel):
    return "gemm"
  return "copy" if _COPY_KERNEL.search(kernel) else "fusion"


def op_class(op: OpCost) -> str:
  """The class of a projected op: cuDNN attention, a matmul, a copy, else a fusion."""
  if "fmha" in op.kind:
    return "attention"
  kind = op.kind.lower()
  if op.opcode in ("dot", "convolution") or any(k in kind for k in ("cublas", "gemm", "dot")):
    return "gemm"
  return "copy" if op.opcode in ("copy", "copy-start") else "fusion"


def _op_of(name: str, stats: dict, device_plane: bool) -> str | None:
  """The HLO op an event ran: its hlo_op stat, an annotation naming one, or on a GPU's
  plane the kernel's own name (XLA names a fusion's kernel after the fusion; a kernel of
  a command buffer goes by its own name too)."""
  found = [str(stats["hlo_op"])] if stats.get("hlo_op") else []
  for key in ("kernel_annotation", "annotation", "tf_op", "long_name"):
    found = found or _HLO_OP.findall(str(stats.get(key, "")))
  if found and not (device_plane and _COMMAND_BUFFER.match(found[-1])):
    return found[-1]
  return name if device_plane else None


def _accumulate(events: list[tuple[str, float]], source: str) -> TraceOps:
  seconds: dict[str, float] = {}
  runs: dict[str, int] = {}
  for op, duration_s in events:
    seconds[op] = seconds.get(op, 0.0) + duration_s
    runs[op] = runs.get(op, 0) + 1
  return TraceOps(source, seconds, runs, len(events))


def _from_xplane(path: str) -> TraceOps:
  data = jax.profiler.ProfileData.from_file(path)
  planes = list(data.planes)
  # A GPU's kernels are on its device planes; the host plane then holds only launches.
  gpu = [p for p in planes if p.name.startswith("/device:") and "CPU" not in p.name.upper()]
  events = []
  for plane in gpu or planes:
    lines = list(plane.lines)
    # A GPU's kernels are on its stream lines; lines a profiler derives from them (XLA
    # Ops, XLA Modules, Steps) would count them again.
    streams = [line for line in lines if line.name.startswith("Stream")] if gpu else []
    for line in streams or lines:
      for event in line.events:
        op = _op_of(event.name, dict(event.stats), bool(gpu))
        if op is not None:
          events.append((op, event.duration_ns * 1e-9))
  return _accumulate(
    events,
    f"{os.path.basename(path)} (jax.profiler.ProfileData, {'device' if gpu else 'host'} planes)",
  )


def _from_chrome_trace(path: str) -> TraceOps:
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  events = []
  for event in trace.get("traceEvents", []):
    if event.get("ph") != "X":
      continue
    op = _op_of(event.get("name", ""), event.get("args", {}), False)
    if op is not None:
      events.append((op, float(event.get("dur", 0.0)) * 1e-6))
  return _accumulate(events, f"{os.path.basename(path)} (Chrome trace JSON)")


def read_trace(trace_dir: str) -> tuple[TraceOps | None, str, str | None]:
  """(op times, note, the .xplane.pb) of the newest trace under `trace_dir`."""
  planes = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  chrome = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  xplane = planes[-1] if planes else None
  failures = []
  for reader, paths in ((_from_xplane, planes), (_from_chrome_trace, chrome)):
    if not paths:
      continue
    try:
      ops = reader(paths[-1])
    except Exception as e:  # pylint: disable=broad-except (a format this jax does not read)
      failures.append(f"{os.path.basename(paths[-1])}: {type(e).__name__}: {_first_line(e)}")
      continue
    if ops.events:
      return ops, "", xplane
    failures.append(f"{os.path.basename(paths[-1])}: no event names an HLO op")
  note = "; ".join(failures) or f"no trace file under {trace_dir}"
  return None, note, xplane


def _key(name: str) -> str:
  """Names as kernels carry them: XLA writes a fusion 'loop_add_fusion.2' as a kernel
  'loop_add_fusion_2'."""
  return re.sub(r"[^A-Za-z0-9]", "_", name)


def compare_ops(
  trace: TraceOps, projected: dict[str, OpCost], traced_step_s: float, top: int = TOP_KERNELS
) -> dict:
  """The trace's op times beside the projection's, top `top` by measured time, and both
  summed by kernel class."""
  by_key = {_key(name): op for name, op in projected.items()}
  by_class = {c: {"measured_s": 0.0, "events": 0, "projected_s": 0.0, "runs": 0} for c in CLASSES}
  for op in projected.values():
    by_class[op_class(op)]["projected_s"] += op.seconds
    by_class[op_class(op)]["runs"] += op.runs
  matched_s = unmatched_s = 0.0
  rows = []
  for name, seconds in trace.seconds.items():
    op = by_key.get(_key(name))
    if op is None and _CONTAINERS.match(name):
      continue  # its ops are counted themselves
    if op is None:
      unmatched_s += seconds
    else:
      matched_s += seconds
    entry = by_class[op_class(op) if op else kernel_class(name)]
    entry["measured_s"] += seconds
    entry["events"] += trace.runs[name]
    rows.append(
      {
        "op": name,
        "measured_s": seconds,
        "measured_runs": trace.runs[name],
        "projected_s": op.seconds if op else None,
        "projected_runs": op.runs if op else None,
        "opcode": op.opcode if op else "",
        "kind": op.kind if op else "",
        "bound": op.bound if op else "",
        "op_name": op.op_name if op else "",
      }
    )
  rows.sort(key=lambda r: -r["measured_s"])
  matched = {_key(r["op"]) for r in rows if r["projected_s"] is not None}
  return {
    "source": trace.source,
    "events": trace.events,
    "ops": len(trace.seconds),
    "matched_ops": len(matched),
    "projected_ops": len(projected),
    "measured_matched_s": matched_s,
    "measured_unmatched_s": unmatched_s,
    "projected_matched_s": sum(op.seconds for k, op in by_key.items() if k in matched),
    "projected_all_s": sum(op.seconds for op in projected.values()),
    "traced_step_s": traced_step_s,
    # Of the traced step, what no op's event covers: launches, gaps, host work.
    "measured_idle_s": max(traced_step_s - matched_s - unmatched_s, 0.0),
    "top": rows[:top],
    "by_class": by_class,
  }


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else ""
