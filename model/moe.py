"""Mixture-of-experts feed-forward layers for the one decoder (model/gpt.py).

A MoE layer replaces the block's MLP by E routed SwiGLU experts of width Fe, each token sent
to k of them, plus `num_shared_experts` shared experts that every token passes through (the
block's own fc1/fc2 kernels at width num_shared_experts x Fe, so the dense MLP code runs them,
tensor parallel as ever). Routing, as configured (model/config.py):

- scores: softmax over the experts (Mixtral, Qwen3-MoE) or a sigmoid per expert (DeepSeek-V3,
  arXiv:2412.19437 section 2.1.2); the k gates are the selected scores, renormalised to sum
  to 1 when router_topk_norm, times router_scale (DeepSeek-V3's routed_scaling_factor 2.5).
- aux-loss-free balancing (DeepSeek-V3 section 2.1.2): a per-expert bias added to the
  scores for the selection only, never to the gates. It is a parameter of the layer stack
  (`router_bias`) whose "gradient" is, by construction (`_attach`'s custom VJP), the
  number of tokens each expert was given; the train step takes it out before the optimizer
  and moves the bias by router_bias_rate x sign(mean load - load) (`balance`), outside the
  gradient. Summed over micro-batches and data-parallel replicas like any gradient, the
  load is the whole step's.
- group-limited routing (DeepSeek-V3's node-limited routing, its n_group / topk_group): the
  experts split into router_groups groups, each scored by the sum of its two best biased
  scores; a token picks among the experts of its router_topk_groups best groups only.
- the sequence-wise balance loss (DeepSeek-V3 eq. 17-20): per sequence,
  sum_i f_i P_i with f_i = E / (k T) x tokens choosing expert i and P_i the mean over the
  sequence of expert i's normalised score; times aux_loss_coef, averaged over sequences.
  Its gradient is attached to the layer's output (as Megatron-Core's MoEAuxLossAutoScaler
  does), so the reported loss is the language-model loss alone.

Dispatch: capacity buffers. Each sequence is a group of T tokens; expert e takes at most
C = ceil(capacity_factor x k T / E) of them (capacity_factor 0: C = T, the most one expert can
get from a sequence, so no token is ever dropped). Slots go first choices first, then by
position; an assignment past C is dropped (that token's gate for it contributes nothing).
With context parallelism each rank's slab of T / CP tokens is a group of its own (C from
T / CP, positions in the slab's load-balanced order, parallelism/context.py), as the train
step maps the slabs apart: the dispatch stays inside a rank, at the price of drops that
differ from one device's under a capacity factor (dropless, none differ). The
tokens are gathered into a [B, E, C, D] buffer by index (no one-hot matmul: that would cost
2 B T E C D FLOPs, more than the experts at DeepSeek-V3's E = 256), resharded from batch-split
to expert-split (`expert` mesh axis), which the partitioner emits as an all-to-all, run
through the experts as two batched matmuls, resharded back (the second all-to-all) and
combined by index with the gates. That is model.moe_dispatch=capacity. With
moe_dispatch=allgather (Megatron-Core's all-gather token dispatcher) each `expert` rank
all-gathers its expert group's tokens and slots instead (`gathered_dispatch`), fills only
its own experts' slots, and after the experts weighs its outputs for the group's tokens;
the partial sums are reduce-scattered back (`scattered_combine`). The routing, slots and
drops are the same; what moves is the group's tokens, (EP - 1) / EP x D a token each way,
against k x capacity_factor x (EP - 1) / EP x D for the all-to-alls: more where EP > k,
but independent of the capacity (dropless buffers are E / k times the tokens), and an
all-gather crosses InfiniBand once per node where an all-to-all crosses it per GPU. Both
run as explicit collectives in shard_maps (the partitioner, left to place them, gathered
whole index arrays and all-reduced the combine).

Experts and `tensor`. By default each expert's width is split over `tensor` like the MLP's
(Megatron's expert tensor parallel size = TP): every tensor rank dispatches and combines
the whole micro-batch's buffer, and the experts' partial outputs are all-reduced over
`tensor`. With model.experts_over_tensor the experts are whole, split over `tensor` x
`expert` (tensor-major; expert tensor parallel size 1, as Megatron-Bridge's DeepSeek-V3
recipes run TP 2): tensor rank i dispatches only the slots of its share i of the experts
(`shared_dispatch`), the all-to-alls over `expert` move 1 / TP of the buffer, and each
rank's combine of its share's outputs is a partial sum all-reduced over `tensor`
(`shared_combine`), the same all-reduce as the width-split experts'.

Grouped GEMMs as capacity-buffer einsums, not jax.lax.ragged_dot. jax 0.10.2 compiles
ragged_dot for a CUDA target (deviceless, projection/aot_compile.py) as a dense dot over
every group, the input masked per group: DeepSeek-V3's up-projection on one GPU of EP 32
([4,096, 7,168] x [32, 7,168, 2,048]) compiles to 32.0x the grouped GEMM's FLOPs, forward and
backward (`python benchmarks/ragged_dot_check.py`); timed on an H100 with jax 0.11.2 it is
still so, 8.2x slower than these einsums (`--measure`, docs/gpu_check.md). The buffer's
static [E, C] shape also lets the GSPMD partitioner split the experts over `expert` with
sharding constraints alone, and its matmuls have the shapes a balanced routing gives,
which is what the projection costs (routing taken as balanced). The price is padding: C
slots per expert whether filled or not (capacity_factor x the assigned tokens; dropless,
E / k times).

Shapes: B sequences, T tokens, D d_model, E experts, k experts a token, C capacity, F expert
width, G router groups.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from errors import UserInputError
from model import block_scaled
from model.config import ModelConfig
from parallelism import context, pipeline, rules
from parallelism.rules import constrain, on_wire, spec
from parallelism.sequence import TENSOR

# The combine all-to-all's output, by name for the remat policies (model/gpt.py). Saved
# in place of the experts' output it is made of (the same bytes), the backward pass reads
# it where it would redo the all-to-all (the gates' gradient needs the combined values),
# and the stash keeps it in the layout the backward reads. The dispatch's output is not
# saved: the backward redoes that all-to-all for the up-projection's weight gradient,
# which costs less than stashing another buffer (DeepSeek-V3 at 8,192 GB300: 2.99 s a
# step and 270 GB a GPU saved against 2.77 s and 238 GB redone).
RETURNED_NAME = "moe_returned"

EXPERT = "expert"  # the mesh axis the routed experts split over


# The parameters a MoE layer adds to the stack (besides the shared experts' fc1/fc2).
PARAMS = ("router_kernel", "router_bias", "expert_fc1", "expert_fc2")
BIAS = "router_bias"


def init_params(
  layers: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs, stack: str, std: float, out_std: float
) -> None:
  """Adds the routed experts' parameters, stacked over `stack`, to the layer stack module."""
  L, D, E, F = cfg.num_layers, cfg.d_model, cfg.num_experts, cfg.expert_ffn_dim
  dt = jnp.dtype(cfg.param_dtype)
  normal = lambda shape: jax.random.normal(rngs.params(), shape, dt)
  # The router is small (D x E) and every token needs every score: replicated over `expert`.
  layers.router_kernel = nnx.Param(std * normal((L, D, E)), axes=(stack, "embed", None))
  # A vector per layer: no weight decay (train/optimizer.py decays matrices only). Float32
  # whatever the parameters' type: DeepSeek-V3's steps of 1e-3 are below bfloat16's spacing
  # once a bias passes 0.25 (Megatron-Core keeps its expert bias in float32 likewise).
  layers.router_bias = nnx.Param(jnp.zeros((L, E), jnp.float32), axes=(stack, None))
  experts, width = ("expert", "expert_mlp")
  if cfg.experts_over_tensor:
    experts, width = ("expert_by_tensor", None)
  layers.expert_fc1 = nnx.Param(
    std * normal((L, E, D, 2, F)), axes=(stack, experts, "embed", "gate_up", width)
  )
  layers.expert_fc2 = nnx.Param(
    out_std * normal((L, E, F, D)), axes=(stack, experts, width, "embed")
  )


