"""Mixtures of experts (model/moe.py): sharded over `expert` (alone, with data and with
tensor) the step equals one device's, routing and dropped tokens included; bias balancing
evens the load; the named sizes' parameter counts; bad input."""

import dataclasses
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from projected import projected

import experiments
from errors import UserInputError
from experiments import overrides
from measure import host_calibration
from model import flops, moe
from model.attention import attention
from model.config import ModelConfig
from model.gpt import GPT, run_layers
from model.presets import preset
from parallelism import context, pipeline, rules
from parallelism.mesh import MeshConfig, build_mesh, plan
from projection import aot_compile, hlo, step_loops, targets
from projection.plan import plan as projection_plan
from train import data
from train import step as train_step
from train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# moe-tiny (3 layers, the first dense; 8 experts, top-2 of 4 groups' best 2, a shared one,
# sigmoid scores, bias balancing, balance loss) with a capacity factor that drops tokens.
MODEL = dataclasses.replace(preset("moe-tiny"), capacity_factor=1.0, router_bias_rate=1e-2)
TRAIN = TrainConfig(
  global_batch=8, steps=2, warmup_steps=0, task="learnable", learning_rate=1e-2, lr_warmup_steps=1
)
# float32 throughout; sharded reductions sum in another order than one device (a relative
# 1e-7 a sum of at most a few hundred terms), and two Adam steps carry that into the
# parameters (updates normalised per entry by the gradient's size): rtol for the entries,
# atol for those a warm-up-sized update leaves near zero (as tests/test_llama.py). Routing
# is discrete: a flipped choice would move a loss by far more than these.
RTOL, ATOL = 2e-4, 2e-5


def _program(model: ModelConfig, mesh_cfg: MeshConfig, devices: int):
  mesh_cfg = dataclasses.replace(mesh_cfg, devices_per_node=devices)  # one node
  return train_step.build(
    model, TRAIN, build_mesh(plan(mesh_cfg, devices), jax.devices()[:devices])
  )


def _train(program, model: ModelConfig, steps: int = 2, compiled=None, norms=None):
  """Losses, load imbalances and final parameters, compiled under the mesh (and each
  step's gradient norm appended to `norms`)."""
  compiled = compiled or program.lower(TRAIN.global_batch, model.seq_len).compile()
  state, losses, imbalance = program.init(), [], []
  for i in range(steps):
    batch = data.batch(
      TRAIN.task, TRAIN.seed, i, TRAIN.global_batch, model.seq_len, model.vocab_size
    )
    state, metrics = compiled(state, jax.device_put(batch, program.batch_sharding))
    losses.append(float(metrics["loss"]))
    imbalance.append(float(metrics["expert_load_max_over_mean"]))
    if norms is not None:
      norms.append(float(metrics["grad_norm"]))
  return losses, imbalance, jax.tree.map(np.asarray, state.params)


_ONE_DEVICE = {}


def _one_device(model: ModelConfig):
  if model not in _ONE_DEVICE:
    _ONE_DEVICE[model] = _train(_program(model, MeshConfig(data=1), 1), model)
  return _ONE_DEVICE[model]


# Grouped-query attention in place of MLA, for sequence parallelism (MLA refuses it).
GQA_MODEL = dataclasses.replace(MODEL, kv_lora_rank=0)
# moe-tiny in bf16, one dense layer and one routed, with every width a block-scaled GEMM
# contracts or produces a multiple of MXFP8's 32-value blocks (latent ranks and rotary dims
# included; tokens: 8 x 16 a step, 8 x 4 slots an expert).
BLOCKED = dataclasses.replace(
  MODEL,
  num_layers=2,
  d_model=64,
  ffn_dim=64,
  q_lora_rank=32,
  kv_lora_rank=32,
  rope_head_dim=32,
  compute_dtype="bfloat16",
)


# With DeepSeek-V3's multi-token prediction module (a routed block after the last layer).
MTP_MODEL = dataclasses.replace(MODEL, mtp_layers=1)
# Dropless: with context parallelism a rank's slab is its own routing group (model/moe.py),
# whose capacity under a factor differs from a whole sequence's; without drops the routing
# is the one device's. With two multi-token prediction modules, whose shifted targets cross
# the context ranks' slabs (parallelism/context.py `shifted`).
DROPLESS = dataclasses.replace(MODEL, capacity_factor=0.0, mtp_layers=2)
# The all-gather dispatch (model/moe.py `gathered_dispatch`): the same routing and drops,
# here with the multi-token prediction module's routed block too. (The all-to-all
# dispatch's sharded case is the sequence-parallel one.)
GATHERED_MTP = dataclasses.replace(MTP_MODEL, moe_dispatch="allgather")
# Whole experts split over `expert` x `tensor`, each tensor rank dispatching its share.
OVER_TENSOR = dataclasses.replace(MODEL, experts_over_tensor=True)


