"""The MLPerf Training GPT-3 175B benchmark as published: its definition, the steps its
published runs took to reach the target by global batch, and its published times.

Sources (summarised with their citations in docs/sources/mlperf-gpt3.md): the benchmark's
reference implementation and rules (github.com/mlcommons/training, retired_benchmarks/gpt3;
github.com/mlcommons/training_policies, training_rules.adoc) and the result logs of MLPerf
Training v3.1 (Nov 2023) and v4.1 (Nov 2024) (github.com/mlcommons/training_results_v3.1,
training_results_v4.1; mlcommons.org/benchmarks/training).
"""

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

# Published results: (round and system, hardware, GPUs, minutes to train).
RESULTS = (
  ("v3.1 NVIDIA Eos", "h100", 10752, 3.92),
  ("v3.1 Azure ND H100 v5", "h100", 10752, 4.01),
  ("v4.1 NVIDIA Eos", "h100", 512, 49.80),
)
