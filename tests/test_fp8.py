"""FP8 delayed scaling (model/fp8.py): the scales it casts with, and the amaxes it records
through every path that differentiates the layers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from small_models import SMALL_LLAMA

from errors import UserInputError
from model import fp8
from model.config import ModelConfig
from model.gpt import GPT, KERNELS
from parallelism import pipeline, rules, sequence
from parallelism.mesh import MeshConfig, build_mesh, plan
from train import data
from train import step as train_step
from train.config import TrainConfig

MODEL = ModelConfig(
  num_layers=4,
  d_model=32,
  num_heads=4,
  head_dim=8,
  seq_len=16,
  vocab_size=128,
  remat="elementwise",
  fp8=True,
  fp8_amax_history=4,
)
TRAIN = TrainConfig(
  global_batch=8, steps=2, warmup_steps=0, task="learnable", learning_rate=1e-2, lr_warmup_steps=1
)
BATCH = data.batch("learnable", 0, 0, TRAIN.global_batch, MODEL.seq_len, MODEL.vocab_size)


def test_delayed_scaling_casts_with_the_given_scales_and_returns_the_amaxes():
  # One matmul given the scales current scaling would compute computes what current
  # scaling does, and its scales' cotangents are the amaxes of the input and of the output
  # gradient; given another input scale (not a power of 2, which would only shift every
  # cast's exponent), it computes something else.
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (4, 16, 32)) * 3
  w = jax.random.normal(keys[1], (32, 64)) * 0.02
  g = jax.random.normal(keys[2], (4, 16, 64)) * 1e-3
  x_amax, g_amax = jnp.max(jnp.abs(x)), jnp.max(jnp.abs(g))
  x_scale, g_scale = x_amax / 448.0, g_amax / 57344.0  # E4M3's and E5M2's largest finite

  def current(x, w):
    return fp8.einsum("btd,df->btf", x, w)

  def delayed(x, w, x_scale, g_scale):
    stack = fp8.cast_weights(w[None], (x_scale[None], g_scale[None]))  # one layer
    return fp8.einsum("btd,df->btf", x, jax.tree.map(lambda a: a[0], stack))

  y, vjp = jax.vjp(current, x, w)
  y_d, vjp_d = jax.vjp(delayed, x, w, x_scale, g_scale)
  np.testing.assert_allclose(y_d, y, rtol=1e-6)
  dx, dw, observed_x, observed_g = vjp_d(g)
  for a, b in zip((dx, dw), vjp(g), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)
  np.testing.assert_allclose(observed_x, x_amax, rtol=1e-6)
  np.testing.assert_allclose(observed_g, g_amax, rtol=1e-6)
  assert np.abs(np.asarray(delayed(x, w, 3 * x_scale, g_scale) - y)).max() > 1e-3


@pytest.mark.parametrize("entry", [True, False], ids=["entry", "exit"])
def test_sequence_parallel_matmul_observes_the_amax_of_every_shard(entry):
  # Inside sequence parallelism's shard_map each tensor rank sees a shard (at an entry, of
  # the input; everywhere, of the output gradient); the scales' cotangents are still the
  # whole tensors' amaxes, also per replica under the pipelined step's vmap over data.
  # (Summing the ranks' observations instead of keeping the largest nearly doubles them.)
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (4, 16, 32)) * 3
  w = jax.random.normal(keys[1], (32, 64)) * 0.02
  g = jax.random.normal(keys[2], (4, 16, 64)) * 1e-3
  x_axes = ("batch", "act_seq" if entry else "length", "act_embed")

  def scale_cotangents(x, g):
    def product(x, x_scale, g_scale):
      stack = fp8.cast_weights(w[None], (x_scale[None], g_scale[None]))  # one layer
      return sequence.matmul(
        fp8.einsum,
        "btd,df->btf",
        x,
        jax.tree.map(lambda a: a[0], stack),
        x_axes,
        ("embed", "mlp"),
        ("batch", "length", "act_mlp"),
        tensor_in_fn=True,
      )

    _, vjp = jax.vjp(product, x, jnp.float32(0.01), jnp.float32(1e-8))
    return vjp(g)[1:]

  mesh = build_mesh(plan(MeshConfig(data=2, tensor=2), 4), jax.devices()[:4])
  with jax.set_mesh(mesh):
    whole = jax.jit(scale_cotangents)(x, g)
    with rules.vmapped("data"):
      replicas = jax.jit(jax.vmap(scale_cotangents, spmd_axis_name="data"))(
        x.reshape(2, 2, *x.shape[1:]), g.reshape(2, 2, *g.shape[1:])
      )
  amax = lambda a: np.abs(np.asarray(a)).reshape(2, -1).max(axis=1)  # per half of the batch
  np.testing.assert_allclose(whole, (amax(x).max(), amax(g).max()), rtol=1e-6)
  np.testing.assert_allclose(replicas, (amax(x), amax(g)), rtol=1e-6)


def test_delayed_scaling_trains_like_bf16_once_its_history_fills():
  # The bounds of tests/test_pipeline.py's FP8-against-bf16 check, after one pass has
  # filled the history (the first casts at scale 1, as Transformer Engine's first step).
  bf16 = dataclasses.replace(MODEL, fp8=False, compute_dtype="bfloat16", remat="none")
  delayed = dataclasses.replace(bf16, fp8=True)
  params = jax.jit(lambda: nnx.state(GPT(bf16, nnx.Rngs(0)), nnx.Param))()

  def loss(p, scales, cfg):
    logits = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))), p)(
      BATCH["inputs"], scales
    )
    return train_step.cross_entropy(logits, BATCH["targets"])

  @jax.jit
  def run():
    history = {name: fp8.new_history(MODEL.num_layers, 4, "layers")[...] for name in KERNELS}
    grad = jax.value_and_grad(loss, argnums=(0, 1))
    for _ in range(2):
      scales = {name: fp8.delayed_scales(h) for name, h in history.items()}
      loss_8, (grads_8, amaxes) = grad(params, scales, delayed)
      history = {name: fp8.record(h, amaxes[name]) for name, h in history.items()}
    return jax.value_and_grad(loss)(params, {}, bf16), (loss_8, grads_8), history

  (loss_16, grads_16), (loss_8, grads_8), history = run()
  assert abs(float(loss_8) / float(loss_16) - 1) < 0.01, (loss_8, loss_16)
  for name in KERNELS:
    g8, g16 = (np.asarray(g["layers"][name][...], np.float32) for g in (grads_8, grads_16))
    error = np.linalg.norm(g8 - g16) / np.linalg.norm(g16)
    assert error < 0.15, (name, error)
    # Two passes recorded, newest first, for every layer's input and gradient.
    assert np.all(np.asarray(history[name][..., :2]) > 0), name
    assert np.all(np.asarray(history[name][..., 2:]) == 0), name


# How closely two programs' amaxes must agree. The sharded and one-device programs sum in
# another order, so their float32 values differ in the last bits (2^-24 relative): where no
# FP8 cast precedes an amax (the first layer's input) that is all, REDUCTION_RTOL. Further
# on, such a difference can tip one element across an E4M3 / E5M2 rounding boundary (3 / 2
# mantissa bits), moving it by one FP8 step, up to 2^-3 / 2^-2 of itself; through the
# next matmul that moves a downstream amax by a small part of that (0.4% seen), bounded
# here by FLIP_RTOL. The faults these tests look for are far larger: amaxes summed over
# 2 to 4 ranks, replicas or micro-batches come out 1.5-4x, and the layers' amaxes differ
# from each other by up to 12%, so a wrong layer's or an idle trip's shows in some kernel.
REDUCTION_RTOL = 1e-5
FLIP_RTOL = 0.05
# Losses downstream of FP8 casts: one flipped rounding changes the loss of the few tokens
# after it, and the loss averages 128 tokens.
LOSS_RTOL = 1e-3


def _first_steps(
  mesh_cfg: MeshConfig, devices: int, train: TrainConfig, model: ModelConfig, batch: dict = BATCH
):
  """Two steps on `batch`: their losses, each kernel's amaxes [L, 2] (model order) recorded
  by the first, and the fc1 kernels' change over both [L, D, F] (stage order; the first
  step's learning rate is 0, warm-up)."""
  program = train_step.build(
    model, train, build_mesh(plan(mesh_cfg, devices), jax.devices()[:devices])
  )
  # Compiled as the train loop does, under the mesh: traced outside it, sequence
  # parallelism's shard_map (and its amax reductions) would not be in the program.
  step = program.lower(*batch["inputs"].shape).compile()
  batch = jax.device_put(batch, program.batch_sharding)
  state = program.init()
  fc1 = np.asarray(state.params["layers"]["fc1_kernel"][...])
  state, first = step(state, batch)
  for history in state.fp8_history.values():  # replicated: every device holds the same
    shards = [np.asarray(shard.data) for shard in history[...].addressable_shards]
    starts = [shard.index for shard in history[...].addressable_shards]
    for shard, start in zip(shards, starts):
      np.testing.assert_array_equal(shard, np.asarray(history[...])[start])
  newest = {name: np.asarray(h[...])[..., 0] for name, h in state.fp8_history.items()}
  if mesh_cfg.pipeline > 1:
    newest = {
      name: np.asarray(pipeline.model_order(h, mesh_cfg.pipeline, train.virtual_stages))
      for name, h in newest.items()
    }
  state, second = step(state, batch)
  change = np.asarray(state.params["layers"]["fc1_kernel"][...]) - fc1
  return [float(first["loss"]), float(second["loss"])], newest, change


