"""The MLPerf Training DeepSeek-V3 671B benchmark as published (round v6.0): its definition,
the reference convergence points (RCPs) its scores are normalized to, NVIDIA's layout, and
the two published results used as calibration points.

Sources (summarised with their citations in docs/sources/mlperf-deepseek-v3-671b.md): the
reference implementation (github.com/mlcommons/training, llm_moe_pretraining/nemo: README
and pretraining script), the rules (github.com/mlcommons/training_policies,
training_rules.adoc), the compliance and RCP checkers (github.com/mlcommons/logging,
mlperf_logging/compliance_checker/training_6.0.0/closed_deepseekv3_671b.yaml,
mlperf_logging/rcp_checker/training_6.0.0/rcps_deepseekv3_671b.json), the submitters'
config scripts (github.com/mlcommons/training_results_v6.0, NVIDIA/benchmarks/
deepseekv3_671b/implementations/*/config_*_mxfp8_full_cg.sh) and the published results
(mlcommons.org/benchmarks/training, Training v6.0).

Only the two calibration points are here. The other published results (GB200 and GB300 at
256 to 8,192 GPUs) are a check set for the projections: nothing is fitted to them, and they
are not part of this data.
"""

import dataclasses
import math

SEQ_LEN = 4096  # C4 en 3.0.1 packed to 4,096 tokens (the compliance checker's value)
TARGET_LOG_PERPLEXITY = 3.6
# An evaluation after every step (on the clock), each on 1,024 validation sequences.
EVAL_EVERY_STEPS = 1
EVAL_SEQUENCES = 1_024

# The optimizer (training_policies' hyperparameter table and the reference script):
# AdamW, 4 warm-up steps, cosine decay over 11,996 steps.
BETA1, BETA2, EPS, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0
BASE_LEARNING_RATE, BASE_GLOBAL_BATCH = 2.4e-5, 16_384
WARMUP_STEPS, DECAY_STEPS = 4, 11_996
MIN_GLOBAL_BATCH = 15_360  # the rules' smallest allowed GBS

# The sequence balance loss's coefficient in the benchmark (the reference script fixes it;
# the DeepSeek-V3 report pre-trained with 1e-4) and the multi-token prediction loss scale
# (the recipe default, not overridden; one MTP module).
AUX_LOSS_COEF = 0.01
MTP_LAYERS, MTP_LOSS_SCALE = 1, 0.1


def learning_rate(global_batch: int) -> float:
  """Peak learning rate: 2.4e-5 x sqrt(GBS / 16,384) (square-root scaling)."""
  return BASE_LEARNING_RATE * math.sqrt(global_batch / BASE_GLOBAL_BATCH)


# Samples (sequences) at convergence of the six reference runs at each global batch
# (github.com/mlcommons/logging, mlperf_logging/rcp_checker/training_6.0.0/
# rcps_deepseekv3_671b.json, "Epochs to converge"; training_6.1.0's are the same runs; a
# run converges at an evaluation, here every step, so each is a whole number of steps).
# How a score is normalized to them (olympic means 725,760, 765,952 and 861,696; none
# pruned): experiments/_rcp.py.
RCP_SAMPLES: dict[int, tuple[int, ...]] = {
  15_360: (721_920,) * 3 + (737_280,) * 2 + (691_200,),
  16_384: (770_048,) * 3 + (786_432,) + (753_664,) * 2,
  18_432: (847_872,) + (866_304,) * 4 + (829_440,),
}


@dataclasses.dataclass(frozen=True)
class PublishedRun:
  """One published result and the layout it ran (the submitter's config script and result
  log). expert: EP, the experts split over that many GPUs of one NVL72 rack."""

  system: str
  hardware: str  # hardware/catalog.py name
  gpus: int
  global_batch: int
  tensor: int
  pipeline: int
  virtual_stages: int
  expert: int
  context: int
  micro_batch: int
  mlp_recompute: bool  # Megatron's recompute of the MLP's activations
  steps: int  # steps the median run took (one evaluation each)
  run_time_min: float  # its wall clock, from its result log
  score_min: float  # the published score: the median run, RCP-normalized
  mxfp8_head: bool = False  # the output head's matmuls in MXFP8 too (the GB300 configs)


ROUND = "v6.0"  # the round the benchmark and both calibration points are from


# The calibration points (MLPerf Training v6.0 results; NVIDIA's config_GB200_*_mxfp8 and
# CoreWeave's config_GB300_*_mxfp8 scripts in training_results_v6.0).
CALIBRATION = (
  PublishedRun(
    "NVIDIA tyche-hsg, GB200 NVL72",
    "gb200",
    512,
    15_360,
    tensor=2,
    pipeline=4,
    virtual_stages=4,
    expert=32,
    context=1,
    micro_batch=1,
    mlp_recompute=True,
    steps=48,
    run_time_min=27.61,
    score_min=27.61,
  ),
  PublishedRun(
    "CoreWeave, GB300 NVL72",
    "gb300",
    8_192,
    16_384,
    tensor=1,
    pipeline=4,
    virtual_stages=4,
    expert=32,
    context=1,
    micro_batch=1,
    mlp_recompute=False,
    steps=45,
    run_time_min=1.945,
    score_min=2.02,
    mxfp8_head=True,
  ),
)

# NVIDIA's pipeline layout "Et*4|(t*4|)*14tmL": 16 virtual stages, the first the embedding
# and 4 layers (the 3 dense ones among them), 14 of 4 layers, the last one layer, the MTP
# module and the loss.
PIPELINE_LAYOUT = "Et*4|(t*4|)*14tmL"
# NVIDIA's model FLOPs a sample (4,096 tokens), as its config counts them.
MODEL_TFLOP_PER_SAMPLE = 1_068
