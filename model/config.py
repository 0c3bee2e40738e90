"""Model configuration and the GPT-3 family's sizes.

Sizes are Table 2.1 of Brown et al. 2020, "Language Models are Few-Shot Learners"
(arXiv:2005.14165): layers, d_model, heads and head size, context 2048.
"""

import dataclasses
from typing import Literal

from errors import UserInputError

RematPolicy = Literal["none", "full", "save_dots", "elementwise"]
REMAT_POLICIES = ("none", "full", "save_dots", "elementwise")
DTYPES = ("float32", "bfloat16")
# xla: softmax attention as written (the [B, H, T, T] scores go through HBM); cudnn:
# cuDNN's fused flash attention (jax.nn.dot_product_attention), NVIDIA GPUs only - what
# the published GPT-3 runs use (Transformer Engine); for GPU runs and GPU projections.
ATTENTION = ("xla", "cudnn")


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

  @property
  def d_ff(self) -> int:
    return 4 * self.d_model

  @property
  def delayed_scaling(self) -> bool:
    return self.fp8 and self.fp8_amax_history > 0

  @property
  def padded_vocab(self) -> int:
    m = self.vocab_multiple
    return (self.vocab_size + m - 1) // m * m

  def validate(self) -> None:
    for field in ("num_layers", "d_model", "num_heads", "head_dim", "seq_len",
                  "vocab_size", "vocab_multiple"):
      if getattr(self, field) < 1:
        raise UserInputError(f"model.{field} must be a positive integer, got {getattr(self, field)}")
    if self.fp8_amax_history < 0:
      raise UserInputError("model.fp8_amax_history must be 0 (current scaling) or a positive "
                           f"number of steps, got {self.fp8_amax_history}")
    if self.remat not in REMAT_POLICIES:
      raise UserInputError(f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
    if self.attention not in ATTENTION:
      raise UserInputError(f"model.attention must be one of {', '.join(ATTENTION)}, "
                           f"got {self.attention!r}")
    for field in ("param_dtype", "compute_dtype"):
      if getattr(self, field) not in DTYPES:
        raise UserInputError(f"model.{field} must be one of {', '.join(DTYPES)}, got {getattr(self, field)!r}")


def _gpt3(name: str, layers: int, d_model: int, heads: int, head_dim: int) -> ModelConfig:
  return ModelConfig(name=name, num_layers=layers, d_model=d_model, num_heads=heads,
                     head_dim=head_dim, seq_len=2048, vocab_size=50257,
                     compute_dtype="bfloat16")


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
}


def preset(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise UserInputError(f"model must be one of {', '.join(PRESETS)}, got {name!r}")
  return PRESETS[name]
