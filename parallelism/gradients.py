"""The gradient strategies: one step's loss, gradients and FP8 amaxes of a batch.

Every strategy is a `LossAndGrads`, (params, scales, batch) -> (loss, (grads, amaxes)),
built by `strategy(plan, pieces)` from a `Plan` (how the batch is split and which
schedule runs it) and the model's `LossPieces` (its loss as functions of its parameters,
which the train step passes in: this layer does not import the model). The train step
jits whichever it gets and never branches on the schedule.

- plain: the whole batch differentiated at once;
- accumulated: the batch as M micro-batches, differentiated one at a time in a loop
  (name scope ACCUMULATION_SCOPE);
- lockstep (train.pipeline_schedule gpipe / interleaved): each data-parallel replica's
  micro-batches through pipeline.run, differentiated by autodiff, in `passes` passes
  accumulated as above;
- 1f1b: each replica's micro-batches through one_f_one_b.run, which runs the layers'
  backward itself; the embedding is differentiated around it, the head inside it.

scales are FP8 delayed scaling's {kernel: (input scales [L], gradient scales [L])} ({}
otherwise), differentiated with params: their cotangents are the amaxes observed, and
where gradients are summed (over micro-batches, passes, 1F1B trips, replicas) the amaxes
are maximised. Autodiff of the lockstep loops would sum them, so the lockstep schedules
refuse delayed scaling (`check_scales`).
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from errors import UserInputError
from parallelism import context, one_f_one_b, pipeline, rules

# Name scope of the gradient-accumulation loop. It survives into the optimized HLO as the
# while op's metadata op_name (".../grad_accumulation/while"), which is how the projection
# finds the loop whose trip count is the number of micro-batches (or passes).
ACCUMULATION_SCOPE = "grad_accumulation"
DATA_AXIS = "data"

Params = Any  # the model's parameter tree
Scales = dict  # {kernel: (input scales [L], gradient scales [L])}, {} without delayed scaling
Batch = dict  # {"inputs", "targets"}: int32 [B, T]
LossAndGrads = Callable[[Params, Scales, Batch], tuple[jax.Array, tuple[Params, Scales]]]


class LossPieces(NamedTuple):
  """A model's loss as the functions of its parameters that the strategies compose.

  The whole model is head(run_layers(embed(tokens), stack(scales))); b sequences of T
  tokens, width D, vocabulary V, L stacked layers.
  """

  embed: Callable[[Params, jax.Array], jax.Array]  # (params, tokens [b, T]) -> x [b, T, D]
  # (params, scales) -> the layer stack [L, ...] as run_layers reads it (FP8 casts included)
  stack: Callable[[Params, Scales], Any]
  # (x, stack, chunk=None, unroll=False) -> x: every layer of the stack, or with
  # chunk = (first, count) its rows first .. first + count - 1 (sliced inside the remat
  # boundary); unroll: the layer loop unrolled
  run_layers: Callable[..., jax.Array]
  head: Callable[[Params, jax.Array], jax.Array]  # (params, x [b, T, D]) -> logits [b, T, V]
  loss: Callable[[jax.Array, jax.Array], jax.Array]  # (logits [..., V], targets [...]) -> mean
  split_params: Callable[[Params], tuple[Params, Any]]  # params -> (the rest, the layer stack)
  join_params: Callable[[Params, Any], Params]  # the inverse of split_params
  # stack -> (weights to differentiate, constants (FP8 casts), scales) and its inverse
  split_stack: Callable[[Any], tuple[Any, Any, Any]]
  join_stack: Callable[[Any, Any, Any], Any]
  activation_axes: Sequence[str | None]  # logical axes of x [b, T, D]
  # Pipelined: (params, x) -> x, layers run after the embedding, before the pipeline (a
  # MoE model's dense first layers, which the stack of routed layers cannot hold); None:
  # none.
  prefix: Callable[[Params, jax.Array], jax.Array] | None = None
  # The layers' backward adds to weight gradients beyond what the output's cotangent
  # gives (model/moe.py): the 1F1B schedule drops idle trips' weight gradients.
  zero_idle_grads: bool = False
  # Multi-token prediction (model.mtp_layers): (params, x [b, T, D] the last layer's
  # output, targets [b, T]) -> its loss, scaled, to add to the mean loss; None: none.
  mtp: Callable[[Params, jax.Array, jax.Array], jax.Array] | None = None
  # With Plan.gather_specs: (params, one chunk's kernels [C, ...]) -> their constants
  # (block scaling's quantizations), made in the 1F1B fill chunk by chunk
  # (train.overlap_param_gather; parallelism/one_f_one_b.py), `stack` then leaving them
  # out; None: `stack` makes every layer's.
  prepare: Callable[[Params, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one step's batch is split and scheduled."""

  schedule: str  # train.pipeline_schedule: gpipe, interleaved or 1f1b (pipelined only)
  stages: int  # mesh pipeline; 1: not pipelined
  virtual_stages: int
  replicas: int  # mesh data: pipelined, each replica runs its own pipeline
  micro_batches: int  # per data-parallel replica
  passes: int  # lockstep pipeline passes; 1 otherwise
  num_layers: int = 0  # model.num_layers (pipelined: whether the split is uneven); 0: even
  context_ranks: int = 1  # mesh context: each rank's slab of every sequence mapped apart
  # ((layer weight name, the layout of its gradient [L, ...]), ...): with 1f1b at V > 1,
  # the weight gradients to reduce over `data` during the drain (one_f_one_b.run's
  # reduce_specs; train/step.py chooses them)
  reduce_specs: tuple = ()
  # ((layer weight name, its layout as stored [L, ...]), ...): with 1f1b at V > 1, the
  # kernels stored split over `data` that the fill gathers and quantizes chunk by chunk
  # (one_f_one_b.run's stored_specs, LossPieces.prepare; train/step.py chooses them)
  gather_specs: tuple = ()

  @property
  def pipelined(self) -> bool:
    return self.stages > 1


