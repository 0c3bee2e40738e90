"""The end of a sweep: the terminal table, results.csv, the plots and REPORT.md."""

import os
import re

from report import export, plots, points, sweep_report, table


def _row(r: dict) -> tuple:
  def num(key: str, spec: str) -> str:
    return "" if r.get(key) is None else format(r[key], spec)

  note = r.get("reason") or points.configuration_text(r)
  return (
    r["scaling"],
    r["hardware"],
    r["devices"],
    r["status"],
    num("global_batch", ","),
    num("step_time_s", ".4g"),
    num("tokens_per_s_per_device", ",.1f"),
    points.mfu_text(r),
    num("scaling_efficiency", ".0%"),
    num("time_to_train_min", ",.1f"),
    num("memory_per_gpu_gb", ".1f"),
    note[:60] + ("..." if len(note) > 60 else ""),
  )


def _report_is_current(records: list[dict], output_dir: str) -> bool:
  """REPORT.md is this sweep's, newer than every record, and its plots exist: a sweep
  started again with nothing left to run need not draw them again."""
  report = os.path.join(output_dir, "REPORT.md")
  if not os.path.exists(report):
    return False
  if os.path.getmtime(report) < os.path.getmtime(os.path.join(output_dir, "results.jsonl")):
    return False
  text = open(report).read()
  pngs = re.findall(r"\]\(([\w.]+\.png)\)", text)
  return f"`{records[0]['sweep_config']}`" in text and all(
    os.path.exists(os.path.join(output_dir, p)) for p in pngs
  )


def finish(records: list[dict], output_dir: str) -> None:
  headers = (
    "scaling",
    "hardware",
    "devices",
    "status",
    "batch",
    "step s",
    "tokens/s/dev",
    "MFU",
    "efficiency",
    "train min",
    "memory GB",
    "note (a searched point: its configuration)",
  )
  print(table.columns(headers, [_row(r) for r in records]))
  print(f"\n{sweep_report.findings(records)}\n")
  csv_path = export.write_csv(output_dir)
  report = os.path.join(output_dir, "REPORT.md")
  if _report_is_current(records, output_dir):
    print(f"{report} and its plots are up to date with results.jsonl: kept")
    return
  written = plots.write_all(records, output_dir)
  sweep_report.write(records, written, output_dir)
  for path in [csv_path, report, *filter(None, written.values())]:
    print(f"wrote {path}")