def _largest_over_parts(parts: int, model: ModelConfig) -> dict:
  """The amaxes a run records when each of `parts` equal slices of BATCH is differentiated
  for its own mean loss: one device runs each slice, and the largest is kept. Gradients
  scale with 1 / slice size, and E5M2's subnormals (below 2^-14) do not scale exactly, so
  the reference is run at the slice size rather than scaled from the whole batch."""
  rows = TRAIN.global_batch // parts
  train = dataclasses.replace(TRAIN, global_batch=rows)
  runs = [
    _first_steps(
      MeshConfig(data=1),
      1,
      train,
      model,
      jax.tree.map(lambda a: a[i * rows : (i + 1) * rows], BATCH),
    )[1]
    for i in range(parts)
  ]
  return {name: np.max([run[name] for run in runs], axis=0) for name in runs[0]}


def _assert_same_amaxes(got: dict, want: dict):
  assert set(got) == set(want) and want, (set(got), set(want))
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=FLIP_RTOL, err_msg=name)
  # The first layer's input is cast before any FP8 rounding can differ.
  first = "qkv_kernel" if "qkv_kernel" in want else "q_kernel"  # grouped-query: q and kv
  np.testing.assert_allclose(got[first][0, 0], want[first][0, 0], rtol=REDUCTION_RTOL)


