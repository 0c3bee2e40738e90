"""The MLPerf Training GPT-3 175B benchmark as published: its definition and optimizer
rules, the steps its published runs took to reach the target by global batch, and its
published runs with their configurations and times. Every published fact of the
benchmark that the code uses is here (experiments/mlperf_gpt3_175b.py builds the
experiment from them; sweep/, report/ and benchmarks/mlperf.py read them).

Sources (summarised with their citations in docs/sources/mlperf-gpt3.md): the benchmark's
reference implementation and rules (github.com/mlcommons/training, retired_benchmarks/gpt3;
github.com/mlcommons/training_policies, training_rules.adoc) and the result logs of MLPerf
Training v3.1 (Nov 2023) and v4.1 (Nov 2024) (github.com/mlcommons/training_results_v3.1,
training_results_v4.1; mlcommons.org/benchmarks/training).
"""

import dataclasses
import math

SEQ_LEN = 2048
# Evaluation every 24,576 sequences (50,331,648 tokens): the benchmark's definition.
EVAL_INTERVAL_SEQUENCES = 24_576
# The validation set: 5,662 sequences of 2,048 tokens. NVIDIA's v4.1 NeMo configuration
# limits a run's validation to ceil(5662 / GBS) batches, i.e. the whole set
# (training_results_v4.1, NVIDIA/benchmarks/gpt3/implementations/eos_n32_ngc24.09_nemo/
# conf/custom.yaml, limit_val_batches).
EVAL_SEQUENCES = 5_662

# Steps at run stop by global batch (sequences), tallied from the published result logs
# (train_samples at run_stop). Where the logs give a range, its midpoint rounded down to a
# whole evaluation interval (a run stops at an evaluation): 1536 368-400 -> 384; 3072
# 192-216 -> 200; 4096 150-162 -> 156; 6144 112-116 -> 112. 2048 "usually 288", 2688 220
# and 2904 207 as published (each a whole number of intervals: 24 x 12, 22 x 10, 23 x 9).
STEPS_TO_CONVERGE = {1536: 384, 2048: 288, 2688: 220, 2904: 207, 3072: 200, 4096: 156, 6144: 112}

# Tokens to the target at global batch 2,048 (288 steps x 2,048 sequences x 2,048 tokens).
TOKENS_AT_2048 = 2048 * STEPS_TO_CONVERGE[2048] * SEQ_LEN

# The optimizer rules: Adam 0.9 / 0.95, eps 1e-8, weight decay 0.1, clip 1.0; warm-up
# ceil(265 x 1536 / GBS) steps, cosine decay to 10% of the base rate at
# ceil(108600 x 1536 / GBS) steps.
BETA1, BETA2, EPS, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0
BASE_GLOBAL_BATCH, BASE_WARMUP_STEPS, BASE_DECAY_STEPS = 1536, 265, 108600
MIN_LR_RATIO = 0.1


def learning_rate(global_batch: int) -> float:
  """2e-5 for global batch 1,536-3,072, 3e-5 for 4,096-8,192 (NVIDIA's v4.1 NeMo
  configuration, conf/custom.yaml, switches at 3,600; used for batches between)."""
  return 2e-5 if global_batch < 3600 else 3e-5


def warmup_steps(global_batch: int) -> int:
  return math.ceil(BASE_WARMUP_STEPS * BASE_GLOBAL_BATCH / global_batch)


def decay_steps(global_batch: int) -> int:
  return math.ceil(BASE_DECAY_STEPS * BASE_GLOBAL_BATCH / global_batch)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
  """One published H100 result and the configuration it ran (its result log and NVIDIA's
  NeMo configuration): an interleaved 1F1B pipeline, data parallelism over the rest."""

  round_name: str
  system: str
  hardware: str  # hardware/catalog.py name
  gpus: int
  tensor: int
  pipeline: int
  virtual_stages: int
  micro_batch: int
  global_batch: int
  minutes: float  # the published time to train

  @property
  def label(self) -> str:
    return f"{self.round_name} {self.system}"


# The calibration points: the published runs whose configurations are published.
PUBLISHED = {
  "eos_10752": PublishedRun("v3.1", "NVIDIA Eos", "h100", 10752, 4, 8, 12, 1, 2688, 3.92),
  "eos_512": PublishedRun("v4.1", "NVIDIA Eos", "h100", 512, 4, 8, 6, 2, 2048, 49.80),
}


def _result(run: PublishedRun) -> tuple[str, str, int, float]:
  return (run.label, run.hardware, run.gpus, run.minutes)


# Published results: (round and system, hardware, GPUs, minutes to train).
RESULTS = (
  _result(PUBLISHED["eos_10752"]),
  ("v3.1 Azure ND H100 v5", "h100", 10752, 4.01),  # its configuration is not published
  _result(PUBLISHED["eos_512"]),
)

# GPU counts of published runs: v3.1's 10,752 H100 and NVIDIA's v4.0 submission on
# 11,616 H100 (June 2024; mlcommons/training_results_v4.0).
PUBLISHED_GPU_COUNTS = (10752, 11616)
