"""results.csv beside results.jsonl: one row per record, nested fields flattened."""

import csv
import json
import os

from report import results


def flatten(record: dict, prefix: str = "") -> dict[str, object]:
  """Nested dicts become dotted columns (breakdown.compute_s); lists stay JSON text."""
  row = {}
  for key, value in record.items():
    if isinstance(value, dict):
      row.update(flatten(value, f"{prefix}{key}."))
    else:
      row[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
  return row


def write_csv(output_dir: str) -> str:
  """Rewrite DIR/results.csv from every record in DIR/results.jsonl, in file order."""
  rows = [flatten(r) for r in results.read(output_dir)]
  columns = list(dict.fromkeys(key for row in rows for key in row))
  path = os.path.join(output_dir, "results.csv")
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
  return path
