"""Context parallelism (parallelism/context.py): the load-balanced token order, steps over
`context` equal to one device, the K/V all-gather on the context axis, rank-local
activations, bad combinations refused."""

import dataclasses
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx
from small_models import SMALL_LLAMA

import experiments
from errors import UserInputError
from experiments import overrides
from model.config import ModelConfig
from model.gpt import GPT as Decoder
from parallelism import context, gradients, pipeline
from parallelism.mesh import MeshConfig, build_mesh, plan
from projection import hlo_text, targets
from train import data
from train import step as train_step
from train.config import TrainConfig

# A tiny Llama (4 query heads sharing 2 K/V heads, rotary positions) and a tiny GPT
# (learned positions, fused QKV); T = 16 and D = 32 make the activation shapes below
# recognisable in the HLO (and F = 96 keeps a tensor rank's [F / tensor, D] MLP weight from
# passing for a [T, D] activation).
# The Llama's rotary base is small and unscaled so that positions turn its queries and
# keys visibly over 16 tokens (Llama 3's 500,000 and factor 8 barely turn them at T = 16,
# and a step with positions by index would pass for one with true positions).
LLAMA = dataclasses.replace(
  SMALL_LLAMA,
  ffn_dim=96,
  compute_dtype="float32",
  rope_theta=100.0,
  rope_scale_factor=1.0,
)
GPT = ModelConfig(num_layers=2, d_model=32, num_heads=4, head_dim=8, seq_len=16, vocab_size=128)
TRAIN = TrainConfig(
  global_batch=8, steps=2, warmup_steps=0, task="learnable", learning_rate=1e-2, lr_warmup_steps=1
)
# float32 throughout; the sharded step sums in another order than one device (the
# softmax over keys in gathered order, the loss over permuted tokens, weight gradients
# over context ranks: a relative 1e-7 per sum of at most a few hundred terms), and two
# Adam steps carry that into the parameters (O(1e-2) updates normalised per entry by the
# gradient's size): rtol for the entries, atol for those a warm-up-sized update leaves
# near zero (as tests/test_llama.py and test_pipeline.py).
RTOL, ATOL = 2e-4, 2e-5
# The step's loss and gradients themselves (no Adam, whose first step turns a gradient
# entry of rounding size, as the GPT's K bias has, into a whole +-lr update): float32 sums
# in another order, measured against one device with data 2 alone (no context) as with
# context 2: the loss within 3e-7 relative, each gradient within 2e-5 of its leaf's largest
# entry (q_kernel; the other leaves 7e-7). Wrong rotary or learned positions move a
# gradient by ~1 of that, targets in the wrong order the loss by 3e-3.
LOSS_RTOL, GRAD_TOL = 1e-6, 1e-4


def _program(model: ModelConfig, mesh_cfg: MeshConfig, train: TrainConfig = TRAIN):
  devices = math.prod(
    (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.context, mesh_cfg.tensor, mesh_cfg.pipeline)
  )
  mesh_cfg = dataclasses.replace(mesh_cfg, devices_per_node=devices)  # one node
  return train_step.build(
    model, train, build_mesh(plan(mesh_cfg, devices), jax.devices()[:devices])
  )


def _train(program, model: ModelConfig, steps: int = 2, state=None):
  """Losses, final parameters and the compiled step's text (compiled under the mesh), from
  `state` (None: program.init()'s)."""
  compiled = program.lower(TRAIN.global_batch, model.seq_len).compile()
  state, losses = program.init() if state is None else state, []
  for i in range(steps):
    batch = data.batch(
      TRAIN.task, TRAIN.seed, i, TRAIN.global_batch, model.seq_len, model.vocab_size
    )
    state, metrics = compiled(state, jax.device_put(batch, program.batch_sharding))
    losses.append(float(metrics["loss"]))
  return losses, jax.tree.map(np.asarray, state.params), compiled.as_text()


_ONE_DEVICE = {}


def _one_device(model: ModelConfig):
  key = dataclasses.replace(model, sequence_parallel=False)
  if key not in _ONE_DEVICE:
    program = _program(key, MeshConfig(data=1))
    # The initial state copied to the host (the step donates its input), from which the
    # pipelined steps start (_in_stage_order).
    initial = jax.tree.map(np.array, program.init())
    _ONE_DEVICE[key] = (*_train(program, key), initial)
  return _ONE_DEVICE[key]


