"""The mlperf_llama31_405b experiment's sweep: the generations MLPerf ran it on, each
target the published run or the generation's published layout and batch rule
(experiments/mlperf_llama31_405b.py for_target), which reports its own time to train."""

from reference import mlperf_llama31_405b
from sweep.definitions import Sweep

# From 256 GPUs (two replicas of H100's published TP 8 x PP 8 x CP 2) to 8,192 (the
# largest published run, reference/mlperf_llama31_405b.py).
GPU_COUNTS = tuple(2**k for k in range(8, 14))

SWEEP = Sweep(
  mode="project",
  counts=GPU_COUNTS,
  hardware=tuple(mlperf_llama31_405b.TENSOR_BY_HARDWARE),
  scalings=("configured",),
)