@pytest.mark.parametrize(
  "mesh_cfg, model, sequence_parallel",
  [
    (MeshConfig(data=2, expert=2, tensor=2), GATHERED_MTP, False),
    (MeshConfig(data=2, expert=2, tensor=2), GQA_MODEL, True),
    (MeshConfig(data=2, expert=2, tensor=2), OVER_TENSOR, False),
  ],
  ids=[
    "data2-expert2-tensor2-mtp-allgather",
    "data2-expert2-tensor2-sequence-parallel",
    "data2-expert2-tensor2-experts-over-tensor",
  ],
)
def test_sharded_moe_step_matches_one_device(mesh_cfg, model, sequence_parallel):
  devices = mesh_cfg.data * mesh_cfg.expert * mesh_cfg.tensor * mesh_cfg.context
  program = _program(
    dataclasses.replace(model, sequence_parallel=sequence_parallel), mesh_cfg, devices
  )
  layers = program.abstract_state.params["layers"]
  fc1, fc2 = layers["expert_fc1"].sharding.spec, layers["expert_fc2"].sharding.spec
  if model.experts_over_tensor:  # whole experts, tensor-major
    assert fc1[1] == fc2[1] == ("tensor", "expert") and fc1[4] is None and fc2[2] is None
  else:
    assert fc1[1] == fc2[1] == "expert" and fc1[4] == "tensor"
  text = program.lower(TRAIN.global_batch, model.seq_len).compile().as_text()
  if model.moe_dispatch == "allgather":
    # The expert group's tokens all-gathered and the partial outputs reduce-scattered over
    # `expert` (devices 0 and 2 are one expert group: data x expert x tensor), no
    # all-to-all.
    expert_groups = "replica_groups={{0,2},{1,3},{4,6},{5,7}}"
    for kind in ("all-gather", "reduce-scatter"):
      ops = [line for line in text.splitlines() if re.search(f" {kind}(-start)?\\(", line)]
      assert any(expert_groups in line for line in ops), f"no {kind} over `expert`"
    assert "all-to-all(" not in text
  else:
    # The dispatch and combine are all-to-alls over `expert`, in the forward and backward.
    assert text.count("all-to-all(") >= 2, "no all-to-all in the compiled step"
  losses, imbalance, params = _train(program, model)
  losses_1, imbalance_1, params_1 = _one_device(model)
  np.testing.assert_allclose(losses, losses_1, rtol=RTOL)
  # Loads are token counts: the same routing gives the same counts exactly (float32 sums of
  # whole numbers below 2^24).
  assert imbalance == imbalance_1
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1), strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_backward_does_not_redo_the_combine_all_to_all():
  """Under remat `none` the combine all-to-all's output is saved (moe.RETURNED_NAME): the
  compiled step on data 2 x expert 4 has 5 all-to-alls of activations a routed layer, the
  dispatch and combine forward, their transposes, and the dispatch redone for the
  up-projection's weight gradient. Without the name the backward redid the combine too (6;
  DeepSeek-V3 at 8,192 GB300: 2.86 -> 2.77 s a step)."""
  model = dataclasses.replace(MODEL, remat="none")
  program = _program(model, MeshConfig(data=2, expert=4), 8)
  text = program.lower(TRAIN.global_batch, model.seq_len).compile().as_text()
  # The routing's masks travel as pred all-to-alls: not activations.
  moved = re.findall(r"= \(?\(?(\w+)\[[^\n]*? all-to-all(?:-start)?\(", text)
  assert sorted(t for t in moved if t != "pred") == ["f32"] * 5, moved


def test_accumulated_micro_batches_match_the_whole_batch():
  """Two micro-batches of 4 accumulated: the balance loss's gradient and the experts' loads
  are averaged like the language-model loss's gradient, so the step is the whole batch's."""
  train = dataclasses.replace(TRAIN, micro_batch=4)
  mesh = build_mesh(plan(MeshConfig(data=1, devices_per_node=1), 1), jax.devices()[:1])
  losses, imbalance, params = _train(train_step.build(MODEL, train, mesh), MODEL)
  losses_1, imbalance_1, params_1 = _one_device(MODEL)
  np.testing.assert_allclose(losses, losses_1, rtol=RTOL)
  np.testing.assert_allclose(imbalance, imbalance_1, rtol=1e-6)  # ratios of float32 means
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1), strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_moe_trains():
  """moe-tiny on the learnable task, one device: the loss falls over 20 steps."""
  losses = _train(_program(MODEL, MeshConfig(data=1), 1), MODEL, steps=20)[0]
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses


def test_moe_step_with_mxfp8_is_near_bf16():
  """BLOCKED with model.block_scaling=mxfp8 (the experts, latent attention's projections,
  the dense and shared MLPs; the router in float32): a train step's loss within 0.1% of
  bf16's on the same parameters and batch, its gradients finite. E4M3 keeps 3 mantissa
  bits, each operand within 2^-4 of itself, errors that average out over a contraction and
  over the mean loss: 0.005% here."""
  model = dataclasses.replace(BLOCKED, block_scaling="mxfp8")
  program, norms = _program(model, MeshConfig(data=1), 1), []
  losses, _, _ = _train(program, model, steps=1, norms=norms)
  assert np.isfinite(norms).all() and norms[0] > 0, norms
  # bf16's loss, forward only, on the parameters the step started from.
  graph = nnx.graphdef(nnx.eval_shape(lambda: GPT(BLOCKED, nnx.Rngs(0))))
  batch = data.batch(TRAIN.task, TRAIN.seed, 0, TRAIN.global_batch, model.seq_len, model.vocab_size)
  loss = jax.jit(
    lambda params: train_step.cross_entropy(
      nnx.merge(graph, params)(batch["inputs"]), batch["targets"]
    )
  )
  bf16 = float(loss(program.init().params))
  assert losses[0] != bf16  # quantized: not the bf16 step
  np.testing.assert_allclose(losses[0], bf16, rtol=1e-3)


