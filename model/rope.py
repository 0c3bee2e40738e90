"""Rotary position embeddings with Llama 3.1's frequency scaling.

Rotary embeddings (Su et al. 2021, arXiv:2104.09864) rotate each pair of a query's or
key's entries by an angle proportional to its position, so that q.k depends on the
positions' difference only. Pair i of a head of size K turns at frequency
theta^(-2i / K). The pairs here are the head's two halves (entry i with entry i + K/2,
the layout of Hugging Face's Llama, whose weights are Meta's permuted to it): two
contiguous slices instead of strided ones, the same model up to that permutation.

Llama 3.1 scales the frequencies to extend the context (Meta's llama-models
`apply_scaling`; config.json `rope_scaling`, rope_type "llama3"): with wavelength
w = 2 pi / f, original context C, factor s and low / high frequency factors l < h,

    w < C / h        f unchanged (high frequencies: local order)
    w > C / l        f / s
    otherwise        (1 - a) f / s + a f,   a = (C / w - l) / (h - l)

a smooth ramp between the two.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig


def frequencies(cfg: ModelConfig) -> np.ndarray:
  """The K/2 rotation frequencies (radians per position), float64, scaled as Llama 3.1."""
  K = cfg.head_dim
  freq = cfg.rope_theta ** (-np.arange(0, K, 2, dtype=np.float64) / K)
  if cfg.rope_scale_factor == 1:
    return freq
  C, s = cfg.rope_original_seq_len, cfg.rope_scale_factor
  low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  wavelength = 2 * math.pi / freq
  ramp = np.clip((C / wavelength - low) / (high - low), 0.0, 1.0)
  # ramp is 0 beyond C / low (divided by s) and 1 below C / high (kept).
  return (1 - ramp) * freq / s + ramp * freq


def rotate(
  x: jax.Array, cfg: ModelConfig, positions: np.ndarray | jax.Array | None = None
) -> jax.Array:
  """Queries or keys x [B, T, heads, K] rotated by their positions [T] (default
  0 .. T - 1; with context parallelism the tokens' true positions, which the
  load-balanced order permutes; traced on one context rank's slab).

  The angles are constants of the program (float32, computed here in float64 first;
  traced positions take their rows of the table of all model.seq_len positions);
  the rotation runs in float32 and returns x's dtype.
  """
  T, K = x.shape[1], x.shape[-1]
  positions = np.arange(T) if positions is None else positions
  rows = np.arange(cfg.seq_len) if isinstance(positions, jax.Array) else np.asarray(positions)
  angles = rows.astype(np.float64)[:, None] * frequencies(cfg)[None, :]  # [rows, K/2]
  cos = jnp.asarray(np.cos(angles), jnp.float32)[:, None, :]  # [rows, 1, K/2]
  sin = jnp.asarray(np.sin(angles), jnp.float32)[:, None, :]
  if isinstance(positions, jax.Array):
    cos, sin = cos[positions], sin[positions]  # [T, 1, K/2]
  x32 = x.astype(jnp.float32)
  first, second = x32[..., : K // 2], x32[..., K // 2 :]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(
    x.dtype
  )
