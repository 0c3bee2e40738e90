"""The MLPerf Training Llama 3.1 405B benchmark as published (rounds v5.0, v5.1 and v6.0): its
definition, the reference convergence points (RCPs) its scores are normalized to, and the
published results used as calibration points.

Sources (summarised with their citations in docs/sources/mlperf-llama31-405b.md): the
reference implementation (github.com/mlcommons/training,
large_language_model_pretraining/nemo/README.md), the rules (github.com/mlcommons/
training_policies, training_rules.adoc, the Llama 3.1 405B hyperparameter table), the
compliance and RCP checkers (github.com/mlcommons/logging, mlperf_logging/
compliance_checker/training_5.0.0, 5.1.0 and 6.0.0 closed_llama31_405b.yaml, mlperf_logging/
rcp_checker/training_5.0.0, 5.1.0 and 6.0.0 rcps_llama31_405b.json) and the submitters'
result logs (github.com/mlcommons/training_results_v5.0, training_results_v5.1).

v6.0 changed nothing of the benchmark's: its compliance file and its RCP file are v5.1's
line for line, and training_rules.adoc gives v6.0 the v5.1 evaluation schedule and
hyperparameter table. (training_6.1.0 has no llama31_405b files.)

Only the two calibration points are here. The other published results (H100 ... GB300 at
256 to 5,120 GPUs) are a check set for the projections: nothing is fitted to them, and
they are not part of this data.
"""

import dataclasses
import math

SEQ_LEN = 8192  # the compliance checker enforces it
# The Mixtral 8x22B tokenizer's vocabulary (huggingface.co/mistralai/Mixtral-8x22B-v0.1,
# config.json vocab_size), which the benchmark uses in place of Llama's 128,256 tokens.
VOCAB_SIZE = 32_768
TARGET_LOG_PERPLEXITY = 5.6
# Each evaluation: 5,760 sequences (47,185,920 tokens) of the validation set, unshuffled.
EVAL_SEQUENCES = 5_760
# An evaluation after this many trained sequences, by round (github.com/mlcommons/
# training_policies, training_rules.adoc, the evaluation frequency table).
EVAL_INTERVAL_SEQUENCES = {"v5.0": 46_080, "v5.1": 18_432, "v6.0": 18_432}
# v5.1 and v6.0 skip the first floor(0.0026 x GBS + 12) evaluations; held as 12 +
# floor(26 x GBS / 10,000), which is the same number in integer arithmetic.
EVAL_SKIP_BASE = {"v5.0": 0, "v5.1": 12, "v6.0": 12}
EVAL_SKIP_PER_10K_SEQUENCES = {"v5.0": 0, "v5.1": 26, "v6.0": 26}

# The optimizer (training_policies' hyperparameter table): AdamW, cosine decay.
BETA1, BETA2, EPS, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 1e-5, 0.1, 1.0
BASE_LEARNING_RATE, BASE_GLOBAL_BATCH = 8e-5, 1152
END_LEARNING_RATE = 8e-7
BASE_WARMUP_STEPS = 8000
# The reference README's scheduler length at GBS 1,152 (its "maximum number of steps").
BASE_DECAY_STEPS = 1_200_000


def learning_rate(global_batch: int) -> float:
  """Peak learning rate: 8e-5 x GBS / 1152 (linear in the batch). The rules' table lists
  GBS 1,152 to 9,216 and asks for new RCPs outside it; the RCP checker still scores a
  smaller batch against the smallest RCP, and published runs use batches down to 448."""
  return BASE_LEARNING_RATE * global_batch / BASE_GLOBAL_BATCH


def warmup_steps(global_batch: int) -> int:
  """ceil(8000 x 1152 / GBS) steps: the same warm-up in sequences at every batch."""
  return math.ceil(BASE_WARMUP_STEPS * BASE_GLOBAL_BATCH / global_batch)


def decay_steps(global_batch: int) -> int:
  """The cosine's length, scaled with the batch as the warm-up is."""
  return math.ceil(BASE_DECAY_STEPS * BASE_GLOBAL_BATCH / global_batch)


# Samples (sequences) at convergence of each reference run, by round and global batch
# (github.com/mlcommons/logging, mlperf_logging/rcp_checker/training_<round>/
# rcps_llama31_405b.json, "Epochs to converge"; a run converges at an evaluation, so each
# is a whole number of evaluation intervals). How a score is normalized to them:
# experiments/_rcp.py.
_V51_RCP_SAMPLES = {
  1152: (313_344,) * 4 + (331_776, 294_912),
  2304: (368_640,) * 4 + (350_208, 387_072),
  4608: (497_664,) * 4 + (460_800, 479_232),
}
RCP_SAMPLES: dict[str, dict[int, tuple[int, ...]]] = {
  "v5.0": {
    1008: (324_576,) * 6,
    1152: (322_560,) * 6,
    2304: (368_640,) * 4 + (414_720,) * 2,
    4608: (460_800,) * 2 + (506_880,) * 4,
    6912: (580_608,) * 3 + (628_992,) * 3,
    9216: (645_120,) * 2 + (691_200,) * 2 + (737_280,) * 2,
  },
  "v5.1": _V51_RCP_SAMPLES,
  # training_6.0.0's file: the same runs as training_5.1.0's ("Reference RCPs after 5.0
  # submission", 288 DGX H100, BF16).
  "v6.0": _V51_RCP_SAMPLES,
}


@dataclasses.dataclass(frozen=True)
class PublishedRun:
  """One published result and the configuration it ran (the submitter's config script
  and result log)."""

  round_name: str
  system: str
  hardware: str  # hardware/catalog.py name
  gpus: int
  global_batch: int
  tensor: int
  pipeline: int
  virtual_stages: int
  context: int
  micro_batch: int
  precision: str
  steps: int  # steps the run took (whole evaluation intervals)
  run_time_min: float  # its wall clock, from its result log
  score_min: float  # the published score: the median run, RCP-normalized


# The calibration points.
CALIBRATION = (
  PublishedRun(
    "v5.0",
    "NVIDIA Eos-dfw, DGX H100 (1,024 nodes)",
    "h100",
    8192,
    1536,
    8,
    8,
    8,
    2,
    1,
    "fp8",
    210,
    19.64,
    20.81,
  ),
  PublishedRun(
    "v5.0",
    "IBM + CoreWeave + NVIDIA Carina, GB200 NVL72",
    "gb200",
    2496,
    1248,
    4,
    8,
    8,
    2,
    1,
    "fp8",
    259,
    26.99,
    27.33,
  ),
)


# How every published run is laid out (NVIDIA NeMo / Megatron-Core config scripts in
# mlcommons/training_results_v5.0 and v5.1): micro-batch 1, context 2, pipeline 8 with 8
# virtual stages, and tensor parallelism by generation.
MICRO_BATCH, CONTEXT, PIPELINE, VIRTUAL_STAGES = 1, 2, 8, 8
TENSOR_BY_HARDWARE = {"h100": 8, "h200": 4, "b200": 4, "gb200": 4, "gb300": 2}