@pytest.mark.skipif(not targets.cuda_available()[0], reason="no deviceless CUDA target")
def test_expert_gemms_compile_to_cudnn_block_scaled_dots():
  """One routed layer with block_scaling=mxfp8 (widths of 128: cuDNN pads a block-scaled
  GEMM's to 128), forward and backward, compiled deviceless for one GB200: the experts'
  six GEMMs (up and down, forward and both gradients) are cuDNN's block-scaled dots with
  E4M3 operands, one GEMM batched over the 8 experts each, 2 B E C (D 2F + F D) FLOPs a
  pass; only the router's matmuls (float32) are not."""
  model = dataclasses.replace(
    MODEL,
    d_model=128,
    moe_ffn_dim=128,
    seq_len=128,
    compute_dtype="bfloat16",
    block_scaling="mxfp8",
  )
  cfg, B = model.routed_stack(), 4
  mesh = build_mesh(plan(MeshConfig(data=1), 1), targets.target_devices("gb200", 1, 1))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  layers = nnx.state(nnx.eval_shape(lambda: GPT(model, nnx.Rngs(0))), nnx.Param)["layers"]
  p = {
    name: jax.ShapeDtypeStruct(
      layers[name].get_value().shape[1:],
      jnp.float32 if name == moe.BIAS else jnp.bfloat16,
      sharding=whole,
    )
    for name in moe.PARAMS
  }
  h = jax.ShapeDtypeStruct((B, model.seq_len, model.d_model), jnp.bfloat16, sharding=whole)

  def loss(h, p):
    return jnp.sum(moe.routed(cfg, h, p)[0].astype(jnp.float32) ** 2)

  with jax.set_mesh(mesh), targets.cudnn_version_of("gb200"):
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, p).compile().as_text()
  E, C, D, F = cfg.num_experts, moe.capacity(cfg, model.seq_len), cfg.d_model, cfg.moe_ffn_dim
  calls = [
    line for line in text.splitlines() if 'custom_call_target="__cudnn$blockScaledDot"' in line
  ]
  assert len(calls) == 6 and all(f"[{E},{B * C}," in line for line in calls), calls
  by_type = {}
  for node, times in hlo.walk(hlo.analyze(text)):
    if isinstance(node, hlo.Compute) and node.dot_flops:
      by_type[node.dot_dtype] = by_type.get(node.dot_dtype, 0) + node.dot_flops * times
  assert by_type.pop("f8e4m3fn") == 3 * 2 * B * E * C * (D * 2 * F + F * D)
  assert set(by_type) == {"f32"}, by_type


def _routed(model: ModelConfig, mesh=None):
  """One routed layer on a fixed input: (output, experts chosen, dropped assignments)."""
  cfg = model.routed_stack()
  params = nnx.state(GPT(model, nnx.Rngs(3)), nnx.Param)["layers"]
  p = {name: v[...][0] for name, v in params.items()}
  p["router_bias"] = jnp.linspace(-0.02, 0.02, cfg.num_experts)  # a bias that matters
  h = jax.random.normal(jax.random.key(1), (8, model.seq_len, model.d_model))

  def layer(h, p):
    logits = jnp.einsum("btd,de->bte", h, p["router_kernel"])
    experts = moe.route(cfg, logits, p["router_bias"])[0]
    y, dropped = moe.routed(cfg, h, p)
    return y, experts, dropped

  if mesh is None:
    return jax.jit(layer)(h, p)
  with jax.set_mesh(mesh):
    return jax.jit(layer)(h, p)


@pytest.mark.parametrize("capacity_factor", [1.0, 0.0], ids=["capacity-1", "dropless"])
def test_routing_and_dropped_tokens_do_not_depend_on_the_mesh(capacity_factor):
  model = dataclasses.replace(MODEL, capacity_factor=capacity_factor)
  y_1, experts_1, dropped_1 = _routed(model)
  mesh_cfg = MeshConfig(data=2, expert=2, tensor=2, devices_per_node=8)
  y, experts, dropped = _routed(model, build_mesh(plan(mesh_cfg, 8), jax.devices()[:8]))
  np.testing.assert_array_equal(experts, experts_1)
  assert int(dropped) == int(dropped_1)
  if capacity_factor:
    assert int(dropped_1) > 0  # the capacity binds: the test sees dropping
  else:
    assert int(dropped_1) == 0
  np.testing.assert_allclose(y, y_1, rtol=1e-5, atol=1e-6)  # float32, sums reordered


