"""Parameter counts and model FLOPs, from the configuration alone.

Model FLOPs per token of a training step (forward + backward, no recomputation):

    6 * N_matmul  +  6 * L * T * H * K

N_matmul counts the weights that take part in a matmul: per layer

    D * (H + 2G) * K      the Q, K and V projections (G = H without grouped-query
                          attention: 3 * D * H * K)
    H * K * D             the attention output projection
    m * D * F             the MLP: m = 2 for GELU (fc1, fc2), 3 for SwiGLU (gate, up, down)

(12 * D^2 for GPT-3, with K * H = D and F = 4D), plus the V x D output projection, which
is the token embedding when tied (the input embedding is a lookup, no matmul). Each
weight costs 2 FLOPs per token forward and 4 backward: 6N (Kaplan et al. 2020,
arXiv:2001.08361, section 2.1).

The attention term: per layer and token, Q.K^T and probs.V each take 2 * T * H * K
FLOPs forward over the full T x T square, 4 * T * H * K in all, times 3 for
forward + backward = 12 * T * H * K. Causal attention only needs the lower triangle,
so it is counted once (half the square): 6 * L * T * H * K. Grouped-query attention
shares K and V between query heads but every query head still scores every key, so
the term counts H, not G. NVIDIA's NeMo and Megatron-LM count the full square, which
makes their GPT-3 175B figure about 1.4% larger than this one.

Llama 3.1 405B at T = 8,192 (D 16,384, L 126, H 128, G 8, K 128, F 53,248, V 128,256):
N_matmul = 403.8e9 (of the 405.9e9 parameters, less the 2.1e9 input embedding and the
norms), 6N = 2.42e12, attention 6LTHK = 0.10e12, 2.52e12 FLOPs per token.

Mixtures of experts (model/moe.py) count active weights: a routed layer's MLP term is

    D * E                 the router
    3 * D * S             the shared experts (S = num_shared_experts x Fe)
    k * 3 * D * Fe        the k routed experts a token goes through

and its parameters hold all E experts (3 * D * Fe each) and the router's bias [E]. The
first_dense_layers layers count as dense ones. DeepSeek-V3 671B with full multi-head attention
standing in for its MLA (model/presets.py): 688.3e9 parameters, 37.9e9 active matmul weights
(docs/moe.md has the figures against the published 671e9 and 37e9).

Recomputation (remat) is not model FLOPs: MFU deliberately ignores it. Rotary
positions, norms and SwiGLU's product are elementwise, not counted.
"""

from model import lora, moe
from model.config import ModelConfig


def _mlp_matrices(cfg: ModelConfig) -> int:
  """D x F matrices of the MLP: fc1 and fc2 (GELU), gate, up and down (SwiGLU)."""
  return 3 if cfg.mlp == "swiglu" else 2


def _stacks(cfg: ModelConfig) -> list[ModelConfig]:
  """The model's layer stacks, each a configuration whose num_layers is its depth: a MoE
  model's dense first layers and its routed layers; a dense model's one stack."""
  if cfg.moe and cfg.first_dense_layers:
    return [cfg.dense_prefix(), cfg.routed_stack()]
  return [cfg]


def _ffn(cfg: ModelConfig) -> int:
  """The block's own MLP width: the shared experts' in a routed layer."""
  return cfg.shared_ffn_dim if cfg.moe else cfg.d_ff


def param_count(cfg: ModelConfig) -> int:
  """Every parameter, embeddings, norms and biases included (model/gpt.py's shapes)."""
  D, V = cfg.d_model, cfg.padded_vocab
  norm = D * (2 if cfg.use_bias and cfg.norm == "layernorm" else 1)
  positions = cfg.seq_len * D if cfg.positions == "learned" else 0
  embeddings = V * D + positions + (0 if cfg.tie_embeddings else D * V)
  return (
    sum(s.num_layers * _layer_param_count(s) for s in _stacks(cfg))
    + embeddings
    + norm
    + mtp_param_count(cfg)
  )


def mtp_param_count(cfg: ModelConfig) -> int:
  """The multi-token prediction modules' own parameters (model/gpt.py): each a block,
  the [2D, D] projection and three norm scales; the embedding and head are shared."""
  if not cfg.mtp_layers:
    return 0
  D = cfg.d_model
  return cfg.mtp_layers * (_layer_param_count(cfg.mtp_stack()) + 2 * D * D + 3 * D)


def routed_expert_param_count(cfg: ModelConfig) -> int:
  """The routed experts' weights, all E of every routed layer (3 * D * Fe each): the part
  of param_count split over mesh.expert (model/moe.py); 0 for a dense model."""
  return cfg.moe_layers * cfg.num_experts * 3 * cfg.d_model * cfg.expert_ffn_dim