def check_scales(schedule: str, stages: int, delayed_scaling: bool) -> None:
  """FP8 delayed scaling, pipelined, needs the 1f1b schedule: autodiff of the lockstep
  loops (parallelism/pipeline.py) would sum the micro-batches' amaxes, not keep the largest."""
  if stages > 1 and delayed_scaling and schedule != "1f1b":
    raise UserInputError(
      "model.fp8_amax_history > 0 (delayed scaling) needs "
      "train.pipeline_schedule = 1f1b when pipelined, got "
      f"{schedule!r}"
    )


def plan(
  num_layers: int,
  stages: int,
  virtual_stages: int,
  replicas: int,
  micro_batches: int,
  schedule: str,
  passes: int,
  context_ranks: int = 1,
  reduce_specs: tuple = (),
  gather_specs: tuple = (),
) -> Plan:
  """The plan of a step; bad pipeline shapes raise UserInputError naming the field.
  passes: train.pipeline_passes (0: pipeline.passes chooses). reduce_specs, gather_specs:
  see Plan, kept for the 1f1b schedule with data-parallel replicas only (gather_specs at
  V > 1)."""
  if stages == 1:
    return Plan(schedule, stages, virtual_stages, replicas, micro_batches, 1, 0, context_ranks)
  passes = pipeline.passes(passes, micro_batches, stages, schedule)
  pipeline.check(num_layers, stages, virtual_stages, micro_batches, passes, schedule)
  if schedule != "1f1b" or replicas == 1:
    reduce_specs = gather_specs = ()
  if virtual_stages == 1:
    gather_specs = ()
  return Plan(
    schedule,
    stages,
    virtual_stages,
    replicas,
    micro_batches,
    passes,
    num_layers,
    context_ranks,
    reduce_specs,
    gather_specs,
  )