def test_dropped_assignments_contribute_nothing():
  """With capacity 1 slot an expert, only each expert's first assignment survives."""
  experts = jnp.array([[[0, 1], [0, 2], [1, 0]]])  # [B=1, T=3, k=2]
  slot, counts = moe.slots(experts, 4, 1)
  # First choices queue first: token 0 takes expert 0's slot, token 2 expert 1's (before
  # token 0's second choice); every second choice finds its expert full but token 1's.
  np.testing.assert_array_equal(slot, [[[0, 4], [4, 2], [1, 4]]])
  np.testing.assert_array_equal(counts, [[3, 2, 1, 0]])
  x = jnp.arange(3.0)[None, :, None] + 1  # token t's vector is t + 1
  buffer = moe.dispatch(x, slot, 4)
  np.testing.assert_array_equal(buffer[0, :, 0], [1, 3, 2, 0])
  y = moe.combine(buffer, slot, jnp.ones((1, 3, 2)))
  np.testing.assert_array_equal(y[0, :, 0], [1, 2, 3])


def test_bias_balancing_evens_a_skewed_load():
  """Skewed router logits (expert e favoured by 0.3 e): the bias steps alone, rate 0.01,
  bring the busiest expert's load from over twice the mean to within 20% of it (the sign
  steps then oscillate about balance, about 1.15 here)."""
  cfg = dataclasses.replace(MODEL, router_groups=1, router_topk_groups=1).routed_stack()
  E = cfg.num_experts
  logits = jax.random.normal(jax.random.key(0), (16, 64, E)) + 0.3 * jnp.arange(E)

  @jax.jit
  def step(bias):  # bias [1, E]: one layer's
    experts = moe.route(cfg, logits, bias[0])[0]
    load = moe.slots(experts, E, 64)[1].sum(0)[None].astype(jnp.float32)
    params = nnx.State({"layers": {"router_bias": nnx.Param(bias)}})
    new = moe.balance(params, {"layers": load}, 0.01)["layers"]["router_bias"][...]
    return new, moe.load_imbalance({"layers": load})

  bias, imbalance = jnp.zeros((1, E)), []
  for _ in range(30):
    bias, value = step(bias)
    imbalance.append(float(value))
  assert imbalance[0] > 2.0, imbalance
  assert max(imbalance[-5:]) < 1.2, imbalance


def test_bias_balancing_in_the_train_step():
  """The one-device train step from a skewed start (biases favouring the first experts by
  up to 0.3): the router biases move by whole steps of the rate (the optimizer never sees
  them) and the step's load imbalance falls."""
  program = _program(MODEL, MeshConfig(data=1), 1)
  state = program.init()
  bias = state.params["layers"]["router_bias"]
  skewed = np.broadcast_to(np.linspace(0.3, -0.3, MODEL.num_experts), bias[...].shape)
  # A copy of its own: the step donates the state.
  state.params["layers"]["router_bias"] = bias.replace(jnp.array(skewed, jnp.float32))
  step, imbalance = program.lower(TRAIN.global_batch, MODEL.seq_len).compile(), []
  for i in range(40):
    batch = data.batch("synthetic", 0, i, TRAIN.global_batch, MODEL.seq_len, MODEL.vocab_size)
    state, metrics = step(state, jax.device_put(batch, program.batch_sharding))
    imbalance.append(float(metrics["expert_load_max_over_mean"]))
  assert np.mean(imbalance[-5:]) < 0.75 * np.mean(imbalance[:5]), imbalance
  rate = MODEL.router_bias_rate
  moved = (np.asarray(state.params["layers"]["router_bias"][...]) - skewed) / rate
  np.testing.assert_allclose(moved, np.round(moved), atol=1e-3)  # float32 sums of 40 steps
  assert np.abs(moved).max() >= 5


def test_balance_loss_pushes_scores_from_the_busiest_expert():
  """The sequence balance loss's gradient, attached to the layer output, lowers the
  router's score for the experts most chosen."""
  cfg = MODEL.routed_stack()
  logits = jax.random.normal(jax.random.key(2), (2, 16, cfg.num_experts)) + jnp.arange(8) * 0.2

  def loss(logits):
    experts, _, scores = moe.route(cfg, logits, jnp.zeros(cfg.num_experts))
    counts = moe.slots(experts, cfg.num_experts, 16)[1]
    return moe.balance_loss(cfg, scores, counts)

  grad = jax.grad(loss)(logits).sum((0, 1))
  assert grad[-1] > 0 > grad[0]  # the most chosen expert's logit is pushed down


@pytest.mark.parametrize("mtp_layers", [0, 2])
def test_matmul_flops_formula_counts_the_compiled_moe_step(mtp_layers):
  """One CPU device, full remat: latent attention, the dense first layer, the router, the
  shared expert and the routed experts over their capacity buffers' E x C slots, forward,
  backward and recomputed, and two multi-token prediction modules (routed blocks,
  projections, the shared head twice more), equal the compiled dots' FLOPs exactly. (Also
  checked when this was written: remat none, and dropless.)"""
  model = dataclasses.replace(MODEL, remat="full", mtp_layers=mtp_layers)
  mesh = build_mesh(plan(MeshConfig(data=1), 1), jax.devices()[:1])
  step = train_step.build(model, TrainConfig(global_batch=2), mesh)
  program = hlo.analyze(step.lower(2, model.seq_len).compile().as_text())
  assert hlo.dot_flops(program) == flops.matmul_flops_per_step(model, 2)


