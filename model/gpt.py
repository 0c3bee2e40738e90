"""The decoder in Flax NNX: the GPT-3 and Llama 3 families as configuration of one model.

GPT-3 (the ModelConfig defaults): learned positions, pre-LayerNorm, GELU MLP of width
4 x d_model, causal multi-head attention with one fused QKV kernel, biases everywhere.
Llama 3 (model/presets.py LLAMA3_ARCHITECTURE): RMSNorm, rotary positions (model/rope.py),
SwiGLU MLP (gate and up one [D, 2, F] kernel, as Megatron-Core's fused linear_fc1, then
down), grouped-query attention with separate Q [D, H, K] and KV [D, 2, G, K] kernels, no
biases. The layers are one stacked set of parameters (leading axis `layers`, or `stage`
when pipelined: parallelism/pipeline.py runs them then) run by `jax.lax.scan`, so compile
time does not grow with depth. Every parameter carries its logical axis names in the
`axes` metadata; parallelism/rules.py maps them to the mesh.

Shapes: B batch, T sequence, D d_model, H heads, G key/value heads, K head size, F MLP
width, V padded vocab, L layers.
"""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from errors import UserInputError
from model import block_scaled, fp8, lora, mla, moe, rope
from model import matmul as dense
from model.attention import attention
from model.config import ModelConfig
from model.norms import norm
from parallelism import context, rules, sequence
from parallelism.rules import constrain, on_wire

SAVED_NAMES = ("layer_input", "mid_residual", "qkv", "attention", "fc1")
_REMAT = {
  # No matmul is recomputed, but LayerNorm, GELU and softmax are: their intermediates
  # would otherwise be stacked over layers by the scan, written in the forward pass
  # and read back in the backward. On CPU those memory passes cost more than the
  # recomputation, and the step's temporary memory roughly halves.
  # Block-scaled matmuls are custom calls, not dots: their outputs are saved by name, and
  # so is the routed experts' combined output (model/moe.py), so that the backward pass
  # does not redo the combine all-to-all.
  "none": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names(
      block_scaled.OUTPUT_NAME, block_scaled.BATCHED_OUTPUT_NAME, moe.RETURNED_NAME
    ),
  ),
  "full": jax.checkpoint_policies.nothing_saveable,
  # Saves Q/K/V, projections and MLP matmul outputs; attention scores and the routed
  # experts' batched matmuls (block-scaled or not) are recomputed.
  "save_dots": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(block_scaled.OUTPUT_NAME),
  ),
  # Saves what Megatron keeps with sequence parallelism (Korthikanti et al. 2022): the
  # layer input, the QKV, attention and fc1 outputs and the mid-block residual;
  # LayerNorms, GELU, FP8 casts and the sequence-parallel all-gathers of the LayerNorm
  # outputs are redone. Without the layer input, a remat boundary around several layers
  # (a pipeline chunk) would recompute fc2 to rebuild each layer's input.
  "elementwise": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
}


# The weight matrices of a GPT block: the matmuls that FP8 runs (`kernels` for any model).
KERNELS = ("qkv_kernel", "out_kernel", "fc1_kernel", "fc2_kernel")
GROUPED_QUERY_KERNELS = ("q_kernel", "kv_kernel", "out_kernel", "fc1_kernel", "fc2_kernel")


# Axes of a kernel (after the layer axis) that its matmul contracts: the attention
# output's heads and head features; one (the input features) for the others.
_CONTRACTED_AXES = {"out_kernel": 2}
# Weight matmuls besides `kernels`' that block scaling runs: latent attention's projections
# (model/mla.py) and the routed experts' stacks (model/moe.py), whose expert axis (after the
# layer axis) is a batch axis of their matmuls. The router stays in float32.
_LATENT_KERNELS = ("q_down", "q_up", "q_kernel", "kv_down", "kv_up")
_BATCH_AXES = {"expert_fc1": 1, "expert_fc2": 1}


def kernels(cfg: ModelConfig) -> tuple[str, ...]:
  """The block's weight matrices for cfg, the keys of FP8's casts and amax histories:
  separate Q and KV kernels with grouped-query attention, one QKV kernel otherwise."""
  return GROUPED_QUERY_KERNELS if cfg.grouped_query else KERNELS


