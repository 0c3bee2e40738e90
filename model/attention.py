"""Causal softmax attention for the decoder (model/gpt.py): XLA's as written, or cuDNN's
fused flash attention on NVIDIA targets; grouped-query heads without copies of K and V.

Latent attention's values are narrower than its keys (model/mla.py: 192 query-key dims,
128 value dims for DeepSeek-V3). jax.nn.dot_product_attention takes values shaped like the
keys, and JAX's own entry for cuDNN's narrower values cannot be vmapped (its batching rule
reshapes the values and the output to the keys' and queries' head dims), which the 1F1B
ranks' vmap needs: the values are zero-padded to the keys' width and the output's padding
dropped. The kernel computes P.V and its gradients over the padded width, and the HLO is
costed as it runs (projection/hlo.py)."""

import math

import jax
import jax.numpy as jnp


def attention(
  q: jax.Array, k: jax.Array, v: jax.Array, kind: str = "xla", mask: jax.Array | None = None
) -> jax.Array:
  """Causal softmax attention. q: [B, T, H, K], k: [B, S, G, K], v: [B, S, G, V] with G
  dividing H (query head h uses K/V head h // (H / G)) -> [B, T, H, V]; V is K but with
  latent attention (model/mla.py); kind as ModelConfig.attention.
  mask [T, S] (True: attend; context parallelism's, by true positions), else causal by
  index (S = T)."""
  if kind == "cudnn" and v.shape[-1] != k.shape[-1]:
    pad = k.shape[-1] - v.shape[-1]
    wide = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad)))
    return attention(q, k, wide, kind, mask)[..., : v.shape[-1]]
  if kind == "cudnn":
    if mask is None:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    # As a [1, 1, T, S] bias: the kernel computes every score block, skipping none.
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation="cudnn")
  B, T, H, K = q.shape
  G = k.shape[2]
  causal = jnp.tril(jnp.ones((T, T), bool)) if mask is None else mask
  if G == H:
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(K)  # [B, H, T, T]
    scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqt,bthv->bqhv", probs, v)
  # Grouped: each K/V head meets its H / G query heads in one batched matmul, with no
  # copy of K and V per query head.
  q = q.reshape(B, T, G, H // G, K)
  scores = jnp.einsum("bqgjk,btgk->bgjqt", q, k) / math.sqrt(K)  # [B, G, H/G, T, T]
  scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bgjqt,btgv->bqgjv", probs, v).reshape(B, T, H, v.shape[-1])
