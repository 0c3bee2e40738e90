"""The sharded train step: loss, gradients, AdamW update, all under one jit.

Inputs and outputs carry explicit shardings derived from the logical-axis rules; the
state is donated so parameters and moments are updated in place.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from errors import UserInputError
from model.config import ModelConfig
from model import fp8
from model.gpt import GPT, KERNELS, residual_axes, run_layers
from parallelism import one_f_one_b, pipeline, rules, sharding
from train.config import TrainConfig
from train.optimizer import learning_rate_schedule, make_optimizer

# Name scope of the gradient-accumulation loop. It survives into the optimized HLO as the
# while op's metadata op_name (".../grad_accumulation/while"), which is how
# projection/project.py finds the loop whose trip count is the number of micro-batches.
GRAD_ACCUMULATION_SCOPE = "grad_accumulation"


class TrainState(NamedTuple):
  step: jax.Array       # int32 scalar
  params: nnx.State     # model parameters, NNX variables carrying logical axes
  opt_state: Any        # optax state; its moments mirror `params`
  # FP8 delayed scaling: {kernel: fp8.AmaxHistory [L, 2, N]}, the layers in the stack's
  # order; empty otherwise.
  fp8_history: dict


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token loss. logits [B, T, V] float32, targets [B, T] int32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@dataclasses.dataclass(frozen=True)
class TrainProgram:
  """Everything needed to initialise, lower and run the train step on one mesh."""
  mesh: Mesh
  init: Callable[[], TrainState]                  # jitted, sharded initialisation
  step: Callable[[TrainState, dict], tuple[TrainState, dict]]  # jitted train step
  abstract_state: TrainState                      # shapes + shardings, nothing allocated
  batch_sharding: NamedSharding
  micro_batches: int = 1          # per data-parallel replica: accumulated, or pipelined

  def abstract_batch(self, global_batch: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    shape = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=self.batch_sharding)
    return {"inputs": shape, "targets": shape}

  def lower(self, global_batch: int, seq_len: int) -> jax.stages.Lowered:
    with jax.set_mesh(self.mesh):
      return self.step.lower(self.abstract_state, self.abstract_batch(global_batch, seq_len))


def check_fp8_schedule(model_cfg: ModelConfig, train_cfg: TrainConfig, stages: int) -> None:
  """FP8 delayed scaling, pipelined, needs the 1f1b schedule: autodiff of the lockstep
  loops (parallelism/pipeline.py) would sum the micro-batches' amaxes, not keep the largest."""
  if stages > 1 and model_cfg.delayed_scaling and train_cfg.pipeline_schedule != "1f1b":
    raise UserInputError("model.fp8_amax_history > 0 (delayed scaling) needs "
                         "train.pipeline_schedule = 1f1b when pipelined, got "
                         f"{train_cfg.pipeline_schedule!r}")