def _in_stage_order(state, program, stages: int, virtual: int):
  """A one-device initial state (host arrays) laid out as the pipelined program's init
  lays it out: the layer stacks (parameters and Adam moments) in stage order, placed with
  the program's shardings. What program.init() returns, without compiling it (on CPU its
  compile costs as much as the step's, ~14 s)."""

  def leaf(path, x):
    in_stack = any(getattr(key, "key", None) == "layers" for key in path)
    return pipeline.stage_order(x, stages, virtual) if in_stack else x

  leaves = jax.tree.leaves(jax.tree_util.tree_map_with_path(leaf, state))
  abstract = jax.tree.leaves(program.abstract_state)
  assert [x.shape for x in leaves] == [a.shape for a in abstract]
  placed = [jax.device_put(x, a.sharding) for x, a in zip(leaves, abstract, strict=True)]
  return jax.tree.unflatten(jax.tree.structure(program.abstract_state), placed)


def _context_groups(program) -> set[tuple[int, ...]]:
  """Partition ids of each group along `context` (partition i is mesh.devices.flat[i])."""
  mesh = program.mesh
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  axis = mesh.axis_names.index(context.CONTEXT)
  along = np.moveaxis(ids, axis, -1).reshape(-1, mesh.shape[context.CONTEXT])
  return {tuple(int(i) for i in g) for g in along}


def _collectives_over(text: str, kind: str, groups: set, num_partitions: int) -> list[str]:
  """Shapes of the compiled `kind` collectives whose replica groups are exactly `groups`."""
  found = []
  for comp in hlo_text.parse_module(text)[0].values():
    for ins in comp.instrs:
      if ins.opcode not in (kind, f"{kind}-start"):
        continue
      parsed = hlo_text.parse_replica_groups(ins.attrs.get("replica_groups", "{}"), num_partitions)
      if {tuple(g) for g in parsed} == groups:
        found.append(ins.shape)
  return found


def test_each_rank_holds_chunk_i_and_chunk_2cp_minus_1_minus_i():
  np.testing.assert_array_equal(context.order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  order = context.order(16, 4).reshape(4, 2, 2)  # [rank, its two chunks, 2 tokens]
  for rank in range(4):
    np.testing.assert_array_equal(order[rank, :, 0] // 2, [rank, 7 - rank])
  np.testing.assert_array_equal(np.sort(context.order(24, 3)), np.arange(24))
  np.testing.assert_array_equal(context.order(8, 1), np.arange(8))


@pytest.mark.parametrize(
  "model, mesh_cfg, sequence_parallel",
  [
    # 4 tensor ranks, 2 K/V heads: each rank takes the K/V head its query heads share.
    (LLAMA, MeshConfig(data=1, context=2, tensor=4), True),
    (LLAMA, MeshConfig(data=2, context=2), False),
  ],
  # Context 2 alone and GPT under fsdp + tensor + SP: their losses and every gradient are
  # checked below, which is what two Adam steps could get wrong for them.
  ids=["llama-context2-tensor4-sp", "llama-context2-data2"],
)
def test_context_parallel_step_matches_one_device(model, mesh_cfg, sequence_parallel):
  program = _program(dataclasses.replace(model, sequence_parallel=sequence_parallel), mesh_cfg)
  losses, params, text = _train(program, model)
  _assert_same(losses, params, _one_device(model))
  _assert_split_over_context(program, model, text, sequence_parallel)


def _loss_and_grads(model: ModelConfig, mesh_cfg: MeshConfig):
  """The loss and gradients of step 0's batch at program.init()'s parameters, by the
  gradient strategy train_step.build plans for mesh_cfg (unpipelined, no micro-batches)."""
  program = _program(model, mesh_cfg)
  mesh = program.mesh.shape
  plan = gradients.plan(
    model.num_layers, 1, 1, mesh["data"], 1, TRAIN.pipeline_schedule, 0, mesh[context.CONTEXT]
  )
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(model, nnx.Rngs(0))))
  loss_and_grads = gradients.strategy(plan, train_step.loss_pieces(model, graphdef))
  batch = data.batch(TRAIN.task, TRAIN.seed, 0, TRAIN.global_batch, model.seq_len, model.vocab_size)
  with jax.set_mesh(program.mesh):
    loss, (grads, _) = jax.jit(loss_and_grads)(
      program.init().params, {}, jax.device_put(batch, program.batch_sharding)
    )
  return float(loss), jax.tree.map(np.asarray, grads)


_ONE_DEVICE_GRADS = {}