def _active_rows(plan: Plan) -> Any:
  """An uneven split's layer flags by rank (pipeline.active_rows); None when even."""
  if not plan.num_layers:
    return None
  return pipeline.active_rows(plan.num_layers, plan.stages, plan.virtual_stages)


def strategy(plan: Plan, pieces: LossPieces) -> LossAndGrads:
  """The plan's strategy (see the module docstring)."""
  if plan.context_ranks > 1:
    # A slab's tokens are 1/CP of the replica's, and its loss their mean: scaled so, its
    # gradients (and the FP8 gradient amaxes observed) are the whole sequences', and the
    # slabs' sum is the replica's.
    whole_loss, slabs = pieces.loss, plan.context_ranks
    pieces = pieces._replace(loss=lambda logits, targets: whole_loss(logits, targets) / slabs)
  if plan.pipelined:
    replica = _one_f_one_b if plan.schedule == "1f1b" else _lockstep
    reduced = dict(plan.reduce_specs)
    return _over_replicas(replica(plan, pieces), plan.replicas, plan.context_ranks, reduced)
  plain = _loss_and_grads(_whole_model_loss(pieces))
  if plan.micro_batches > 1:
    whole = plain
    plain = lambda params, scales, batch: accumulated(
      whole, params, scales, split(batch, plan.micro_batches)
    )
  if plan.context_ranks == 1:
    return plain
  # The replicas are mapped apart with the slabs: left to the partitioner, `data` stays
  # automatic inside sequence parallelism's shard_maps, whose collectives then gathered
  # every replica's tokens (parallelism/sequence.py, which cannot nest a shard_map manual
  # over `data` under the slabs' vmap).
  return _over_replicas(plain, plan.replicas, plan.context_ranks)


def split(batch: Batch, micro_batches: int) -> Batch:
  """[B, T] -> [M, B/M, T]. Reshaped to [B/M, M, T] first, which keeps each device's rows
  on it (rows are sharded in contiguous blocks); the micro-batch index then moves to the
  front."""
  return jax.tree.map(lambda x: x.reshape(-1, micro_batches, x.shape[-1]).swapaxes(0, 1), batch)


def accumulated(
  loss_and_grads: LossAndGrads, params: Params, scales: Scales, micro: Batch
) -> tuple[jax.Array, tuple[Params, Scales]]:
  """Mean loss and gradients over the leading axis of micro, one entry at a time; the
  largest amaxes."""

  def accumulate(carry, entry):
    (total, (total_grads, top)), (loss, (grads, amaxes)) = (
      carry,
      loss_and_grads(params, scales, entry),
    )
    return (
      total + loss,
      (jax.tree.map(jnp.add, total_grads, grads), jax.tree.map(jnp.maximum, top, amaxes)),
    ), None

  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, (params, scales)))
  with jax.named_scope(ACCUMULATION_SCOPE):
    (loss, (grads, amaxes)), _ = jax.lax.scan(accumulate, zeros, micro)
  n = jax.tree.leaves(micro)[0].shape[0]
  return loss / n, (jax.tree.map(lambda x: x / n, grads), amaxes)


def _loss_and_grads(loss_fn: Callable[[Params, Scales, Batch], jax.Array]) -> LossAndGrads:
  return jax.value_and_grad(loss_fn, argnums=(0, 1))


def _whole_model_loss(pieces: LossPieces) -> Callable[[Params, Scales, Batch], jax.Array]:
  def loss_fn(params, scales, batch):
    x = pieces.embed(params, batch["inputs"])
    x = pieces.run_layers(x, pieces.stack(params, scales))
    return pieces.loss(pieces.head(params, x), batch["targets"]) + _mtp(pieces, params, x, batch)

  return loss_fn


