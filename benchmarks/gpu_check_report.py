"""benchmarks/gpu_check.py's output: the markdown tables of measured against projected
steps and of the traced step's ops, and the files it writes."""

import io
import json
import os
import shutil
import tarfile

MAX_FILE_BYTES = 16 * 2**20  # what the device tool brings back per file
TARGET_ERROR = 0.25  # the project's closing-the-loop target (benchmarks/closing_the_loop.py)


def first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else ""


def ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:,.2f}"


def ratio(projected: float | None, measured: float) -> str:
  if projected is None or not measured > 0:
    return "-"
  return f"{projected / measured - 1:+.1%}"


def config_table(records: list[dict]) -> list[str]:
  lines = [
    "| configuration | model | batch x seq | remat | fp8 | compile s | measured step ms | "
    "measured MFU | projected step ms | projected MFU | error | compute ms | "
    "memory-bound ms | launches ms | exposed comm ms | memory GB |",
    "|" + "---|" * 16,
  ]
  for r in records:
    head = (
      f"| {r['config']} | {r['model']} | {r['global_batch']} x {r['seq_len']} | "
      f"{r['remat']} | {r['fp8']} |"
    )
    if "error" in r or "skipped" in r:
      lines.append(f"{head} {r.get('error') or r.get('skipped')} |" + " |" * 10)
      continue
    p = r["projected"]
    b = p["breakdown"]
    flag = "" if abs(p["step_time_s"] / r["step_time_s"] - 1) <= TARGET_ERROR else " *"
    lines.append(
      f"{head} {r['compile_s']:.1f} | {ms(r['step_time_s'])} | {r['mfu']:.1%} | "
      f"{ms(p['step_time_s'])} | {p['mfu']:.1%} | "
      f"{ratio(p['step_time_s'], r['step_time_s'])}{flag} | {ms(b['compute_s'])} | "
      f"{ms(b['memory_bound_s'])} | {ms(b['other_s'])} | {ms(b['exposed_comm_s'])} | "
      f"{p['memory_per_gpu_gb']:.1f} / {p['hbm_capacity_gb']:.0f} |"
    )
  for r in records:
    if "first_attempt_error" in r:
      lines.append(
        f"\n{r['config']}: the first attempt failed ({r['first_attempt_error']}); "
        f"the row is the retry with {' '.join(r['fallback_sets'])}."
      )
  lines.append(
    f"\nerror: projected over measured median step, minus one; * misses the "
    f"{TARGET_ERROR:.0%} target. compute includes memory-bound (ops whose HBM "
    f"bytes outlast their FLOPs); launches: the cost model's per-kernel overhead."
  )
  return lines


def kernel_table(kernels: dict) -> list[str]:
  lines = [
    f"Trace of one `{kernels['config']}` step ({kernels['source']}): {kernels['events']} op "
    f"events, {kernels['ops']} ops, {kernels['matched_ops']} of them matched to the "
    f"{kernels['projected_ops']} ops of the projected program.",
    "",
    f"- traced step {ms(kernels['traced_step_s'])} ms: matched ops "
    f"{ms(kernels['measured_matched_s'])} ms (projected "
    f"{ms(kernels['projected_matched_s'])} ms), unmatched "
    f"{ms(kernels['measured_unmatched_s'])} ms, not in any op "
    f"{ms(kernels['measured_idle_s'])} ms (projected launches "
    f"{ms(kernels['projected_launch_s'])} ms)",
    "",
    "| # | HLO op | opcode / kind | bound | runs | measured ms | projected ms | error | from |",
    "|" + "---|" * 9,
  ]
  for i, row in enumerate(kernels["top"], 1):
    kind = f"{row['opcode']} {row['kind']}".strip() or "-"
    runs = (
      f"{row['measured_runs']}"
      if row["projected_runs"] is None
      else f"{row['measured_runs']} / {row['projected_runs']}"
    )
    source = row["op_name"][-60:] if row["op_name"] else "-"
    lines.append(
      f"| {i} | {row['op']} | {kind} | {row['bound'] or '-'} | {runs} | "
      f"{ms(row['measured_s'])} | {ms(row['projected_s'])} | "
      f"{ratio(row['projected_s'], row['measured_s'])} | {source} |"
    )
  lines.append(
    "\nruns: events in the trace / executions the program makes (loop trips "
    "counted); projected ms leaves out the per-kernel launch overhead."
  )
  by_class = kernels.get("by_class")
  if by_class:
    lines += [
      "",
      "| kernel class | kernels traced | measured ms | ops projected (runs) | projected ms | "
      "error |",
      "|" + "---|" * 6,
    ]
    for name, c in by_class.items():
      lines.append(
        f"| {name} | {c['events']} | {ms(c['measured_s'])} | {c['runs']} | "
        f"{ms(c['projected_s'])} | {ratio(c['projected_s'], c['measured_s'])} |"
      )
    lines.append(
      "\nkernel class: a traced kernel by its name (cuBLAS's and cuDNN's kernels name no "
      "op inside a CUDA graph), a projected op by its opcode and kind; an op XLA emits "
      "as several kernels counts each."
    )
  return lines


def write_markdown(
  path: str,
  header: list[str],
  records: list[dict],
  traced: list[tuple[str, dict | None, str]],
) -> None:
  """The tables of this run: its configurations, then each traced step (configuration, its
  op table or None, a note)."""
  lines = [*header, "", *config_table(records)]
  for config, kernels, note in traced:
    lines.append("")
    lines += kernel_table(kernels) if kernels else [f"Trace of `{config}`: {note}"]
  partial = f"{path}.partial"
  with open(partial, "w") as f:
    f.write("\n".join(lines) + "\n")
  os.replace(partial, path)  # a reader sees the last whole table


def write_programs(path: str, programs: dict[str, str]) -> None:
  """Each configuration's optimized HLO as CONFIG.hlo.txt in one gzipped tar, rewritten
  whole as each is added (a run cut short keeps those before)."""
  partial = f"{path}.partial"
  with tarfile.open(partial, "w:gz") as tar:
    for config, text in programs.items():
      data = text.encode()
      info = tarfile.TarInfo(f"{config}.hlo.txt")
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  os.replace(partial, path)


def append_jsonl(path: str, record: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def copy_small(source: str, target: str) -> str:
  if os.path.getsize(source) > MAX_FILE_BYTES:
    return f"{os.path.basename(source)} is {os.path.getsize(source) / 2**20:.0f} MiB: not copied"
  shutil.copyfile(source, target)
  return ""
