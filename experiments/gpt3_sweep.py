"""The gpt3 experiment's sweep: every generation from one HGX node to the published MLPerf
GPT-3 GPU counts, strong and weak scaling, time to train MLPerf's token budget."""

from hardware import catalog
from reference import mlperf_gpt3
from sweep.definitions import Sweep

# Powers of two from one HGX node up, plus the GPU counts of published MLPerf GPT-3 runs
# (reference/mlperf_gpt3.py).
GPU_COUNTS = tuple(sorted([2**k for k in range(3, 15)] + list(mlperf_gpt3.PUBLISHED_GPU_COUNTS)))

SWEEP = Sweep(
  mode="project",
  counts=GPU_COUNTS,
  hardware=tuple(catalog.names()),
  # 2 sequences per replica is MLPerf v3.1's global batch of 2,688 at 10,752 GPUs
  # (1,344 replicas of tensor 8); the strong series keeps the GPT-3 paper's 1,536.
  weak_sequences_per_replica=2,
  # Tokens the MLPerf GPT-3 175B benchmark trains to reach its target at global batch
  # 2,048: time to train is that budget over the throughput.
  token_budget=mlperf_gpt3.TOKENS_AT_2048,
  token_budget_label="1.21 B tokens (MLPerf GPT-3 175B at global batch 2,048)",
)
