"""The MLPerf DeepSeek-V3 671B benchmark as data: RCP means, the RCP-normalized score
reproduced from the published run times, the learning-rate rule, the evaluation every step
through the pipeline, and the published layouts as variants. Pure arithmetic on the
published numbers; pytest.approx's 1e-6 default only absorbs float rounding, except where
a published figure is rounded (the score to 3 significant digits: rel 5e-3).
"""

import numpy as np
import pytest

import experiments
from experiments import _rcp, overrides
from experiments import mlperf_deepseek_v3_671b as mlperf
from hardware import catalog
from parallelism.mesh import AXES
from projection import collective_timing, collectives, hlo, layout
from projection.plan import plan as plan_target
from reference import mlperf_deepseek_v3_671b as published

BENCH = mlperf.benchmark()


def test_rcp_means_are_the_checkers_olympic_means():
  """mlcommons/logging rcp_checker.py: each RCP's mean without its fastest and slowest run;
  none is pruned."""
  means = mlperf.benchmark().mean_samples_by_global_batch
  # 15,360: 691,200, 721,920 x 3, 737,280 x 2 -> (3 x 721,920 + 737,280) / 4 = 725,760
  # (the plain mean of all six: 721,920).
  assert _rcp.olympic_mean(published.RCP_SAMPLES[15_360]) == 725_760
  # 16,384: 753,664 x 2, 770,048 x 3, 786,432 -> (753,664 + 3 x 770,048) / 4 = 765,952
  # (plain: 767,317.33).
  assert _rcp.olympic_mean(published.RCP_SAMPLES[16_384]) == 765_952
  # 18,432: 829,440, 847,872, 866,304 x 4 -> (847,872 + 3 x 866,304) / 4 = 861,696
  # (plain: 857,088).
  assert _rcp.olympic_mean(published.RCP_SAMPLES[18_432]) == 861_696
  # 16,384 is under 15,360 to 18,432's 725,760 + 135,936 / 3 = 771,072: kept.
  assert means == {15_360: 725_760, 16_384: 765_952, 18_432: 861_696}


def test_published_scores_are_run_times_rcp_normalized():
  # GB200: 48 steps x 15,360 = 737,280 samples, past the mean: not scaled, 27.61. GB300: 45
  # x 16,384 = 737,280, scaled by 765,952 / 737,280: 1.945 x 1.03889 = 2.0206 (the plain
  # mean's 767,317.33 gave 2.0242); both 2.02 at the published 3 digits.
  for run in published.CALIBRATION:
    samples = run.steps * run.global_batch
    factor = max(1.0, BENCH.mean_samples(run.global_batch) / samples)
    assert run.run_time_min * factor == pytest.approx(run.score_min, rel=5e-3)
  assert round(1.945 * 765_952 / 737_280, 2) == 2.02


def test_costed_run_stops_at_the_rcp_mean():
  # An evaluation every step: the run costed is the last whole step at or below the mean.
  # 725,760 / 15,360 = 47.25 -> 47 steps (721,920 samples), scaled by 725,760 / 721,920
  # (the plain mean, 721,920, was exactly 47 steps and left it unscaled); 765,952 / 16,384
  # = 46.75 -> 46 steps (753,664), scaled by 765,952 / 753,664.
  assert BENCH.eval_interval_steps(15_360) == BENCH.eval_interval_steps(16_384) == 1
  assert BENCH.steps_to_converge(15_360) == 47
  assert BENCH.normalization(15_360) == pytest.approx(725_760 / 721_920)
  assert BENCH.steps_to_converge(16_384) == 46
  assert BENCH.normalization(16_384) == pytest.approx(765_952 / 753_664)
  assert BENCH.evaluations(16_384) == 46


def test_learning_rate_rule():
  assert published.learning_rate(16_384) == pytest.approx(2.4e-5)
  assert published.learning_rate(15_360) == pytest.approx(2.4e-5 * (15_360 / 16_384) ** 0.5)


