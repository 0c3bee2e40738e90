"""benchmarks/gpu_check.py's dry run: the GPU check's whole path (measure, project the
program compiled for the local device, trace one step and read its ops) on a host CPU
device with tiny models, so that the script a lent GPU runs cannot rot unnoticed.

Projected onto the catalog's h200 figures: the numbers mean nothing for a CPU step, but
the path is the one a GPU takes, and no host profile has to be measured first."""

import gzip
import json
import math
import os

import pytest

from benchmarks import gpu_check

STEPS = ["--steps=2", "--warmup_steps=1"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_check")
  code = gpu_check.cli(["--dry_run", f"--output_dir={out}", "--hardware=h200", *STEPS])
  records = [json.loads(line) for line in (out / gpu_check.JSONL).read_text().splitlines()]
  return code, out, records


def _positive(value) -> bool:
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_dry_run_measures_and_projects_every_configuration(dry_run):
  code, out, records = dry_run
  assert code == 0
  configs = [r for r in records if r["kind"] == "config"]
  assert [r["config"] for r in configs] == list(gpu_check.CONFIG_NAMES)
  for r in configs:
    assert "error" not in r, r
    assert r["platform"] == "cpu" and r["dry_run"]
    assert len(r["step_times_s"]) == 2
    for value in (r["compile_s"], r["step_time_s"], r["mfu"]):
      assert _positive(value), r
    p = r["projected"]
    b = p["breakdown"]
    assert p["hardware"] == "h200"
    values = {**p, **b, **r["projected_program"]}
    for key in ("step_time_s", "mfu", "compute_s", "other_s", "hlo_flops_per_device", "kernels"):
      assert _positive(values[key]), (key, p)
    assert 0 <= b["memory_bound_s"] <= b["compute_s"]
    # The step is at least its ops and their launches (one device: no collectives).
    assert p["step_time_s"] >= b["compute_s"] + b["other_s"] - 1e-12  # float sums
    assert math.isfinite(r["error_vs_measured"])
  by_name = {r["config"]: r for r in configs}
  assert by_name["remat"]["remat"] == "full" and by_name["fp8"]["fp8"]


def test_dry_run_writes_the_tables_and_the_trace(dry_run):
  _, out, records = dry_run
  assert sorted(os.listdir(out)) == sorted(
    [gpu_check.JSONL, gpu_check.MARKDOWN, gpu_check.TRACE_FILE, gpu_check.HLO_FILE]
  )
  markdown = (out / gpu_check.MARKDOWN).read_text()
  for name in gpu_check.CONFIG_NAMES:
    assert sum(line.startswith(f"| {name} |") for line in markdown.splitlines()) == 1
  with gzip.open(out / gpu_check.HLO_FILE, "rt") as f:
    assert f.read().startswith("HloModule")


def test_dry_run_reads_the_ops_of_the_traced_step(dry_run):
  _, out, records = dry_run
  (kernels,) = [r for r in records if r["kind"] == "kernels"]
  assert kernels["config"] == "memory"
  # XLA:CPU's trace names each thunk's HLO op: nearly all of them match the program's.
  assert kernels["matched_ops"] > 0.9 * kernels["projected_ops"]
  assert 0 < len(kernels["top"]) <= gpu_check.TOP_KERNELS
  times = [row["measured_s"] for row in kernels["top"]]
  assert times == sorted(times, reverse=True)
  assert all(_positive(t) for t in times)
  assert any(_positive(row["projected_s"]) for row in kernels["top"])
  markdown = (out / gpu_check.MARKDOWN).read_text()
  assert f"| 1 | {kernels['top'][0]['op']} |" in markdown


def test_bad_flags_are_one_line_and_exit_code_2(capsys):
  for argv in (["--only=nope"], ["--trace=nope"], ["--steps=0"], ["--dry_run", "--bogus"]):
    with pytest.raises(SystemExit) as stop:
      gpu_check.cli(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
  assert gpu_check.cli(["--dry_run", "--hardware=nope"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --hardware") and err.count("\n") == 1, err


def test_without_a_gpu_the_check_asks_for_dry_run(tmp_path, capsys):
  assert gpu_check.cli([f"--output_dir={tmp_path}"]) == 2
  err = capsys.readouterr().err
  assert "--dry_run" in err and err.count("\n") == 1, err
  assert not os.listdir(tmp_path)  # nothing written


def test_a_failed_configuration_is_tried_again_with_its_fallback(tmp_path, monkeypatch):
  calls = []
  measure = gpu_check.measure

  def fail_first(exp, device, hooks=()):
    calls.append(exp.model.attention)
    if len(calls) == 1:
      raise RuntimeError("cuDNN attention is not supported here\nsecond line")
    return measure(exp, device, hooks)

  monkeypatch.setattr(gpu_check, "measure", fail_first)
  argv = [
    "--dry_run",
    f"--output_dir={tmp_path}",
    "--hardware=h200",
    "--only=compute",
    "--trace=none",
    *STEPS,
  ]
  assert gpu_check.cli(argv) == 0
  (record,) = [json.loads(line) for line in (tmp_path / gpu_check.JSONL).read_text().splitlines()]
  assert len(calls) == 2
  assert record["first_attempt_error"] == "RuntimeError: cuDNN attention is not supported here"
  assert record["fallback_sets"] == list(gpu_check.CONFIGS[0].fallback_sets)
  assert record["global_batch"] == 2 and _positive(record["projected"]["step_time_s"])
