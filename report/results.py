"""results.jsonl: one JSON object per result, appended, never rewritten.

A writer killed mid-line leaves a partial last line. The next append starts a new line
after it rather than joining the two (which would make the new record unreadable too),
and reading skips any line that is not a JSON object with a one-line warning naming it;
nothing already in the file is rewritten or dropped.

This module is the one writer and reader of the file. A record is a
records.points.MeasuredPoint or ProjectedPoint, or a dict (a sweep's point, which adds
its labels, or a search's, which adds the candidate); reading folds the duplicate keys of
older files into the kept ones (records.points.OLD_KEYS), so an old file still resumes a
sweep.
"""

import datetime
import json
import os
import sys
import tempfile

from errors import UserInputError
from records import points

FILE = "results.jsonl"


def check_writable(output_dir: str) -> None:
  """Refuse an output directory where results.jsonl (or the TensorBoard and profile
  directories beside it) could not be written, creating nothing."""
  if not output_dir.strip():
    raise UserInputError("--output_dir: empty; name a directory (default: runs)")
  path = os.path.abspath(output_dir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserInputError(f"--output_dir {path} is a file, not a directory")
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise UserInputError(f"--output_dir {path}: {existing} is a file, not a directory")
  if not can_create_in(existing):
    raise UserInputError(f"--output_dir {path}: nothing can be created in {existing}")
  results = os.path.join(path, FILE)
  if os.path.isdir(results):
    raise UserInputError(f"--output_dir: {results} is a directory, not a file")
  if os.path.exists(results) and not os.access(results, os.W_OK):
    raise UserInputError(f"--output_dir: {results} is not writable")
  for sub in ("tensorboard", "profile"):
    if os.path.exists(os.path.join(path, sub)) and not os.path.isdir(os.path.join(path, sub)):
      raise UserInputError(f"--output_dir: {os.path.join(path, sub)} is a file, not a directory")


def can_create_in(directory: str) -> bool:
  """Whether a directory can be made in `directory`: tried with an empty one, removed at
  once (permission bits alone miss read-only file systems, and root passes them all)."""
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=directory))
  except OSError:
    return False
  return True


def _ends_mid_line(path: str) -> bool:
  if not os.path.exists(path) or os.path.getsize(path) == 0:
    return False
  with open(path, "rb") as f:
    f.seek(-1, os.SEEK_END)
    return f.read(1) != b"\n"


def append(output_dir: str, record, stamp: bool = False) -> str:
  """Append one record as it is (with `stamp`, with the time it is written, UTC, as
  `time`); the file's path."""
  data = points.to_json(record)
  if stamp:
    now = datetime.datetime.now(datetime.timezone.utc)
    data = {**data, "time": now.isoformat(timespec="seconds")}
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, FILE)
  line = json.dumps(data) + "\n"
  if _ends_mid_line(path):
    print(
      f"warning: {path} ended in a partial line (a writer was killed?); it is kept "
      f"as it is and the new record starts on the next line",
      file=sys.stderr,
    )
    line = "\n" + line
  with open(path, "a") as f:
    f.write(line)
  return path


def read(output_dir: str) -> list[dict]:
  """Every record, as dicts with today's keys; lines that are not a JSON object are
  skipped with a warning each."""
  path = os.path.join(output_dir, FILE)
  if not os.path.exists(path):
    return []
  records = []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      try:
        record = json.loads(raw)
      except ValueError:  # JSONDecodeError and UnicodeDecodeError
        record = None
      if not isinstance(record, dict):
        print(
          f"warning: {path} line {number} is not a JSON object (a partial write?); skipped",
          file=sys.stderr,
        )
        continue
      records.append(points.upgrade(record))
  return records
