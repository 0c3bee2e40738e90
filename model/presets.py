"""The named model sizes (`--set model=NAME`) and their published sources.

GPT-3 sizes are Table 2.1 of Brown et al. 2020, "Language Models are Few-Shot Learners"
(arXiv:2005.14165): layers, d_model, heads and head size, context 2048. Llama 3 sizes are
Table 3 of Meta's "The Llama 3 Herd of Models" (arXiv:2407.21783) and the params.json /
config.json Meta publishes with each model (huggingface.co/meta-llama,
github.com/meta-llama/llama-models): RMSNorm, rotary positions (theta 500,000, with Llama 3.1's
frequency scaling), SwiGLU, grouped-query attention with 8 key/value heads, no biases, a
128,256-token vocabulary. ModelConfig (model/config.py) says what each field means.
"""

from errors import UserInputError
from model.config import ModelConfig


def _gpt3(name: str, layers: int, d_model: int, heads: int, head_dim: int) -> ModelConfig:
  return ModelConfig(
    name=name,
    num_layers=layers,
    d_model=d_model,
    num_heads=heads,
    head_dim=head_dim,
    seq_len=2048,
    vocab_size=50257,
    compute_dtype="bfloat16",
  )


def _llama3(
  name: str,
  layers: int,
  d_model: int,
  heads: int,
  ffn_dim: int,
  tied: bool,
  rope_scale_factor: float,
) -> ModelConfig:
  return ModelConfig(
    name=name,
    num_layers=layers,
    d_model=d_model,
    num_heads=heads,
    head_dim=d_model // heads,
    num_kv_heads=8,
    ffn_dim=ffn_dim,
    seq_len=8192,
    vocab_size=128256,
    tie_embeddings=tied,
    compute_dtype="bfloat16",
    **LLAMA3_ARCHITECTURE,
    rope_scale_factor=rope_scale_factor,
  )


# What every Llama 3 size shares (Meta's params.json: norm_eps 1e-5, rope_theta 500000,
# use_scaled_rope; config.json rope_scaling: low_freq_factor 1, high_freq_factor 4,
# original_max_position_embeddings 8192). Pre-training runs at 8,192 tokens
# (arXiv:2407.21783, section 3.4).
LLAMA3_ARCHITECTURE = dict(
  norm="rmsnorm",
  norm_eps=1e-5,
  positions="rope",
  mlp="swiglu",
  use_bias=False,
  rope_theta=500000.0,
  rope_low_freq_factor=1.0,
  rope_high_freq_factor=4.0,
  rope_original_seq_len=8192,
)


# Mixtures of experts (model/moe.py). Shapes from each model's published config.json:
# Mixtral 8x7B (https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json;
# Jiang et al. 2024, arXiv:2401.04088): 8 experts, 2 a token, softmax router.
# Qwen3-30B-A3B (https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json): 128 experts
# of 768, 8 a token, top-k renormalised, 4 K/V heads of 128 (32 x 128 = 4,096 > d_model 2,048);
# Qwen3's q/k RMSNorm (2 x 128 scales a layer) is not modelled.
# DeepSeek-V3 (https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json;
# arXiv:2412.19437): 61 layers, the first 3 dense (FFN 18,432), 256 routed experts of 2,048
# and 1 shared, 8 a token, sigmoid scores with bias balancing (u = 1e-3) in 8 groups, 4 a
# token, scaled by 2.5, sequence balance loss 1e-4 (the MLPerf benchmark uses 0.01,
# experiments/moe.py); 129,280 tokens, untied; docs/sources/mlperf-deepseek-v3-671b.md.
# Multi-head latent attention (model/mla.py): 128 heads, q_lora_rank 1,536, kv_lora_rank 512,
# qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128.
_MOE_ARCHITECTURE = dict(
  norm="rmsnorm",
  positions="rope",
  mlp="swiglu",
  use_bias=False,
  tie_embeddings=False,
  compute_dtype="bfloat16",
)
MOE_PRESETS: dict[str, ModelConfig] = {
  "mixtral-8x7b": ModelConfig(
    name="mixtral-8x7b",
    num_layers=32,
    d_model=4096,
    num_heads=32,
    head_dim=128,
    num_kv_heads=8,
    ffn_dim=14336,
    seq_len=4096,
    vocab_size=32000,
    norm_eps=1e-5,
    rope_theta=1e6,
    num_experts=8,
    experts_per_token=2,
    **_MOE_ARCHITECTURE,
  ),
  "qwen3-30b-a3b": ModelConfig(
    name="qwen3-30b-a3b",
    num_layers=48,
    d_model=2048,
    num_heads=32,
    head_dim=128,
    num_kv_heads=4,
    ffn_dim=6144,
    moe_ffn_dim=768,
    seq_len=4096,
    vocab_size=151936,
    norm_eps=1e-6,
    rope_theta=1e6,
    num_experts=128,
    experts_per_token=8,
    **_MOE_ARCHITECTURE,
  ),
  "deepseek-v3-671b": ModelConfig(
    name="deepseek-v3-671b",
    num_layers=61,
    d_model=7168,
    num_heads=128,
    head_dim=128,
    ffn_dim=18432,
    moe_ffn_dim=2048,
    seq_len=4096,
    vocab_size=129280,
    norm_eps=1e-6,
    num_experts=256,
    experts_per_token=8,
    num_shared_experts=1,
    first_dense_layers=3,
    router_score="sigmoid",
    router_scale=2.5,
    router_bias_rate=1e-3,
    router_groups=8,
    router_topk_groups=4,
    aux_loss_coef=1e-4,
    kv_lora_rank=512,
    q_lora_rank=1536,
    rope_head_dim=64,
    **_MOE_ARCHITECTURE,
  ),
  # Test size: 3 layers (1 dense), 8 experts of 32, 2 a token and a shared one, in 4
  # groups of which a token's 2 best; latent attention with ranks 24 (q) and 16 (kv), 8
  # rotary dims and values of 8 (queries and keys 16). Values of 12 made XLA's GPU compiler
  # (jax 0.10.2) fail on the [16, 4 x 20] weight gradient ("Couldn't find output tile sizes").
  "moe-tiny": ModelConfig(
    name="moe-tiny",
    num_layers=3,
    d_model=32,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
    ffn_dim=64,
    moe_ffn_dim=32,
    seq_len=16,
    vocab_size=128,
    num_experts=8,
    experts_per_token=2,
    num_shared_experts=1,
    first_dense_layers=1,
    router_score="sigmoid",
    router_bias_rate=1e-3,
    router_groups=4,
    router_topk_groups=2,
    aux_loss_coef=1e-2,
    kv_lora_rank=16,
    q_lora_rank=24,
    rope_head_dim=8,
    v_head_dim=8,
    **{**_MOE_ARCHITECTURE, "compute_dtype": "float32"},
  ),
}


