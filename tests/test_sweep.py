"""Sweeps: resume, CSV against JSON Lines, plots and report (TensorBoard and the profiler
are checked through launch.py in tests/test_launch.py).

The sweep is the real runner on real projections of a 1-layer GPT (tiny) on H100s, so
the plots draw numbers a user would see; GPT-3 175B sweeps are timed outside the tests.
"""

import csv
import dataclasses
import json
import os
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest

import experiments
from errors import UserInputError
from hardware import catalog
from parallelism.mesh import MeshConfig
from projection import compose, project
from projection.plan import plan
from records import points
from records.points import ProjectedPoint, from_json, to_json
from report import export, plots, results, sweep_report
from report import points as printers
from sweep import definitions, runner
from sweep.definitions import Sweep
from train import hooks

SWEEP = Sweep(
  mode="project",
  counts=(4, 8, 16),
  hardware=("h100",),
  token_budget=10**9,
  token_budget_label="1 B tokens",
)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("sweep"))
  tiny = experiments.load("tiny")
  # One layer, and micro-batches of one sequence so that every point shares one compile.
  exp = dataclasses.replace(
    tiny,
    model=dataclasses.replace(tiny.model, num_layers=1),
    train=dataclasses.replace(tiny.train, micro_batch=1),
  )
  return exp, out, runner.run(exp, SWEEP, out, platform="cpu")


def _by_point(records):
  return {(r["scaling"], r["devices"]): r for r in records}


def test_every_point_is_recorded_including_those_that_cannot_run(swept):
  _, out, records = swept
  assert len(records) == len(results.read(out)) == 6  # strong and weak x 3 counts
  by = _by_point(records)
  for scaling in ("strong", "weak"):
    assert by[(scaling, 4)]["status"] == "cannot_run"
    assert "whole number of 8-GPU nodes" in by[(scaling, 4)]["reason"]
    assert by[(scaling, 8)]["status"] == by[(scaling, 16)]["status"] == "ok"
  assert by[("strong", 8)]["global_batch"] == by[("strong", 16)]["global_batch"] == 16
  # weak: 2 sequences per data x fsdp replica (8 GPUs: data 2 x fsdp 2 x tensor 2)
  assert by[("weak", 8)]["global_batch"] == 8 and by[("weak", 16)]["global_batch"] == 16


def test_efficiency_and_time_to_train(swept):
  by = _by_point(swept[2])
  base, big = by[("strong", 8)], by[("strong", 16)]
  assert base["scaling_efficiency"] == 1.0 and big["scaling_baseline_devices"] == 8
  speed_up = base["step_time_s"] / big["step_time_s"]
  assert big["scaling_efficiency"] == pytest.approx(speed_up / 2)
  assert 0 < big["scaling_efficiency"] < 1.5
  assert big["time_to_train_min"] == pytest.approx(1e9 / big["tokens_per_s"] / 60)


def test_interrupted_sweep_resumes_with_the_missing_points_only(swept, tmp_path, monkeypatch):
  exp, out, records = swept
  lines = open(os.path.join(out, "results.jsonl")).readlines()
  (tmp_path / "results.jsonl").write_text("".join(lines[:-2]))  # as if killed 2 points early
  calls = []
  real = project.project

  def counted(exp, target, how="auto"):
    calls.append((target.hardware.name, target.gpus))
    return real(exp, target, how)

  monkeypatch.setattr(project, "project", counted)
  again = runner.run(exp, SWEEP, str(tmp_path), platform="cpu")
  assert calls == [("h100", 8), ("h100", 16)]  # the weak series' two points
  assert len(results.read(str(tmp_path))) == 6
  for old, new in zip(records, again):
    assert {k: v for k, v in old.items() if k != "time"} == {
      k: v for k, v in new.items() if k != "time"
    }
  runner.run(exp, SWEEP, str(tmp_path), platform="cpu")
  assert len(calls) == 2 and len(results.read(str(tmp_path))) == 6
  # another configuration is another sweep: nothing of it is skipped
  other = dataclasses.replace(exp, train=dataclasses.replace(exp.train, steps=3))
  assert runner.point_key(other, SWEEP, runner.points(SWEEP, "cpu")[0]) not in {
    r["sweep_key"] for r in results.read(str(tmp_path))
  }