def _mtp(pieces: LossPieces, params: Params, x: jax.Array, batch: Batch, axis=None) -> jax.Array:
  """The multi-token prediction loss of x [..., b, T, D] (0 without): vmapped over the
  leading axes, spmd over `axis`, their mean."""
  if pieces.mtp is None:
    return jnp.zeros((), jnp.float32)
  fn = lambda y, targets: pieces.mtp(params, y, targets)
  for _ in range(x.ndim - 3):
    fn = jax.vmap(fn, spmd_axis_name=axis)
  with rules.vmapped(*([axis] if axis and x.ndim > 3 else [])):
    return fn(x, batch["targets"]).mean()


def layer_weight_of(path, names) -> str | None:
  """The layer weight name a parameter tree path is of (params["layers"][name]), if in names."""
  keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  if len(keys) >= 2 and keys[0] == "layers" and keys[1] in names:
    return keys[1]
  return None


def _over_replicas(
  replica: LossAndGrads,
  replicas: int,
  context_ranks: int,
  reduced: dict | None = None,
) -> LossAndGrads:
  """replica (one data-parallel replica's rows [B/R, T], or with context ranks one rank's
  slab of them [B/R, T/CP], `context.slabs`) over the R replicas of mesh `data` and the CP
  ranks of `context`, vmapped with the weights unbatched: each replica's and slab's
  gradients build up locally through every micro-batch, pipeline trip and pass and come
  out per replica and slab, sharded over `data` and `context`; the mean over replicas of
  the slabs' sum, one reduction over both axes, comes after. (Left to the partitioner, a
  slab's weight gradients were all-reduced over `context` in every 1F1B trip: Llama 3.1
  405B at 8,192 H100 as published, 199 trips of 0.8 GB.) R = 1: `data` is left to the
  partitioner."""
  mapped = [
    (n, axis) for n, axis in ((replicas, DATA_AXIS), (context_ranks, context.CONTEXT)) if n > 1
  ]
  # Summed in the gradients' own dtype, as the reduction over the axes runs (jnp.sum would
  # convert bfloat16 to float32 first and all-reduce twice the bytes).
  dims = tuple(range(len(mapped)))
  over = lambda op: lambda x: jax.lax.reduce(x, jnp.zeros((), x.dtype), op, dims)
  # The slabs' losses are scaled to sum (`strategy`); the replicas' are means.
  mean = lambda x: over(jax.lax.add)(x) / replicas
  fn = replica
  if context_ranks > 1:
    fn = jax.vmap(fn, (None, None, 0), spmd_axis_name=context.CONTEXT, axis_name=context.SLAB)
  if replicas > 1:
    fn = jax.vmap(fn, (None, None, 0), spmd_axis_name=DATA_AXIS)

  def layout(x):  # [B, T] -> [R, CP, B/R, T/CP], without the axes of one
    x = context.slabs(x.reshape(replicas, -1, x.shape[-1]), context_ranks)  # [R, B/R, CP, T/CP]
    x = x.swapaxes(1, 2)
    return x.reshape(*(n for n, _ in mapped), *x.shape[2:])

  def loss_and_grads(params, scales, batch):
    with rules.vmapped(*(axis for _, axis in mapped)):
      loss, (grads, amaxes) = fn(params, scales, jax.tree.map(layout, batch))
    specs = reduced or {}
    axes = tuple(axis for _, axis in mapped)

    def combine(path, g):
      name = layer_weight_of(path, specs)
      if name is None:
        return mean(g)
      return one_f_one_b.join_reduced(g, specs[name], axes) / replicas

    grads = jax.tree_util.tree_map_with_path(combine, grads)
    return mean(loss), (grads, jax.tree.map(over(jax.lax.max), amaxes))

  return loss_and_grads


