"""The configurations benchmarks/gpu_check.py measures and projects, each on one device:
data."""

import dataclasses

# Every configuration runs on one device of the tiny experiment's mesh, synthetic tokens.
BASE_SETS = (
  "mesh.data=1",
  "mesh.fsdp=1",
  "mesh.tensor=1",
  "mesh.pipeline=1",
  "train.task=synthetic",
)


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  exercises: str  # the part of the cost model it loads
  gpu_sets: tuple[str, ...]  # --set overrides on one GPU
  dry_sets: tuple[str, ...]  # the same shape of run, tiny, for --dry_run on a CPU
  # Added to either after a failure, for one more try: cuDNN attention that does not
  # compile or run here falls back to XLA's, at a batch whose scores fit.
  fallback_sets: tuple[str, ...] = ()


# GPT-3 sizes: Brown et al. 2020 (model/presets.py). Each fits one 141 GB H200 with room
# to spare under JAX's default 75% preallocation: compiled deviceless for H200
# (projection/aot_compile.py compile_step) they take 43 (compute), 11 (memory), 53 (remat)
# and 42 GB (fp8) per device; the fallbacks 40 and 39 GB.
_XLA_ATTENTION = ("model.attention=xla", "train.global_batch=2")
CONFIGS = (
  Config(
    "compute",
    "matmul-bound: GPT-3 1.3B, bf16, cuDNN attention, 8 x 2048 tokens",
    ("model=gpt3-1.3b", "model.attention=cudnn", "train.global_batch=8"),
    ("model.d_model=128", "model.head_dim=32", "train.global_batch=8"),
    _XLA_ATTENTION,
  ),
  Config(
    "memory",
    "memory-bound-heavy: GPT-3 125M, attention scores through HBM (xla)",
    ("model=gpt3-125m", "train.global_batch=4"),
    ("model.seq_len=256", "train.global_batch=4"),
  ),
  Config(
    "remat",
    "remat full: GPT-3 2.7B, every layer's forward run twice",
    ("model=gpt3-2.7b", "remat=full", "train.global_batch=8"),
    ("remat=full", "model.num_layers=3", "train.global_batch=8"),
  ),
  Config(
    "fp8",
    "FP8 matmuls and their casts: GPT-3 1.3B, E4M3 / E5M2, current scaling",
    ("model=gpt3-1.3b", "model.attention=cudnn", "precision=fp8", "train.global_batch=8"),
    ("precision=fp8", "train.global_batch=8"),
    _XLA_ATTENTION,
  ),
  # DeepSeek-V3's layer shapes (d_model 7,168, latent attention, experts of 2,048, a shared
  # expert, sigmoid group-limited routing), cut to 3 layers (1 dense), 8 experts of which 4
  # a token and a 32K vocabulary so that its 2.2 B parameters and Adam state fit an H100.
  Config(
    "moe",
    "mixture of experts: DeepSeek-V3 layer shapes, 3 layers, 8 experts (4 a token) as "
    "capacity-buffer einsums, latent attention, cuDNN attention, 2 x 4096 tokens",
    (
      "model=deepseek-v3-671b",
      "model.num_layers=3",
      "model.first_dense_layers=1",
      "model.num_experts=8",
      "model.experts_per_token=4",
      "model.router_groups=4",
      "model.router_topk_groups=2",
      "model.vocab_size=32768",
      "model.capacity_factor=1",
      "model.attention=cudnn",
      "train.global_batch=2",
    ),
    ("model=moe-tiny", "model.capacity_factor=1", "train.global_batch=8"),
    ("model.attention=xla", "train.global_batch=1"),
  ),
  # Last, so the time budget drops it first. Llama 3.2 1B: Meta's shapes (model/presets.py).
  Config(
    "llama",
    "grouped-query attention, SwiGLU, a 128K vocabulary: Llama 3.2 1B, bf16, "
    "cuDNN attention, 4 x 4096 tokens",
    ("model=llama3.2-1b", "model.attention=cudnn", "model.seq_len=4096", "train.global_batch=4"),
    ("model=llama3-tiny", "train.global_batch=8"),
    ("model.attention=xla", "train.global_batch=1"),
  ),
)
CONFIG_NAMES = tuple(c.name for c in CONFIGS)
