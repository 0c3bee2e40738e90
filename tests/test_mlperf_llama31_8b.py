"""The MLPerf Llama 3.1 8B benchmark as data (experiments/mlperf_llama31_8b.py): no compile."""

import pytest

import experiments
from reference import mlperf_llama31_8b as published


def test_rcp_means_and_the_evaluation_schedule():
  means = published.rcp_mean_samples()
  # The checker's output in the reference README: 178,858.67 at GBS 32 (fastest and
  # slowest of 20 runs dropped).
  assert means[32] == pytest.approx(178858.6667, abs=1e-3)
  exp = experiments.load("mlperf_llama31_8b")
  bench = exp.benchmark
  assert bench.mean_samples(48) == pytest.approx((means[32] + means[64]) / 2)
  # Every 12,288 sequences: 384 steps at GBS 32; 14 whole intervals before the mean.
  assert bench.eval_interval_steps(32) == 384
  assert bench.steps_to_converge(32) == 14 * 384 and bench.evaluations(32) == 14


def test_layouts_one_node_and_beyond():
  exp = experiments.load("mlperf_llama31_8b")
  one_node = experiments.at_target(exp, 8, "h100")
  assert (one_node.mesh.tensor, one_node.train.global_batch) == (4, 32)
  wide = experiments.at_target(exp, 256, "gb200")
  assert wide.train.global_batch == 64  # 64 replicas of tensor 4, one sequence each
