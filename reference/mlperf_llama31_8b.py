"""The MLPerf Training Llama 3.1 8B pre-training benchmark (round v5.1 on): definition and the
reference convergence points (RCPs).

Sources (addresses in docs/sources/mlperf-llama31-8b.md): the reference implementation
(github.com/mlcommons/training, small_llm_pretraining/nemo: README.md and
config_H100_1x8x4_8b.sh) and the RCPs (github.com/mlcommons/logging,
mlperf_logging/rcp_checker/training_5.1.0/rcps_llama31_8b.json). No published result is
used here: the projections at 8 and 64 GPUs are not calibrated against this benchmark.
"""

SEQ_LEN = 8192
TARGET_LOG_PERPLEXITY = 3.3
EVAL_INTERVAL_SEQUENCES = 12_288  # an evaluation every 12,288 trained sequences
EVAL_SEQUENCES = 1_024  # the first 1,024 validation sequences, unshuffled

# The reference implementation's H100 configuration (config_H100_1x8x4_8b.sh): one node of
# 8, tensor parallelism 4, GBS 32, micro-batch 1, peak learning rate 5e-4, 16,384 / GBS
# warm-up steps.
REFERENCE_TENSOR, REFERENCE_GLOBAL_BATCH, REFERENCE_MICRO_BATCH = 4, 32, 1
REFERENCE_LEARNING_RATE = 5e-4
WARMUP_SEQUENCES = 16_384

# Samples to converge of the reference runs (20 a batch), by global batch, in the file's
# order (github.com/mlcommons/logging, mlperf_logging/rcp_checker/training_5.1.0/
# rcps_llama31_8b.json, "Epochs to converge"; training_6.0.0's and training_6.1.0's are the
# same runs). GBS 16 joined the file in October 2025 ("Add llama31_8b GBS16 RCPs"). How a
# score is normalized to them: experiments/_rcp.py.
RCP_SAMPLES: dict[int, tuple[int, ...]] = {
  16: (159744,) * 6 + (172032, 159744, 172032, 159744, 172032) + (159744,) * 9,
  32: (
    196608, 172032, 184320, 184320, 172032, 172032, 184320, 184320, 184320, 172032,
    172032, 172032, 184320, 184320, 184320, 172032, 172032, 172032, 184320, 184320,
  ),
  64: (
    233472, 208896, 208896, 233472, 233472, 233472, 233472, 233472, 208896, 233472,
    233472, 233472, 245760, 221184, 208896, 233472, 233472, 221184, 221184, 221184,
  ),
  96: (
    297216, 284832, 272448, 272448, 272448, 272448, 297216, 272448, 297216, 272448,
    297216, 260064, 272448, 272448, 272448, 284832, 260064, 284832, 284832, 272448,
  ),
  128: (
    368640, 344064, 356352, 344064, 368640, 368640, 405504, 344064, 331776, 307200,
    331776, 380928, 307200, 344064, 319488, 356352, 331776, 319488, 356352, 331776,
  ),
}  # fmt: skip
