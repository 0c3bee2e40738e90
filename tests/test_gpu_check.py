"""benchmarks/gpu_check.py's dry run: the GPU check's whole path (measure, project the
program compiled for the local device, trace one step and read its ops) on a host CPU
device with tiny models, so that the script a lent GPU runs cannot rot unnoticed.

Projected onto the catalog's h200 figures: the numbers mean nothing for a CPU step, but
the path is the one a GPU takes, and no host profile has to be measured first."""

import gzip
import json
import math
import os
import tarfile

import pytest

from benchmarks import gpu_check
from projection import targets

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
  with tarfile.open(out / gpu_check.HLO_FILE) as tar:
    names = tar.getnames()
    assert names == [f"{name}.hlo.txt" for name in gpu_check.CONFIG_NAMES]
    assert tar.extractfile(names[0]).read().startswith(b"HloModule")


def test_dry_run_reads_the_ops_of_every_traced_step(dry_run):
  _, out, records = dry_run
  traced = [r for r in records if r["kind"] == "kernels"]
  assert [k["config"] for k in traced] == list(gpu_check.CONFIG_NAMES)
  for kernels in traced:
    # XLA:CPU's trace names each thunk's HLO op: nearly all of them match the program's.
    assert kernels["matched_ops"] > 0.9 * kernels["projected_ops"], kernels["config"]
    assert 0 < len(kernels["top"]) <= gpu_check.TOP_KERNELS
    times = [row["measured_s"] for row in kernels["top"]]
    assert times == sorted(times, reverse=True)
    assert all(_positive(t) for t in times)
    assert any(_positive(row["projected_s"]) for row in kernels["top"])
    # The classes hold every event but the loops' own (whose ops count themselves).
    by_class = kernels["by_class"]
    assert 0 < sum(c["events"] for c in by_class.values()) <= kernels["events"]
    assert _positive(by_class["fusion"]["measured_s"])
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


# The step a real H100 ran (jax 0.11.2, `fp8` configuration): its optimized HLO, and the
# record benchmarks/gpu_check.py wrote for it.
H100_HLO = os.path.join(os.path.dirname(__file__), "data", "h100_fp8_step_hlo.txt.gz")
H100_RECORDS = os.path.join(gpu_check.ROOT, "docs", "gpu_check", "h100.jsonl")


def test_a_real_h100_programs_async_fusions_are_costed_once(tmp_path):
  """XLA's GPU compiler (jax 0.11) runs a layer scan's dynamic slices and in-place updates
  as async fusions (fusion-start / fusion-done). Read as plain ops, each was charged the
  whole stacked buffer twice over: 3.2 TB a step, a 1.20 s projection of a 0.32 s step."""
  from benchmarks import gpu_check_deviceless
  from benchmarks.gpu_check_report import write_programs
  from projection import hlo

  with gzip.open(H100_HLO, "rt") as f:
    text = f.read()
  program = hlo.analyze(text)
  starts = [n for n, _ in hlo.walk(program) if n.name.startswith("fusion-start")]
  assert starts and all(n.opcode == "fusion" for n in starts)
  # One layer's slice of a [24, ...] stacked buffer moves, not the 7.5 GB buffer.
  assert max(n.bytes_read + n.bytes_written for n in starts) < 1e9
  assert not [n for n, _ in hlo.walk(program) if n.name.startswith("fusion-done")]
  # The program as gpu_check.py keeps it, read back and projected onto one h100.
  write_programs(str(tmp_path / "hlo.tar.gz"), {"fp8": text})
  (record,) = gpu_check_deviceless.measured_records(H100_RECORDS, ["fp8"])
  programs = gpu_check_deviceless.gpu_programs(str(tmp_path / "hlo.tar.gz"))
  point = gpu_check_deviceless.reprojected(record, programs["fp8"])
  # Within the project's 25% closing-the-loop target of the step measured on the H100
  # (0.320 s; the projection gives 0.290 s, -9%).
  assert abs(point.step_time_s / record["step_time_s"] - 1) < 0.25


