"""DIR/REPORT.md for a sweep: the plots, a paragraph of findings drawn from the numbers,
and every point's row."""

import os
import statistics

from reference import mlperf_gpt3, mlperf_llama31_405b
from report import points

_PLOT_TITLES = {
  "scaling_efficiency": "Scaling efficiency against device count",
  "time_to_train": "Time to train against GPU count",
  "step_breakdown": "Step-time breakdown",
  "memory": "Memory per GPU against capacity",
}
_NO_PLOT = {
  "scaling_efficiency": "no point ran",
  "time_to_train": "the sweep sets no token budget and the records carry no time to train",
  "step_breakdown": "measured points have no step-time breakdown",
  "memory": "measured points have no memory analysis",
}


def _ok(records: list[dict]) -> list[dict]:
  return [r for r in records if r["status"] == "ok"]


def _largest(records: list[dict], scaling: str) -> list[dict]:
  """Each generation's largest point of one scaling rule."""
  out = {}
  for r in sorted(_ok(records), key=lambda r: r["devices"]):
    if r["scaling"] == scaling:
      out[r["hardware"]] = r
  return list(out.values())


def _efficiency_sentence(records: list[dict]) -> list[str]:
  sentences = []
  for scaling in ("weak", "strong", "configured"):
    largest = _largest(records, scaling)
    if not largest:
      continue
    unit = "GPUs" if largest[0]["sweep_mode"] == "project" else "devices"
    bases = {r["scaling_baseline_devices"] for r in largest}
    parts = ", ".join(
      f"{r['hardware'].upper()} {r['scaling_efficiency']:.0%} at {r['devices']:,}"
      + ("" if len(bases) == 1 else f" (against {r['scaling_baseline_devices']:,})")
      for r in largest
    )
    base = bases.pop() if len(bases) == 1 else None
    against = f", against {base:,} {unit if base != 1 else unit[:-1]}" if base else ""
    sentences.append(
      f"{scaling.capitalize()} scaling efficiency at the largest point that runs{against}: {parts}."
    )
  return sentences


def _mfu_sentence(records: list[dict]) -> list[str]:
  ok = [r for r in _ok(records) if points.headline_mfu(r)[0] is not None]
  if not ok:
    return []
  best = max(ok, key=lambda r: points.headline_mfu(r)[0])
  worst = min(ok, key=lambda r: points.headline_mfu(r)[0])
  return [
    f"MFU ranges from {points.mfu_text(worst)} ({worst['hardware'].upper()} x "
    f"{worst['devices']:,}, {worst['scaling']}) to {points.mfu_text(best)} "
    f"({best['hardware'].upper()} x {best['devices']:,}, {best['scaling']})."
  ]


def _breakdown_sentence(records: list[dict]) -> list[str]:
  ok = [r for r in _ok(records) if "breakdown" in r]
  if not ok:
    return []
  shares = [r["breakdown"]["exposed_comm_s"] / r["step_time_s"] for r in ok]
  return [
    f"Exposed communication takes {min(shares):.0%}-{max(shares):.0%} of the step "
    f"(median {statistics.median(shares):.0%})."
  ]


def _published_results(model: str) -> tuple[tuple[str, str, int, float], ...]:
  """MLPerf's published (label, hardware, GPUs, minutes) for the model a sweep trains."""
  if model == "gpt3-175b":
    return mlperf_gpt3.RESULTS
  if model == "llama3.1-405b":
    return tuple(
      (f"{run.round_name} {run.system}", run.hardware, run.gpus, run.score_min)
      for run in mlperf_llama31_405b.CALIBRATION
    )
  return ()


def _time_to_train_sentence(records: list[dict]) -> list[str]:
  ok = [r for r in _ok(records) if r.get("time_to_train_min")]
  if not ok:
    return []
  best = min(ok, key=lambda r: r["time_to_train_min"])
  sentences = [
    f"The fastest time to train is {best['time_to_train_min']:,.1f} min "
    f"({best['hardware'].upper()} x {best['devices']:,}, {best['scaling']} scaling)."
  ]
  compared = set()
  for label, hardware, gpus, minutes in _published_results(ok[0].get("model", "")):
    same = [r for r in ok if r["hardware"] == hardware and r["devices"] == gpus]
    if same and ok[0]["sweep_mode"] == "project" and (hardware, gpus) not in compared:
      compared.add((hardware, gpus))
      r = min(same, key=lambda r: r["time_to_train_min"])
      sentences.append(
        f"At {gpus:,} {hardware.upper()} it projects "
        f"{r['time_to_train_min']:,.1f} min against MLPerf's {minutes} min "
        f"({label}), {r['time_to_train_min'] / minutes:.1f}x."
      )
  return sentences


