"""The import contract (pyproject.toml's import-linter layers) holds: no import points back
up the chain launch > modes > experiments > sweep > measure > projection | report > train >
model > parallelism > hardware | reference | records."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_point_one_way():
  lint = shutil.which("lint-imports") or os.path.join(
    os.path.dirname(sys.executable), "lint-imports"
  )
  out = subprocess.run(
    [lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
  assert "1 kept, 0 broken" in out.stdout


def test_no_module_imports_launch():
  """launch.py is a single module, which import-linter's layers cannot name: it is the
  entry point, and nothing imports it."""
  offenders = []
  for top in (
    "modes",
    "experiments",
    "sweep",
    "measure",
    "report",
    "projection",
    "train",
    "model",
    "parallelism",
    "hardware",
    "reference",
    "records",
    "benchmarks",
    "tools",
  ):
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          with open(path, encoding="utf-8") as f:
            text = f.read()
          if "import launch" in text or "from launch " in text:
            offenders.append(os.path.relpath(path, ROOT))
  assert offenders == []