def test_1f1b_points_are_composed_unless_full_compile(swept, tmp_path, monkeypatch):
  # Which projection a point runs, not its numbers (tests/test_compose.py checks those).
  exp, _, records = swept
  pipelined = dataclasses.replace(
    exp,
    model=dataclasses.replace(exp.model, num_layers=2),  # whole chunks: one a stage
    mesh=MeshConfig(data=-1, pipeline=2),
    train=dataclasses.replace(exp.train, pipeline_schedule="1f1b"),
  )
  done = next(r for r in records if r["status"] == "ok")
  calls = []

  def stub(name):
    def projector(exp, target):
      calls.append((name, target.gpus))
      return from_json(ProjectedPoint, dict(done, devices=target.gpus))

    return projector

  monkeypatch.setattr(compose, "composed", stub("composed"))
  monkeypatch.setattr(project, "whole", stub("full"))
  one = Sweep(mode="project", counts=(8,), hardware=("h100",), scalings=("strong",))
  runner.run(pipelined, one, str(tmp_path), platform="cpu")
  runner.run(exp, one, str(tmp_path / "gpipe"), platform="cpu")  # no pipeline: full
  # 1 layer over 2 stages is not whole chunks: not composed.
  runner.run(dataclasses.replace(pipelined, model=exp.model), one, str(tmp_path / "uneven"), "cpu")
  assert calls == [("composed", 8), ("full", 8), ("full", 8)]
  # A full compile is its own point: the composed record does not stand in for it.
  runner.run(pipelined, one, str(tmp_path), platform="cpu", full_compile=True)
  assert calls[3:] == [("full", 8)]
  keys = [r["sweep_key"] for r in results.read(str(tmp_path))]
  assert len(keys) == 2 and keys[1] == keys[0] + "/full"


def test_a_composed_point_near_hbm_capacity_is_compiled_whole(swept, monkeypatch):
  exp, _, records = swept
  pipelined = dataclasses.replace(
    exp,
    model=dataclasses.replace(exp.model, num_layers=2),
    mesh=MeshConfig(data=-1, pipeline=2),
    train=dataclasses.replace(exp.train, pipeline_schedule="1f1b"),
  )
  done = next(r for r in records if r["status"] == "ok")
  capacity = done["hbm_capacity_gb"]
  for share, whole in ((compose.NEAR_CAPACITY - 0.01, False), (compose.NEAR_CAPACITY + 0.01, True)):
    monkeypatch.setattr(
      compose,
      "composed",
      lambda *a, s=share: from_json(ProjectedPoint, dict(done, memory_per_gpu_gb=s * capacity)),
    )
    monkeypatch.setattr(
      project, "whole", lambda *a: from_json(ProjectedPoint, dict(done, memory_per_gpu_gb=capacity))
    )
    record = to_json(project.project(pipelined, plan(pipelined, catalog.get("h100"), 8)))
    assert ("composed_estimate" in record) == whole
    assert record["memory_per_gpu_gb"] == (capacity if whole else share * capacity)