def test_one_f_one_b_records_the_largest_amax_over_micro_batches_replicas_and_shards():
  # The interleaved 1F1B schedule (2 ranks x 2 chunks) on 2 replicas of 4 micro-batches,
  # each tensor-parallel over 2 with sequence parallelism. Each replica differentiates the
  # mean loss of its half of the batch, so the amaxes recorded are the larger of what one
  # device records on each half. Summing amaxes over micro-batches, replicas or tensor
  # ranks, or recording an idle trip's, would be off by up to 4x (or give another layer's).
  model = dataclasses.replace(MODEL, sequence_parallel=True)
  losses_1, _, _ = _first_steps(MeshConfig(data=1), 1, TRAIN, model)
  train = dataclasses.replace(TRAIN, pipeline_schedule="1f1b", virtual_stages=2, micro_batch=1)
  mesh = MeshConfig(data=2, tensor=2, pipeline=2)
  losses_8, eight, _ = _first_steps(mesh, 8, train, model)
  np.testing.assert_allclose(losses_8, losses_1, rtol=LOSS_RTOL)
  _assert_same_amaxes(eight, _largest_over_parts(2, model))


def test_tensor_parallel_step_records_the_amax_of_every_shard():
  # Unpipelined, data 4 x tensor 2 with sequence parallelism: each FP8 matmul runs on a
  # shard inside a shard_map over `tensor`, and the amaxes recorded are the whole batch's.
  model = dataclasses.replace(MODEL, sequence_parallel=True)
  _, one, _ = _first_steps(MeshConfig(data=1), 1, TRAIN, model)
  mesh = MeshConfig(data=4, tensor=2)
  losses, eight, change = _first_steps(mesh, 8, TRAIN, model)
  _assert_same_amaxes(eight, one)
  # The moments split over data, and with them the FP8 kernels, whose casts each step
  # gathers: the same training, the update made in shards.
  split = dataclasses.replace(TRAIN, shard_optimizer=True)
  split_losses, _, split_change = _first_steps(mesh, 8, split, model)
  np.testing.assert_allclose(split_losses, losses, rtol=LOSS_RTOL)
  assert np.abs(change).max() > 1e-3
  # Compared as a whole: a flipped FP8 rounding (see FLIP_RTOL) moves one row of one
  # gradient (32 of fc1's 16,384 entries) by a few percent, and Adam's update with it;
  # an update made from another shard's moments, or not made, is off by O(1).
  error = np.linalg.norm(split_change - change) / np.linalg.norm(change)
  assert error < 1e-2, error