def _h200_sentence(records: list[dict]) -> list[str]:
  by_point = {(r["hardware"], r["scaling"], r["devices"]): r for r in _ok(records)}
  ratios = [
    by_point[("h200", s, n)]["tokens_per_s"] / r["tokens_per_s"]
    for (h, s, n), r in by_point.items()
    if h == "h100" and ("h200", s, n) in by_point
  ]
  if not ratios:
    return []
  return [
    f"H200 over H100 at the same points: {statistics.median(ratios):.2f}x throughput "
    f"(median of {len(ratios)}; range {min(ratios):.2f}-{max(ratios):.2f}x), against the "
    f"press claim of 1.28x."
  ]


def _status_sentence(records: list[dict]) -> list[str]:
  counts = {}
  for r in records:
    counts.setdefault(r["status"], []).append(r)
  text = [f"{len(counts.get('ok', []))} of {len(records)} points ran"]
  if "cannot_run" in counts:
    text.append(
      f"{len(counts['cannot_run'])} cannot run (their mesh or batch does not divide "
      f"the count; reasons in the table)"
    )
  if "does_not_fit" in counts:
    text.append(f"{len(counts['does_not_fit'])} do not fit in memory")
  if "failed" in counts:
    text.append(f"{len(counts['failed'])} failed and will be retried")
  return ["; ".join(text) + "."]


def findings(records: list[dict]) -> str:
  """One paragraph, every figure in it computed from `records`."""
  sentences = (
    _status_sentence(records)
    + _efficiency_sentence(records)
    + _mfu_sentence(records)
    + _breakdown_sentence(records)
    + _time_to_train_sentence(records)
    + _h200_sentence(records)
  )
  return " ".join(sentences)


def _fmt(value, spec: str) -> str:
  return "" if value is None else format(value, spec)


def _table(records: list[dict]) -> list[str]:
  lines = [
    "| scaling | hardware | devices | status | global batch | step s | tokens/s/device "
    "| MFU | efficiency | time to train min | memory GB "
    "| note (a searched point: its configuration) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in records:
    note = (r.get("reason") or points.configuration_text(r)).replace("|", "/")
    lines.append(
      f"| {r['scaling']} | {r['hardware']} | {r['devices']:,} | {r['status']} | "
      f"{_fmt(r.get('global_batch'), ',')} | {_fmt(r.get('step_time_s'), '.4g')} | "
      f"{_fmt(r.get('tokens_per_s_per_device'), ',.1f')} | {points.mfu_text(r)} | "
      f"{_fmt(r.get('scaling_efficiency'), '.0%')} | {_fmt(r.get('time_to_train_min'), ',.1f')} "
      f"| {_fmt(r.get('memory_per_gpu_gb'), '.1f')} | {note} |"
    )
  return lines


def write(records: list[dict], plots: dict[str, str | None], output_dir: str) -> str:
  first = records[0]
  lines = [
    f"# Sweep: {first['sweep']} ({first.get('model', '')}, {first['sweep_mode']} mode)",
    "",
    f"Configuration fingerprint `{first['sweep_config']}`; every record is in "
    "[results.jsonl](results.jsonl) and [results.csv](results.csv). Scaling efficiency "
    "is per-device tokens/s against the series' smallest point that runs (README, "
    "Sweeps).",
    "",
    "## Findings",
    "",
    findings(records),
    "",
    "## Plots",
    "",
  ]
  for name, path in plots.items():
    if path:
      lines += [f"### {_PLOT_TITLES[name]}", "", f"![{name}]({os.path.basename(path)})", ""]
    else:
      lines += [f"### {_PLOT_TITLES[name]}", "", f"Not drawn: {_NO_PLOT[name]}.", ""]
  lines += ["## Points", ""] + _table(records)
  path = os.path.join(output_dir, "REPORT.md")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path
