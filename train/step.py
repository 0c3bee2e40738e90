"""The sharded train step: loss, gradients, AdamW update, all under one jit.

The loss and gradients come from the gradient strategy the configuration plans
(parallelism/gradients.py: plain, accumulated micro-batches, a lockstep pipeline or 1F1B),
given the GPT's loss in pieces (`loss_pieces`). Inputs and outputs carry explicit
shardings derived from the logical-axis rules; the state is donated so parameters and
moments are updated in place.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from errors import UserInputError
from model import fp8, lora, moe
from model.config import ModelConfig
from model.gpt import (
  GPT,
  GROUPED_QUERY_KERNELS,
  KERNELS,
  cast_once_kernels,
  kernels,
  residual_axes,
  run_layers,
)
from parallelism import context, gradients, one_f_one_b, pipeline, sharding
from train.config import TrainConfig
from train.optimizer import learning_rate_schedule, make_optimizer

# Every block kernel name of any model (lora.targets are checked against them).
_KNOWN_KERNELS = tuple(dict.fromkeys(KERNELS + GROUPED_QUERY_KERNELS))


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar
  params: nnx.State  # model parameters, NNX variables carrying logical axes
  # optax state; its moments mirror `params`, or with LoRA only its adapters
  # (model/lora.py: the rest is frozen)
  opt_state: Any
  # FP8 delayed scaling: {kernel: fp8.AmaxHistory [L, 2, N]}, the layers in the stack's
  # order; empty otherwise.
  fp8_history: dict


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token loss. logits [B, T, V] float32, targets [B, T] int32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def mtp_loss(logits: list[jax.Array], targets: jax.Array, scale: float) -> jax.Array:
  """Multi-token prediction's loss: scale x the mean over the modules of each one's mean
  cross-entropy. Module k's logits [B, T, V] predict targets [B, T] rolled k to the left
  (model/gpt.py `mtp_logits`); the sequence's last k positions have no such token and are
  left out. On a context rank's slab the mean is over the whole sequences' positions, so
  that the slabs' losses sum to it (parallelism/context.py `shifted`)."""
  T, total = targets.shape[-1], jnp.zeros((), jnp.float32)
  for k, module_logits in enumerate(logits, start=1):
    labels, valid, counted = context.shifted(targets, k)
    per_token = optax.softmax_cross_entropy_with_integer_labels(module_logits, labels)
    total += jnp.where(valid, per_token, 0).sum() / (counted * (per_token.size // T))
  return scale * total / len(logits)


@dataclasses.dataclass(frozen=True)
class TrainProgram:
  """Everything needed to initialise, lower and run the train step on one mesh."""

  mesh: Mesh
  init: Callable[[], TrainState]  # jitted, sharded initialisation
  step: Callable[[TrainState, dict], tuple[TrainState, dict]]  # jitted train step
  abstract_state: TrainState  # shapes + shardings, nothing allocated
  batch_sharding: NamedSharding
  micro_batches: int = 1  # per data-parallel replica: accumulated, or pipelined
  # Bytes a device holds of the layer gradients the 1F1B drain reduces over `data`, in
  # their reduced layout (1 / data of them): a buffer that shrinks as `data` grows.
  drain_reduced_bytes: int = 0

  def abstract_batch(self, global_batch: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    shape = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=self.batch_sharding)
    return {"inputs": shape, "targets": shape}

  def lower(self, global_batch: int, seq_len: int) -> jax.stages.Lowered:
    with jax.set_mesh(self.mesh):
      return self.step.lower(self.abstract_state, self.abstract_batch(global_batch, seq_len))


def loss_pieces(
  model_cfg: ModelConfig,
  graphdef: nnx.GraphDef,
  frozen: nnx.State | None = None,
  dropout_key: jax.Array | None = None,
) -> gradients.LossPieces:
  """The GPT's loss as functions of its parameters, for the gradient strategies. With
  LoRA the parameters differentiated are the adapters, and `frozen` the rest (constants
  of the step); dropout_key: this step's adapter dropout."""
  model = lambda params: nnx.merge(graphdef, params, *([frozen] if frozen is not None else []))

  def split_params(params):
    return nnx.State({k: v for k, v in params.items() if k != "layers"}), params["layers"]

  return gradients.LossPieces(
    embed=lambda params, tokens: model(params).embed(tokens),
    stack=lambda params, scales: model(params).layer_params(scales, dropout_key),
    run_layers=functools.partial(run_layers, model_cfg),
    head=lambda params, x: model(params).head(x),
    # The model runs the tokens in context parallelism's order: targets alike.
    loss=lambda logits, targets: cross_entropy(logits, context.permuted(targets)),
    split_params=split_params,
    join_params=lambda rest, layers: nnx.State({**rest, "layers": layers}),
    split_stack=fp8.split_casts,
    join_stack=fp8.with_casts,
    activation_axes=residual_axes(model_cfg),
    mtp=_mtp(model_cfg, model),
  )


def _mtp(model_cfg: ModelConfig, model: Callable, block_cfg: ModelConfig | None = None):
  """LossPieces.mtp: the multi-token prediction loss of the last layer's output, or None."""
  if not model_cfg.mtp_layers:
    return None
  scale = model_cfg.mtp_loss_scale
  return lambda params, x, targets: mtp_loss(
    model(params).mtp_logits(x, targets, block_cfg), targets, scale
  )


def _pieces(
  model_cfg: ModelConfig, graphdef: nnx.GraphDef, plan: gradients.Plan
) -> gradients.LossPieces:
  """The model's pieces; with plan.gather_specs the block-scaled kernels quantized a
  chunk at a time in the 1F1B fill; a pipelined MoE model's with its dense first layers
  as the prefix, idle trips' weight gradients dropped (the loads and the balance loss's gradient
  do not vanish with the output's cotangent), and the balance loss's coefficient over the
  M' micro-batches of a pass (all M under 1F1B): each micro-batch's forward attaches it
  whole, while a pass weighs each micro-batch's language-model loss 1 / M' (accumulation
  over the passes averages both)."""
  pieces = loss_pieces(model_cfg, graphdef)
  model = lambda params: nnx.merge(graphdef, params)
  if plan.gather_specs:
    pieces = pieces._replace(
      stack=lambda params, scales: model(params).layer_params(scales, quantize=False),
      prepare=lambda params, rows: fp8.split_casts(model(params).quantized_rows(rows))[1],
    )
  if not (plan.pipelined and model_cfg.moe):
    return pieces
  scaled = dataclasses.replace(
    model_cfg, aux_loss_coef=model_cfg.aux_loss_coef / (plan.micro_batches // plan.passes)
  )
  return pieces._replace(
    run_layers=functools.partial(run_layers, scaled),
    prefix=lambda params, x: model(params).prefix(x),
    zero_idle_grads=True,
    mtp=_mtp(model_cfg, model, scaled.mtp_stack()),
  )


def _chunk_loops_apply(train_cfg: TrainConfig, adapters: lora.LoraConfig) -> bool:
  """What the fill's gathering loop and the drain's reducing loop both need: the split
  optimizer, the 1f1b schedule at V > 1 and no LoRA adapters."""
  return (
    train_cfg.shard_optimizer
    and train_cfg.pipeline_schedule == "1f1b"
    and train_cfg.virtual_stages > 1
    and not adapters.enabled
  )


def _fill_gather_specs(
  model_cfg: ModelConfig,
  train_cfg: TrainConfig,
  mesh: Mesh,
  params: nnx.State,
  adapters: lora.LoraConfig,
) -> tuple:
  """((kernel, its layout as stored), ...) for the 1F1B fill to gather over `data` and
  quantize chunk by chunk (train.overlap_param_gather), or () where the step quantizes
  every kernel before the pipeline: no block scaling; no split optimizer (the kernels are
  whole: `build`); LoRA; one chunk a rank (V 1: the first trip reads every kernel)."""
  if not (
    train_cfg.overlap_param_gather
    and _chunk_loops_apply(train_cfg, adapters)
    and model_cfg.block_scaling != "none"
  ):
    return ()
  layers = params["layers"]
  names = cast_once_kernels(model_cfg, {name: v.shape for name, v in layers.items()})
  return tuple((n, sharding.over_data(layers[n], mesh).get_value().spec) for n in names)


def _drain_reduce_specs(
  model_cfg: ModelConfig,
  train_cfg: TrainConfig,
  mesh: Mesh,
  params: nnx.State,
  adapters: lora.LoraConfig,
) -> tuple:
  """((layer weight, the layout of its gradient: its optimizer state's), ...) for the 1F1B
  drain to reduce over `data` (train.overlap_grad_reduce), or () where the step reduces
  every gradient after the pipeline: no split optimizer; `fsdp` ranks, whose gradients
  take other layouts; one chunk a rank (V 1: no drain trip comes after a chunk is final
  but before the last); LoRA (adapters); a compute dtype other than the parameters' (the
  drain reduces the layers' gradients in the compute dtype, the step in the parameters').
  `expert` ranks reduce: within a replica the partitioner sums each trip's gradients of
  the weights shared by the expert ranks over `expert`, and the experts' own are whole.
  The router biases' entries (the experts' loads, model/moe.py) stay with the step: counts
  summed in float32, not moved by the optimizer."""
  if not (
    train_cfg.overlap_grad_reduce
    and _chunk_loops_apply(train_cfg, adapters)
    and mesh.shape.get("fsdp", 1) == 1
    and model_cfg.param_dtype == model_cfg.compute_dtype
  ):
    return ()
  layouts = sharding.over_data(params["layers"], mesh)
  specs = ((name, v.get_value().spec) for name, v in layouts.items() if name != moe.BIAS)
  return tuple((name, spec) for name, spec in specs if one_f_one_b.scatter_dim(spec))


def _drain_reduced_bytes(plan: gradients.Plan, layers: nnx.State, mesh: Mesh) -> int:
  """Bytes a device holds of the gradients the drain reduces, in their reduced layout."""
  return sharding.bytes_per_device(
    [
      jax.ShapeDtypeStruct(layers[n].shape, layers[n].dtype, sharding=NamedSharding(mesh, spec))
      for n, spec in plan.reduce_specs
    ]
  )


def build(
  model_cfg: ModelConfig,
  train_cfg: TrainConfig,
  mesh: Mesh,
  adapters: lora.LoraConfig | None = None,
) -> TrainProgram:
  """The train program of model_cfg and train_cfg on mesh; bad input raises UserInputError.
  adapters: LoRA fine-tuning (model/lora.py), None or rank 0: every parameter trains."""
  model_cfg.validate()
  train_cfg.validate()
  adapters = adapters or lora.LoraConfig()
  adapters.validate(kernels(model_cfg), _KNOWN_KERNELS, model_cfg.fp8)
  tx = make_optimizer(train_cfg)
  schedule = learning_rate_schedule(train_cfg)
  stages, virtual = mesh.shape[pipeline.MESH_AXIS], train_cfg.virtual_stages
  pipelined = stages > 1
  if model_cfg.sequence_parallel and model_cfg.seq_len % mesh.shape["tensor"]:
    raise UserInputError(
      f"model.seq_len = {model_cfg.seq_len} does not divide over mesh tensor "
      f"= {mesh.shape['tensor']} (model.sequence_parallel)"
    )

  model_cfg.validate_context(mesh.shape.get(context.CONTEXT, 1), mesh.shape["tensor"], stages)
  moe.check_mesh(model_cfg, dict(mesh.shape))
  stacked = model_cfg.stacked_layers  # the dense prefix runs before (gradients.LossPieces)
  gradients.check_scales(train_cfg.pipeline_schedule, stages, model_cfg.delayed_scaling)
  if adapters.enabled and pipelined:
    raise UserInputError(
      f"lora.rank = {adapters.rank} with mesh.pipeline = {stages}: LoRA runs without "
      "pipeline parallelism here (the published LoRA runs use none); set mesh.pipeline=1"
    )
  if adapters.enabled and model_cfg.moe:
    raise UserInputError(
      f"lora.rank = {adapters.rank} with model.num_experts = {model_cfg.num_experts}: LoRA "
      "fine-tunes dense models here; set lora.rank=0 or choose a dense model"
    )

  def init() -> TrainState:
    model = GPT(model_cfg, nnx.Rngs(train_cfg.seed), pipelined, adapters)
    params = nnx.state(model, nnx.Param)
    if pipelined:
      params["layers"] = pipeline.stage_order(params["layers"], stages, virtual)
    history = {}
    if model_cfg.delayed_scaling:
      stack_axis = "stage" if pipelined else "layers"
      # Pipelined, one history per stored row (an uneven split's padding included).
      rows = pipeline.stack_rows(stacked, stages, virtual) if pipelined else (model_cfg.num_layers)
      history = {
        name: fp8.new_history(rows, model_cfg.fp8_amax_history, stack_axis)
        for name in kernels(model_cfg)
      }
    opt_state = tx.init(lora.trainable_params(adapters, params))
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, history)

  data_ways = sharding.data_parallel_ways(mesh)
  if train_cfg.global_batch % data_ways:
    raise UserInputError(
      f"train.global_batch = {train_cfg.global_batch} does not divide over "
      f"mesh data x fsdp = {data_ways}"
    )
  per_replica = train_cfg.global_batch // data_ways
  if train_cfg.micro_batch and per_replica % train_cfg.micro_batch:
    raise UserInputError(
      f"train.micro_batch = {train_cfg.micro_batch} does not divide the "
      f"{per_replica} sequences per data-parallel replica"
    )
  micro_batches = per_replica // train_cfg.micro_batch if train_cfg.micro_batch else 1
  abstract = jax.eval_shape(init)
  plan = gradients.plan(
    stacked,
    stages,
    virtual,
    mesh.shape["data"],
    micro_batches,
    train_cfg.pipeline_schedule,
    train_cfg.pipeline_passes,
    mesh.shape.get(context.CONTEXT, 1),
    _drain_reduce_specs(model_cfg, train_cfg, mesh, abstract.params, adapters),
    _fill_gather_specs(model_cfg, train_cfg, mesh, abstract.params, adapters),
  )
  sharding.check_divisible(abstract.params, mesh)
  state_shardings = sharding.named_shardings(abstract, mesh)
  if train_cfg.shard_optimizer:
    state_shardings = state_shardings._replace(
      opt_state=sharding.over_data(abstract.opt_state, mesh)
    )
    layers = abstract.params["layers"]
    split = cast_once_kernels(model_cfg, {name: v.shape for name, v in layers.items()})
    if split and not adapters.enabled:
      # The kernels whose matmuls read only casts made once a step are kept split over
      # `data` like their moments, and no whole copy lives between steps: each step
      # all-gathers FP8's E4M3 casts (half the bytes of the updated bfloat16 kernels;
      # Megatron's --fp8-param-gather), or a block-scaled kernel to quantize it
      # (model/gpt.py `_block_scaled`; NVIDIA's MXFP8 DeepSeek-V3 runs gather their
      # parameters this way, with --fp8-param-gather on), where the forward starts
      # instead of after the update.
      split_layouts = {name: sharding.over_data(layers[name], mesh) for name in split}

      def kernel_split(path, leaf):
        name = gradients.layer_weight_of(path, split_layouts)
        return leaf if name is None else split_layouts[name]

      state_shardings = state_shardings._replace(
        params=jax.tree_util.tree_map_with_path(
          kernel_split, state_shardings.params, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
      )
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(model_cfg, nnx.Rngs(0), pipelined, adapters)))
  batch_sharding = sharding.batch_sharding(mesh)
  replicated = NamedSharding(mesh, PartitionSpec())

  # (params, scales, batch) -> (loss, (gradients, amaxes)) of the global batch.
  loss_and_grads = gradients.strategy(plan, _pieces(model_cfg, graphdef, plan))

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    history = {name: h[...] for name, h in state.fp8_history.items()}
    scales = {name: fp8.delayed_scales(h) for name, h in history.items()}
    if adapters.enabled:
      # Only the adapters are differentiated and updated; the rest are constants here.
      trainable, frozen = nnx.split_state(state.params, lora.Adapter, ...)
      key = jax.random.fold_in(jax.random.key(train_cfg.seed), state.step)
      pieces = loss_pieces(model_cfg, graphdef, frozen, key)
      loss, (grads, amaxes) = gradients.strategy(plan, pieces)(trainable, scales, batch)
      updates, opt_state = tx.update(grads, state.opt_state, trainable)
      params = nnx.merge_state(optax.apply_updates(trainable, updates), frozen)
      load = None  # LoRA models are dense (refused with experts above)
    else:
      loss, (grads, amaxes) = loss_and_grads(state.params, scales, batch)
      # Routed layers: the router biases' "gradients" are the experts' loads (model/moe.py).
      grads, load = moe.take_loads(grads)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      params = moe.balance(params, load, model_cfg.router_bias_rate)
    metrics = {
      "loss": loss,
      "grad_norm": optax.tree.norm(grads),
      "learning_rate": schedule(state.step),
    }
    if load is not None:
      metrics["expert_load_max_over_mean"] = moe.load_imbalance(load)
    history = {
      name: state.fp8_history[name].replace(fp8.record(h, amaxes[name]))
      for name, h in history.items()
    }
    return TrainState(state.step + 1, params, opt_state, history), metrics

  def step_on_mesh(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    # The model reads the mesh while it traces (context.ranks and positions, the K/V
    # exchange, rules.constrain, ...), and a jit's shardings do not set it: traced outside
    # the mesh, a context-parallel step ran each rank's slab as a whole sequence (attention
    # within the slab, positions by index). So the step traces under its own mesh, however
    # it is called.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return train_step(state, batch)

  abstract_state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings
  )
  return TrainProgram(
    mesh=mesh,
    init=jax.jit(init, out_shardings=state_shardings),
    step=jax.jit(
      step_on_mesh,
      in_shardings=(state_shardings, batch_sharding),
      out_shardings=(state_shardings, replicated),
      donate_argnums=0,
    ),
    abstract_state=abstract_state,
    batch_sharding=batch_sharding,
    micro_batches=plan.micro_batches,
    drain_reduced_bytes=_drain_reduced_bytes(plan, abstract.params["layers"], mesh),
  )