def test_a_searched_sweep_runs_each_point_at_its_searchs_best(swept, tmp_path, monkeypatch):
  # Which configuration a point keeps, not its numbers: the projector is a stand-in whose
  # made-up step time orders the candidates otherwise than the search's prior does.
  exp, _, records = swept
  done = next(r for r in records if r["status"] == "ok")
  calls = []

  def projector(exp, target, how):
    name = {"auto": "composed", "full": "full"}[how]
    step_s = 1.0 + exp.mesh.tensor + 0.1 * exp.train.micro_batch
    calls.append((name, target.gpus, step_s))
    point = dict(done, fits=True, devices=target.gpus, step_time_s=step_s)
    return from_json(ProjectedPoint, point)

  monkeypatch.setattr(project, "project", projector)
  searched = definitions.searched(dataclasses.replace(SWEEP, counts=(8, 16)), 3)
  assert searched.scalings == ("strong",)  # a weak batch would depend on the choice
  got = runner.run(exp, searched, str(tmp_path), platform="cpu")
  first = len(calls)
  assert first in (6, 8) and {c[0] for c in calls} == {"composed"}
  for r in got:
    # The point's own configuration (tensor 2 on 8 GPUs) and the prior's first 3.
    assert r["status"] == "ok" and len(r["search"]["projected"]) in (3, 4)
    assert r["search"]["projected"][0]["included"]
    assert r["search"]["projected"][0]["set"][0] == f"tensor_parallel={exp.mesh.tensor}"
    assert r["sweep_key"].endswith("/best-of-3")
    assert r["step_time_s"] == min(t for _, n, t in calls if n == r["devices"])
    assert printers.configuration_text(r).startswith(f"TP{r['search']['tensor_parallel']} ")
  assert printers.configuration_text(got[0]) in "\n".join(sweep_report._table(got))
  assert plots.step_breakdown(got, str(tmp_path / "breakdown.png"))
  runner.run(exp, searched, str(tmp_path), platform="cpu", full_compile=True)
  assert [c[0] for c in calls[first:]] == ["full"] * first
  # A sweep of its own points, each as configured, does not take the searched records.
  assert runner.point_key(exp, SWEEP, runner.points(SWEEP, "cpu")[0]) not in {
    r["sweep_key"] for r in got
  }


def test_sweep_points_restricted_and_searched_only_where_they_apply():
  assert definitions.restricted(SWEEP, (), ()) is SWEEP
  some = definitions.restricted(SWEEP, ("h100",), (8,))
  assert (some.hardware, some.counts) == (("h100",), (8,))
  with pytest.raises(UserInputError, match="--hardware: 'gb300' is not one of this sweep"):
    definitions.restricted(SWEEP, ("gb300",), ())
  measured = experiments.sweep("tiny")
  with pytest.raises(UserInputError, match="--hardware/--gpus: a measured sweep"):
    definitions.restricted(measured, (), (4,))
  with pytest.raises(UserInputError, match="--search_budget: a measured sweep"):
    definitions.searched(measured, 2)
  with pytest.raises(ValueError, match="strong or configured"):
    dataclasses.replace(SWEEP, search_budget=2)


def test_each_sweep_is_beside_its_experiment_and_imports_no_jax():
  # modes/host_devices.py reads a sweep's mode before jax starts.
  code = (
    "import json, sys, experiments\n"
    "modes = {n: experiments.sweep(n).mode for n in experiments.sweep_names()}\n"
    "assert 'jax' not in sys.modules, 'imported jax'\n"
    "print(json.dumps(sorted(modes)))"
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False
  )
  assert out.returncode == 0, out.stderr[-2000:]
  names = experiments.sweep_names()
  assert set(names) <= set(experiments.names())
  assert json.loads(out.stdout) == names
  with pytest.raises(UserInputError, match="no sweep is defined for 'moe'"):
    experiments.sweep("moe")
  # The sweeps' GPU counts (their points: runner.points).
  assert experiments.sweep("gpt3").counts == (
    *(2**k for k in range(3, 14)),
    10752,
    11616,
    16384,
  )
  assert experiments.sweep("mlperf_llama31_405b").counts == (256, 512, 1024, 2048, 4096, 8192)
  assert experiments.sweep("tiny").counts == (1, 2, 4, 8)


def test_a_results_file_with_the_old_duplicate_keys_still_resumes(swept, tmp_path, monkeypatch):
  # Older files carried `gpus` beside `devices` and `tokens_per_s_per_gpu` beside
  # `tokens_per_s_per_device` (equal values): read as the kept keys, every point is done.
  exp, out, records = swept
  lines = []
  for line in open(os.path.join(out, "results.jsonl")):
    record = json.loads(line)
    record["gpus"] = record["devices"]
    if "tokens_per_s_per_device" in record:
      record["tokens_per_s_per_gpu"] = record["tokens_per_s_per_device"]
    lines.append(json.dumps(record) + "\n")
  (tmp_path / "results.jsonl").write_text("".join(lines))
  calls = []
  monkeypatch.setattr(project, "project", lambda *a: calls.append(a))
  again = runner.run(exp, SWEEP, str(tmp_path), platform="cpu")
  assert calls == []
  assert again == results.read(out)
  assert not any("gpus" in r or "tokens_per_s_per_gpu" in r for r in again)


