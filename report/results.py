"""results.jsonl: one JSON object per result, appended, never rewritten."""

import json
import os


def append(output_dir: str, record: dict) -> str:
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, "results.jsonl")
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")
  return path


def read(output_dir: str) -> list[dict]:
  path = os.path.join(output_dir, "results.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