def test_evaluation_runs_through_the_pipeline():
  # 8,192 GB300 as published: 2,048 replicas of PP 4 x VP 4, M = 8 micro-batches a step,
  # one evaluation micro-batch each: (1 x 4 + 3) / (8 x 4 + 3) of the step's trips.
  bench = mlperf.benchmark(2048, 4, 4)
  out = bench.estimate(10.0, 16_384, 0.3)
  assert out["eval_s_each"] == pytest.approx(10.0 * 0.3 * 7 / 35)
  assert out["time_to_train_min"] == pytest.approx(
    (46 * 10.0 + 46 * out["eval_s_each"]) * bench.normalization(16_384) / 60
  )
  # Without a pipeline the evaluation is its share of the batch's forward FLOPs.
  plain = mlperf.benchmark(64).estimate(10.0, 15_360, 0.3)
  assert plain["eval_s_each"] == pytest.approx(10.0 * 0.3 * 16 / 240)


def test_published_layouts_are_variants_by_gpu_count():
  exp = experiments.load("mlperf_deepseek_v3_671b")
  gb200 = experiments.at_target(exp, 512, "gb200")
  gb300 = experiments.at_target(exp, 8192, "gb300")
  # EP 32 = expert 16 x tensor 2 at GB200 (whole experts split over both).
  assert (gb200.mesh.tensor, gb200.mesh.pipeline, gb200.mesh.expert) == (2, 4, 16)
  assert gb200.model.experts_over_tensor and gb300.model.experts_over_tensor
  assert (gb300.mesh.tensor, gb300.mesh.pipeline, gb300.mesh.expert) == (1, 4, 32)
  assert (gb200.train.global_batch, gb300.train.global_batch) == (15_360, 16_384)
  assert gb200.train.virtual_stages == gb300.train.virtual_stages == 4
  assert gb200.train.pipeline_schedule == "1f1b"
  assert gb200.model.aux_loss_coef == published.AUX_LOSS_COEF
  assert (gb200.model.remat, gb300.model.remat) == ("elementwise", "none")
  assert gb200.model.attention == gb300.model.attention == "cudnn"
  assert gb200.model.block_scaling == gb300.model.block_scaling == "mxfp8"  # as NVIDIA's


def test_the_hgx_layout_keeps_each_expert_group_inside_a_node():
  exp = overrides.apply(experiments.load("mlperf_deepseek_v3_671b"), ["variant=hgx_ep8"])
  assert (exp.mesh.expert, exp.mesh.tensor, exp.mesh.pipeline) == (8, 1, 16)
  assert (exp.model.remat, exp.model.block_scaling, exp.train.virtual_stages) == ("full", "none", 1)
  assert exp.benchmark.replicas == 512 // 16 and exp.train.global_batch == 15_360
  reduced = plan_target(exp, catalog.get("h200"), 1024).reduced
  ids = np.arange(reduced.devices).reshape([reduced.sizes[a] for a in AXES])
  # Each expert group's 8 devices (the other axes fixed) are one node's NVLink domain.
  groups = tuple(map(tuple, np.moveaxis(ids, AXES.index("expert"), -1).reshape(-1, 8).tolist()))
  assert all(len(set(d)) == 1 for d in layout.target_group_domains(groups, reduced))


@pytest.mark.parametrize("hardware, gpus", [("gb200", 512), ("gb300", 8192)])
def test_expert_groups_sit_inside_one_nvl72_rack(hardware, gpus):
  # EP 32 (expert 16 x TP 2 at GB200, 32 at GB300) inside one rack, as published. With
  # pipeline the fastest node axis, a rack would hold the pipeline stages of a part of
  # each expert group, and every dispatch and combine all-to-all would cross InfiniBand
  # (docs/moe.md: in the width-split layout, 7.5 ms each on GB200 against 0.63 ms on
  # NVLink, 173.9 of the step's 177.5 s of exposed expert communication).
  exp = experiments.at_target(experiments.load("mlperf_deepseek_v3_671b"), gpus, hardware)
  hw = catalog.get(hardware)
  reduced = plan_target(exp, hw, gpus).reduced
  ids = np.arange(reduced.devices).reshape([reduced.sizes[a] for a in AXES])
  for axis in ("expert", "tensor"):
    size = reduced.sizes[axis]
    groups = tuple(map(tuple, np.moveaxis(ids, AXES.index(axis), -1).reshape(-1, size).tolist()))
    assert all(len(set(d)) == 1 for d in layout.target_group_domains(groups, reduced)), axis
    if axis == "expert":
      buffer = 256 * 128 * 7168 * 2
      a2a = hlo.Collective("a2a", "all-to-all", buffer, "bf16", groups)
      in_rack = collectives.collective_time_s("all-to-all", buffer, [0] * size, hw)
      assert collective_timing.collective_timer(reduced, hw)(a2a) == in_rack < 1e-3