@pytest.mark.skipif(not targets.cuda_available()[0], reason="no deviceless CUDA target")
def test_latent_attention_runs_through_cudnn():
  """moe-tiny (16 query-key dims a head, 8 value dims) with model.attention=cudnn, compiled
  deviceless for one GB200: every layer's attention is cuDNN's fused causal kernel,
  forward and backward, its values padded to the keys' 16 dims and counted so, and no op
  writes a [B, H, T, T] score tensor to HBM. Vmapped, as the 1F1B ranks run it, the
  attention's gradient traces too."""
  model = dataclasses.replace(MODEL, attention="cudnn", compute_dtype="bfloat16", seq_len=512)
  model.validate()
  mesh = build_mesh(plan(MeshConfig(data=1), 1), targets.target_devices("gb200", 1, 1))
  step = train_step.build(model, TrainConfig(global_batch=2), mesh)
  with targets.cudnn_version_of("gb200"):
    program = hlo.analyze(step.lower(2, model.seq_len).compile().as_text())
  B, H, T, L = 2, model.num_heads, model.seq_len, model.num_layers
  qk, v = model.qk_head_dim, model.value_head_dim
  assert (qk, v) == (16, 8)
  half = B * H * T * T / 2  # the causal kernel's score blocks
  runs = {"__cudnn$fmhaSoftmax": 0, "__cudnn$fmhaSoftmaxBackward": 0}
  for n, m in hlo.walk(program):
    if isinstance(n, hlo.Compute) and n.kind in runs:
      runs[n.kind] += m
      assert n.dot_flops == 2 * half * qk * (5 if n.kind.endswith("Backward") else 2)
    if isinstance(n, hlo.Compute):
      assert n.bytes_written < B * H * T * T * 2  # bf16 scores
  assert runs["__cudnn$fmhaSoftmaxBackward"] == L
  assert runs["__cudnn$fmhaSoftmax"] >= L

  def loss(q, k, v):
    return jnp.square(attention(q, k, v, "cudnn").astype(jnp.float32)).sum()

  x = lambda d: jax.ShapeDtypeStruct((3, B, T, H, d), jnp.bfloat16)
  with targets.cudnn_version_of("gb200"):
    grads = jax.eval_shape(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))), x(qk), x(qk), x(v))
  assert [g.shape[-1] for g in grads] == [qk, qk, v]


def _ep16(*assignments: str):
  """The moe experiment with 16 experts over EP 16 (beyond an 8-GPU node), bf16, one
  sequence a micro-batch, and `assignments`."""
  fields = [
    "model.num_experts=16",
    "model.compute_dtype=bfloat16",
    "mesh.expert=16",
    "mesh.tensor=1",
    "mesh.data=-1",
    "mesh.allow_expert_beyond_nvlink=true",
    "train.global_batch=32",
    "train.micro_batch=1",
  ]
  return overrides.apply(experiments.load("moe"), [*fields, *assignments])


@pytest.mark.skipif(not targets.cuda_available()[0], reason="no deviceless CUDA target")
def test_expert_all_to_all_is_costed_on_nvlink_or_infiniband():
  """moe-tiny with 16 experts over EP 16, projected (deviceless CUDA compile): on 16 H100
  (two 8-GPU nodes) the expert group crosses InfiniBand, on 16 GB200 it sits in one NVL72
  rack. The only exposed communication is on `expert`, and it costs more over the NICs."""
  exp = _ep16()
  h100, gb200 = (projected(exp, hw, 16) for hw in ("h100", "gb200"))
  by_axis = [r["breakdown"]["exposed_comm_by_axis_s"] for r in (h100, gb200)]
  assert all(set(axes) == {"expert"} for axes in by_axis), by_axis
  assert by_axis[0]["expert"] > 2 * by_axis[1]["expert"], by_axis
  # The record says how the routing was costed.
  assert h100["routing"].startswith("taken as balanced: every expert's matmuls at capacity")


@pytest.mark.skipif(not targets.cuda_available()[0], reason="no deviceless CUDA target")
def test_allgather_dispatch_compiles_for_h100_without_all_to_all():
  """model.moe_dispatch=allgather compiled deviceless for 16 H100 (EP 16 over two nodes):
  the expert group's tokens all-gathered and the outputs reduce-scattered over `expert`
  (the forward, the remat's recompute and the backward), no all-to-all; projected, its
  `expert` communication is what is exposed."""
  exp = _ep16("model.moe_dispatch=allgather")
  record = projected(exp, "h100", 16)
  assert record["compile_target"] == "cuda", record["compile_note"]
  assert set(record["breakdown"]["exposed_comm_by_axis_s"]) == {"expert"}
  reduced = projection_plan(exp, host_calibration.hardware("h100", 16), 16).reduced
  train = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  step = aot_compile.compile_step(exp.model, train, tuple(reduced.sizes.items()), "h100", 8)
  kinds = {n.kind for n, _ in hlo.walk(step.program) if isinstance(n, hlo.Collective)}
  assert "all-to-all" not in kinds and {"all-gather", "reduce-scatter"} <= kinds, kinds