def _layer_param_count(cfg: ModelConfig) -> int:
  D, H, K, F = cfg.d_model, cfg.num_heads, cfg.head_dim, _ffn(cfg)
  qkv_heads = H + 2 * cfg.kv_heads
  m = _mlp_matrices(cfg)
  # A norm has a scale [D], and a LayerNorm with biases a shift [D] too.
  norm = D * (2 if cfg.use_bias and cfg.norm == "layernorm" else 1)
  biases = (qkv_heads * K + D + (m - 1) * F + D) if cfg.use_bias else 0
  per_layer = 2 * norm + _attention_matmul_params(cfg) + m * D * F + biases
  if cfg.mla:
    per_layer += cfg.q_lora_rank + cfg.kv_lora_rank  # the latents' RMSNorm scales
  if cfg.moe:
    E = cfg.num_experts
    per_layer += D * E + E + E * 3 * D * cfg.expert_ffn_dim
  return per_layer


def layer_matmul_param_count(cfg: ModelConfig, routed_experts: float | None = None) -> int:
  """One layer's matmul weights a token uses: Q/K/V, attention output and MLP (a routed
  layer: router, shared experts and `routed_experts` experts, by default k)."""
  D, F = cfg.d_model, _ffn(cfg)
  n = _attention_matmul_params(cfg) + _mlp_matrices(cfg) * D * F
  if cfg.moe:
    k = cfg.experts_per_token if routed_experts is None else routed_experts
    n += D * cfg.num_experts + k * 3 * D * cfg.expert_ffn_dim
  return n


def _attention_matmul_params(cfg: ModelConfig) -> int:
  """Q/K/V and output projections; latent attention's down- and up-projections (model/mla.py)."""
  D, H, K, V = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.value_head_dim
  if not cfg.mla:
    return D * (H + 2 * cfg.kv_heads) * K + H * K * D
  Rq, Rkv, Rr = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_head_dim
  q = D * Rq + Rq * H * (K + Rr) if Rq else D * H * (K + Rr)
  return q + D * (Rkv + Rr) + Rkv * H * (K + V) + H * V * D


def matmul_param_count(cfg: ModelConfig) -> int:
  """Matmul weights a token uses (active ones in a mixture of experts)."""
  layers = sum(s.num_layers * layer_matmul_param_count(s) for s in _stacks(cfg))
  D = cfg.d_model
  # Each multi-token prediction module: its block, its projection and the shared head.
  mtp = cfg.mtp_layers * (
    layer_matmul_param_count(cfg.mtp_stack()) + 2 * D * D + cfg.padded_vocab * D
  )
  return layers + cfg.padded_vocab * D + mtp


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
  T = seq_len or cfg.seq_len
  # Q.K^T over the query-key dims, probs.V over the value dims (both K but with latent
  # attention): 3 L T H (K_qk + V), 6 L T H K for the others.
  layers = cfg.num_layers + cfg.mtp_layers
  attention = 3 * layers * T * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim)
  return 6.0 * matmul_param_count(cfg) + attention


def attended_keys(cfg: ModelConfig, context_ranks: int = 1) -> float:
  """Keys each query's attention kernel scores, on average over the T queries: T for
  XLA's attention (the masked half computed too); T / 2 for cuDNN's causal kernel, which
  skips the masked blocks; 3T / 4 with context parallelism, whose masked calls score the
  early query chunk against half the sequence and the late one against all of it
  (parallelism/context.py)."""
  T = cfg.seq_len
  if context_ranks > 1:
    return 0.75 * T
  return T / 2 if cfg.attention == "cudnn" else float(T)


