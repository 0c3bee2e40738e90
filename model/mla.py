"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 section 2.1; DeepSeek-V3,
arXiv:2412.19437 section 2.1.1) as the decoder's attention (model/gpt.py), by configuration:
model.kv_lora_rank > 0.

Keys and values come from a compressed latent c_kv [B, T, R_kv] (one down-projection of the
normed residual, RMSNorm'd), expanded per head to K "no-position" key dims and V value dims;
queries likewise from a latent of rank R_q (q_lora_rank; 0: a plain projection). Rotary
positions live in R_r extra dims (rope_head_dim) kept apart: each query head has its own,
and one rotary key of R_r dims, computed from the residual beside the latent, is shared by
every head. Attention scores run over K + R_r dims, scaled by 1 / sqrt(K + R_r); values
are V dims a head, and the output projection maps H x V to D.

Training computes K and V in full per head (the latent's savings are in inference's KV
cache), so the compiled matmuls are the up-projections and attention at H heads. DeepSeek's
YaRN scaling of the rotary frequencies and of the softmax scale (factor 40 for 128K context)
is not modelled: the MLPerf benchmark trains at 4,096 tokens.

Shapes: B batch, T sequence, D d_model, H heads, K qk_nope head dim (model.head_dim), R_r
rotary dims, V value head dim, R_q and R_kv the latent ranks.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import block_scaled, rope
from model.config import ModelConfig
from model.norms import rms_norm
from parallelism.rules import constrain


def init_params(layers: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs, stack: str, std: float):
  """Adds the latent attention's projections (not the output one) to the layer stack."""
  L, D, H, K = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim
  Rq, Rkv, Rr, V = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_head_dim, cfg.value_head_dim
  dt = jnp.dtype(cfg.param_dtype)
  normal = lambda shape: std * jax.random.normal(rngs.params(), shape, dt)
  # Down-projections are small and every head needs them: replicated over `tensor`;
  # up-projections are split by heads like the query kernel.
  if Rq:
    layers.q_down = nnx.Param(normal((L, D, Rq)), axes=(stack, "embed", None))
    layers.q_norm_scale = nnx.Param(jnp.ones((L, Rq), dt), axes=(stack, None))
    layers.q_up = nnx.Param(normal((L, Rq, H, K + Rr)), axes=(stack, None, "heads", "kv"))
  else:
    layers.q_kernel = nnx.Param(normal((L, D, H, K + Rr)), axes=(stack, "embed", "heads", "kv"))
  layers.kv_down = nnx.Param(normal((L, D, Rkv + Rr)), axes=(stack, "embed", None))
  layers.kv_norm_scale = nnx.Param(jnp.ones((L, Rkv), dt), axes=(stack, None))
  layers.kv_up = nnx.Param(normal((L, Rkv, H, K + V)), axes=(stack, None, "heads", "kv"))


def qkv(
  cfg: ModelConfig, h: jax.Array, p: dict, positions: np.ndarray | jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The normed residual h [B, T, D] -> q, k [B, T, H, K + R_r] (rotary dims rotated by the
  tokens' positions [T], default 0 .. T - 1; with context parallelism their true positions,
  model/rope.py) and v [B, T, H, V]."""
  K, Rkv, Rr = cfg.head_dim, cfg.kv_lora_rank, cfg.rope_head_dim
  heads = ("batch", "length", "act_heads", None)
  # The projections are weight matmuls like the block's: block-scaled with block scaling.
  matmul = block_scaled.einsum_for(cfg.block_scaling)
  if cfg.q_lora_rank:
    cq = rms_norm(matmul("btd,dr->btr", h, p["q_down"]), p["q_norm_scale"], cfg.norm_eps)
    q = matmul("btr,rhk->bthk", cq, p["q_up"])
  else:
    q = matmul("btd,dhk->bthk", h, p["q_kernel"])
  q = constrain(q, heads)
  latent = matmul("btd,dr->btr", h, p["kv_down"])  # [B, T, R_kv + R_r]
  ckv = rms_norm(latent[..., :Rkv], p["kv_norm_scale"], cfg.norm_eps)
  kv = constrain(matmul("btr,rhk->bthk", ckv, p["kv_up"]), heads)  # [B, T, H, K + V]
  rotary = dataclasses.replace(cfg, head_dim=Rr)
  q_rope = rope.rotate(q[..., K:], rotary, positions)
  # [B, T, 1, R_r]: shared by the heads
  k_rope = rope.rotate(latent[..., None, Rkv:], rotary, positions)
  k_rope = jnp.broadcast_to(k_rope, (*kv.shape[:3], Rr))
  q = jnp.concatenate([q[..., :K], q_rope], axis=-1)
  k = constrain(jnp.concatenate([kv[..., :K], k_rope], axis=-1), heads)
  return q, k, kv[..., K:]
