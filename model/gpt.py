"""A GPT-3 style decoder in Flax NNX.

Learned positions, pre-LayerNorm, GELU MLP of width 4 x d_model, causal multi-head
attention. The layers are one stacked set of parameters (leading axis `layers`, or
`stage` when pipelined: parallelism/pipeline.py runs them then) run by `jax.lax.scan`,
so compile time does not grow with depth. Every parameter carries its logical axis names
in the `axes` metadata; parallelism/rules.py maps them to the mesh.

Shapes: B batch, T sequence, D d_model, H heads, K head size, F 4 x D, V padded vocab,
L layers.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from model import fp8
from model import matmul as dense
from model.config import ModelConfig
from parallelism import sequence
from parallelism.rules import constrain

SAVED_NAMES = ("layer_input", "mid_residual", "qkv", "attention", "fc1")
_REMAT = {
    # No matmul is recomputed, but LayerNorm, GELU and softmax are: their intermediates
    # would otherwise be stacked over layers by the scan, written in the forward pass
    # and read back in the backward. On CPU those memory passes cost more than the
    # recomputation, and the step's temporary memory roughly halves.
    "none": jax.checkpoint_policies.dots_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Saves Q/K/V, projections and MLP matmul outputs; attention scores are recomputed.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Saves what Megatron keeps with sequence parallelism (Korthikanti et al. 2022): the
    # layer input, the QKV, attention and fc1 outputs and the mid-block residual;
    # LayerNorms, GELU, FP8 casts and the sequence-parallel all-gathers of the LayerNorm
    # outputs are redone. Without the layer input, a remat boundary around several layers
    # (a pipeline chunk) would recompute fc2 to rebuild each layer's input.
    "elementwise": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
}


# The weight matrices of a block: the matmuls that FP8 runs.
KERNELS = ("qkv_kernel", "out_kernel", "fc1_kernel", "fc2_kernel")


def _param(key: jax.Array, shape: tuple[int, ...], axes: tuple, std: float, dtype) -> nnx.Param:
  value = std * jax.random.normal(key, shape, dtype) if std else jnp.zeros(shape, dtype)
  return nnx.Param(value, axes=axes)


def _ones(shape: tuple[int, ...], axes: tuple, dtype) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, dtype), axes=axes)


class Layers(nnx.Module):
  """All transformer blocks' parameters, stacked along a leading axis named `stack`."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: str = "layers"):
    L, D, H, K, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    dt = jnp.dtype(cfg.param_dtype)
    std = 0.02
    # GPT-2/3 scale the residual-branch output projections by 1/sqrt(2L).
    out_std = std / math.sqrt(2 * L)
    self.ln1_scale = _ones((L, D), (stack, "embed"), dt)
    self.ln1_bias = _param(None, (L, D), (stack, "embed"), 0, dt)
    self.qkv_kernel = _param(rngs.params(), (L, D, 3, H, K), (stack, "embed", "qkv", "heads", "kv"), std, dt)
    self.qkv_bias = _param(None, (L, 3, H, K), (stack, "qkv", "heads", "kv"), 0, dt)
    self.out_kernel = _param(rngs.params(), (L, H, K, D), (stack, "heads", "kv", "embed"), out_std, dt)
    self.out_bias = _param(None, (L, D), (stack, "embed"), 0, dt)
    self.ln2_scale = _ones((L, D), (stack, "embed"), dt)
    self.ln2_bias = _param(None, (L, D), (stack, "embed"), 0, dt)
    self.fc1_kernel = _param(rngs.params(), (L, D, F), (stack, "embed", "mlp"), std, dt)
    self.fc1_bias = _param(None, (L, F), (stack, "mlp"), 0, dt)
    self.fc2_kernel = _param(rngs.params(), (L, F, D), (stack, "mlp", "embed"), out_std, dt)
    self.fc2_bias = _param(None, (L, D), (stack, "embed"), 0, dt)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
  """LayerNorm with statistics in float32 whatever the compute dtype."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  return (y * scale + bias).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kind: str = "xla") -> jax.Array:
  """Causal softmax attention. q, k, v: [B, T, H, K] -> [B, T, H, K]; kind as
  ModelConfig.attention."""
  if kind == "cudnn":
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  T, K = q.shape[1], q.shape[3]
  scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(K)  # [B, H, T, T]
  causal = jnp.tril(jnp.ones((T, T), bool))
  scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqt,bthk->bqhk", probs, v)


def residual_axes(cfg: ModelConfig) -> tuple[str, str, str]:
  """Logical axes of the residual stream [B, T, D]: sequence-sharded with sequence parallelism."""
  return ("batch", "act_seq" if cfg.sequence_parallel else "length", "act_embed")


def block(cfg: ModelConfig, x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  """One pre-LN transformer block. x: [B, T, D]; p: one layer's parameters.

  The constraints mark the tensor-parallel regions: QKV and fc1 outputs are split over
  heads / MLP width, and the output projections' partial sums return to the residual
  stream's sharding: an all-reduce, or with sequence parallelism a reduce-scatter along
  the sequence (and the next region's input an all-gather).
  """
  residual = residual_axes(cfg)
  matmul = fp8.einsum if cfg.fp8 else dense.einsum

  def tensor_parallel(spec, h, w, h_axes, w_axes, out_axes):
    if cfg.sequence_parallel:
      return sequence.matmul(matmul, spec, h, w, h_axes, w_axes, out_axes, tensor_in_fn=cfg.fp8)
    return constrain(matmul(spec, h, w), out_axes)

  x = checkpoint_name(constrain(x, residual), "layer_input")
  h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
  # [B, T, 3, H, K] is the matmul's natural output order; putting the q/k/v axis first
  # made XLA:CPU transpose the kernel and the activations in every layer.
  qkv_axes = ("batch", "length", "qkv", "act_heads", None)
  qkv = tensor_parallel("btd,dchk->btchk", h, p["qkv_kernel"], residual,
                        ("embed", "qkv", "heads", "kv"), qkv_axes)
  qkv = checkpoint_name(constrain(qkv + p["qkv_bias"], qkv_axes), "qkv")
  a = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], cfg.attention)
  a = checkpoint_name(a, "attention")
  x = x + tensor_parallel("bthk,hkd->btd", a, p["out_kernel"],
                          ("batch", "length", "act_heads", None), ("heads", "kv", "embed"),
                          residual) + p["out_bias"]
  x = checkpoint_name(x, "mid_residual")
  h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
  mlp_axes = ("batch", "length", "act_mlp")
  h = tensor_parallel("btd,df->btf", h, p["fc1_kernel"], residual, ("embed", "mlp"), mlp_axes)
  h = jax.nn.gelu(checkpoint_name(constrain(h + p["fc1_bias"], mlp_axes), "fc1"))
  h = tensor_parallel("btf,fd->btd", h, p["fc2_kernel"], mlp_axes, ("mlp", "embed"), residual)
  return x + h + p["fc2_bias"]


def run_layers(cfg: ModelConfig, x: jax.Array, layer_params: dict[str, jax.Array],
               chunk: tuple[jax.Array, int] | None = None, unroll: bool = False) -> jax.Array:
  """Layers of a stack (leading axis of each parameter) on x, under the remat policy: all of
  them, or with chunk = (first, count) the stack's rows first .. first + count - 1.

  The pipeline's chunk changes every trip. It is sliced once, inside a remat boundary
  around the whole chunk: sliced outside, the slice would be saved for the backward pass
  every trip; indexed row by row inside the layer scan, each trip's weight gradient would
  be a whole-stack buffer (zeroed, scattered into, and added to the accumulator every
  trip) instead of `count` rows added in place.

  unroll: the layer scan unrolled (the 1f1b schedule, so that a trip's forward and
  backward chunks are one loop body whose ops XLA can interleave).
  """
  policy = _REMAT[cfg.remat]
  step = jax.checkpoint(lambda carry, p: (block(cfg, carry, p), None), policy=policy,
                        prevent_cse=False)
  if chunk is None:
    return jax.lax.scan(step, x, layer_params, unroll=unroll)[0]
  first, count = chunk

  @functools.partial(jax.checkpoint, policy=policy, prevent_cse=False)
  def run_chunk(x, layer_params):
    rows = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, first, count), layer_params)
    return jax.lax.scan(step, x, rows)[0]

  return run_chunk(x, layer_params)


class GPT(nnx.Module):
  """Decoder-only transformer: tokens [B, T] int32 -> logits [B, T, V] float32.

  pipelined: the layer stack's leading axis is `stage` (sharded over the pipeline axis)
  and the train step runs embed, the pipeline and head itself instead of __call__.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, pipelined: bool = False):
    cfg.validate()
    self.cfg = cfg
    D, V, dt = cfg.d_model, cfg.padded_vocab, jnp.dtype(cfg.param_dtype)
    self.wte = _param(rngs.params(), (V, D), ("vocab", "embed"), 0.02, dt)
    self.wpe = _param(rngs.params(), (cfg.seq_len, D), ("position", "embed"), 0.01, dt)
    self.layers = Layers(cfg, rngs, "stage" if pipelined else "layers")
    self.lnf_scale = _ones((D,), ("embed",), dt)
    self.lnf_bias = _param(None, (D,), ("embed",), 0, dt)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs.params(), (D, V), ("embed", "vocab"), 0.02, dt)

  def _cast(self, a: nnx.Param) -> jax.Array:
    return a[...].astype(jnp.dtype(self.cfg.compute_dtype))

  def _token_table(self) -> jax.Array:
    # Gather the table over fsdp first (as FSDP does for every weight) so the lookup
    # is vocab-parallel over tensor only; otherwise the partitioner replicates it.
    return constrain(self._cast(self.wte), ("vocab", None))

  def layer_params(self, scales: dict | None = None) -> dict[str, jax.Array | fp8.CastWeight]:
    """The stacked layer parameters in the compute dtype; with FP8 the matmul kernels
    with their FP8 casts, made once here for every layer call of the step. scales:
    delayed scaling's {kernel: (input scales [L], gradient scales [L])}."""
    params = {name: self._cast(v) for name, v in vars(self.layers).items()
              if isinstance(v, nnx.Param)}
    if self.cfg.fp8:
      for name in KERNELS:
        w = fp8.cast_weights(params[name], (scales or {}).get(name))
        # A kernel may be stored split over `data` (train.shard_optimizer): its cast is
        # gathered whole, in FP8 (otherwise the constraint changes nothing).
        axes = getattr(self.layers, name).get_metadata()["axes"]
        params[name] = w._replace(cast=constrain(w.cast, axes))
    return params

  def embed(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> the residual stream entering the first layer [B, T, D]."""
    x = self._token_table()[tokens] + self._cast(self.wpe)[:tokens.shape[1]]
    return constrain(x, residual_axes(self.cfg))

  def head(self, x: jax.Array) -> jax.Array:
    """The last layer's output [B, T, D] -> logits [B, T, V] float32."""
    x = layer_norm(x, self._cast(self.lnf_scale), self._cast(self.lnf_bias))
    if self.cfg.tie_embeddings:
      logits = jnp.einsum("btd,vd->btv", x, self._token_table())
    else:
      logits = jnp.einsum("btd,dv->btv", x, self._cast(self.lm_head))
    return constrain(logits, ("batch", "length", "act_vocab")).astype(jnp.float32)

  def __call__(self, tokens: jax.Array, scales: dict | None = None) -> jax.Array:
    return self.head(run_layers(self.cfg, self.embed(tokens), self.layer_params(scales)))
