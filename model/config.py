"""Model configuration: what a decoder of the GPT-3, Llama 3 or mixture-of-experts families is.

One decoder (model/gpt.py) serves all; the fields `norm`, `positions`, `mlp`,
`num_kv_heads`, `use_bias` say which of its parts a model uses, and their defaults are
GPT-3's. The named sizes, each with its published source, are in model/presets.py.
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
# Router scores of a mixture of experts (model/moe.py): softmax over the experts (Mixtral,
# Qwen3-MoE) or a sigmoid per expert (DeepSeek-V3).
ROUTER_SCORES = ("softmax", "sigmoid")
# How tokens reach their experts: capacity buffers resharded by the GSPMD partitioner (an
# all-to-all each way; model/moe.py).
MOE_DISPATCH = ("capacity", "allgather")


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
  # The output head's matmul block-scaled too, in block_scaling's format (NVIDIA's GB300
  # DeepSeek-V3 recipe runs an MXFP8 LM head); false: the head in the compute dtype.
  block_scaled_head: bool = False
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
  # Mixture of experts (model/moe.py); num_experts 0: every layer dense. Otherwise every
  # layer after the first `first_dense_layers` routes each token to experts_per_token of
  # num_experts SwiGLU experts of width moe_ffn_dim (0: ffn_dim), plus num_shared_experts
  # shared ones every token passes through.
  num_experts: int = 0
  experts_per_token: int = 2
  moe_ffn_dim: int = 0
  num_shared_experts: int = 0
  first_dense_layers: int = 0
  router_score: str = "softmax"  # one of ROUTER_SCORES
  # The k gates renormalised to sum to 1, then scaled (DeepSeek-V3's routed_scaling_factor).
  router_topk_norm: bool = True
  router_scale: float = 1.0
  # DeepSeek-V3's aux-loss-free balancing: the selection bias's step a train step (its u);
  # 0: no bias.
  router_bias_rate: float = 0.0
  # Group-limited routing: experts in router_groups groups, a token's experts from its
  # router_topk_groups best groups (1, 1: unlimited).
  router_groups: int = 1
  router_topk_groups: int = 1
  # The sequence-wise balance loss's coefficient (DeepSeek-V3's alpha; 0: none).
  aux_loss_coef: float = 0.0
  # Slots per expert = capacity_factor x k T / E per sequence; assignments beyond are
  # dropped. 0: dropless.
  capacity_factor: float = 0.0
  # Token dispatch and combine over `expert` (model/moe.py): capacity buffers moved by
  # all-to-alls, or the expert group's tokens all-gathered and outputs reduce-scattered.
  moe_dispatch: str = "capacity"  # one of MOE_DISPATCH
  # The routed experts kept whole and split over `expert` x `tensor`, each tensor rank
  # dispatching the slots of its 1 / tensor of the experts (Megatron's
  # expert_tensor_parallel_size 1); False: each expert's width split over `tensor` like
  # the MLP's, every tensor rank dispatching all of a micro-batch's slots (model/moe.py).
  experts_over_tensor: bool = False
  # Multi-head latent attention (model/mla.py; DeepSeek-V2/V3) when kv_lora_rank > 0: keys
  # and values from a latent of this rank, queries from one of q_lora_rank (0: a plain
  # projection), rope_head_dim rotary dims beside head_dim, values of v_head_dim (0: head_dim).
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  rope_head_dim: int = 64
  v_head_dim: int = 0
  # Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2): mtp_layers modules
  # in sequence after the last layer, module k (from 1) predicting the token k beyond the
  # next one from the previous module's output and the embedding of the token k - 1 beyond
  # it; their mean cross-entropy joins the loss times mtp_loss_scale (the MLPerf recipe's
  # 0.1). Each module is one block of the last layer's kind (model/gpt.py `mtp_logits`).
  mtp_layers: int = 0
  mtp_loss_scale: float = 0.1

  @property
  def mla(self) -> bool:
    return self.kv_lora_rank > 0

  @property
  def value_head_dim(self) -> int:
    """Value dims a head: v_head_dim with latent attention (0: head_dim), else head_dim."""
    return (self.v_head_dim or self.head_dim) if self.mla else self.head_dim

  @property
  def qk_head_dim(self) -> int:
    """Dims a query meets a key over: head_dim, plus the rotary ones with latent attention."""
    return self.head_dim + (self.rope_head_dim if self.mla else 0)

  @property
  def moe(self) -> bool:
    return self.num_experts > 0

  @property
  def expert_ffn_dim(self) -> int:
    return self.moe_ffn_dim or self.d_ff

  @property
  def shared_ffn_dim(self) -> int:
    """The shared experts as one SwiGLU MLP (the block's fc1/fc2) of this width."""
    return self.num_shared_experts * self.expert_ffn_dim

  @property
  def moe_layers(self) -> int:
    return self.num_layers - self.first_dense_layers if self.moe else 0

  @property
  def stacked_layers(self) -> int:
    """The layers of the main stack, the one a pipeline splits: a mixture of experts'
    routed layers (its dense first layers run before the pipeline), else every layer."""
    return self.moe_layers or self.num_layers

  def dense_prefix(self) -> "ModelConfig":
    """The first_dense_layers dense layers' configuration (a stack of their own)."""
    return dataclasses.replace(self, num_layers=self.first_dense_layers, num_experts=0)

  def routed_stack(self) -> "ModelConfig":
    """The routed layers' configuration (the main stack)."""
    return dataclasses.replace(self, num_layers=self.moe_layers, first_dense_layers=0)

  def mtp_stack(self) -> "ModelConfig":
    """The multi-token prediction modules' blocks: a stack of mtp_layers blocks like the
    last layer (routed in a mixture of experts)."""
    return dataclasses.replace(self, num_layers=self.mtp_layers, first_dense_layers=0, mtp_layers=0)

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
    if self.block_scaled_head and self.block_scaling == "none":
      raise UserInputError(
        "model.block_scaled_head = true needs model.block_scaling = mxfp8 or nvfp4"
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
    self._validate_moe()
    self._validate_mla()
    self._validate_mtp()

  def _validate_mtp(self) -> None:
    if self.mtp_layers < 0 or self.mtp_loss_scale < 0:
      raise UserInputError(
        "model.mtp_layers and model.mtp_loss_scale must be 0 or positive, got "
        f"{self.mtp_layers} and {self.mtp_loss_scale}"
      )
    if self.mtp_layers and self.mtp_layers >= self.seq_len:
      raise UserInputError(
        f"model.mtp_layers = {self.mtp_layers} must be below model.seq_len = {self.seq_len}"
      )
    if self.mtp_layers and self.fp8:
      raise UserInputError(
        "model.mtp_layers > 0 has no per-tensor FP8 path: set model.fp8=false "
        "(model.block_scaling=mxfp8 or nvfp4 is allowed)"
      )

  def _validate_mla(self) -> None:
    for field in ("kv_lora_rank", "q_lora_rank", "v_head_dim"):
      if getattr(self, field) < 0:
        raise UserInputError(f"model.{field} must be 0 or positive, got {getattr(self, field)}")
    if not self.mla:
      return
    if self.rope_head_dim < 2 or self.rope_head_dim % 2:
      raise UserInputError(
        f"model.rope_head_dim must be a positive even number, got {self.rope_head_dim}"
      )
    if self.positions != "rope" or self.norm != "rmsnorm" or self.use_bias:
      raise UserInputError(
        "model.kv_lora_rank > 0 (latent attention) needs model.positions=rope, "
        "model.norm=rmsnorm and model.use_bias=false"
      )
    if self.fp8 or self.sequence_parallel:
      raise UserInputError(
        "model.kv_lora_rank > 0 (latent attention) runs without per-tensor FP8 and without "
        "sequence parallelism: set model.fp8=false (model.block_scaling=mxfp8 or nvfp4 is "
        "allowed) and model.sequence_parallel=false"
      )

  def _validate_moe(self) -> None:
    for field in (
      "num_experts",
      "moe_ffn_dim",
      "num_shared_experts",
      "first_dense_layers",
      "router_bias_rate",
      "aux_loss_coef",
      "capacity_factor",
    ):
      if getattr(self, field) < 0:
        raise UserInputError(f"model.{field} must be 0 or positive, got {getattr(self, field)}")
    if not self.moe:
      return
    for field, allowed in (("router_score", ROUTER_SCORES), ("moe_dispatch", MOE_DISPATCH)):
      if getattr(self, field) not in allowed:
        raise UserInputError(
          f"model.{field} must be one of {', '.join(allowed)}, got {getattr(self, field)!r}"
        )
    if self.experts_over_tensor and self.moe_dispatch != "capacity":
      raise UserInputError(
        f"model.experts_over_tensor runs with model.moe_dispatch=capacity, got "
        f"{self.moe_dispatch!r}"
      )
    if not 1 <= self.experts_per_token <= self.num_experts:
      raise UserInputError(
        f"model.experts_per_token = {self.experts_per_token} must be between 1 and "
        f"model.num_experts = {self.num_experts}"
      )
    if self.first_dense_layers >= self.num_layers:
      raise UserInputError(
        f"model.first_dense_layers = {self.first_dense_layers} must be below "
        f"model.num_layers = {self.num_layers} (at least one routed layer)"
      )
    groups, top_groups = self.router_groups, self.router_topk_groups
    if groups < 1 or self.num_experts % groups:
      raise UserInputError(
        f"model.router_groups = {groups} must divide model.num_experts = {self.num_experts}"
      )
    if not 1 <= top_groups <= groups:
      raise UserInputError(
        f"model.router_topk_groups = {top_groups} must be between 1 and "
        f"model.router_groups = {groups}"
      )
    if top_groups * (self.num_experts // groups) < self.experts_per_token:
      raise UserInputError(
        f"model.router_topk_groups = {top_groups} groups of "
        f"{self.num_experts // groups} experts hold fewer than model.experts_per_token "
        f"= {self.experts_per_token}"
      )
    if not self.router_scale > 0:
      raise UserInputError(f"model.router_scale must be positive, got {self.router_scale}")
    # What model/moe.py builds: SwiGLU experts without biases, in the compute dtype or
    # block-scaled.
    if self.mlp != "swiglu" or self.use_bias:
      raise UserInputError(
        "model.num_experts > 0 needs model.mlp=swiglu and model.use_bias=false "
        "(the experts are SwiGLU without biases)"
      )
    if self.fp8:
      raise UserInputError(
        "model.fp8 = true: model.num_experts > 0 has no per-tensor FP8 path; set "
        "model.fp8=false, or model.block_scaling=mxfp8 or nvfp4 (--set precision=mxfp8)"
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