# Table 2.1 of the GPT-3 paper. Its 13B row says d_model 5140 with 40 heads of 128;
# 40 x 128 = 5120, the width every reimplementation (Megatron, NeMo) uses.
PRESETS: dict[str, ModelConfig] = {
  "tiny": ModelConfig(),
  "gpt3-125m": _gpt3("gpt3-125m", 12, 768, 12, 64),
  "gpt3-350m": _gpt3("gpt3-350m", 24, 1024, 16, 64),
  "gpt3-760m": _gpt3("gpt3-760m", 24, 1536, 16, 96),
  "gpt3-1.3b": _gpt3("gpt3-1.3b", 24, 2048, 24, 128),
  "gpt3-2.7b": _gpt3("gpt3-2.7b", 32, 2560, 32, 80),
  "gpt3-6.7b": _gpt3("gpt3-6.7b", 32, 4096, 32, 128),
  "gpt3-13b": _gpt3("gpt3-13b", 40, 5120, 40, 128),
  "gpt3-175b": _gpt3("gpt3-175b", 96, 12288, 96, 128),
  # Llama 3.1 (arXiv:2407.21783 Table 3; rope scale factor 8) and 3.2 (Meta's Llama 3.2
  # model cards and config.json: tied embeddings, rope scale factor 32).
  "llama3.1-8b": _llama3("llama3.1-8b", 32, 4096, 32, 14336, False, 8.0),
  "llama3.1-70b": _llama3("llama3.1-70b", 80, 8192, 64, 28672, False, 8.0),
  "llama3.1-405b": _llama3("llama3.1-405b", 126, 16384, 128, 53248, False, 8.0),
  "llama3.2-1b": _llama3("llama3.2-1b", 16, 2048, 32, 8192, True, 32.0),
  "llama3.2-3b": _llama3("llama3.2-3b", 28, 3072, 24, 8192, True, 32.0),
  # Llama 2 70B (Touvron et al. 2023, arXiv:2307.09288, Table 1: 70B with grouped-query
  # attention, context 4,096; Meta's params.json for Llama-2-70b: dim 8192, n_layers 80,
  # n_heads 64, n_kv_heads 8, ffn_dim_multiplier 1.3 and multiple_of 4096, which make the
  # SwiGLU width 28,672, norm_eps 1e-5, vocab 32,000, rope theta 10,000, no scaling):
  # 68.98 B parameters, the base model of MLPerf's LoRA benchmark
  # (experiments/mlperf_llama2_70b_lora.py runs it at the benchmark's 8,192 tokens).
  "llama2-70b": ModelConfig(
    name="llama2-70b",
    num_layers=80,
    d_model=8192,
    num_heads=64,
    head_dim=128,
    num_kv_heads=8,
    ffn_dim=28672,
    seq_len=4096,
    vocab_size=32000,
    tie_embeddings=False,
    compute_dtype="bfloat16",
    **{**LLAMA3_ARCHITECTURE, "rope_theta": 10000.0},
  ),
  # The Llama architecture at test size: 4 query heads sharing 2 K/V heads.
  "llama3-tiny": ModelConfig(
    name="llama3-tiny",
    num_kv_heads=2,
    ffn_dim=160,
    vocab_size=256,
    tie_embeddings=False,
    **LLAMA3_ARCHITECTURE,
    rope_scale_factor=8.0,
  ),
  **MOE_PRESETS,
}


def preset(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise UserInputError(f"model must be one of {', '.join(PRESETS)}, got {name!r}")
  return PRESETS[name]