def _param_count(name: str) -> int:
  abstract = nnx.eval_shape(lambda: GPT(preset(name), nnx.Rngs(0)))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
  "name, total, active",
  [
    # Mistral's announcement (https://mistral.ai/news/mixtral-of-experts): 46.7B, 12.9B active.
    ("mixtral-8x7b", 46.7e9, 12.9e9),
    # Qwen3's model card (https://huggingface.co/Qwen/Qwen3-30B-A3B): 30.5B, 3.3B activated.
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),
    # The DeepSeek-V3 report (arXiv:2412.19437): 671B, 37B activated for each token.
    ("deepseek-v3-671b", 671e9, 37e9),
  ],
)
def test_parameter_counts_from_abstract_shapes(name, total, active):
  count = _param_count(name)
  assert count == flops.param_count(preset(name))
  assert abs(count / total - 1) < 0.005, count  # published to 3 figures
  # Active: the matmul weights a token uses plus its embedding row.
  cfg = preset(name)
  used = flops.matmul_param_count(cfg) + cfg.padded_vocab * cfg.d_model
  assert abs(used / active - 1) < 0.02, used  # published to 2 figures


def test_deepseek_v3_mtp_module_parameters():
  """DeepSeek-V3 with its one multi-token prediction module: 685B, "671B of the Main Model
  weights and 14B of the Multi-Token Prediction (MTP) Module weights"
  (https://huggingface.co/deepseek-ai/DeepSeek-V3), whose checkpoint stores the module
  with its own copies of the embedding and head; here they are shared (2 V D fewer)."""
  cfg = dataclasses.replace(preset("deepseek-v3-671b"), mtp_layers=1)
  abstract = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert count == flops.param_count(cfg)
  copies = 2 * cfg.padded_vocab * cfg.d_model
  assert abs((count + copies) / 685e9 - 1) < 0.005, count  # published to 3 figures


def test_mtp_modules_see_no_token_they_predict():
  """Module k's logits at position i read tokens up to i + k and predict token i + k + 1
  (targets [B, T] hold token i + 1 at i): changing targets[:, j] leaves module 1's logits
  before j and module 2's before j - 1 unchanged and changes them there (a shift the wrong
  way or one too far would fail). The loss is the scaled mean over the modules of each
  one's cross-entropy on the positions that have its token. Dropless, so that no token's
  routing depends on another's."""
  cfg = dataclasses.replace(MODEL, capacity_factor=0.0, mtp_layers=2)
  model = GPT(cfg, nnx.Rngs(0))
  T, j = cfg.seq_len, 5
  inputs = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
  targets = jnp.roll(inputs, -1, axis=1)

  def logits(targets):
    x = run_layers(cfg, model.embed(inputs), model.layer_params())
    return model.mtp_logits(x, targets)

  before, after = (
    logits(targets),
    logits(targets.at[:, j].set((targets[:, j] + 1) % cfg.vocab_size)),
  )
  for k, (a, b) in enumerate(zip(before, after, strict=True), start=1):
    changed = np.abs(np.asarray(a - b)).max(axis=(0, 2)) > 0  # [T]
    assert not changed[: j - k + 1].any() and changed[j - k + 1], (k, changed)
  ce = [
    optax.softmax_cross_entropy_with_integer_labels(lg[:, : T - k], targets[:, k:]).mean()
    for k, lg in enumerate(before, start=1)
  ]
  # The same float32 means summed in another order: a few ulps.
  np.testing.assert_allclose(
    train_step.mtp_loss(before, targets, 0.1), 0.1 * (ce[0] + ce[1]) / 2, rtol=1e-6
  )


def test_mtp_targets_across_context_ranks_are_the_rolled_sequence():
  """context.shifted on 2 ranks' slabs (the train step's vmap over them): the token k true
  positions later at each place, as rolling the unpermuted sequence gives (wrapping round:
  the places past the end route like one device's, though the loss leaves them out), which
  places have one, and the mean's count over the whole sequence."""
  mesh = build_mesh(plan(MeshConfig(data=1, context=2, devices_per_node=2), 2), jax.devices()[:2])
  T, k = 16, 2
  tokens = jnp.arange(100, 100 + 2 * T, dtype=jnp.int32).reshape(2, T)  # [b, T], true order
  slabs = context.slabs(tokens, 2).swapaxes(0, 1)  # [CP, b, T / CP]
  with jax.set_mesh(mesh), rules.vmapped(context.CONTEXT):
    fn = jax.vmap(lambda t: context.shifted(t, k), axis_name=context.SLAB)
    later, valid, counted = jax.jit(fn)(slabs)
  rolled = context.slabs(jnp.roll(tokens, -k, axis=-1), 2).swapaxes(0, 1)
  is_valid = context.slabs(jnp.arange(T) < T - k, 2)
  np.testing.assert_array_equal(later, rolled)
  np.testing.assert_array_equal(valid, is_valid)
  np.testing.assert_array_equal(counted, T - k)


def test_moe_experiment_selects_sizes():
  exp = overrides.apply(experiments.load("moe"), ["model=deepseek-v3-671b"])
  assert exp.model.num_experts == 256 and exp.model.first_dense_layers == 3
  assert exp.mesh.expert == 2