def check_mesh(cfg: ModelConfig, mesh_shape: dict[str, int]) -> None:
  """What model/moe.py runs on a mesh: experts dividing over `expert`, and `expert` only
  with experts."""
  ways = mesh_shape.get("expert", 1)
  if not cfg.moe:
    if ways > 1:
      raise UserInputError(
        f"mesh.expert = {ways} needs a mixture of experts (model.num_experts > 0)"
      )
    return
  if cfg.experts_over_tensor:
    tensor = mesh_shape.get(TENSOR, 1)
    if cfg.num_experts % (ways * tensor):
      raise UserInputError(
        f"model.num_experts = {cfg.num_experts} does not divide over mesh.expert = {ways} "
        f"x mesh.tensor = {tensor} (model.experts_over_tensor)"
      )
  if cfg.num_experts % ways:
    raise UserInputError(
      f"model.num_experts = {cfg.num_experts} does not divide over mesh.expert = {ways}"
    )


def capacity(cfg: ModelConfig, tokens: int) -> int:
  """Slots per expert for a group of `tokens` tokens (see the module docstring)."""
  if cfg.capacity_factor <= 0:
    return tokens
  slots = math.ceil(cfg.capacity_factor * tokens * cfg.experts_per_token / cfg.num_experts)
  return min(tokens, slots)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """jax.lax.top_k over the last axis (the same values and indices, ties to the lower index)
  as a stable sort, which the partitioner splits along every other axis. jax.lax.top_k
  reaches XLA as a TopK of rank 2 whose rows merge the batch dimensions, and under the
  1F1B ranks' vmap the partitioner gathers it whole across the data, expert and pipeline
  ranks: DeepSeek-V3 on 512 GB200 would gather two 1 GiB arrays of scores over 256 GPUs in
  every routed layer's forward and its recompute (15,408 all-gathers, 24.8 s of a step)."""
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  values, indices = jax.lax.sort((-x, index), dimension=x.ndim - 1, is_stable=True, num_keys=1)
  return -values[..., :k], indices[..., :k]