def _lockstep(plan: Plan, pieces: LossPieces) -> LossAndGrads:
  """One replica's micro-batches [M, mb, T] through pipeline.run in passes of M' = M /
  passes, each differentiated by autodiff of the pipeline loop."""
  stages, virtual, passes = plan.stages, plan.virtual_stages, plan.passes
  per_pass = plan.micro_batches // passes
  # The head's micro-batches split over the stages, which would otherwise all repeat it.
  spread = pipeline.MESH_AXIS if per_pass % stages == 0 else None

  def front(params, tokens):  # [M', mb, T] -> [M', mb, T, D]
    if pieces.prefix is None:
      return jax.vmap(lambda tokens: pieces.embed(params, tokens))(tokens)
    # The dense first layers of a MoE model: the pass's micro-batches as one batch, each
    # device's rows first (as the 1F1B schedule's `prefixed`).
    m, mb, T = tokens.shape
    x = pieces.prefix(params, pieces.embed(params, tokens.swapaxes(0, 1).reshape(mb * m, T)))
    return x.reshape(mb, m, *x.shape[1:]).swapaxes(0, 1)

  def pass_loss(params, scales, micro):  # micro [M', mb, T]
    x = front(params, micro["inputs"])
    x = pipeline.run(
      pieces.run_layers, pieces.stack(params, scales), x, stages, virtual, _active_rows(plan)
    )
    logits = jax.vmap(lambda y: pieces.head(params, y), spmd_axis_name=spread)(x)
    return pieces.loss(logits, micro["targets"]) + _mtp(pieces, params, x, micro, spread)

  pass_grads = _loss_and_grads(pass_loss)

  def replica(params, scales, rows):  # rows [B/R, T]
    micro = jax.tree.map(
      lambda x: x.reshape(passes, per_pass, *x.shape[1:]), split(rows, plan.micro_batches)
    )
    if passes == 1:
      return pass_grads(params, scales, jax.tree.map(lambda x: x[0], micro))
    return accumulated(pass_grads, params, scales, micro)

  return replica