@pytest.mark.parametrize(
  "assignments, message",
  [
    # Fine: 8 experts over 8 ranks, one node of 8.
    (["mesh.expert=8", "mesh.data=1", "mesh.tensor=1", "mesh.devices_per_node=8"], None),
    (
      [
        "model.num_experts=6",
        "model.router_groups=1",
        "model.router_topk_groups=1",
        "mesh.expert=4",
        "mesh.tensor=1",
      ],
      "model.num_experts = 6 does not divide over mesh.expert",
    ),
    (["model.experts_per_token=9"], "model.experts_per_token = 9"),
    (["model.router_groups=3"], "model.router_groups = 3"),
    (["model.router_topk_groups=1", "model.experts_per_token=3"], "model.router_topk_groups = 1"),
    (["mesh.expert=4", "mesh.tensor=2", "mesh.data=1"], "mesh.expert 4"),
    # Block-scaled matmuls run the experts and latent attention; per-tensor FP8 does not.
    (["precision=mxfp8"], None),
    (["precision=nvfp4"], None),
    (["precision=fp8"], "model.fp8 = true"),
    (["model.mtp_layers=-1"], "model.mtp_layers and model.mtp_loss_scale"),
    (
      [
        "model.experts_over_tensor=true",
        "model.num_experts=6",
        "model.router_groups=1",
        "model.router_topk_groups=1",
        "mesh.expert=2",
        "mesh.tensor=4",
        "mesh.data=1",
        "mesh.devices_per_node=8",
      ],
      "model.num_experts = 6 does not divide over mesh.expert = 2 x mesh.tensor = 4",
    ),
    (
      ["model.experts_over_tensor=true", "model.moe_dispatch=allgather"],
      "model.experts_over_tensor runs with model.moe_dispatch=capacity",
    ),
  ],
  ids=[
    "fits",
    "experts-over-expert",
    "top-k-above-experts",
    "groups",
    "top-groups",
    "beyond-nvlink",
    "mxfp8",
    "nvfp4",
    "fp8",
    "mtp-layers",
    "experts-over-expert-x-tensor",
    "experts-over-tensor-allgather",
  ],
)
def test_bad_moe_input_is_refused(assignments, message):
  exp = overrides.apply(experiments.load("moe"), assignments)
  try:
    exp.model.validate()
    layout = plan(exp.mesh, 8)
    moe.check_mesh(exp.model, layout.sizes)
  except UserInputError as e:
    assert message is not None and message in str(e) and "\n" not in str(e), str(e)
    return
  assert message is None, "accepted"


def test_bad_moe_input_at_the_command_line_is_one_line_and_exit_2():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  run = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "launch.py"),
      "--experiment=moe",
      "--set",
      "mesh.expert=4",
      "--set",
      "mesh.tensor=2",
      "--set",
      "mesh.data=1",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert run.returncode == 2, run.stderr
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1 and "mesh.expert" in lines[0], run.stderr


# ------------------------------------------------------------------ pipelined (1F1B)
def _pipelined(model: ModelConfig, mesh_cfg: MeshConfig, micro_batch: int, **train_fields):
  devices = mesh_cfg.data * mesh_cfg.expert * mesh_cfg.context * mesh_cfg.pipeline
  train = dataclasses.replace(
    TRAIN, micro_batch=micro_batch, **{"pipeline_schedule": "1f1b", **train_fields}
  )
  mesh_cfg = dataclasses.replace(mesh_cfg, devices_per_node=devices)
  return train_step.build(
    model, train, build_mesh(plan(mesh_cfg, devices), jax.devices()[:devices])
  )


def _assert_matches_one_device(program, model, compiled, virtual_stages: int, routed: int):
  """Two steps of a pipelined (P 2) program give the one-device losses, loads and
  parameters. Same tolerances as the sharded test above: float32 sums reordered, two Adam
  steps."""
  losses, imbalance, params = _train(program, model, compiled=compiled)
  losses_1, imbalance_1, params_1 = _one_device(model)
  np.testing.assert_allclose(losses, losses_1, rtol=RTOL)
  np.testing.assert_allclose(imbalance, imbalance_1, rtol=1e-6)  # ratios of float32 means
  params["layers"] = pipeline.model_order(params["layers"], 2, virtual_stages, routed)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1), strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_pipelined_moe_step_matches_one_device():
  """The dense first layer before the pipeline, the routed ones in it (1F1B, 3 chunks a
  rank), the multi-token prediction module with the loss, on 2 replicas x expert 2 x
  pipeline 2 with the optimizer split over `data` (train.overlap_grad_reduce): the same
  losses, loads and parameters as one device.
  The balance loss's gradient is scaled by 1 / M and the idle trips' loads dropped, or
  they would differ (a padding row's: the lockstep test below).
  The layer gradients, the experts' own and those every expert rank shares, are
  reduce-scattered over `data` in the 1F1B drain's reducing loop (2 iterations with 3
  chunks a rank). The router biases' entries (the loads) stay out of the drain: their
  sums would round in bfloat16. Without the drain for `expert` meshes there is no
  reducing loop.
  The routing's top-k stays on each rank: jax.lax.top_k under the 1F1B ranks' vmap is
  partitioned by gathering the scores of every data, expert and pipeline rank (DeepSeek-V3
  on 512 GB200: 15,408 all-gathers of 1 GiB a step), moe.top_k is not."""
  routed = 6
  model = dataclasses.replace(MTP_MODEL, num_layers=1 + routed)
  program = _pipelined(
    model,
    MeshConfig(data=2, expert=2, pipeline=2),
    1,
    virtual_stages=3,
    shard_optimizer=True,
    overlap_grad_reduce=True,
  )
  compiled = program.lower(TRAIN.global_batch, model.seq_len).compile()
  text = compiled.as_text()
  gather = re.compile(r"all-gather(-start)?\(")
  in_routing = re.compile(r'op_name="[^"]*/(top_k|sort)"')
  routing = [line for line in text.splitlines() if gather.search(line) and in_routing.search(line)]
  assert not routing, routing[0]
  (loop,) = step_loops.drain_reduce_loops(hlo.analyze(text))
  scatters = [c for c, _ in hlo.collectives(loop.body) if c.kind == "reduce-scatter"]
  assert scatters, "no reduce-scatter in the drain's reducing loop"
  _assert_matches_one_device(program, model, compiled, 3, routed)