def route(
  cfg: ModelConfig, logits: jax.Array, bias: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """logits [B, T, E] float32, bias [E] -> (experts [B, T, k] int32, gates [B, T, k] float32,
  scores [B, T, E] float32). The bias picks, the unbiased scores weigh."""
  E, k = cfg.num_experts, cfg.experts_per_token
  scores = jax.nn.sigmoid(logits) if cfg.router_score == "sigmoid" else jax.nn.softmax(logits)
  # Selection only: no gradient flows through the choices.
  biased = jax.lax.stop_gradient(scores + bias.astype(jnp.float32))
  if cfg.router_groups > 1:
    B, T, G = *biased.shape[:2], cfg.router_groups
    grouped = biased.reshape(B, T, G, E // G)
    best = top_k(grouped, min(2, E // G))[0].sum(-1)  # [B, T, G]
    _, groups = top_k(best, cfg.router_topk_groups)  # [B, T, topk_groups]
    allowed = jax.nn.one_hot(groups, G, dtype=jnp.bool_).any(-2)  # [B, T, G]
    allowed = jnp.repeat(allowed, E // G, axis=-1)  # [B, T, E]
    biased = jnp.where(allowed, biased, -jnp.inf)
  _, experts = top_k(biased, k)
  gates = jnp.take_along_axis(scores, experts, axis=-1)
  if cfg.router_topk_norm:
    gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
  return experts, gates * cfg.router_scale, scores


def slots(experts: jax.Array, num_experts: int, capacity_slots: int) -> tuple[jax.Array, jax.Array]:
  """experts [B, T, k] -> (slot [B, T, k] int32: e x C + position in e's queue, or E x C when
  dropped; counts [B, E]: assignments per expert before dropping). First choices queue
  first, then by position in the sequence."""
  B, T, k = experts.shape
  E, C = num_experts, capacity_slots
  chosen = jax.nn.one_hot(experts, E, dtype=jnp.int32)  # [B, T, k, E]
  queue = chosen.transpose(0, 2, 1, 3).reshape(B, k * T, E)  # choice-major
  position = ((jnp.cumsum(queue, axis=1) - 1) * queue).sum(-1)  # [B, k T]
  position = position.reshape(B, k, T).transpose(0, 2, 1)  # [B, T, k]
  slot = jnp.where(position < C, experts * C + position, E * C)
  return slot, chosen.sum((1, 2))


def dispatch(
  x: jax.Array, slot: jax.Array, num_slots: int, batch_axes: tuple = ("batch", None)
) -> jax.Array:
  """x [B, T, D] -> the buffer [B, S, D] (S = E x C) by index; empty slots are zeros.
  batch_axes: the logical axes of the token indices [B, S] (inside `_by_hand`, none)."""
  B, T, k = slot.shape
  rows = jnp.arange(B)[:, None, None]
  tokens = jnp.broadcast_to(jnp.arange(T)[None, :, None], slot.shape)
  # Which token fills each slot (T: none, a zero row); the drop slot S is cut off.
  token_of_slot = jnp.full((B, num_slots + 1), T, jnp.int32).at[rows, slot].set(tokens)
  # Operand and indices split alike over the batch, so the gather stays on each rank.
  token_of_slot = constrain(token_of_slot, batch_axes)
  padded = constrain(jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1), (*batch_axes, None))
  return jnp.take_along_axis(padded, token_of_slot[:, :num_slots, None], axis=1)


def _local_slots(slot: jax.Array, mesh_axis: str, local_slots: int) -> jax.Array:
  """Slots (indices into all E x C) -> indices into this `mesh_axis` rank's local_slots
  (rank r holds slots r x local_slots onward), or local_slots for an assignment to
  another rank's experts or dropped. Inside a shard_map manual over mesh_axis."""
  local = slot - jax.lax.axis_index(mesh_axis) * local_slots
  return jnp.where((local >= 0) & (local < local_slots), local, local_slots)


def shared_dispatch(x: jax.Array, slot: jax.Array, num_slots: int, shares: int) -> jax.Array:
  """`dispatch` with the slots in `shares` contiguous shares, share i on tensor rank i
  (model.experts_over_tensor): x [B, T, D] (whole on every tensor rank) -> [B, shares,
  S / shares, D]; each tensor rank gathers only its share's tokens."""

  def local(x, slot):  # [b, T, D], [b, T, k] -> [b, 1, S / shares, D]
    per = num_slots // shares
    return dispatch(x, _local_slots(slot, TENSOR, per), per, (None, None))[:, None]

  batch = ("batch", None, None)
  return _by_hand(local, (batch, batch), ("batch", "tensor_share", None, None))(x, slot)


def shared_combine(y: jax.Array, slot: jax.Array, gates: jax.Array) -> jax.Array:
  """`combine` for y [B, shares, S / shares, D] with share i on tensor rank i: each rank
  weighs its own experts' outputs (assignments to other shares' experts read a zero
  row), and the partial sums are all-reduced over `tensor` (as the partial sums of
  experts split by width are)."""

  def local(y, slot, gates):  # [b, 1, S / shares, D], [b, T, k] x 2 -> [b, T, D]
    partial = combine(y[:, 0], _local_slots(slot, TENSOR, y.shape[2]), gates)
    return jax.lax.psum(partial, TENSOR)

  batch = ("batch", None, None)
  return _by_hand(local, (("batch", "tensor_share", None, None), batch, batch), batch)(
    y, slot, gates
  )


def _by_hand(fn, in_axes: tuple, out_axes: tuple):
  """fn on each rank's blocks, manual over every mesh axis (as parallelism/context.py's
  attention, and for the same reasons: under the pipeline's vmaps; every collective in fn
  explicit). in_axes and out_axes: the logical axes (rules.py) of its inputs and output."""
  mesh = jax.sharding.get_abstract_mesh()
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=tuple(spec(axes) for axes in in_axes),
    out_specs=spec(out_axes),
    axis_names=set(mesh.axis_names),
    check_vma=False,
  )


def _group_slots(slot: jax.Array, local_slots: int) -> jax.Array:
  """A rank's slots [b, T, k] -> its expert group's [b EP, T, k] (all-gathered over
  `expert`), as indices into this rank's local_slots (E / EP experts' C each), or
  local_slots for an assignment to another rank's experts or dropped."""
  group = jax.lax.all_gather(slot, EXPERT, axis=0, tiled=True)
  return _local_slots(group, EXPERT, local_slots)


def gathered_dispatch(h: jax.Array, slot: jax.Array, experts: int, capacity_slots: int):
  """The all-gather dispatch (model.moe_dispatch=allgather): h [B, T, D] and slot [B, T, k]
  split over the batch -> the buffer [B, E, C, D] split over `expert` along E, each rank
  filling its own experts' slots from its expert group's tokens, all-gathered."""
  D = h.shape[-1]

  def local(h, slot):  # [b, T, D], [b, T, k] -> [b EP, E / EP, C, D]
    local_experts = experts // jax.lax.axis_size(EXPERT)
    slots = _group_slots(slot, local_experts * capacity_slots)
    group = jax.lax.all_gather(h, EXPERT, axis=0, tiled=True)
    buffer = dispatch(group, slots, local_experts * capacity_slots, (None, None))
    return buffer.reshape(-1, local_experts, capacity_slots, D)

  batch = ("batch", None, None)
  return _by_hand(local, (batch, batch), ("expert_batch", "act_expert", None, None))(h, slot)


def scattered_combine(y: jax.Array, slot: jax.Array, gates: jax.Array) -> jax.Array:
  """The all-gather dispatch's combine: y [B, E, C, D] split over `expert` along E, slot and
  gates [B, T, k] split over the batch -> [B, T, D] likewise: each rank weighs its own
  experts' outputs for its expert group's tokens, and the partial sums are
  reduce-scattered over `expert` back to the batch's split."""

  def local(y, slot, gates):  # [b EP, E / EP, C, D], [b, T, k] x 2 -> [b, T, D]
    b, local_experts, capacity_slots, D = y.shape
    slots = _group_slots(slot, local_experts * capacity_slots)
    group_gates = jax.lax.all_gather(gates, EXPERT, axis=0, tiled=True)
    partial = combine(y.reshape(b, -1, D), slots, group_gates)
    summed = jax.lax.psum_scatter(on_wire(partial), EXPERT, scatter_dimension=0, tiled=True)
    return summed.astype(y.dtype)

  batch = ("batch", None, None)
  return _by_hand(local, (("expert_batch", "act_expert", None, None), batch, batch), batch)(
    y, slot, gates
  )


def combine(y: jax.Array, slot: jax.Array, gates: jax.Array) -> jax.Array:
  """y [B, S, D] the experts' outputs, slot and gates [B, T, k] -> [B, T, D]."""
  B, T, k = slot.shape
  padded = jnp.concatenate([y, jnp.zeros_like(y[:, :1])], axis=1)  # [B, S + 1, D]
  padded = constrain(padded, ("batch", None, None))
  index = constrain(slot.reshape(B, T * k, 1), ("batch", None, None))
  picked = jnp.take_along_axis(padded, index, axis=1)  # [B, T k, D]
  # Elementwise, not an einsum: k is small, and a dot here would be matmul work the FLOPs
  # formula (model/flops.py) does not count.
  return (picked.reshape(B, T, k, -1) * gates.astype(y.dtype)[..., None]).sum(2)


def balance_loss(cfg: ModelConfig, scores: jax.Array, counts: jax.Array) -> jax.Array:
  """The sequence-wise balance loss, averaged over sequences (unscaled). scores [B, T, E],
  counts [B, E]. On a context rank's slab (parallelism/context.py) the loss is this slab's
  share of its sequences': f from the whole sequences' counts (summed over the slabs), P
  from this slab's scores over the whole length, so that the slabs' shares, like their
  gradients, sum to the sequences' loss."""
  E, k = cfg.num_experts, cfg.experts_per_token
  T = scores.shape[1]
  if context.slabbed():
    counts, T = jax.lax.psum(counts, context.SLAB), T * context.ranks()
  normalised = scores / scores.sum(-1, keepdims=True)
  f = jax.lax.stop_gradient(counts.astype(jnp.float32)) * E / (k * T)  # [B, E]
  p = normalised.sum(1) / T  # [B, E]
  return (f * p).sum(-1).mean()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attach(
  coef: float, y: jax.Array, aux: jax.Array, bias: jax.Array, load: jax.Array, weight: jax.Array
):
  """y unchanged; backward: aux's gradient is coef x weight, bias's is load x weight (see
  the module docstring; weight 0: a pipeline's padding row, parallelism/pipeline.py)."""
  return y


def _attach_fwd(coef, y, aux, bias, load, weight):
  return y, (aux, bias, load, weight)


def _attach_bwd(coef, residuals, g):
  aux, bias, load, weight = residuals
  return (
    g,
    jnp.full_like(aux, coef) * weight,
    (load * weight).astype(bias.dtype),
    jnp.zeros_like(load),
    jnp.zeros_like(weight),
  )


_attach.defvjp(_attach_fwd, _attach_bwd)


def routed(cfg: ModelConfig, h: jax.Array, p: dict) -> tuple[jax.Array, jax.Array]:
  """The routed experts on the normed residual h [B, T, D] with one layer's parameters p ->
  (output [B, T, D], dropped assignments [] int32)."""
  B, T, D = h.shape
  E, C = cfg.num_experts, capacity(cfg, h.shape[1])
  h = constrain(h, ("batch", "length", None))
  logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), p["router_kernel"].astype(jnp.float32))
  experts, gates, scores = route(cfg, logits, p[BIAS])
  slot, counts = slots(experts, E, C)
  dropped = (slot == E * C).sum()
  # Shares of the experts, one a tensor rank (model.experts_over_tensor); with one tensor
  # rank that is the plain capacity dispatch.
  shares = rules.ranks(TENSOR) if cfg.experts_over_tensor else 1
  experts_on = "act_expert_by_tensor" if cfg.experts_over_tensor else "act_expert"
  expert_axes = ("expert_batch", experts_on, None, None)
  gathered = cfg.moe_dispatch == "allgather" and rules.ranks(EXPERT) > 1
  if gathered:
    buffer = gathered_dispatch(h, slot, E, C)
  elif shares > 1:
    buffer = shared_dispatch(h, slot, E * C, shares)  # [B, shares, E / shares x C, D]
    # Batch-split -> expert-split within each share: the dispatch all-to-all over `expert`.
    buffer = constrain(
      buffer.reshape(B, shares, E // shares, C, D),
      ("expert_batch", "tensor_share", "act_expert", None, None),
    )
    buffer = buffer.reshape(B, E, C, D)
  else:
    buffer = dispatch(h, slot, E * C).reshape(B, E, C, D)
  # Batch-split -> expert-split: the dispatch all-to-all (capacity).
  buffer = constrain(buffer, expert_axes)
  # One GEMM an expert (the expert axis a batch axis), block-scaled with block scaling.
  matmul = block_scaled.einsum_for(cfg.block_scaling)
  up = matmul("becd,edgf->becgf", buffer, p["expert_fc1"])
  width = None if cfg.experts_over_tensor else "act_mlp"
  up = constrain(up, (*expert_axes, None, width))
  act = jax.nn.silu(up[..., 0, :]) * up[..., 1, :]  # [B, E, C, F]
  out = constrain(matmul("becf,efd->becd", act, p["expert_fc2"]), expert_axes)
  if gathered:
    y = checkpoint_name(scattered_combine(out, slot, gates), RETURNED_NAME)
  elif shares > 1:
    # Expert-split -> batch-split within each share: the combine all-to-all over `expert`.
    out = out.reshape(B, shares, E // shares * C, D)
    out = checkpoint_name(constrain(out, ("batch", "tensor_share", None, None)), RETURNED_NAME)
    y = shared_combine(out, slot, gates)
  else:
    # Expert-split -> batch-split: the combine all-to-all.
    out = checkpoint_name(constrain(out, ("batch", None, None, None)), RETURNED_NAME)
    y = combine(out.reshape(B, E * C, D), slot, gates)
  if cfg.aux_loss_coef > 0 or cfg.router_bias_rate > 0:
    aux = balance_loss(cfg, scores, counts) if cfg.aux_loss_coef > 0 else jnp.zeros(())
    row = pipeline.row_weight()
    weight = jnp.ones((), jnp.float32) if row is None else row
    y = _attach(cfg.aux_loss_coef, y, aux, p[BIAS], counts.sum(0).astype(jnp.float32), weight)
  return y, dropped


# The parameter stacks whose routed layers carry router biases: the layers, and the
# multi-token prediction modules' blocks (model/gpt.py).
ROUTED_STACKS = ("layers", "mtp_blocks")


def take_loads(grads: nnx.State) -> tuple[nnx.State, dict[str, jax.Array] | None]:
  """The step's gradients with the router biases' entries zeroed, and those entries by
  stack: the tokens each expert was given, [L, E] (None without routed layers)."""
  loads = {}
  for name in ROUTED_STACKS:
    stack = grads.get(name) if hasattr(grads, "get") else None
    if stack is None or BIAS not in stack:
      continue
    load = stack[BIAS][...]
    stack[BIAS] = stack[BIAS].replace(jnp.zeros_like(load))
    loads[name] = load.astype(jnp.float32)
  return grads, loads or None


def balance(params: nnx.State, loads: dict[str, jax.Array] | None, rate: float) -> nnx.State:
  """The router biases moved by rate towards uniform load: + rate where an expert got fewer
  tokens than the mean, - rate where more (DeepSeek-V3 section 2.1.2)."""
  if loads is None or rate <= 0:
    return params
  for name, load in loads.items():
    bias = params[name][BIAS]
    step = rate * jnp.sign(load.mean(-1, keepdims=True) - load)
    params[name][BIAS] = bias.replace((bias[...] + step).astype(bias[...].dtype))
  return params


def load_imbalance(loads: dict[str, jax.Array]) -> jax.Array:
  """Mean over routed layers of the busiest expert's load over the mean load (1:
  balanced); rows that routed nothing (a pipeline's padding rows, parallelism/pipeline.py)
  left out."""
  load = jnp.concatenate(list(loads.values()))  # [layers of every stack, E]
  routed = load.sum(-1) > 0
  ratio = load.max(-1) / jnp.maximum(load.mean(-1), 1e-20)
  return jnp.where(routed, ratio, 0).sum() / jnp.maximum(routed.sum(), 1)
