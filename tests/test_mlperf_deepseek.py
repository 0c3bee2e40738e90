"""The MLPerf DeepSeek-V3 671B benchmark as data: RCP means, the RCP-normalized score
reproduced from the published run times, the learning-rate rule, the evaluation every step
through the pipeline, and the published layouts as variants. Pure arithmetic on the
published numbers; pytest.approx's 1e-6 default only absorbs float rounding, except where
a published figure is rounded (the score to 3 significant digits: rel 5e-3).
"""

import numpy as np
import pytest

import experiments
from experiments import mlperf_deepseek_v3_671b as mlperf
from hardware import catalog
from parallelism.mesh import AXES
from projection import collective_timing, collectives, hlo, layout
from projection.plan import plan as plan_target
from reference import mlperf_deepseek_v3_671b as published

BENCH = mlperf.benchmark()


def test_rcp_means():
  means = published.rcp_mean_samples()
  assert means[15_360] == 721_920 == 47 * 15_360
  assert means[16_384] == pytest.approx(767_317.333)
  assert means[18_432] == pytest.approx((847_872 + 4 * 866_304 + 829_440) / 6)


def test_published_scores_are_run_times_rcp_normalized():
  for run in published.CALIBRATION:
    samples = run.steps * run.global_batch
    factor = max(1.0, BENCH.mean_samples(run.global_batch) / samples)
    assert run.run_time_min * factor == pytest.approx(run.score_min, rel=5e-3)


def test_costed_run_stops_at_the_rcp_mean():
  # An evaluation every step: the run costed is the last whole step at or below the mean.
  assert BENCH.eval_interval_steps(15_360) == BENCH.eval_interval_steps(16_384) == 1
  assert BENCH.steps_to_converge(15_360) == 47
  assert BENCH.steps_to_converge(16_384) == 46
  assert BENCH.normalization(16_384) == pytest.approx(767_317.333 / (46 * 16_384))
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
  assert (gb200.mesh.tensor, gb200.mesh.pipeline, gb200.mesh.expert) == (2, 4, 32)
  assert (gb300.mesh.tensor, gb300.mesh.pipeline, gb300.mesh.expert) == (1, 4, 32)
  assert (gb200.train.global_batch, gb300.train.global_batch) == (15_360, 16_384)
  assert gb200.train.virtual_stages == gb300.train.virtual_stages == 4
  assert gb200.train.pipeline_schedule == "1f1b"
  assert gb200.model.aux_loss_coef == published.AUX_LOSS_COEF
  assert (gb200.model.remat, gb300.model.remat) == ("save_dots", "none")
  assert gb200.model.attention == gb300.model.attention == "cudnn"
  assert gb200.model.block_scaling == gb300.model.block_scaling == "mxfp8"  # as NVIDIA's


@pytest.mark.parametrize("hardware, gpus", [("gb200", 512), ("gb300", 8192)])
def test_expert_groups_sit_inside_one_nvl72_rack(hardware, gpus):
  # EP 32 x TP 2 (GB200) or EP 32 (GB300) inside one rack's 64 GPUs, as published. When
  # devices were numbered with pipeline the fastest node axis, a rack held the 4 pipeline
  # stages of a quarter (GB200) or half (GB300) of each expert group, and every dispatch
  # and combine all-to-all (one micro-batch's [256, 128, 7,168] bf16 buffer, 23,112 a step
  # at 512 GB200) crossed InfiniBand: 7.5 ms each on GB200 against 0.63 ms on NVLink,
  # 173.9 of the step's 177.5 s of exposed expert communication.
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