def matmul_flops_per_step(
  cfg: ModelConfig,
  global_batch: int,
  context_ranks: int = 1,
  layer_rows: int | None = None,
  layer_passes: float = 1.0,
) -> float:
  """Matmul FLOPs of one compiled train step of model/gpt.py, recomputation included.

  Unlike `train_flops_per_token` this counts what XLA runs, so a compiled program's
  matmul FLOPs can be checked against it. Per token, with A keys scored a query
  (`attended_keys`):

    forward   2 * N_matmul + 4 * L * A * H * K
    backward  twice the forward: an input and a weight (or second operand) gradient
              for every matmul, the first layer's included (the embeddings train);
              cuDNN's attention backward runs five matmuls, not four (it recomputes
              Q.K^T): 5 * L * A * H * K, latent attention's values padded to K
    remat     "none": nothing more with XLA's attention. "save_dots": the attention
              matmuls (Q.K^T and probs.V have batch dimensions, so the policy does not
              save them) are recomputed, + 4 * L * A * H * K. "elementwise": Q.K^T
              again for the softmax's backward, + 2 * L * A * H * K. "full": each
              layer's forward is recomputed except fc2 (down), whose output only feeds
              the residual sum that the backward pass does not need (XLA drops it):
              + 2 * L * (N_layer - DF) + 4 * L * A * H * K, N_layer a layer's matmul
              weights (3DHK + HKD + 2DF for GPT-3). cuDNN's attention is one kernel
              whose softmax statistics no policy saves: under every policy its forward
              runs again, + 4 * L * A * H * K.

  Pipelined, the layer terms count `layer_rows` rows (an uneven split's padding rows
  compute too, their output discarded: parallelism/pipeline.py) and run `layer_passes`
  times per micro-batch chunk (the 1F1B schedule's ranks compute in every trip, the
  idle ones on stale data: (M V + P - 1) / (M V), parallelism/one_f_one_b.py).

  Equal to projection/hlo.py's dot FLOPs of compiled steps: GPT-3 175B with full remat
  on H100 and a small model with save_dots on CPU (tests/test_projection.py), the Llama
  benchmark's layout at test size on H100 (tests/test_mlperf_llama.py); when this was
  written, that layout under each policy with either attention, and small models with
  each policy on CPU.
  """
  mtp = _mtp_matmul_flops(cfg, global_batch, context_ranks)
  if cfg.moe:
    # Each stack at its own depth; a routed layer's expert matmuls run over the capacity
    # buffer's E x C slots a sequence, not the k T assignments (model/moe.py). Equal to a
    # compiled moe-tiny step's dot FLOPs (tests/test_moe.py).
    head = 3 * 2 * cfg.padded_vocab * cfg.d_model * global_batch * cfg.seq_len
    total = -float(len(_stacks(cfg)) - 1) * head
    for s in _stacks(cfg):
      slots = _slots(s)
      total += _step_matmul_flops(s, global_batch, context_ranks, None, 1.0, slots)
    return total + mtp
  layers = _step_matmul_flops(cfg, global_batch, context_ranks, layer_rows, layer_passes, None)
  return layers + mtp


def _slots(cfg: ModelConfig) -> float | None:
  """A routed layer's expert slots a token (capacity buffer), None for a dense one."""
  return moe.capacity(cfg, cfg.seq_len) * cfg.num_experts / cfg.seq_len if cfg.moe else None


def _mtp_matmul_flops(cfg: ModelConfig, global_batch: int, context_ranks: int) -> float:
  """The multi-token prediction modules' matmul FLOPs a step: their blocks (recomputed
  as the layers are), and per module its projection [2D, D] and the shared head, forward
  and backward, never recomputed (they run outside the remat boundary)."""
  if not cfg.mtp_layers:
    return 0.0
  blocks = cfg.mtp_stack()
  # _step_matmul_flops counts one head with the blocks.
  total = _step_matmul_flops(blocks, global_batch, context_ranks, None, 1.0, _slots(blocks))
  D, tokens = cfg.d_model, global_batch * cfg.seq_len
  per_module = 3 * 2 * (2 * D * D + cfg.padded_vocab * D)
  return total + (cfg.mtp_layers * per_module - 3 * 2 * cfg.padded_vocab * D) * tokens


def _step_matmul_flops(
  cfg: ModelConfig,
  global_batch: int,
  context_ranks: int,
  layer_rows: int | None,
  layer_passes: float,
  routed_experts: float | None,
) -> float:
  L, D, H, F, T = cfg.num_layers, cfg.d_model, cfg.num_heads, _ffn(cfg), cfg.seq_len
  A = attended_keys(cfg, context_ranks)
  # One layer's attention matmuls, forward, a token (4 A H K but with latent attention).
  cudnn = cfg.attention == "cudnn"
  # cuDNN's kernel runs latent attention's values padded to the keys' width
  # (model/attention.py).
  scores = 2 * A * H * (cfg.qk_head_dim + (cfg.qk_head_dim if cudnn else cfg.value_head_dim))
  backward_scores = scores * (5 / 2 if cudnn else 2)
  weights = layer_matmul_param_count(cfg, routed_experts)
  layer_forward = 2 * weights + scores
  recompute = {
    "none": scores if cudnn else 0,
    "save_dots": scores,
    "elementwise": scores if cudnn else scores / 2,
    "full": 2 * (weights - D * F) + scores,
  }[cfg.remat]
  per_layer = layer_forward + (layer_forward - scores) * 2 + backward_scores + recompute
  head = 3 * 2 * cfg.padded_vocab * D
  layers = (layer_rows or L) * per_layer * layer_passes
  return float(layers + head) * global_batch * T