def cast_once_kernels(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
  """Of a stack's weights (`shapes`: name -> [L, ...] shape), those whose matmuls read only
  casts that `GPT.layer_params` makes once a step: FP8's E4M3 casts, or block scaling's
  quantizations where the weight's shape splits into blocks (block_scaled.cacheable;
  otherwise each matmul quantizes the weight itself)."""
  if cfg.fp8:
    return tuple(name for name in kernels(cfg) if name in shapes)
  if cfg.block_scaling == "none":
    return ()
  names = dict.fromkeys((*kernels(cfg), *_LATENT_KERNELS, *_BATCH_AXES))
  return tuple(
    name
    for name in names
    if name in shapes
    and block_scaled.cacheable(
      shapes[name], _CONTRACTED_AXES.get(name, 1), cfg.block_scaling, _BATCH_AXES.get(name, 0)
    )
  )


def _param(key: jax.Array, shape: tuple[int, ...], axes: tuple, std: float, dtype) -> nnx.Param:
  value = std * jax.random.normal(key, shape, dtype) if std else jnp.zeros(shape, dtype)
  return nnx.Param(value, axes=axes)


def _ones(shape: tuple[int, ...], axes: tuple, dtype) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, dtype), axes=axes)


class Layers(nnx.Module):
  """All transformer blocks' parameters, stacked along a leading axis named `stack`."""

  def __init__(
    self,
    cfg: ModelConfig,
    rngs: nnx.Rngs,
    stack: str = "layers",
    adapters: lora.LoraConfig | None = None,
  ):
    L, D, H, K, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    # Routed layers: the block's MLP is the shared experts (none: no fc1/fc2), model/moe.py.
    F = cfg.shared_ffn_dim if cfg.moe else F
    G = cfg.kv_heads
    dt = jnp.dtype(cfg.param_dtype)
    std = 0.02
    # GPT-2/3 scale the residual-branch output projections by 1/sqrt(2L).
    out_std = std / math.sqrt(2 * L)
    # LayerNorm's shift is a bias too; RMSNorm has none.
    norm_bias = cfg.use_bias and cfg.norm == "layernorm"
    # SwiGLU's gate and up projections: one kernel [D, 2, F].
    fc1_shape, fc1_axes = (
      ((D, 2, F), ("embed", "gate_up", "mlp"))
      if cfg.mlp == "swiglu"
      else ((D, F), ("embed", "mlp"))
    )
    self.ln1_scale = _ones((L, D), (stack, "embed"), dt)
    if norm_bias:
      self.ln1_bias = _param(None, (L, D), (stack, "embed"), 0, dt)
    if cfg.mla:
      mla.init_params(self, cfg, rngs, stack, std)
    elif cfg.grouped_query:
      self.q_kernel = _param(rngs.params(), (L, D, H, K), (stack, "embed", "heads", "kv"), std, dt)
      self.kv_kernel = _param(
        rngs.params(), (L, D, 2, G, K), (stack, "embed", "qkv", "kv_heads", "kv"), std, dt
      )
      if cfg.use_bias:
        self.q_bias = _param(None, (L, H, K), (stack, "heads", "kv"), 0, dt)
        self.kv_bias = _param(None, (L, 2, G, K), (stack, "qkv", "kv_heads", "kv"), 0, dt)
    else:
      self.qkv_kernel = _param(
        rngs.params(), (L, D, 3, H, K), (stack, "embed", "qkv", "heads", "kv"), std, dt
      )
      if cfg.use_bias:
        self.qkv_bias = _param(None, (L, 3, H, K), (stack, "qkv", "heads", "kv"), 0, dt)
    self.out_kernel = _param(
      rngs.params(), (L, H, cfg.value_head_dim, D), (stack, "heads", "kv", "embed"), out_std, dt
    )
    if cfg.use_bias:
      self.out_bias = _param(None, (L, D), (stack, "embed"), 0, dt)
    self.ln2_scale = _ones((L, D), (stack, "embed"), dt)
    if norm_bias:
      self.ln2_bias = _param(None, (L, D), (stack, "embed"), 0, dt)
    if F:
      self.fc1_kernel = _param(rngs.params(), (L, *fc1_shape), (stack, *fc1_axes), std, dt)
      if cfg.use_bias:
        self.fc1_bias = _param(None, (L, *fc1_shape[1:]), (stack, *fc1_axes[1:]), 0, dt)
      self.fc2_kernel = _param(rngs.params(), (L, F, D), (stack, "mlp", "embed"), out_std, dt)
      if cfg.use_bias:
        self.fc2_bias = _param(None, (L, D), (stack, "embed"), 0, dt)
    if cfg.moe:
      moe.init_params(self, cfg, rngs, stack, std, out_std)
    if adapters is not None and adapters.enabled:
      contracted = {name: _CONTRACTED_AXES.get(name, 1) for name in kernels(cfg)}
      lora.add_adapters(self, adapters, contracted, rngs, dt)