def test_context_parallel_moe_inside_the_pipeline_matches_one_device():
  """Each context rank's slab through the 1F1B pipeline (expert 2 x context 2 x pipeline
  2, dropless, the all-gather dispatch, two multi-token prediction modules): latent
  attention's rotary dims at the tokens' true positions, the balance loss's counts summed
  over the slabs inside the pipeline's loops (model/moe.py `balance_loss`), the loads
  summed with the gradients, the MTP modules' targets read across the slabs, the
  dispatch's shard_maps under the slabs' and ranks' vmaps; the one-device losses, loads
  and parameters (tolerances as above)."""
  routed = 2
  model = dataclasses.replace(DROPLESS, num_layers=1 + routed, moe_dispatch="allgather")
  program = _pipelined(model, MeshConfig(data=1, expert=2, context=2, pipeline=2), 2)
  compiled = program.lower(TRAIN.global_batch, model.seq_len).compile()
  _assert_matches_one_device(program, model, compiled, 1, routed)


def test_lockstep_pipelined_moe_step_matches_one_device():
  """A lockstep schedule (parallelism/pipeline.py `run`: GPipe, in 2 passes of 1
  micro-batch), differentiated by autodiff, on data 2 x expert 2 x pipeline 2 with the
  dense first layer before the loop and the multi-token prediction module with the loss:
  the one-device losses, loads and parameters (tolerances as above). Its idle trips
  compute on stale data: their loads and balance-loss gradients are weighted 0, and the
  coefficient is over a pass's micro-batches. 3 routed layers in 2 chunks of 2 slots
  leave a padding row, skipped, its loads dropped. (The interleaved schedule runs the
  same `run`, its chunk chosen by the trip; it matched one device too, outside the
  suite.)"""
  routed = 3
  model = dataclasses.replace(MTP_MODEL, num_layers=1 + routed)
  program = _pipelined(
    model, MeshConfig(data=2, expert=2, pipeline=2), 1, pipeline_schedule="gpipe", pipeline_passes=2
  )
  compiled = program.lower(TRAIN.global_batch, model.seq_len).compile()
  _assert_matches_one_device(program, model, compiled, 1, routed)


def test_top_k_is_lax_top_k():
  """The sort-based top-k: jax.lax.top_k's values and indices, ties to the lower index,
  -inf (experts of groups not chosen) last."""
  # Ties (rounded; + 0 makes -0.0 0.0, which lax.top_k would rank below 0.0).
  x = jax.random.normal(jax.random.key(0), (3, 5, 16)).round(1) + 0.0
  x = x.at[..., 3:7].set(-jnp.inf)
  for k in (1, 2, 8):
    for a, b in zip(moe.top_k(x, k), jax.lax.top_k(x, k), strict=True):
      np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not targets.cuda_available()[0], reason="no deviceless CUDA target")
def test_pipelined_cudnn_attention_is_not_gathered():
  """The dense layers before the pipeline with cuDNN attention, EP 2 x PP 2 on 4 GB200
  (deviceless): vmapped over the micro-batches, cuDNN's batching rule would merge them into
  the batch with the sharded rows minor and the partitioner would all-gather q, k and v
  over `expert` (DeepSeek-V3 at 512 GB200: 193 GB, 30 a step); run as one batch, no
  head-shaped array is gathered."""
  model = dataclasses.replace(MODEL, attention="cudnn", compute_dtype="bfloat16", seq_len=128)
  train = dataclasses.replace(TRAIN, micro_batch=1, pipeline_schedule="1f1b")
  mesh_cfg = MeshConfig(data=1, expert=2, pipeline=2, devices_per_node=4)
  mesh = build_mesh(plan(mesh_cfg, 4), targets.target_devices("gb200", 1, 4))
  program = train_step.build(model, train, mesh)
  with targets.cudnn_version_of("gb200"):
    text = program.lower(train.global_batch, model.seq_len).compile().as_text()
  heads = f",{model.num_heads},{model.qk_head_dim}]"  # [..., H, K_qk]: q, k, padded v
  gathers = [line for line in text.splitlines() if re.search(r"all-gather(-start)?\(", line)]
  assert gathers and not [line for line in gathers if heads in line]
