"""Model configuration and the sizes of the GPT-3 and Llama 3 families.

One decoder (model/gpt.py) serves both; the fields `norm`, `positions`, `mlp`,
`num_kv_heads`, `use_bias` say which of its parts a model uses, and their defaults are
GPT-3's. GPT-3 sizes are Table 2.1 of Brown et al. 2020, "Language Models are Few-Shot
Learners" (arXiv:2005.14165): layers, d_model, heads and head size, context 2048.
Llama 3 sizes are Table 3 of Meta's "The Llama 3 Herd of Models" (arXiv:2407.21783)
and the params.json / config.json Meta publishes with each model (huggingface.co/meta-llama,
github.com/meta-llama/llama-models): RMSNorm, rotary positions (theta 500,000, with
Llama 3.1's frequency scaling), SwiGLU, grouped-query attention with 8 key/value heads,
no biases, a 128,256-token vocabulary.
"""

import dataclasses
import math
from typing import Literal

from errors import UserInputError

RematPolicy = Literal["none", "full", "save_dots", "elementwise"]
REMAT_POLICIES = ("none", "full", "save_dots", "elementwise")
DTYPES = ("float32", "bfloat16")
# xla: softmax attention as written (the [B, H, T, T] scores go through HBM); cudnn:
# cuDNN's fused flash attention (jax.nn.dot_product_attention), NVIDIA GPUs only - what
# the published GPT-3 runs use (Transformer Engine); for GPU runs and GPU projections.
ATTENTION = ("xla", "cudnn")
NORMS = ("layernorm", "rmsnorm")
# learned: a trained position table added to the token embedding (GPT); rope: rotary
# embeddings applied to queries and keys in every layer (Su et al. 2021, arXiv:2104.09864).
POSITIONS = ("learned", "rope")
# gelu: fc1 [D, F], GELU, fc2 [F, D] (GPT); swiglu: gate and up [D, 2, F], silu(gate) x up,
# down [F, D] (Shazeer 2020, arXiv:2002.05202; Llama).
MLPS = ("gelu", "swiglu")
# Block-scaled weight-matmul formats (model/block_scaled.py), or none.
BLOCK_SCALING = ("none", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  name: str = "tiny"
  num_layers: int = 2
  d_model: int = 64
  num_heads: int = 4
  head_dim: int = 16
  seq_len: int = 64
  vocab_size: int = 256
  # Megatron and nanoGPT pad the vocabulary so the embedding matmul tiles evenly.
  vocab_multiple: int = 128
  tie_embeddings: bool = True
  # none: keep every activation; full: keep only each layer's input; save_dots: keep
  # the outputs of weight matmuls, recompute the rest (attention scores included).
  remat: RematPolicy = "none"
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  attention: str = "xla"  # one of ATTENTION
  # Megatron-style sequence parallelism over the tensor axis: the residual stream
  # (LayerNorm, biases, residual adds) is sharded along the sequence (rules.py `act_seq`).
  sequence_parallel: bool = False
  # FP8 weight matmuls (QKV, attention output, MLP): E4M3 operands forward, E5M2
  # gradients backward, scaled per tensor (model/fp8.py).
  fp8: bool = False
  # With fp8: 0 scales activations and gradients by their own amax (current scaling);
  # N > 0 by the largest amax of the last N steps (delayed scaling, model/fp8.py).
  fp8_amax_history: int = 0
  # Blackwell's block-scaled weight matmuls instead: "mxfp8" (E4M3, a power-of-two scale
  # per 32 values) or "nvfp4" (E2M1, an E4M3 scale per 16 and one per tensor), forward
  # and backward (model/block_scaled.py); "none": the compute dtype (or fp8).
  block_scaling: str = "none"  # one of BLOCK_SCALING
  norm: str = "layernorm"  # one of NORMS
  norm_eps: float = 1e-5
  positions: str = "learned"  # one of POSITIONS
  mlp: str = "gelu"  # one of MLPS
  # Feed-forward width F; 0: 4 x d_model (GPT-3).
  ffn_dim: int = 0
  # Key/value heads; 0: as many as num_heads (multi-head attention, one fused QKV kernel).
  # Fewer: grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245), each K/V head
  # shared by num_heads / num_kv_heads query heads, with separate Q and KV kernels.
  num_kv_heads: int = 0
  # Biases on every matmul and on the norms (GPT); Llama has none.
  use_bias: bool = True
  # Rotary positions (positions = rope): the base of the frequencies, and Llama 3.1's
  # scaling of them (rope_scale_factor 1: none). Frequencies whose wavelength exceeds
  # rope_original_seq_len / rope_low_freq_factor are divided by the factor, those shorter
  # than rope_original_seq_len / rope_high_freq_factor kept, those between interpolated
  # (model/rope.py).
  rope_theta: float = 10000.0
  rope_scale_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_seq_len: int = 8192

  @property
  def d_ff(self) -> int:
    return self.ffn_dim or 4 * self.d_model

  @property
  def kv_heads(self) -> int:
    """Key/value heads (num_kv_heads, or num_heads when it is 0)."""
    return self.num_kv_heads or self.num_heads

  @property
  def grouped_query(self) -> bool:
    """Fewer K/V heads than query heads: separate Q and KV kernels (model/gpt.py)."""
    return self.kv_heads < self.num_heads

  @property
  def delayed_scaling(self) -> bool:
    return self.fp8 and self.fp8_amax_history > 0

  @property
  def padded_vocab(self) -> int:
    m = self.vocab_multiple
    return (self.vocab_size + m - 1) // m * m

  def validate(self) -> None:
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, float) and not math.isfinite(value):
        raise UserInputError(f"model.{field.name} must be a finite number, got {value}")
    for field in (
      "num_layers",
      "d_model",
      "num_heads",
      "head_dim",
      "seq_len",
      "vocab_size",
      "vocab_multiple",
    ):
      if getattr(self, field) < 1:
        raise UserInputError(
          f"model.{field} must be a positive integer, got {getattr(self, field)}"
        )
    for field in ("ffn_dim", "num_kv_heads"):
      if getattr(self, field) < 0:
        raise UserInputError(
          f"model.{field} must be 0 (the default) or a positive integer, got {getattr(self, field)}"
        )
    if self.num_heads % self.kv_heads:
      raise UserInputError(
        f"model.num_kv_heads = {self.num_kv_heads} must divide model.num_heads "
        f"= {self.num_heads} (each K/V head serves a group of query heads)"
      )
    for field, allowed in (("norm", NORMS), ("positions", POSITIONS), ("mlp", MLPS)):
      if getattr(self, field) not in allowed:
        raise UserInputError(
          f"model.{field} must be one of {', '.join(allowed)}, got {getattr(self, field)!r}"
        )
    if self.positions == "rope":
      if self.head_dim % 2:
        raise UserInputError(
          f"model.head_dim = {self.head_dim} must be even with rotary "
          "positions (they rotate pairs of entries)"
        )
      if not (
        self.rope_theta > 1
        and self.rope_scale_factor >= 1
        and self.rope_original_seq_len >= 1
        and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
      ):
        raise UserInputError(
          "model.rope_*: need rope_theta > 1, rope_scale_factor >= 1, "
          "rope_original_seq_len >= 1 and 0 < rope_low_freq_factor < "
          f"rope_high_freq_factor, got {self.rope_theta}, "
          f"{self.rope_scale_factor}, {self.rope_original_seq_len}, "
          f"{self.rope_low_freq_factor}, {self.rope_high_freq_factor}"
        )
    if not self.norm_eps > 0:
      raise UserInputError(f"model.norm_eps must be positive, got {self.norm_eps}")
    if self.fp8_amax_history < 0:
      raise UserInputError(
        "model.fp8_amax_history must be 0 (current scaling) or a positive "
        f"number of steps, got {self.fp8_amax_history}"
      )
    if self.block_scaling not in BLOCK_SCALING:
      raise UserInputError(
        f"model.block_scaling must be one of {', '.join(BLOCK_SCALING)}, got {self.block_scaling!r}"
      )
    if self.block_scaling != "none" and self.fp8:
      raise UserInputError(
        f"model.block_scaling = {self.block_scaling} replaces per-tensor FP8: set "
        "model.fp8=false (or --set precision=...)"
      )
    if self.remat not in REMAT_POLICIES:
      raise UserInputError(
        f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}"
      )
    if self.attention not in ATTENTION:
      raise UserInputError(
        f"model.attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}"
      )
    for field in ("param_dtype", "compute_dtype"):
      if getattr(self, field) not in DTYPES:
        raise UserInputError(
          f"model.{field} must be one of {', '.join(DTYPES)}, got {getattr(self, field)!r}"
        )

  def validate_context(self, context: int, tensor: int, pipeline: int) -> None:
    """The model on a mesh with `context` context-parallel ranks (parallelism/context.py)."""
    if context == 1:
      return
    if self.seq_len % (2 * context):
      raise UserInputError(
        f"model.seq_len = {self.seq_len} does not split into 2 x mesh.context "
        f"= {2 * context} equal chunks (causal load balance); use a multiple "
        f"of {2 * context}"
      )
    if self.sequence_parallel and (self.seq_len // context) % tensor:
      raise UserInputError(
        f"model.seq_len = {self.seq_len}: a context rank's {self.seq_len // context} "
        f"tokens do not divide over mesh.tensor = {tensor} "
        "(model.sequence_parallel)"
      )


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
}


def preset(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise UserInputError(f"model must be one of {', '.join(PRESETS)}, got {name!r}")
  return PRESETS[name]