def residual_axes(cfg: ModelConfig) -> tuple[str, str, str]:
  """Logical axes of the residual stream [B, T, D]: sequence-sharded with sequence parallelism."""
  return ("batch", "act_seq" if cfg.sequence_parallel else "length", "act_embed")


def weight_matmul(cfg: ModelConfig):
  """The einsum the block's weight matmuls run: FP8 (model/fp8.py), block-scaled
  (model/block_scaled.py) or in the compute dtype (model/matmul.py)."""
  if cfg.fp8:
    return fp8.einsum
  if cfg.block_scaling != "none":
    return functools.partial(block_scaled.einsum, fmt=cfg.block_scaling)
  return dense.einsum


def _sequence_major(cfg: ModelConfig, batch: int) -> tuple[Callable, Callable, Callable]:
  """(array, einsum spec, logical axes) -> the same laid out sequence-major, [T, B, ...],
  for the attention output projection and the MLP; the identities unless sequence
  parallelism runs more than one sequence a micro-batch.

  A region's exit reduce-scatters its product along the sequence and its entry
  all-gathers its input along it; a collective splits and joins whole blocks of the
  leading axis. Laid out [B, T, ...], XLA reordered the whole sequence around each of
  them: the exits' bfloat16 products and the MLP's FP8 input, a pass over T x B x D
  apiece (GPT-3 175B as published on 512 H100, micro-batch 2: 10.31 -> 10.05 s a step).
  Megatron keeps every activation [s, b, h] for the same reason. Sequence-major, the
  reorders are of the attention output (in the pass that casts it to FP8), of the MLP's
  normed input and of the blocks' products (shards of 1/tensor of the sequence)."""
  if not (cfg.sequence_parallel and batch > 1):
    same = lambda a: a  # noqa: E731
    return same, same, same
  return (
    lambda a: jnp.swapaxes(a, 0, 1),
    lambda spec: spec.replace("bt", "tb"),
    lambda axes: (axes[1], axes[0], *axes[2:]),
  )