def build(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh) -> TrainProgram:
  model_cfg.validate()
  train_cfg.validate()
  tx = make_optimizer(train_cfg)
  schedule = learning_rate_schedule(train_cfg)
  stages, virtual = mesh.shape[pipeline.MESH_AXIS], train_cfg.virtual_stages
  pipelined = stages > 1
  if model_cfg.sequence_parallel and model_cfg.seq_len % mesh.shape["tensor"]:
    raise UserInputError(f"model.seq_len = {model_cfg.seq_len} does not divide over mesh tensor "
                         f"= {mesh.shape['tensor']} (model.sequence_parallel)")

  check_fp8_schedule(model_cfg, train_cfg, stages)

  def init() -> TrainState:
    params = nnx.state(GPT(model_cfg, nnx.Rngs(train_cfg.seed), pipelined), nnx.Param)
    if pipelined:
      params["layers"] = pipeline.stage_order(params["layers"], stages, virtual)
    history = {}
    if model_cfg.delayed_scaling:
      stack_axis = "stage" if pipelined else "layers"
      history = {name: fp8.new_history(model_cfg.num_layers, model_cfg.fp8_amax_history,
                                       stack_axis) for name in KERNELS}
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), history)

  data_ways = sharding.data_parallel_ways(mesh)
  if train_cfg.global_batch % data_ways:
    raise UserInputError(f"train.global_batch = {train_cfg.global_batch} does not divide over "
                         f"mesh data x fsdp = {data_ways}")
  per_replica = train_cfg.global_batch // data_ways
  if train_cfg.micro_batch and per_replica % train_cfg.micro_batch:
    raise UserInputError(f"train.micro_batch = {train_cfg.micro_batch} does not divide the "
                         f"{per_replica} sequences per data-parallel replica")
  micro_batches = per_replica // train_cfg.micro_batch if train_cfg.micro_batch else 1
  pipeline_schedule = train_cfg.pipeline_schedule
  passes = (pipeline.passes(train_cfg.pipeline_passes, micro_batches, stages, pipeline_schedule)
            if pipelined else 1)
  per_pass = micro_batches // passes
  if pipelined:
    pipeline.check(model_cfg.num_layers, stages, virtual, micro_batches, passes,
                   pipeline_schedule)
  abstract = jax.eval_shape(init)
  sharding.check_divisible(abstract.params, mesh)
  state_shardings = sharding.named_shardings(abstract, mesh)
  if train_cfg.shard_optimizer:
    state_shardings = state_shardings._replace(
        opt_state=sharding.over_data(abstract.opt_state, mesh))
    if model_cfg.fp8:
      # The FP8 matmuls' kernels are kept split over `data` like their moments: the
      # forward reads only their casts, which each step all-gathers in FP8 (half the bytes
      # of gathering the updated bfloat16 kernels; Megatron's --fp8-param-gather).
      params = state_shardings.params
      layers = {**params["layers"], **{name: sharding.over_data(abstract.params["layers"][name],
                                                                mesh) for name in KERNELS}}
      state_shardings = state_shardings._replace(params=type(params)({**params, "layers": layers}))
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(model_cfg, nnx.Rngs(0), pipelined)))
  batch_sharding = sharding.batch_sharding(mesh)
  replicated = NamedSharding(mesh, PartitionSpec())

  # Every loss below is differentiated for (params, scales): scales are FP8 delayed
  # scaling's {kernel: (input scales [L], gradient scales [L])} ({} otherwise), and their
  # "gradients" the amaxes observed, kept as the largest over micro-batches and replicas.
  loss_and_grads_of = lambda loss_fn: jax.value_and_grad(loss_fn, argnums=(0, 1))

  def loss_fn(params, scales, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"], scales)
    return cross_entropy(logits, batch["targets"])

  def split(batch):
    # [B, T] -> [B/n, n, T] keeps each device's rows on it (rows are sharded in
    # contiguous blocks); the micro-batch index then moves to the front.
    n = micro_batches
    return jax.tree.map(lambda x: x.reshape(-1, n, x.shape[-1]).swapaxes(0, 1), batch)

  def pipelined_loss_fn(params, scales, micro):
    # One data-parallel replica's micro-batches micro [M', mb, T] through the pipeline.
    model = nnx.merge(graphdef, params)
    x = jax.vmap(model.embed)(micro["inputs"])
    x = pipeline.run(lambda x, p, chunk: run_layers(model_cfg, x, p, chunk),
                     model.layer_params(scales), x, stages, virtual)
    # The head's micro-batches split over the stages, which would otherwise all repeat it.
    spread = pipeline.MESH_AXIS if per_pass % stages == 0 else None
    logits = jax.vmap(model.head, spmd_axis_name=spread)(x)
    return cross_entropy(logits, micro["targets"])

  def accumulated(loss_and_grads_fn, params, scales, micro):
    """Mean loss and gradients over the leading axis of micro, one entry at a time; the
    largest amaxes."""
    def accumulate(carry, entry):
      (total, (total_grads, top)), (loss, (grads, amaxes)) = carry, loss_and_grads_fn(
          params, scales, entry)
      return (total + loss, (jax.tree.map(jnp.add, total_grads, grads),
                             jax.tree.map(jnp.maximum, top, amaxes))), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, (params, scales)))
    with jax.named_scope(GRAD_ACCUMULATION_SCOPE):
      (loss, (grads, amaxes)), _ = jax.lax.scan(accumulate, zeros, micro)
    n = jax.tree.leaves(micro)[0].shape[0]
    return loss / n, (jax.tree.map(lambda x: x / n, grads), amaxes)

  def replica_loss_and_grads(params, scales, rows):
    # rows [B/R, T]: one data-parallel replica's share; its micro-batches [M, mb, T] run
    # through the pipeline in `passes` passes of M' = M / passes.
    micro = jax.tree.map(lambda x: x.reshape(passes, per_pass, *x.shape[1:]), split(rows))
    grad_fn = loss_and_grads_of(pipelined_loss_fn)
    if passes == 1:
      return grad_fn(params, scales, jax.tree.map(lambda x: x[0], micro))
    return accumulated(grad_fn, params, scales, micro)

  def one_f_one_b_loss_and_grads(params, scales, rows):
    # rows [B/R, T]: one data-parallel replica's share, its micro-batches [M, mb, T]
    # through the 1F1B schedule, which runs the backward pass itself: the embedding and
    # the layers' casts before it are differentiated here with jax.vjp, the head in it.
    micro = split(rows)
    group_targets = micro["targets"].reshape(-1, stages, *micro["targets"].shape[1:])
    rest = nnx.State({k: v for k, v in params.items() if k != "layers"})

    def front(params):
      model = nnx.merge(graphdef, params)
      # Every rank embeds the micro-batches itself (only rank 0 reads them): embedded once,
      # they were all-reduced over `pipeline`, and their gradients too (512 H100 as
      # published: 2 x 1.6 GB, 0.1 s a step).
      tokens = pipeline.pin(jnp.broadcast_to(micro["inputs"], (stages, *micro["inputs"].shape)))
      with rules.vmapped(pipeline.MESH_AXIS):
        x = jax.vmap(jax.vmap(model.embed), spmd_axis_name=pipeline.MESH_AXIS)(tokens)  # [P, M, ...]
      return x, model.layer_params(scales)

    (x, layer_params), front_vjp = jax.vjp(front, params)
    weights, casts, layer_scales = fp8.split_casts(layer_params)

    def head(ys, group):  # ys [P, mb, T, D]: a group's last-layer outputs
      def group_loss(rest, ys):
        model = nnx.merge(graphdef, nnx.State({**rest, "layers": params["layers"]}))
        logits = jax.vmap(model.head, spmd_axis_name=pipeline.MESH_AXIS)(ys)
        return cross_entropy(logits, group_targets[group]) * stages / micro_batches
      loss, vjp = jax.vjp(group_loss, rest, ys)
      d_rest, d_ys = vjp(jnp.ones_like(loss))
      return loss, d_ys, d_rest

    loss, d_weights, amaxes, d_x, d_rest = one_f_one_b.run(
        lambda x, w, s, c: run_layers(model_cfg, x, fp8.with_casts(w, c, s), unroll=True),
        weights, layer_scales, casts, x, head, stages, virtual, residual_axes(model_cfg))
    zeros = jax.tree.map(jnp.zeros_like, (casts, layer_scales))
    grads = front_vjp((d_x, fp8.with_casts(d_weights, *zeros)))[0]
    head_grads = dict(jax.tree_util.tree_flatten_with_path(d_rest)[0])
    return loss, (jax.tree_util.tree_map_with_path(
        lambda path, g: g + head_grads[path] if path in head_grads else g, grads), amaxes)

  def loss_and_grads(params, scales, batch):
    """(loss, (gradients, amaxes)) of the global batch."""
    if pipelined:
      # Each replica accumulates its own gradients (vmapped with the weights unbatched:
      # its gradients come out per replica, sharded over `data`) through every pipeline
      # trip and pass; the mean over replicas, one reduction over `data`, comes after.
      replicas = mesh.shape["data"]
      rows = jax.tree.map(lambda x: x.reshape(replicas, -1, x.shape[-1]), batch)  # [R, B/R, T]
      with rules.vmapped("data"):
        replica = (one_f_one_b_loss_and_grads if pipeline_schedule == "1f1b"
                   else replica_loss_and_grads)
        loss, (grads, amaxes) = jax.vmap(replica, in_axes=(None, None, 0),
                                         spmd_axis_name="data")(params, scales, rows)
      # Summed in the gradients' own dtype, as the reduction over `data` runs (jnp.sum
      # would convert bfloat16 to float32 first and all-reduce twice the bytes).
      over_replicas = lambda op: lambda x: jax.lax.reduce(x, jnp.zeros((), x.dtype), op, (0,))
      mean = lambda x: over_replicas(jax.lax.add)(x) / replicas
      return mean(loss), (jax.tree.map(mean, grads),
                          jax.tree.map(over_replicas(jax.lax.max), amaxes))
    if micro_batches == 1:
      return loss_and_grads_of(loss_fn)(params, scales, batch)
    return accumulated(loss_and_grads_of(loss_fn), params, scales, split(batch))

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    history = {name: h[...] for name, h in state.fp8_history.items()}
    scales = {name: fp8.delayed_scales(h) for name, h in history.items()}
    loss, (grads, amaxes) = loss_and_grads(state.params, scales, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule(state.step)}
    history = {name: state.fp8_history[name].replace(fp8.record(h, amaxes[name]))
               for name, h in history.items()}
    return TrainState(state.step + 1, params, opt_state, history), metrics

  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings)
  return TrainProgram(
      mesh=mesh,
      init=jax.jit(init, out_shardings=state_shardings),
      step=jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated), donate_argnums=0),
      abstract_state=abstract_state,
      batch_sharding=batch_sharding,
      micro_batches=micro_batches)
