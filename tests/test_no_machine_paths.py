"""No file of the repository names a path of a developer's machine: a clone elsewhere has
none of them. Sources are cited publicly (docs/sources/)."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Built from parts so that this file does not match itself.
MACHINE_PATH = re.compile("|".join([r"/" + "work/", r"\.\./" + "shared", "shared/" + "reference"]))


def _repository_files() -> list[str]:
  """Tracked files and new ones git does not ignore."""
  out = subprocess.run(
    ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
    cwd=ROOT,
    capture_output=True,
    check=True,
    timeout=60,
  )
  return [p for p in out.stdout.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))]


def test_no_file_contains_a_machine_path():
  found = []
  for path in _repository_files():
    with open(os.path.join(ROOT, path), "rb") as f:
      text = f.read().decode("utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
      if MACHINE_PATH.search(line):
        found.append(f"{path}:{number}: {line.strip()[:120]}")
  assert found == [], "\n".join(found)


def test_the_check_sees_a_machine_path():
  assert MACHINE_PATH.search("see " + "/" + "work/" + "shared/" + "reference/hardware.md")
  assert MACHINE_PATH.search("(" + ".." + "/shared" + "/mlperf-gpt3.md)")
  assert not MACHINE_PATH.search("docs/sources/hardware.md")