def _one_f_one_b(plan: Plan, pieces: LossPieces) -> LossAndGrads:
  """One replica's micro-batches [M, mb, T] through the 1F1B schedule, which runs the
  layers' backward itself: the embedding and the layers' FP8 casts before it are
  differentiated here with jax.vjp, the head inside it, group by group."""
  stages, virtual, micro_batches = plan.stages, plan.virtual_stages, plan.micro_batches
  axis = pipeline.MESH_AXIS

  def chunk(x, weights, scales, constants, flags=None):
    stack = pieces.join_stack(weights, constants, scales)
    if flags is None:
      return pieces.run_layers(x, stack, unroll=True)
    # An uneven split: the chunk's rows one at a time, padding skipped.
    return pipeline.masked_chunk(pieces.run_layers, x, stack, 0, flags)

  def replica(params, scales, rows):  # rows [B/R, T]
    micro = split(rows, micro_batches)
    group_targets = micro["targets"].reshape(-1, stages, *micro["targets"].shape[1:])
    rest, layers = pieces.split_params(params)

    def front(params):
      if pieces.prefix is not None:
        return prefixed(params), pieces.stack(params, scales)
      # Every rank embeds the micro-batches itself (only rank 0 reads them): embedded once,
      # they were all-reduced over `pipeline`, and their gradients too (512 H100 as
      # published: 2 x 1.6 GB, 0.1 s a step).
      tokens = pipeline.pin(jnp.broadcast_to(micro["inputs"], (stages, *micro["inputs"].shape)))
      with rules.vmapped(axis):
        embed = lambda tokens: pieces.embed(params, tokens)
        x = jax.vmap(jax.vmap(embed), spmd_axis_name=axis)(tokens)  # [P, M, mb, T, D]
      return x, pieces.stack(params, scales)

    def prefixed(params):
      # The embedding and the prefix layers, the micro-batches split over the pipeline
      # ranks (M / P each: repeated on every rank, DeepSeek-V3's 3 dense layers would add a
      # fifth to each rank's work), then gathered over `pipeline` for rank 0 (the
      # gradients reduce-scattered back). Recomputed for the backward: kept, the 3 layers'
      # activations of M / P micro-batches would live through the whole pipeline.
      # A rank's M / P micro-batches run as one batch, each device's rows first (mb
      # major): vmapped over the micro-batches instead, cuDNN attention's batching rule
      # merges the micro-batch axis into the batch axis with the sharded rows minor, which
      # the partitioner can only lay out by all-gathering them over `expert` (193 GB at
      # 512 GB200, 30 times a step).
      tokens = micro["inputs"].reshape(stages, -1, *micro["inputs"].shape[1:])  # [P, M/P, mb, T]
      P, m, mb, T = tokens.shape
      rows = tokens.swapaxes(1, 2).reshape(P, mb * m, T)
      one = jax.checkpoint(lambda tokens: pieces.prefix(params, pieces.embed(params, tokens)))
      with rules.vmapped(axis):
        x = jax.vmap(one, spmd_axis_name=axis)(pipeline.pin(rows))  # [P, mb M/P, T, D]
      x = x.reshape(P, mb, m, *x.shape[2:]).swapaxes(1, 2).reshape(-1, mb, *x.shape[2:])
      return pipeline.pin(jnp.broadcast_to(x, (stages, *x.shape)))

    (x, stack), front_vjp = jax.vjp(front, params)
    weights, constants, stack_scales = pieces.split_stack(stack)
    reduced = dict(plan.reduce_specs)

    def head(ys, group):  # ys [P, mb, T, D]: a group's last-layer outputs
      # Differentiated rank by rank, so that each rank's gradients of the head's weights
      # stay its own until one_f_one_b.run sums them after the loops: summed over the
      # ranks here, they would be all-reduced over `pipeline` once a group (DeepSeek-V3 at
      # 512 GB200: the head's and the MTP module's, 60 times a step).
      def rank_loss(rest, y, targets):  # y [mb, T, D], one micro-batch
        whole = pieces.join_params(rest, layers)
        loss = pieces.loss(pieces.head(whole, y), targets)
        return (loss + _mtp(pieces, whole, y, {"targets": targets})) / micro_batches

      def rank(y, targets):
        loss, vjp = jax.vjp(lambda rest, y: rank_loss(rest, y, targets), rest, y)
        d_rest, d_y = vjp(jnp.ones_like(loss))
        return loss, d_y, d_rest

      losses, d_ys, d_rest = jax.vmap(rank, spmd_axis_name=axis)(ys, group_targets[group])
      return losses.sum(), d_ys, d_rest

    loss, d_weights, amaxes, d_x, d_rest = one_f_one_b.run(
      chunk,
      weights,
      stack_scales,
      constants,
      x,
      head,
      stages,
      virtual,
      pieces.activation_axes,
      _active_rows(plan),
      pieces.zero_idle_grads,
      reduced,
      functools.partial(pieces.prepare, params) if plan.gather_specs else None,
      dict(plan.gather_specs),
    )
    # The drain's reduced gradients are blocks of the replicas' sum, not this replica's
    # gradient: they bypass the embedding's vjp (identity on the layer weights, whose
    # compute and parameter dtypes train/step.py requires equal) and come out as they are.
    shards = {n: d_weights[n] for n in reduced}
    d_weights = {**d_weights, **{n: jnp.zeros_like(weights[n]) for n in reduced}}
    zeros = jax.tree.map(jnp.zeros_like, (constants, stack_scales))
    grads = front_vjp((d_x, pieces.join_stack(d_weights, *zeros)))[0]
    head_grads = dict(jax.tree_util.tree_flatten_with_path(d_rest)[0])

    def combine(path, g):
      name = layer_weight_of(path, shards)
      if name is not None:
        return shards[name]
      return g + head_grads[path] if path in head_grads else g

    return loss, (jax.tree_util.tree_map_with_path(combine, grads), amaxes)

  return replica
