"""The mlperf_llama2_70b_lora experiment's sweep: the press claim's generations, each
point the benchmark's layout (experiments/mlperf_llama2_70b_lora.py for_target: the
calibration layouts at 8 and 1,024 GPUs, the v4.1 pair's TP 4, CP 2, GBS 64 elsewhere),
which reports its own time to train."""

from sweep.definitions import Sweep

# From one node to the largest calibration point; at 64 to 512 GPUs GBS 64 gives every
# replica (data = GPUs / 8) at least one sequence.
GPU_COUNTS = (8, 64, 128, 256, 512, 1024)

SWEEP = Sweep(
  mode="project",
  counts=GPU_COUNTS,
  hardware=("h100", "h200"),
  scalings=("configured",),
)
