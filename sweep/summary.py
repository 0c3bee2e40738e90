"""The end of a sweep: the terminal table, results.csv, the plots and REPORT.md."""

import os

from report import export, plots, sweep_report, table


def _row(r: dict) -> tuple:
  def num(key: str, spec: str) -> str:
    return "" if r.get(key) is None else format(r[key], spec)

  note = r.get("reason", "")
  return (
    r["scaling"],
    r["hardware"],
    r["devices"],
    r["status"],
    num("global_batch", ","),
    num("step_time_s", ".4g"),
    num("tokens_per_s_per_device", ",.1f"),
    num("mfu", ".1%"),
    num("scaling_efficiency", ".0%"),
    num("time_to_train_min", ",.1f"),
    num("memory_per_gpu_gb", ".1f"),
    note[:60] + ("..." if len(note) > 60 else ""),
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
    "note",
  )
  print(table.columns(headers, [_row(r) for r in records]))
  csv_path = export.write_csv(output_dir)
  written = plots.write_all(records, output_dir)
  report = sweep_report.write(records, written, output_dir)
  print(f"\n{sweep_report.findings(records)}\n")
  for path in [
    os.path.join(output_dir, "results.jsonl"),
    csv_path,
    report,
    *filter(None, written.values()),
  ]:
    print(f"wrote {path}")