def block(cfg: ModelConfig, x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  """One pre-norm transformer block. x: [B, T, D]; p: one layer's parameters.

  The constraints mark the tensor-parallel regions: Q/K/V and fc1 outputs are split over
  heads / MLP width, and the output projections' partial sums return to the residual
  stream's sharding: an all-reduce, or with sequence parallelism a reduce-scatter along
  the sequence (and the next region's input an all-gather). K/V heads fewer than the
  tensor ranks are replicated (rules.py SPLIT_WHERE_ENOUGH).
  """
  residual = residual_axes(cfg)
  matmul = weight_matmul(cfg)

  def tensor_parallel(spec, h, w, h_axes, w_axes, out_axes):
    if isinstance(w, lora.LoraWeight):  # the frozen kernel's product plus its adapter's
      y = tensor_parallel(spec, h, w.base, h_axes, w_axes, out_axes)
      return constrain(y + lora.delta(spec, h, w, h_axes), out_axes)
    if cfg.sequence_parallel:
      return sequence.matmul(
        matmul,
        spec,
        h,
        w,
        h_axes,
        w_axes,
        out_axes,
        tensor_in_fn=cfg.fp8,
        whole_mesh=cfg.block_scaling != "none",
      )
    return constrain(matmul(spec, h, w), out_axes)

  def biased(y, name):
    return y + p[name] if cfg.use_bias else y

  x = checkpoint_name(constrain(x, residual), "layer_input")
  h = norm(cfg, x, p, "ln1")
  if cfg.mla:
    # Rotary dims rotated by each token's true position (context parallelism's order).
    q, k, v = mla.qkv(cfg, h, p, context.positions(h.shape[1]))
  elif cfg.grouped_query:
    q, k, v = _grouped_qkv(cfg, h, p, tensor_parallel, biased)
  else:
    # [B, T, 3, H, K] is the matmul's natural output order; putting the q/k/v axis first
    # made XLA:CPU transpose the kernel and the activations in every layer.
    qkv_axes = ("batch", "length", "qkv", "act_heads", None)
    qkv = tensor_parallel(
      "btd,dchk->btchk", h, p["qkv_kernel"], residual, ("embed", "qkv", "heads", "kv"), qkv_axes
    )
    qkv = checkpoint_name(constrain(biased(qkv, "qkv_bias"), qkv_axes), "qkv")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  if cfg.positions == "rope" and not cfg.mla:
    # Each token's true position: with context parallelism the tokens are in
    # load-balanced order (parallelism/context.py).
    positions = context.positions(q.shape[1])
    q, k = rope.rotate(q, cfg, positions), rope.rotate(k, cfg, positions)
  if context.ranks() > 1:
    a = context.attention(
      q,
      k,
      v,
      lambda q, k, v, mask: attention(q, k, v, cfg.attention, mask),
      ("batch", "length", "act_heads", None),
      ("batch", "length", "act_kv_heads" if cfg.grouped_query else "act_heads", None),
    )
  else:
    a = attention(q, k, v, cfg.attention)
  a = checkpoint_name(a, "attention")
  swap, order, axes_in = _sequence_major(cfg, x.shape[0])
  out = tensor_parallel(
    order("bthk,hkd->btd"),
    swap(a),
    p["out_kernel"],
    axes_in(("batch", "length", "act_heads", None)),
    ("heads", "kv", "embed"),
    axes_in(residual),
  )
  x = biased(x + swap(out), "out_bias")
  x = checkpoint_name(x, "mid_residual")
  h = norm(cfg, x, p, "ln2")
  if cfg.moe:
    # The routed experts' output joins the residual; the shared experts (if any) are the
    # dense MLP below.
    x = x + constrain(moe.routed(cfg, h, p)[0], residual)
    if "fc1_kernel" not in p:
      return x
  mlp_axes = axes_in(("batch", "length", "act_mlp"))
  h = swap(h)
  if cfg.mlp == "swiglu":
    gate_up_axes = axes_in(("batch", "length", None, "act_mlp"))
    h = tensor_parallel(
      order("btd,dcf->btcf"),
      h,
      p["fc1_kernel"],
      axes_in(residual),
      ("embed", "gate_up", "mlp"),
      gate_up_axes,
    )
    h = checkpoint_name(constrain(biased(h, "fc1_bias"), gate_up_axes), "fc1")
    h = jax.nn.silu(h[:, :, 0]) * h[:, :, 1]
  else:
    h = tensor_parallel(
      order("btd,df->btf"), h, p["fc1_kernel"], axes_in(residual), ("embed", "mlp"), mlp_axes
    )
    h = jax.nn.gelu(checkpoint_name(constrain(biased(h, "fc1_bias"), mlp_axes), "fc1"))
  h = tensor_parallel(
    order("btf,fd->btd"), h, p["fc2_kernel"], mlp_axes, ("mlp", "embed"), axes_in(residual)
  )
  return biased(x + swap(h), "fc2_bias")


def _grouped_qkv(cfg: ModelConfig, h: jax.Array, p: dict, tensor_parallel, biased):
  """Grouped-query attention's projections: q [B, T, H, K], k and v [B, T, G, K]."""
  residual = residual_axes(cfg)
  q_axes = ("batch", "length", "act_heads", None)
  q = tensor_parallel("btd,dhk->bthk", h, p["q_kernel"], residual, ("embed", "heads", "kv"), q_axes)
  q = checkpoint_name(constrain(biased(q, "q_bias"), q_axes), "qkv")
  # The K/V heads' axes as the mesh splits them: replicated where there are fewer than
  # tensor ranks (resolved here, since sequence parallelism's shard_map takes the names).
  w_axes, kv_axes = (
    _kv_heads_resolved(cfg, axes)
    for axes in (
      ("embed", "qkv", "kv_heads", "kv"),
      ("batch", "length", "qkv", "act_kv_heads", None),
    )
  )
  if cfg.sequence_parallel and "act_kv_heads" not in kv_axes:
    # Every rank needs every K/V head: each computes them for its own sequence shard and
    # all-gathers the result, 2GK values a token against the D of the normed input that
    # gathering first would move, and no rank computes another's tokens.
    matmul = lora.with_adapters(weight_matmul(cfg))
    kv = matmul("btd,dchk->btchk", h, p["kv_kernel"])
    kv = constrain(biased(kv, "kv_bias"), ("batch", "act_seq", "qkv", None, None))
    kv = _gathered(kv, kv_axes)
  else:
    kv = tensor_parallel("btd,dchk->btchk", h, p["kv_kernel"], residual, w_axes, kv_axes)
    kv = biased(kv, "kv_bias")
  kv = checkpoint_name(constrain(kv, kv_axes), "qkv")
  return q, kv[:, :, 0], kv[:, :, 1]


def _gathered(x: jax.Array, axes: tuple) -> jax.Array:
  """x resharded to axes, across as rules.on_wire says: the transpose of this all-gather
  is a reduce-scatter."""
  return constrain(on_wire(x), axes).astype(x.dtype)


def _kv_heads_resolved(cfg: ModelConfig, axes: tuple) -> tuple:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return axes
  sizes = [cfg.kv_heads if name in rules.SPLIT_WHERE_ENOUGH else 1 for name in axes]
  return rules.resolve(axes, sizes, mesh.shape)


def run_layers(
  cfg: ModelConfig,
  x: jax.Array,
  layer_params: dict[str, jax.Array],
  chunk: tuple[jax.Array, int] | None = None,
  unroll: bool = False,
) -> jax.Array:
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
  if "dense_prefix" in layer_params:
    # A MoE model's first dense layers: their own stack, run first (not pipelined).
    layer_params = dict(layer_params)
    x = run_layers(cfg.dense_prefix(), x, layer_params.pop("dense_prefix"), unroll=unroll)
    cfg = cfg.routed_stack()
  policy = _REMAT[cfg.remat]
  step = jax.checkpoint(
    lambda carry, p: (block(cfg, carry, p), None), policy=policy, prevent_cse=False
  )
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

  def __init__(
    self,
    cfg: ModelConfig,
    rngs: nnx.Rngs,
    pipelined: bool = False,
    adapters: lora.LoraConfig | None = None,
  ):
    cfg.validate()
    self.cfg = cfg
    # Pipelined, the dense first layers of a MoE model run before the pipeline (`prefix`),
    # not in every chunk: layer_params leaves them out.
    self.pipelined = pipelined
    # LoRA (model/lora.py): adapters on the kernels it targets, the base frozen.
    self.adapters = adapters if adapters is not None and adapters.enabled else None
    D, V, dt = cfg.d_model, cfg.padded_vocab, jnp.dtype(cfg.param_dtype)
    self.wte = _param(rngs.params(), (V, D), ("vocab", "embed"), 0.02, dt)
    if cfg.positions == "learned":
      self.wpe = _param(rngs.params(), (cfg.seq_len, D), ("position", "embed"), 0.01, dt)
    if cfg.moe and cfg.first_dense_layers:
      self.dense_layers = Layers(cfg.dense_prefix(), rngs)
      self.layers = Layers(cfg.routed_stack(), rngs, "stage" if pipelined else "layers")
    else:
      self.layers = Layers(cfg, rngs, "stage" if pipelined else "layers", adapters)
    if cfg.mtp_layers:
      # Multi-token prediction (ModelConfig.mtp_layers), per module: norms of the incoming
      # hidden state and of the shifted tokens' embedding, their concatenation [2, D]
      # projected to D, a block, and the module's own final norm before the shared head.
      M = cfg.mtp_layers
      self.mtp_blocks = Layers(cfg.mtp_stack(), rngs)
      self.mtp_hidden_norm_scale = _ones((M, D), ("layers", "embed"), dt)
      self.mtp_embed_norm_scale = _ones((M, D), ("layers", "embed"), dt)
      # The output width unsplit: "embed" already splits the input's over fsdp.
      self.mtp_proj = _param(rngs.params(), (M, 2, D, D), ("layers", None, "embed", None), 0.02, dt)
      self.mtp_final_norm_scale = _ones((M, D), ("layers", "embed"), dt)
    self.lnf_scale = _ones((D,), ("embed",), dt)
    if cfg.use_bias and cfg.norm == "layernorm":
      self.lnf_bias = _param(None, (D,), ("embed",), 0, dt)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs.params(), (D, V), ("embed", "vocab"), 0.02, dt)

  def _cast(self, a: nnx.Param) -> jax.Array:
    return a[...].astype(jnp.dtype(self.cfg.compute_dtype))

  def _token_table(self) -> jax.Array:
    # Gather the table over fsdp first (as FSDP does for every weight) so the lookup
    # is vocab-parallel over tensor only; otherwise the partitioner replicates it.
    return constrain(self._cast(self.wte), ("vocab", None))

  def layer_params(
    self,
    scales: dict | None = None,
    dropout_key: jax.Array | None = None,
    quantize: bool = True,
  ) -> dict[str, jax.Array | fp8.CastWeight]:
    """The stacked layer parameters in the compute dtype; with FP8 the matmul kernels
    with their FP8 casts, with block scaling their quantizations (unless `quantize` is
    False: `quantized_rows` makes them, a chunk at a time), made once here for every
    layer call of the step; with LoRA the target kernels as lora.LoraWeight (their
    adapter dropout drawn from dropout_key). scales:
    delayed scaling's {kernel: (input scales [L], gradient scales [L])}."""
    params = self._cast_stack(self.layers)
    if hasattr(self, "dense_layers") and not self.pipelined:
      params["dense_prefix"] = self._cast_stack(self.dense_layers)
    if self.cfg.fp8:
      names = kernels(self.cfg)
      if scales and set(scales) != set(names):
        # Delayed scaling's histories are keyed by kernel; histories for another model's
        # kernels would leave these current-scaled and record nothing.
        raise UserInputError(
          f"model.fp8_amax_history: amax histories for {', '.join(sorted(scales))}, "
          f"but this model's FP8 kernels are {', '.join(names)}; use "
          "model.fp8_amax_history=0 (current scaling)"
        )
      for name in names:
        w = fp8.cast_weights(params[name], (scales or {}).get(name))
        # A kernel may be stored split over `data` (train.shard_optimizer): its cast is
        # gathered whole, in FP8 (otherwise the constraint changes nothing).
        axes = getattr(self.layers, name).get_metadata()["axes"]
        params[name] = w._replace(cast=constrain(w.cast, axes))
    elif self.cfg.block_scaling != "none" and quantize:
      params = self._block_scaled(self.layers, params)
      if "dense_prefix" in params:
        params["dense_prefix"] = self._block_scaled(self.dense_layers, params["dense_prefix"])
    if self.adapters is not None:
      params = lora.adapted(self.layers, params, scales or {}, self.adapters, dropout_key)
    return params

  def quantized_rows(self, rows: dict[str, jax.Array]) -> dict:
    """Rows of layer_params(quantize=False)'s stack [C, ...] (a pipeline chunk's) with
    their block-scaled kernels' quantizations, as layer_params makes them for the stack."""
    return self._block_scaled(self.layers, rows)

  def _cast_stack(self, layers: Layers) -> dict[str, jax.Array]:
    """A stack's parameters in the compute dtype. The router biases stay in float32
    (model/moe.py): their cotangents are token counts, which bfloat16 would round."""
    return {
      name: v[...] if name == moe.BIAS else self._cast(v)
      for name, v in vars(layers).items()
      if isinstance(v, nnx.Param)
    }

  def _compute_stack(self, layers: Layers) -> dict:
    """A stack run outside layer_params (the pipelined dense prefix, the multi-token
    prediction blocks): cast, and block-scaled where the model is."""
    params = self._cast_stack(layers)
    if self.cfg.block_scaling == "none":
      return params
    return self._block_scaled(layers, params)

  def _block_scaled(self, layers: Layers, params: dict) -> dict:
    """params (one stack's, in the compute dtype) with each block-scaled weight matmul's
    kernel carrying its quantizations, made once a step (block_scaled.quantize_weights),
    where its shape allows (`cacheable`; otherwise each matmul quantizes it)."""
    fmt, params = self.cfg.block_scaling, dict(params)
    shapes = {n: a.shape for n, a in params.items() if hasattr(a, "shape")}  # not sub-stacks
    for name in cast_once_kernels(self.cfg, shapes):
      contracted, batch = _CONTRACTED_AXES.get(name, 1), _BATCH_AXES.get(name, 0)
      # A kernel stored split over `data` (train.shard_optimizer) is gathered whole in the
      # compute dtype and quantized after, as Megatron's distributed optimizer gathers an
      # MXFP8 model's parameters in bf16 and casts them in the copy out
      # (megatron/core/distributed/param_and_grad_buffer.py): quantized shard by shard, a
      # block could straddle two shards. The stored kernel stays as it is: the matmuls
      # read only the quantizations, and the whole copy lives only until they are made.
      axes = getattr(layers, name).get_metadata()["axes"]
      whole = constrain(params[name], axes)
      w = block_scaled.quantize_weights(whole, contracted, fmt, batch)
      params[name] = w._replace(weight=params[name], cast=tuple(constrain(c, axes) for c in w.cast))
    return params

  def embed(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> the residual stream entering the first layer [B, T, D]; with
    context parallelism the tokens in load-balanced order (targets permuted alike:
    parallelism/context.py `permuted`)."""
    tokens = context.permuted(tokens)
    x = self._token_table()[tokens]
    if self.cfg.positions == "learned":
      if context.ranks() > 1:
        x = x + self._cast(self.wpe)[context.positions(tokens.shape[1])]
      else:
        x = x + self._cast(self.wpe)[: tokens.shape[1]]
    return constrain(x, residual_axes(self.cfg))

  def prefix(self, x: jax.Array) -> jax.Array:
    """Pipelined: the dense first layers of a MoE model on x [B, T, D] (identity without)."""
    if not hasattr(self, "dense_layers"):
      return x
    return run_layers(self.cfg.dense_prefix(), x, self._compute_stack(self.dense_layers))

  def head(self, x: jax.Array) -> jax.Array:
    """The last layer's output [B, T, D] -> logits [B, T, V] float32."""
    final = {"lnf_scale": self._cast(self.lnf_scale)}
    if hasattr(self, "lnf_bias"):
      final["lnf_bias"] = self._cast(self.lnf_bias)
    return self._logits(norm(self.cfg, x, final, "lnf"))

  def mtp_logits(
    self, x: jax.Array, targets: jax.Array, block_cfg: ModelConfig | None = None
  ) -> list[jax.Array]:
    """Multi-token prediction: the last layer's output x [B, T, D] and the next tokens
    targets [B, T] -> for module k = 1 .. mtp_layers, logits [B, T, V] float32 whose
    position i predicts token i + k + 1, i.e. targets rolled k to the left (its last k
    positions have no such token: train/step.py masks them). Module k reads the previous
    module's output (x for the first) and the embedding of token i + k, targets rolled
    k - 1 (DeepSeek-V3 section 2.2); the embedding table and the head are the model's.
    block_cfg: the blocks' configuration (default cfg.mtp_stack())."""
    cfg = self.cfg
    block_cfg = block_cfg or cfg.mtp_stack()
    params = self._compute_stack(self.mtp_blocks)
    axes = residual_axes(cfg)
    logits, h = [], x
    for k in range(cfg.mtp_layers):
      # Token i + k + 1 of the sequence: with context parallelism perhaps another rank's.
      shifted = constrain(self._token_table()[context.shifted(targets, k)[0]], axes)
      scale = lambda name: {"n_scale": self._cast(getattr(self, name))[k]}
      both = jnp.stack(  # [B, 2, T, D]
        [
          norm(cfg, h, scale("mtp_hidden_norm_scale"), "n"),
          norm(cfg, shifted, scale("mtp_embed_norm_scale"), "n"),
        ],
        axis=1,
      )
      h = constrain(jnp.einsum("bctd,cde->bte", both, self._cast(self.mtp_proj)[k]), axes)
      h = run_layers(block_cfg, h, jax.tree.map(lambda a: a[k : k + 1], params))
      logits.append(self._logits(norm(cfg, h, scale("mtp_final_norm_scale"), "n")))
    return logits

  def _logits(self, x: jax.Array) -> jax.Array:
    """The shared output head: normed hidden states [B, T, D] -> logits [B, T, V] float32."""
    if self.cfg.block_scaled_head:
      w = self._token_table().T if self.cfg.tie_embeddings else self._cast(self.lm_head)
      # Quantized in each call, [D, V] along D and along V (block_scaled.einsum).
      logits = block_scaled.einsum("btd,dv->btv", x, w, self.cfg.block_scaling)
    elif self.cfg.tie_embeddings:
      logits = jnp.einsum("btd,vd->btv", x, self._token_table())
    else:
      logits = jnp.einsum("btd,dv->btv", x, self._cast(self.lm_head))
    return constrain(logits, ("batch", "length", "act_vocab")).astype(jnp.float32)

  def __call__(self, tokens: jax.Array, scales: dict | None = None) -> jax.Array:
    return self.head(run_layers(self.cfg, self.embed(tokens), self.layer_params(scales)))
