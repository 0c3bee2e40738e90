"""The MLPerf Training Llama 2 70B LoRA benchmark as published (rounds v4.0 on): its
definition, the reference convergence points (RCPs), the two published runs of the "512
H200, 28% over H100" claim and the calibration points.

Sources (with their addresses in docs/sources/mlperf-llama2-70b-lora.md): the reference
implementation (github.com/mlcommons/training, llama2_70b_lora), the rules
(github.com/mlcommons/training_policies, training_rules.adoc), the RCP and compliance
checkers (github.com/mlcommons/logging, mlperf_logging/rcp_checker/training_4.0.0 ..
rcps_llama2_70b_lora.json, compliance_checker closed_llama2_70b_lora.yaml) and the
results repositories (github.com/mlcommons/training_results_v4.0 .. v5.1).

Other published results (8 to 576 GPUs) are a check set: nothing is fitted to them and
they are not part of this data.
"""

import dataclasses

SEQ_LEN = 8192  # GovReport sequences as MLCommons preprocessed them
TRAIN_SEQUENCES, EVAL_SEQUENCES = 3_901, 173
TARGET_EVAL_LOSS = 0.925
EVAL_INTERVAL_SEQUENCES = 384  # an evaluation every 384 trained sequences, on all 173
# The first floor(0.125 x GBS + 2) evaluations may be skipped: 2 + floor(1250 x GBS /
# 10,000) in integer arithmetic.
EVAL_SKIP_BASE, EVAL_SKIP_PER_10K_SEQUENCES = 2, 1250
# Fixed by the rules: LoRA rank 16, alpha 32, dropout 0.1 on the fused QKV and the
# attention output; weight decay 1e-4; gradient clip 0.3.
LORA_RANK, LORA_ALPHA, LORA_DROPOUT = 16, 32.0, 0.1
WEIGHT_DECAY, GRAD_CLIP = 1e-4, 0.3

# Samples (sequences) to converge of the reference runs (20 a batch), by global batch, in
# the file's order (github.com/mlcommons/logging, mlperf_logging/rcp_checker/training_4.1.0/
# rcps_llama2_70b_lora.json, "samples to converge"; training_4.0.0's to training_6.1.0's
# are the same runs). The RCPs are in samples, not epochs, as the checker reads this
# benchmark's. How a score is normalized to them (olympic means 3,178.67, 4,032, 6,037.33
# and 11,264; GBS 32 pruned): experiments/_rcp.py.
RCP_SAMPLES: dict[int, tuple[int, ...]] = {
  8: (
    3072, 2688, 3456, 3072, 3072, 3072, 3456, 3456, 3072, 2688,
    3456, 3072, 3072, 3072, 3840, 3456, 2688, 3072, 3456, 3456,
  ),
  16: (
    3840, 3840, 4224, 3840, 3840, 3840, 4608, 3840, 4608, 3840,
    4992, 3840, 3840, 3840, 4992, 3840, 3840, 4224, 3840, 3456,
  ),
  32: (
    5760, 6528, 6144, 6528, 5376, 6528, 5760, 6144, 6144, 6528,
    6144, 6144, 6144, 5760, 5760, 5760, 5760, 5760, 6144, 5760,
  ),
  128: (
    11520, 13056, 10752, 12672, 12288, 11136, 10752, 13056, 10752, 9984,
    11136, 11136, 11136, 10752, 11520, 11136, 11136, 10752, 11136, 9984,
  ),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PublishedRun:
  round_name: str
  system: str
  hardware: str
  gpus: int
  global_batch: int
  tensor: int
  context: int
  learning_rate: float
  score_min: float
  # The median run's samples at stop and evaluations (None where not taken from its log).
  samples_at_stop: int | None = None
  evaluations: float | None = None


# The press claim's pair (MLPerf Training v4.1, container 24.09 both, PP 1).
AZURE_H200_512 = PublishedRun(
  "v4.1", "Azure ND H200 v5", "h200", 512, 64, 4, 2, 5e-4, 1.6085, 7_296, 9.5
)
ORACLE_H100_512 = PublishedRun(
  "v4.1", "Oracle BM.GPU.H100.8", "h100", 512, 64, 4, 2, 3.5e-4, 2.0649, 8_832, 19
)
# Calibration points (NVIDIA Eos, v4.1); learning rates not used here.
CALIBRATION = (
  PublishedRun("v4.1", "NVIDIA Eos DGX H100", "h100", 8, 8, 4, 1, 0.0, 27.93),
  PublishedRun("v4.1", "NVIDIA Eos, 128 nodes", "h100", 1024, 128, 4, 2, 0.0, 1.1875),
)
