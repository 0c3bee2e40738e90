"""Parameter counts and model FLOPs, from the configuration alone.

Model FLOPs per token of a training step (forward + backward, no recomputation):

    6 * N_matmul  +  6 * L * T * H * K

N_matmul counts the weights that take part in a matmul: per layer the QKV, output
and two MLP kernels (12 * D^2 for K * H = D), plus the V x D output projection, which
is the token embedding when tied. Each weight costs 2 FLOPs per token forward and 4
backward: 6N (Kaplan et al. 2020, arXiv:2001.08361, section 2.1).

The attention term: per layer and token, Q.K^T and probs.V each take 2 * T * H * K
FLOPs forward over the full T x T square, 4 * T * H * K in all, times 3 for
forward + backward = 12 * T * H * K. Causal attention only needs the lower triangle,
so it is counted once (half the square): 6 * L * T * H * K. NVIDIA's NeMo and
Megatron-LM count the full square, which makes their GPT-3 175B figure about 1.4%
larger than this one.

Recomputation (remat) is not model FLOPs: MFU deliberately ignores it.
"""

from model.config import ModelConfig


def param_count(cfg: ModelConfig) -> int:
  """Every parameter, embeddings and biases included."""
  L, D, H, K, F, V = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim,
                      cfg.d_ff, cfg.padded_vocab)
  per_layer = (2 * D            # ln1
               + D * 3 * H * K + 3 * H * K   # qkv
               + H * K * D + D  # attention output
               + 2 * D          # ln2
               + D * F + F + F * D + D)      # mlp
  embeddings = V * D + cfg.seq_len * D + (0 if cfg.tie_embeddings else D * V)
  return L * per_layer + embeddings + 2 * D


def matmul_param_count(cfg: ModelConfig) -> int:
  L, D, H, K, F, V = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim,
                      cfg.d_ff, cfg.padded_vocab)
  return L * (D * 3 * H * K + H * K * D + 2 * D * F) + V * D


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
  T = seq_len or cfg.seq_len
  attention = 6 * cfg.num_layers * T * cfg.num_heads * cfg.head_dim
  return 6.0 * matmul_param_count(cfg) + attention


def matmul_flops_per_step(cfg: ModelConfig, global_batch: int) -> float:
  """Matmul FLOPs of one compiled train step of model/gpt.py, recomputation included.

  Unlike `train_flops_per_token` this counts what XLA runs, so a compiled program's
  matmul FLOPs can be checked against it:

    forward   2 * N_matmul + 4 * L * T * H * K per token: attention over the full
              T x T square, since XLA computes the masked half too
    backward  twice the forward: an input and a weight (or second operand) gradient
              for every matmul, the first layer's included (the embeddings train)
    remat     "none": nothing more. "save_dots": the attention matmuls (Q.K^T and
              probs.V have batch dimensions, so the policy does not save them) are
              recomputed, + 4 * L * T * H * K. "full": each layer's forward is recomputed
              except fc2, whose output only feeds the residual sum that the backward
              pass does not need (XLA drops it): + 2 * L * (3DHK + HKD + DF) + 4 * L * T * H * K.

  Equal to projection/hlo.py's dot FLOPs of compiled steps: GPT-3 175B with full remat
  on H100 and a small model with save_dots on CPU (tests/test_projection.py); small
  models with each policy on CPU when this was written.
  """
  L, D, H, K, F, T = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff,
                      cfg.seq_len)
  attention = 4 * L * T * H * K
  forward = 2 * matmul_param_count(cfg) + attention
  recompute = {"none": 0,
               "save_dots": attention,
               "full": 2 * L * (3 * D * H * K + H * K * D + D * F) + attention}[cfg.remat]
  return float(3 * forward + recompute) * global_batch * T
