"""The decoder's norms (model/gpt.py, model/mla.py): statistics in float32 whatever the
compute dtype."""

import jax
import jax.numpy as jnp

from model.config import ModelConfig


def layer_norm(
  x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float = 1e-5
) -> jax.Array:
  """LayerNorm with statistics in float32 whatever the compute dtype."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  y = y * scale
  return (y if bias is None else y + bias).astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), statistics in float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


def norm(cfg: ModelConfig, x: jax.Array, p: dict, prefix: str) -> jax.Array:
  """The norm cfg names, with parameters p[prefix + "_scale"] (and "_bias")."""
  if cfg.norm == "rmsnorm":
    return rms_norm(x, p[f"{prefix}_scale"], cfg.norm_eps)
  return layer_norm(x, p[f"{prefix}_scale"], p.get(f"{prefix}_bias"), cfg.norm_eps)