def test_projections_are_projected_point_records(swept):
  fields = {f.name for f in dataclasses.fields(points.ProjectedPoint)}
  labels = {
    "status",
    "reason",
    "sweep",
    "sweep_key",
    "sweep_config",
    "sweep_mode",
    "scaling",
    "time",
    "scaling_baseline_devices",
    "scaling_efficiency",
    "token_budget",
    "token_budget_label",
  }
  ran = [r for r in swept[2] if r["status"] in ("ok", "does_not_fit")]
  assert ran and all(set(r) - labels <= fields for r in ran)
  for r in ran:  # and back: the record type's JSON is the record
    projected = {k: v for k, v in r.items() if k in fields}
    assert points.to_json(points.ProjectedPoint(**projected)) == projected


def test_csv_agrees_with_jsonl(swept):
  _, out, _ = swept
  export.write_csv(out)
  with open(os.path.join(out, "results.csv"), newline="") as f:
    rows = list(csv.DictReader(f))
  records = results.read(out)
  assert len(rows) == len(records)
  for row, record in zip(rows, records):
    flat = export.flatten(record)
    assert set(flat) <= set(row)
    for key, value in flat.items():
      if isinstance(value, float):
        assert float(row[key]) == value, key
      else:
        assert row[key] == ("" if value is None else str(value)), key
    assert all(row[k] == "" for k in set(row) - set(flat))
  assert "breakdown.exposed_comm_s" in rows[1]


def test_plots_and_report_are_written(swept):
  _, out, records = swept
  written = plots.write_all(records, out)
  assert set(written) == {"scaling_efficiency", "time_to_train", "step_breakdown", "memory"}
  for path in written.values():
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000
  report = open(sweep_report.write(records, written, out)).read()
  for name in written:
    assert f"]({name}.png)" in report
  assert "4 of 6 points ran" in report and "2 cannot run" in report


@pytest.mark.parametrize("text", ["3", "2:2", "a:b", "0:9"])
def test_bad_profile_steps(text):
  with pytest.raises(UserInputError, match="--profile_steps"):
    hooks.parse_profile_steps(text, 5)


def _purple_pixels(path: str) -> int:
  """Pixels of matplotlib's tab:purple (#9467bd), the pipeline bubble's colour."""
  image = plt.imread(path)[..., :3]
  return int((abs(image - np.array([0x94, 0x67, 0xBD]) / 255).max(axis=-1) < 0.02).sum())


def test_breakdown_plot_stacks_a_pipeline_bubble(swept, tmp_path):
  records = [dict(r) for r in swept[2]]
  plain = plots.step_breakdown(records, str(tmp_path / "plain.png"))
  # As a pipelined experiment's projection records them: a bubble_s part of the step.
  for r in records:
    if "breakdown" in r:
      bubble = 0.25 * r["step_time_s"]
      r["breakdown"] = {
        **r["breakdown"],
        "bubble_s": bubble,
        "compute_s": r["breakdown"]["compute_s"] - bubble,
      }
  piped = plots.step_breakdown(records, str(tmp_path / "bubble.png"))
  assert _purple_pixels(plain) == 0 and _purple_pixels(piped) > 1000


@pytest.mark.parametrize(
  "model, hardware, gpus, published",
  [("gpt3-175b", "h100", 512, "49.8 min"), ("llama3.1-405b", "h100", 8192, "20.81 min")],
)
def test_findings_compare_with_the_published_score_of_the_model_swept(
  model, hardware, gpus, published
):
  # A projected point at a published (hardware, GPUs) is compared with that benchmark's
  # score, and only that benchmark's: a Llama sweep was once compared with GPT-3's.
  record = dict(
    status="ok",
    sweep_mode="project",
    scaling="configured",
    model=model,
    hardware=hardware,
    devices=gpus,
    time_to_train_min=30.0,
    mfu=0.5,
    mfu_fp8=0.25,
    scaling_efficiency=1.0,
    scaling_baseline_devices=gpus,
  )
  text = sweep_report.findings([record])
  assert f"against MLPerf's {published}" in text and text.count("against MLPerf's") == 1
  assert "from 25.0% fp8" in text  # an FP8 program's MFU against the FP8 peak
