"""A GPT-3 style decoder in Flax NNX.

Learned positions, pre-LayerNorm, GELU MLP of width 4 x d_model, causal multi-head
attention. The layers are one stacked set of parameters (leading axis `layers`) run by
`jax.lax.scan`, so compile time does not grow with depth. Every parameter carries its
logical axis names in the `axes` metadata; parallelism/rules.py maps them to the mesh.

Shapes: B batch, T sequence, D d_model, H heads, K head size, F 4 x D, V padded vocab,
L layers.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from parallelism.rules import constrain

_REMAT = {
    # No matmul is recomputed, but LayerNorm, GELU and softmax are: their intermediates
    # would otherwise be stacked over layers by the scan, written in the forward pass
    # and read back in the backward. On CPU those memory passes cost more than the
    # recomputation, and the step's temporary memory roughly halves.
    "none": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Saves Q/K/V, projections and MLP matmul outputs; attention scores are recomputed.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _param(key: jax.Array, shape: tuple[int, ...], axes: tuple, std: float, dtype) -> nnx.Param:
  value = std * jax.random.normal(key, shape, dtype) if std else jnp.zeros(shape, dtype)
  return nnx.Param(value, axes=axes)


def _ones(shape: tuple[int, ...], axes: tuple, dtype) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, dtype), axes=axes)


class Layers(nnx.Module):
  """All transformer blocks' parameters, stacked along a leading `layers` axis."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    L, D, H, K, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    dt = jnp.dtype(cfg.param_dtype)
    std = 0.02
    # GPT-2/3 scale the residual-branch output projections by 1/sqrt(2L).
    out_std = std / math.sqrt(2 * L)
    self.ln1_scale = _ones((L, D), ("layers", "embed"), dt)
    self.ln1_bias = _param(None, (L, D), ("layers", "embed"), 0, dt)
    self.qkv_kernel = _param(rngs.params(), (L, D, 3, H, K), ("layers", "embed", "qkv", "heads", "kv"), std, dt)
    self.qkv_bias = _param(None, (L, 3, H, K), ("layers", "qkv", "heads", "kv"), 0, dt)
    self.out_kernel = _param(rngs.params(), (L, H, K, D), ("layers", "heads", "kv", "embed"), out_std, dt)
    self.out_bias = _param(None, (L, D), ("layers", "embed"), 0, dt)
    self.ln2_scale = _ones((L, D), ("layers", "embed"), dt)
    self.ln2_bias = _param(None, (L, D), ("layers", "embed"), 0, dt)
    self.fc1_kernel = _param(rngs.params(), (L, D, F), ("layers", "embed", "mlp"), std, dt)
    self.fc1_bias = _param(None, (L, F), ("layers", "mlp"), 0, dt)
    self.fc2_kernel = _param(rngs.params(), (L, F, D), ("layers", "mlp", "embed"), out_std, dt)
    self.fc2_bias = _param(None, (L, D), ("layers", "embed"), 0, dt)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
  """LayerNorm with statistics in float32 whatever the compute dtype."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  return (y * scale + bias).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal softmax attention. q, k, v: [B, T, H, K] -> [B, T, H, K]."""
  T, K = q.shape[1], q.shape[3]
  scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(K)  # [B, H, T, T]
  causal = jnp.tril(jnp.ones((T, T), bool))
  scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqt,bthk->bqhk", probs, v)


def block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  """One pre-LN transformer block. x: [B, T, D]; p: one layer's parameters."""
  x = constrain(x, ("batch", "length", "act_embed"))
  h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
  # [B, T, 3, H, K] is the matmul's natural output order; putting the q/k/v axis first
  # made XLA:CPU transpose the kernel and the activations in every layer.
  qkv = jnp.einsum("btd,dchk->btchk", h, p["qkv_kernel"]) + p["qkv_bias"]
  qkv = constrain(qkv, ("batch", "length", "qkv", "act_heads", None))  # [B, T, 3, H, K]
  a = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
  x = x + jnp.einsum("bthk,hkd->btd", a, p["out_kernel"]) + p["out_bias"]
  h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
  h = jnp.einsum("btd,df->btf", h, p["fc1_kernel"]) + p["fc1_bias"]
  h = jax.nn.gelu(constrain(h, ("batch", "length", "act_mlp")))
  return x + jnp.einsum("btf,fd->btd", h, p["fc2_kernel"]) + p["fc2_bias"]


class GPT(nnx.Module):
  """Decoder-only transformer: tokens [B, T] int32 -> logits [B, T, V] float32."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    D, V, dt = cfg.d_model, cfg.padded_vocab, jnp.dtype(cfg.param_dtype)
    self.wte = _param(rngs.params(), (V, D), ("vocab", "embed"), 0.02, dt)
    self.wpe = _param(rngs.params(), (cfg.seq_len, D), ("position", "embed"), 0.01, dt)
    self.layers = Layers(cfg, rngs)
    self.lnf_scale = _ones((D,), ("embed",), dt)
    self.lnf_bias = _param(None, (D,), ("embed",), 0, dt)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs.params(), (D, V), ("embed", "vocab"), 0.02, dt)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.cfg
    cdt = jnp.dtype(cfg.compute_dtype)
    cast = lambda a: a[...].astype(cdt)
    T = tokens.shape[1]
    # Gather the table over fsdp first (as FSDP does for every weight) so the lookup
    # is vocab-parallel over tensor only; otherwise the partitioner replicates it.
    wte = constrain(cast(self.wte), ("vocab", None))
    x = constrain(wte[tokens] + cast(self.wpe)[:T], ("batch", "length", "act_embed"))  # [B, T, D]

    layer_params = {name: cast(v) for name, v in vars(self.layers).items()
                    if isinstance(v, nnx.Param)}
    step = jax.checkpoint(lambda carry, p: (block(carry, p), None),
                          policy=_REMAT[cfg.remat], prevent_cse=False)
    x, _ = jax.lax.scan(step, x, layer_params)

    x = layer_norm(x, cast(self.lnf_scale), cast(self.lnf_bias))
    if cfg.tie_embeddings:
      logits = jnp.einsum("btd,vd->btv", x, wte)
    else:
      logits = jnp.einsum("btd,dv->btv", x, cast(self.lm_head))
    return constrain(logits, ("batch", "length", "act_vocab")).astype(jnp.float32)