def test_command_buffer_kernels_are_read_by_name_and_class():
  """Inside a CUDA graph every kernel's op stat names the graph (command_buffer_N): a fusion's
  kernel is matched by its own name, a cuBLAS or cuDNN kernel is counted by its class."""
  from measure import trace
  from projection.op_costs import OpCost

  stats = {"hlo_op": "command_buffer_134"}
  assert trace._op_of("loop_add_fusion_2", stats, True) == "loop_add_fusion_2"
  assert trace._op_of("anything", {"hlo_op": "fusion.3"}, True) == "fusion.3"
  events = {
    "loop_add_fusion_2": (2e-3, 4),
    "nvjet_sm90_qqtst_176x128_128x5_1x2_h_bz_TNN": (5e-3, 2),
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": (3e-3, 2),
    "memcpy128": (1e-3, 9),
  }
  ops = trace.TraceOps(
    "test", {k: s for k, (s, _) in events.items()}, {k: n for k, (_, n) in events.items()}, 17
  )
  projected = {
    "loop_add_fusion.2": OpCost("loop_add_fusion.2", "fusion", "kLoop", "", 4, 1e-3, "memory"),
    "custom-call.1": OpCost(
      "custom-call.1", "custom-call", "__cublas$lt$matmul$f8", "", 2, 6e-3, "flops"
    ),
    "attn.1": OpCost("attn.1", "custom-call", "__cudnn$fmhaSoftmax", "", 2, 2e-3, "flops"),
  }
  result = trace.compare_ops(ops, projected, 12e-3)
  assert result["matched_ops"] == 1
  by_class = result["by_class"]
  assert by_class["gemm"] == {"measured_s": 5e-3, "events": 2, "projected_s": 6e-3, "runs": 2}
  assert (
    by_class["attention"]["measured_s"] == 3e-3 and by_class["attention"]["projected_s"] == 2e-3
  )
  assert by_class["copy"]["events"] == 9 and by_class["fusion"]["projected_s"] == 1e-3


@pytest.mark.skipif(not targets.cuda_available()[0], reason="needs jax-cuda12-plugin")
def test_the_deviceless_projection_of_a_step_measured_on_an_h100():
  """The projection every mode makes (compiled deviceless here, costed) against the step a
  real H100 ran: GPT-3 125M, 4 x 2048 tokens, 68.2 ms measured, 61.1 ms projected (-10%)."""
  from benchmarks import gpu_check_deviceless

  (record,) = gpu_check_deviceless.measured_records(H100_RECORDS, ["memory"])
  point = gpu_check_deviceless.deviceless(record)
  assert point.hardware == "h100" and point.compile_target == "cuda"
  # The project's 25% closing-the-loop target (benchmarks/closing_the_loop.py).
  assert abs(point.step_time_s / record["step_time_s"] - 1) < 0.25
  lines = gpu_check_deviceless.table([(record, point, None)])
  assert lines[2].startswith("| memory | NVIDIA H100 80GB HBM3, 0.11.2 | 68.18 |")
  assert lines[2].endswith("| cuda | - | - |")


def test_the_catalog_entry_a_gpu_names():
  assert gpu_check.catalog_entry_for("NVIDIA H100 80GB HBM3") == "h100"
  assert gpu_check.catalog_entry_for("NVIDIA H200") == "h200"
  assert gpu_check.catalog_entry_for("NVIDIA GB200") == "gb200"
  assert gpu_check.catalog_entry_for("NVIDIA B200") == "b200"
  assert gpu_check.catalog_entry_for("NVIDIA L40S") == "h200"


def test_kernel_check_dry_run(tmp_path, capsys):
  """benchmarks/kernel_check.py's path (build, compile, project, time, write) on the host
  CPU with tiny sizes, so the script a lent GPU runs cannot rot."""
  from benchmarks import kernel_check

  argv = ["--dry_run", f"--output_dir={tmp_path}", "--hardware=h100", "--iters=2"]
  assert kernel_check.main(argv) == 0
  lines = (tmp_path / kernel_check.JSONL).read_text().splitlines()
  records = [json.loads(line) for line in lines]
  assert [r["family"] for r in records] == [c.family for c in kernel_check.cases(True)]
  for r in records:
    assert _positive(r["measured_s"]) and _positive(r["projected_s"]), r
    assert _positive(r["measured_rate"]) and math.isfinite(r["error"])
  markdown = (tmp_path / kernel_check.MARKDOWN).read_text()
  rows = [line for line in markdown.splitlines() if line.startswith("| ")]
  assert len(rows) == len(records) + 1  # the header, then one row per case
  with pytest.raises(SystemExit) as stop:
    kernel_check.main(["--dry_run", "--iters=0"])
  assert stop.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --iters") and err.count("\n") == 1