@pytest.mark.parametrize(
  "model, mesh_cfg, sequence_parallel",
  [
    (LLAMA, MeshConfig(data=1, context=2), False),
    (LLAMA, MeshConfig(data=2, context=2, tensor=2), False),
    # The replicas mapped apart with the slabs (gradients.py), sequence.py's collectives
    # on each replica's own tokens.
    (LLAMA, MeshConfig(data=2, context=2, tensor=2), True),
    (LLAMA, MeshConfig(data=1, context=4), False),
    # GPT: learned positions and a fused QKV kernel, with FSDP under tensor + SP.
    (GPT, MeshConfig(data=1, fsdp=2, context=2, tensor=2), True),
  ],
  ids=[
    "llama-context2",
    "llama-context2-data2-tensor2",
    "llama-context2-data2-tensor2-sp",
    "llama-context4",
    "gpt-context2-fsdp2-tensor2-sp",
  ],
)
def test_context_parallel_loss_and_gradients_match_one_device(model, mesh_cfg, sequence_parallel):
  """The step's loss and every gradient, not only where two Adam steps leave the
  parameters: token order, true positions (rotary and learned), masks and targets."""
  if model not in _ONE_DEVICE_GRADS:
    _ONE_DEVICE_GRADS[model] = _loss_and_grads(model, MeshConfig(data=1))
  loss_1, grads_1 = _ONE_DEVICE_GRADS[model]
  loss, grads = _loss_and_grads(
    dataclasses.replace(model, sequence_parallel=sequence_parallel), mesh_cfg
  )
  np.testing.assert_allclose(loss, loss_1, rtol=LOSS_RTOL)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_1), strict=True
  ):
    scale = np.abs(b).max()
    np.testing.assert_allclose(
      a, b, rtol=0, atol=GRAD_TOL * scale, err_msg=jax.tree_util.keystr(path)
    )


def test_step_called_outside_the_mesh_matches_one_device():
  """program.step called as it is, outside any `jax.set_mesh` (tests/test_lora.py's
  `_steps`; train/loop.py lowers it under the mesh): the model reads the mesh while it
  traces, so the step must set it itself. Traced without it, each context rank ran its
  slab as a whole sequence (attention within the slab, rotary positions by index): the
  loss 1.7e-4 off and the gradient norm 2.4e-2, where rounding leaves 1e-7."""
  assert jax.sharding.get_abstract_mesh().empty
  if LLAMA not in _ONE_DEVICE_GRADS:
    _ONE_DEVICE_GRADS[LLAMA] = _loss_and_grads(LLAMA, MeshConfig(data=1))
  loss_1, grads_1 = _ONE_DEVICE_GRADS[LLAMA]
  program = _program(LLAMA, MeshConfig(data=1, context=2))
  batch = data.batch(TRAIN.task, TRAIN.seed, 0, TRAIN.global_batch, LLAMA.seq_len, LLAMA.vocab_size)
  _, metrics = program.step(program.init(), jax.device_put(batch, program.batch_sharding))
  # float32 sums in another order, as in the test above (LOSS_RTOL's reason).
  np.testing.assert_allclose(float(metrics["loss"]), loss_1, rtol=LOSS_RTOL)
  # The norm of gradients that each differ by rounding: measured 1.2e-7 relative.
  grad_norm_1 = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads_1)))
  np.testing.assert_allclose(float(metrics["grad_norm"]), grad_norm_1, rtol=1e-5)