# LoRA (model/lora.py): the base weights are frozen, so their weight gradients are not
# computed. A step's model FLOPs per token are then
#
#     4 * N_matmul  +  6 * L * T * H * K  +  6 * N_adapter
#
# the base matmuls forward (2N) and their input gradients (2N), which the adapters below
# them need, but no weight gradients (the 2N that make 6N above); attention as before
# (it has no weights: both operands' gradients flow); and each adapter weight 2 + 4 like
# any trained weight. N_adapter = L * sum over targets of r * (in + out): r (D + (H + 2G)K)
# for a fused QKV target (one A shared by Q and K/V), r (HK + D) for the attention output.
# Llama 2 70B with MLPerf's adapters (rank 16 on QKV and the output projection) at
# T = 8,192: N_matmul 68.7e9, N_adapter 44.6e6: 4N = 274.9e9, attention 6LTHK = 32.2e9,
# 0.27e9 for the adapters: 307.3e9 a token, against 444.5e9 for full fine-tuning.


def _lora_kernel_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """(in, out) features of each block kernel; qkv_kernel on a grouped-query model is the
  fused target (one A on q and kv)."""
  D, H, K, F, G = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff, cfg.kv_heads
  return {
    "qkv_kernel": (D, (H + 2 * G) * K),
    "q_kernel": (D, H * K),
    "kv_kernel": (D, 2 * G * K),
    "out_kernel": (H * K, D),
    "fc1_kernel": (D, (2 if cfg.mlp == "swiglu" else 1) * F),
    "fc2_kernel": (F, D),
  }


def lora_adapter_param_count(cfg: ModelConfig, adapters) -> int:
  """Trainable parameters of LoRA adapters (model/lora.py LoraConfig) on cfg: r (in + out) a
  target kernel a layer."""
  if not adapters.enabled:
    return 0
  sizes = _lora_kernel_sizes(cfg)
  return cfg.num_layers * sum(adapters.rank * sum(sizes[t]) for t in adapters.target_names)


def lora_train_flops_per_token(cfg: ModelConfig, adapters, seq_len: int | None = None) -> float:
  """Model FLOPs per token of a LoRA step (the formula above); full training without
  adapters (rank 0)."""
  if adapters is None or not adapters.enabled:
    return train_flops_per_token(cfg, seq_len)
  T = seq_len or cfg.seq_len
  attention = 6 * cfg.num_layers * T * cfg.num_heads * cfg.head_dim
  return 4.0 * matmul_param_count(cfg) + attention + 6.0 * lora_adapter_param_count(cfg, adapters)


def lora_matmul_flops_per_step(
  cfg: ModelConfig, adapters, global_batch: int, context_ranks: int = 1
) -> float:
  """Matmul FLOPs of one compiled LoRA step (not pipelined), as `matmul_flops_per_step`
  counts them: its count less the base weights' gradients (2 N_layer a layer and token, 2VD
  for the head), plus the adapters' products. A target with k kernels sharing its A (k = 2
  for the fused QKV of a grouped-query model, else 1): forward x A once (XLA merges the
  two identical products) and (x A) B_i, 2r in + 2r sum(out_i); backward, per kernel, the
  gradients of B_i, of x A, of A and of x, 4r (in + out_i) (JAX transposes each use of A
  apart). Recomputation: remat none saves every dot; save_dots recomputes attention's
  Q.K^T, and probs.V only when the attention output's adapter needs it (the frozen output
  projection's weight gradient, which would, is not computed); elementwise and full are
  estimates (x A again; the adapters' forward again), not checked against a compile.
  Equal to the compiled CPU step's dot FLOPs for remat none and save_dots, and to the
  LoRA benchmark's step at 512 H100 with sequence parallelism (tests/test_lora.py); without
  it each tensor rank repeats x A of a column-parallel target for every token (its input is
  replicated over them), 0.15% more there, which this count (each product once) leaves out."""
  base = matmul_flops_per_step(cfg, global_batch, context_ranks)
  if not adapters.enabled:
    return base
  tokens = global_batch * cfg.seq_len
  frozen = cfg.num_layers * 2 * layer_matmul_param_count(cfg) + 2 * cfg.padded_vocab * cfg.d_model
  sizes = _lora_kernel_sizes(cfg)
  names = ("q_kernel", "kv_kernel") if cfg.grouped_query else ("qkv_kernel",)
  r = adapters.rank
  per_layer = 0.0
  for a_name, shared in lora.groups(adapters.target_names, names + ("out_kernel",)):
    fan_in = sizes[a_name][0]
    outs = [sizes[k][1] for k in shared]
    per_layer += 2 * r * fan_in + sum(2 * r * o + 4 * r * (fan_in + o) for o in outs)
    per_layer += {"none": 0, "save_dots": 0, "elementwise": 2 * r * fan_in}.get(
      cfg.remat, 2 * r * (fan_in + sum(outs))
    )
  if cfg.remat == "save_dots" and "out_kernel" not in adapters.target_names:
    per_layer -= 2 * attended_keys(cfg, context_ranks) * cfg.num_heads * cfg.head_dim
  return base - frozen * tokens + cfg.num_layers * per_layer * tokens