def test_accumulated_micro_batches_record_their_largest_amax():
  # Four micro-batches accumulated on one device: each is differentiated for its own mean
  # loss, and the largest of their amaxes is recorded (a sum would be up to 4x).
  _, micro, _ = _first_steps(
    MeshConfig(data=1), 1, dataclasses.replace(TRAIN, micro_batch=2), MODEL
  )
  _assert_same_amaxes(micro, _largest_over_parts(4, MODEL))


# A tiny Llama (grouped-query attention, rotary positions) for context parallelism.
LLAMA = dataclasses.replace(SMALL_LLAMA, fp8=True, fp8_amax_history=4)
_RUNS = {}


def _steps_on(mesh_cfg: MeshConfig, model: ModelConfig):
  """_first_steps on mesh_cfg's devices (one node), run once per test session."""
  devices = mesh_cfg.data * mesh_cfg.context * mesh_cfg.tensor
  key = (mesh_cfg, model)
  if key not in _RUNS:
    mesh_cfg = dataclasses.replace(mesh_cfg, devices_per_node=devices)
    _RUNS[key] = _first_steps(mesh_cfg, devices, TRAIN, model)
  return _RUNS[key]


# Context 2 without sequence parallelism is left out (two more compiles each, and the
# suite's time is its budget): no code of ours reduces its amaxes there, the
# partitioner's max over a sharded array does, and with it the recorded amaxes matched
# one device's when this was built. The cases kept run sequence.py's own maxes.
@pytest.mark.parametrize(
  "history, sequence_parallel",
  [(4, True), (0, True)],
  ids=["delayed-cp2-tp2-sp", "current-cp2-tp2-sp"],
)
def test_context_parallel_step_scales_like_the_same_step_without_context(
  history, sequence_parallel
):
  # Each context rank holds half of every sequence's tokens, so every amax is the largest
  # over the context ranks' (the partitioner's reduction, or inside sequence parallelism's
  # shard_map, manual over `context`, a max over it: sequence.py). Delayed scaling records
  # the whole batch's amaxes, one device's; current scaling casts with the scales the same
  # mesh without `context` does: one device's, or with sequence parallelism tensor 2's,
  # whose ranks scale their own features (model/fp8.py). Summed over the 2 context ranks,
  # an amax comes out nearly 2x.
  model = dataclasses.replace(LLAMA, fp8_amax_history=history, sequence_parallel=sequence_parallel)
  tensor = 2 if sequence_parallel else 1
  losses, amaxes, change = _steps_on(MeshConfig(data=1, context=2, tensor=tensor), model)
  reference = MeshConfig(data=1, tensor=tensor if history == 0 else 1)
  want_losses, want_amaxes, want_change = _steps_on(reference, model)
  np.testing.assert_allclose(losses, want_losses, rtol=LOSS_RTOL)
  if history:
    _assert_same_amaxes(amaxes, want_amaxes)
  else:
    assert amaxes == want_amaxes == {}
  assert np.abs(change).max() > 1e-3  # the second step updates the weights
  # As a whole, as in the 1F1B test above: a flipped FP8 rounding moves a few entries of
  # a gradient, and Adam's update with them; a cast at another scale moves most of them.
  error = np.linalg.norm(change - want_change) / np.linalg.norm(want_change)
  assert error < 1e-2, error


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("interleaved", 2)])
def test_delayed_scaling_needs_1f1b_when_pipelined(schedule, virtual):
  train = dataclasses.replace(TRAIN, pipeline_schedule=schedule, virtual_stages=virtual)
  mesh = build_mesh(plan(MeshConfig(data=1, pipeline=2), 2), jax.devices()[:2])
  with pytest.raises(UserInputError, match="needs train.pipeline_schedule = 1f1b"):
    train_step.build(MODEL, train, mesh)


def test_amax_history_length_is_checked():
  with pytest.raises(UserInputError, match="model.fp8_amax_history must be 0"):
    dataclasses.replace(MODEL, fp8_amax_history=-1).validate()
