"""The MLPerf Llama 3.1 8B benchmark as data (experiments/mlperf_llama31_8b.py): no compile."""

import pytest

import experiments
from experiments import _rcp
from reference import mlperf_llama31_8b as published


def test_rcp_means_are_the_checkers_olympic_means_pruned():
  """mlcommons/logging rcp_checker.py: each RCP's mean without its fastest and slowest of
  20 runs; then the batches below the fastest-converging one dropped, and each inner RCP
  above the interpolation of its neighbours."""
  runs = published.RCP_SAMPLES
  # GBS 32: 172,032 x 9, 184,320 x 10, 196,608; one 172,032 and the 196,608 dropped:
  # (8 x 172,032 + 10 x 184,320) / 18 = 3,219,456 / 18 = 178,858.67, the checker's output
  # in the reference README.
  assert _rcp.olympic_mean(runs[32]) == pytest.approx(3_219_456 / 18) == 178_858.6667
  # GBS 16: 159,744 x 17, 172,032 x 3: (16 x 159,744 + 2 x 172,032) / 18 = 2,899,968 / 18.
  assert _rcp.olympic_mean(runs[16]) == pytest.approx(2_899_968 / 18) == 161_109.3333
  # GBS 64 (208,896 x 4, 221,184 x 4, 233,472 x 11, 245,760): 3 x 208,896 + 4 x 221,184 +
  # 11 x 233,472 = 4,079,616 over 18. GBS 128: 307,200 + 2 x 319,488 + 4 x 331,776 + 4 x
  # 344,064 + 3 x 356,352 + 3 x 368,640 + 380,928 = 6,205,440 over 18 (307,200 and 405,504
  # dropped). GBS 96: 260,064 + 10 x 272,448 + 4 x 284,832 + 3 x 297,216 = 5,015,520 over
  # 18 = 278,640.
  # None pruned: 16 converges fastest; 32 is under 16 to 64's 161,109.33 + 65,536 / 3 =
  # 182,954.67, 64 (226,645.33) under 32 to 96's (178,858.67 + 278,640) / 2 = 228,749.33,
  # 96 (278,640) under 64 to 128's (226,645.33 + 344,746.67) / 2 = 285,696.
  means = _rcp.checker_means(runs)
  assert sorted(means) == [16, 32, 64, 96, 128]
  assert means[64] == pytest.approx(4_079_616 / 18) and means[96] == 278_640
  assert means[128] == pytest.approx(6_205_440 / 18)


def test_rcp_means_and_the_evaluation_schedule():
  exp = experiments.load("mlperf_llama31_8b")
  bench = exp.benchmark
  # GBS 48: half way from 32 (178,858.67) to 64 (226,645.33).
  assert bench.mean_samples(48) == pytest.approx((3_219_456 + 4_079_616) / 36)
  # GBS 24: half way from 16 (161,109.33) to 32.
  assert bench.mean_samples(24) == pytest.approx((2_899_968 + 3_219_456) / 36)
  # Every 12,288 sequences: 384 steps at GBS 32; 14 whole intervals before the mean
  # (178,858.67 / 12,288 = 14.56).
  assert bench.eval_interval_steps(32) == 384
  assert bench.steps_to_converge(32) == 14 * 384 and bench.evaluations(32) == 14


def test_layouts_one_node_and_beyond():
  exp = experiments.load("mlperf_llama31_8b")
  one_node = experiments.at_target(exp, 8, "h100")
  assert (one_node.mesh.tensor, one_node.train.global_batch) == (4, 32)
  wide = experiments.at_target(exp, 256, "gb200")
  assert wide.train.global_batch == 64  # 64 replicas of tensor 4, one sequence each