def _assert_same(losses, params, reference):
  losses_1, params_1, *_ = reference
  np.testing.assert_allclose(losses, losses_1, rtol=RTOL)
  assert losses[1] < losses[0]  # it trains
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1), strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def _assert_split_over_context(
  program, model: ModelConfig, text: str, sequence_parallel: bool, rows: str = r"\d+"
):
  """The compiled step's K/V exchange runs on the context groups and every rank keeps
  only its own tokens. rows: the activations' batch rows a device holds (a pattern)."""
  # The K/V exchange: all-gathers of [.., T, G, K] over exactly the context groups, and
  # their transpose (dK, dV) reduce-scattered over them. Leading axes: batch rows, and
  # inside the pipeline its vmapped rank and replica axes.
  # The shard_map is manual over every axis, so shapes are per device: a rank's K/V heads,
  # G / tensor where they are split, the one its query heads share where there are fewer.
  T, K = model.seq_len, model.head_dim
  G = max(model.kv_heads // program.mesh.shape["tensor"], 1)
  groups, partitions = _context_groups(program), program.mesh.devices.size
  gathered = _collectives_over(text, "all-gather", groups, partitions)
  assert any(re.search(rf"\[(?:\d+,)+{T},{G}(?:,\d+)?,{K}\]", s) for s in gathered), gathered
  assert _collectives_over(text, "reduce-scatter", groups, partitions)
  # No rank holds a full-sequence residual stream [b, T, D] or logits [b, T, V]; each
  # holds its T / CP tokens (and with sequence parallelism T / (CP x tensor)).
  D, V = model.d_model, model.padded_vocab
  assert not re.search(rf"f32\[(?:\d+,)+{T},(?:{D}|{V})\]", text)
  mesh = program.mesh.shape
  local = T // mesh[context.CONTEXT] // (mesh["tensor"] if sequence_parallel else 1)
  assert re.search(rf"f32\[(?:\d+,)*{rows},{local},{D}\]", text)


@pytest.mark.parametrize(
  "mesh_cfg, schedule, micro_batch, sequence_parallel, remat",
  [
    # The MLPerf Llama's combination at test size (one group of P micro-batches: the
    # 1F1B fill and drain loops).
    (MeshConfig(data=1, context=2, tensor=2, pipeline=2), "1f1b", 4, True, "elementwise"),
    # The lockstep pipeline vmapped over 2 replicas, 2 micro-batches each.
    (MeshConfig(data=2, context=2, pipeline=2), "gpipe", 2, False, "none"),
  ],
  ids=["1f1b-context2-tensor2-sp-elementwise-remat", "gpipe-context2-data2"],
)
def test_context_parallel_inside_the_pipeline_matches_one_device(
  mesh_cfg, schedule, micro_batch, sequence_parallel, remat
):
  """Inside the pipeline's vmaps (over `pipeline`, and `data` for the replicas) the
  attention's shard_map, the token order of inputs and targets, and the true positions
  are those of the unpipelined step. The micro-batches sum in yet another order, and
  remat recomputes what the one-device step keeps (the same operations): a reduction
  order as above, so the same tolerance (RTOL, ATOL; tests/test_pipeline.py's too)."""
  train = dataclasses.replace(TRAIN, pipeline_schedule=schedule, micro_batch=micro_batch)
  model = dataclasses.replace(LLAMA, sequence_parallel=sequence_parallel, remat=remat)
  program = _program(model, mesh_cfg, train)
  reference = _one_device(LLAMA)
  state = _in_stage_order(reference[3], program, mesh_cfg.pipeline, 1)
  losses, params, text = _train(program, model, state=state)
  params["layers"] = pipeline.model_order(params["layers"], mesh_cfg.pipeline, 1)
  _assert_same(losses, params, reference)
  _assert_split_over_context(program, model, text, sequence_parallel, rows=str(micro_batch))


def test_cudnn_attention_traces_inside_the_1f1b_pipeline():
  """The 1F1B stages keep each chunk's residuals in slots batched over `pipeline`; a mask
  kept there would reach cuDNN attention's batching rule batched, which (jax 0.10.2)
  reshapes it to [B, H, Tq, Tk] and fails on the [1, 1, Tq, Tk] mask. The masks are
  rebuilt inside the attention's shard_map instead (context.attention). Traced only: CPU
  has no cuDNN (the H100 target's cuDNN version stands in for the library's)."""
  model = dataclasses.replace(LLAMA, attention="cudnn", compute_dtype="bfloat16")
  train = dataclasses.replace(TRAIN, pipeline_schedule="1f1b", micro_batch=2)
  program = _program(model, MeshConfig(data=2, context=2, pipeline=2), train)
  with jax.set_mesh(program.mesh), targets.cudnn_version_of("h100"):
    jaxpr = jax.make_jaxpr(program.step)(
      program.abstract_state, program.abstract_batch(TRAIN.global_batch, model.seq_len)
    )
  assert "dot_product_attention_bwd" in str(jaxpr)


@pytest.mark.parametrize(
  "model, mesh_cfg, message",
  [
    (
      dataclasses.replace(LLAMA, seq_len=12),
      MeshConfig(data=1, context=4),
      "model.seq_len = 12 does not split into 2 x mesh.context = 8 equal chunks",
    ),
    (
      dataclasses.replace(LLAMA, seq_len=12, sequence_parallel=True),
      MeshConfig(data=1, context=2, tensor=4),
      "a context rank's 6 tokens do not divide over mesh.tensor = 4",
    ),
  ],
)
def test_bad_context_parallel_settings_are_refused(model, mesh_cfg, message):
  with pytest.raises(UserInputError, match=re.escape(message)) as raised:
    _program(model, mesh_cfg)
  assert "\n" not in str(raised.value)


def test_context_parallel_shortcut_and_mesh_placement():
  exp = overrides.apply(experiments.load("llama3"), ["context_parallel=4"])
  assert exp.mesh.context == 4
  with pytest.raises(UserInputError, match="context_parallel"):
    overrides.apply(exp, ["context_parallel=0"])
  # Context fills the node after tensor, before fsdp and data.
  layout = plan(MeshConfig(data=2, fsdp=2, context=2, tensor=2, devices_per_node=4), 16)
  assert layout.nvlink == {
    "data": 1,
    "fsdp": 1,
    "expert": 1,
    "context": 2,
    "tensor": 2,
    "pipeline": 1,
  }
  assert layout.infiniband["fsdp"] == 2 and layout.infiniband["data"] == 2
