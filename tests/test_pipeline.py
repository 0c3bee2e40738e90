"""Pipeline and sequence parallelism against the one-device step; FP8 against bf16."""

import collections
import dataclasses
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from errors import UserInputError
from model import fp8
from model.config import ModelConfig
from model.gpt import GPT
from parallelism import one_f_one_b, pipeline, sequence
from parallelism.mesh import MeshConfig, build_mesh, plan
from projection import hlo, step_loops
from train import data
from train import step as train_step
from train.config import TrainConfig

MODEL = ModelConfig(
  num_layers=4, d_model=32, num_heads=4, head_dim=8, seq_len=16, vocab_size=128, remat="full"
)
TRAIN = TrainConfig(
  global_batch=8, steps=2, warmup_steps=0, task="learnable", learning_rate=1e-2, lr_warmup_steps=1
)
# float32 throughout; sharded reductions sum in a different order than one device, a
# relative 1e-7 per sum of at most a few hundred terms. Two Adam steps carry that into the
# parameters (O(1e-2) updates, normalised per entry by the gradient's size): rtol for the
# entries, atol for those a warm-up-sized update leaves near zero.
RTOL, ATOL = 2e-4, 2e-5
_COLLECTIVE = re.compile(r" (all-reduce|all-gather|reduce-scatter|collective-permute)(?:-start)?\(")


def _program(mesh_cfg: MeshConfig, devices: int, model=MODEL, train=TRAIN):
  return train_step.build(
    model, train, build_mesh(plan(mesh_cfg, devices), jax.devices()[:devices])
  )


def _train(program, steps: int = 2, model=MODEL):
  """Losses, final parameters and the compiled step's collectives (one compile)."""
  compiled = program.lower(TRAIN.global_batch, model.seq_len).compile()
  state, losses = program.init(), []
  for i in range(steps):
    batch = data.batch(
      TRAIN.task, TRAIN.seed, i, TRAIN.global_batch, model.seq_len, model.vocab_size
    )
    state, metrics = compiled(state, jax.device_put(batch, program.batch_sharding))
    losses.append(float(metrics["loss"]))
  return losses, jax.tree.map(np.asarray, state.params), _collectives(compiled.as_text())


def _assert_same(run, reference):
  (losses, params, _), (losses_1, params_1, _) = run, reference
  np.testing.assert_allclose(losses, losses_1, rtol=RTOL)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1), strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def _collectives(hlo_text: str) -> collections.Counter:
  return collections.Counter(_COLLECTIVE.findall(hlo_text))


@pytest.fixture(scope="module")
def single_device():
  return _train(_program(MeshConfig(data=1), 1))


@pytest.mark.parametrize(
  "mesh_cfg, schedule, virtual, micro_batch, sequence_parallel, passes, split_optimizer",
  [
    (MeshConfig(data=1, tensor=2, pipeline=4), "gpipe", 1, 0, True, 1, False),
    # 4 micro-batches per replica in 2 passes of 2, the moments split over data, and
    # only the elementwise ops recomputed.
    (MeshConfig(data=2, tensor=2, pipeline=2), "interleaved", 2, 1, False, 2, True),
    # 4 micro-batches per replica in 2 groups of 2, so every loop of the schedule runs
    # (the MLPerf experiment's setting).
    (MeshConfig(data=2, tensor=2, pipeline=2), "1f1b", 2, 1, True, 1, True),
  ],
  ids=[
    "gpipe-pipeline4-tensor2-sequence-parallel",
    "interleaved-pipeline2-data2-tensor2-2-passes-sharded-optimizer-elementwise-remat",
    "interleaved-1f1b-pipeline2-data2-tensor2-sequence-parallel-sharded-optimizer-"
    "elementwise-remat",
  ],
)
def test_pipelined_step_matches_one_device(
  mesh_cfg,
  schedule,
  virtual,
  micro_batch,
  sequence_parallel,
  passes,
  split_optimizer,
  single_device,
):
  train = dataclasses.replace(
    TRAIN,
    pipeline_schedule=schedule,
    virtual_stages=virtual,
    micro_batch=micro_batch,
    pipeline_passes=passes,
    shard_optimizer=split_optimizer,
  )
  model = dataclasses.replace(
    MODEL,
    sequence_parallel=sequence_parallel,
    remat="elementwise" if split_optimizer else MODEL.remat,
  )
  program = _program(mesh_cfg, 8, model=model, train=train)
  losses, params, collectives = _train(program)
  params["layers"] = pipeline.model_order(params["layers"], mesh_cfg.pipeline, virtual)
  _assert_same((losses, params, collectives), single_device)
  # The stages hand activations on with collective permutes; the layer stack stays put.
  assert collectives["collective-permute"] >= 2
  # Sequence parallelism all-gathers activations; the split optimizer, updated parameters.
  assert (collectives["all-gather"] > 0) == (sequence_parallel or split_optimizer)
  # Sequence parallelism ends each tensor-parallel region with a reduce-scatter (forward,
  # and its entries backward) in place of an all-reduce.
  assert (collectives["reduce-scatter"] >= 2) == sequence_parallel, collectives
  assert program.abstract_state.params["layers"]["fc1_kernel"].sharding.spec[0] == "pipeline"
  moment = program.abstract_state.opt_state[1][0].mu["layers"]["fc1_kernel"].sharding.spec
  assert ("data" in jax.tree.leaves(tuple(moment))) == split_optimizer


@pytest.mark.parametrize(
  "micro_batches, stages, virtual", [(4, 4, 1), (8, 2, 3), (64, 8, 6), (8, 8, 12)]
)
def test_one_f_one_b_schedule_keeps_its_order(micro_batches, stages, virtual):
  """Each chunk of each micro-batch forward on every rank in turn, its input arriving from
  the rank before on the trip before; backward in the reverse order, after its forward and
  after the head; every slot read backward holding that chunk's forward residuals."""
  M, P, V = micro_batches, stages, virtual
  plan = one_f_one_b.schedule(M, P, V)
  table = plan.table
  assert len(table) == plan.delay + (plan.groups - 1) * plan.group_trips + plan.drain_trips
  forward, backward, slot_holds, head_done = {}, {}, {}, {}
  boundaries = {plan.delay + g * plan.group_trips: g for g in range(plan.groups)}
  for t, rows in enumerate(table):
    if t in boundaries:  # the head of group g runs before this trip
      for i in range(P):
        assert forward[(P - 1, V - 1, boundaries[t] * P + i)] < t
        head_done[boundaries[t] * P + i] = t
    for s, row in enumerate(rows):
      k = t - s
      if 0 <= k < M * V:
        v, m = row[one_f_one_b.F_CHUNK], row[one_f_one_b.F_MICRO]
        if s > 0:
          assert forward[(s - 1, v, m)] == t - 1
        elif v > 0:
          assert forward[(P - 1, v - 1, m)] == t - 1
        assert row[one_f_one_b.F_FROM_INPUT] == (s == 0 and v == 0)
        assert row[one_f_one_b.F_SLOT] not in slot_holds.get(s, {})
        slot_holds.setdefault(s, {})[row[one_f_one_b.F_SLOT]] = (v, m)
        forward[(s, v, m)] = t
      if row[one_f_one_b.B_VALID]:
        v, slot = row[one_f_one_b.B_CHUNK], row[one_f_one_b.B_SLOT]
        v_m = slot_holds[s].pop(slot)
        assert v_m[0] == v and forward[(s, *v_m)] < t
        m = v_m[1]
        if s < P - 1:
          assert backward[(s + 1, v, m)] == t - 1
        elif v < V - 1:
          assert backward[(0, v + 1, m)] == t - 1
        else:
          assert head_done[m] <= t and row[one_f_one_b.B_HEAD_ROW] == m % P
        backward[(s, v, m)] = t
  assert len(forward) == len(backward) == P * V * M
  assert plan.slots <= plan.delay + P


def test_passes_of_at_least_the_stage_count_by_default():
  assert [pipeline.passes(0, m, 8) for m in (64, 32, 8, 12, 4)] == [8, 4, 1, 1, 1]
  assert pipeline.passes(3, 12, 8) == 3
  assert pipeline.trips(64 // 8, 8, 6) == 55  # one pass of the 512-GPU MLPerf step


def test_stage_order_is_a_permutation_of_chunks():
  rows = pipeline.stage_order(np.arange(8), stages=2, virtual_stages=2)
  # Rank 0 holds chunks 0 and 2 (layers 0-1, 4-5), rank 1 chunks 1 and 3.
  assert rows.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  assert pipeline.model_order(rows, 2, 2).tolist() == list(range(8))
  assert pipeline.trips(micro_batches=4, stages=2, virtual_stages=2) == 9
  assert pipeline.bubble_fraction(4, 2, 2) == pytest.approx(1 / 9)


def test_fp8_matches_bf16_within_quantisation_error():
  bf16 = dataclasses.replace(MODEL, num_layers=2, compute_dtype="bfloat16", remat="none")
  fp8 = dataclasses.replace(bf16, fp8=True)
  batch = data.batch("learnable", 0, 0, 8, MODEL.seq_len, MODEL.vocab_size)
  params = jax.jit(lambda: nnx.state(GPT(bf16, nnx.Rngs(0)), nnx.Param))()

  def loss_and_grads(model_cfg: ModelConfig):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(model_cfg, nnx.Rngs(0))))

    def loss(p):
      logits = nnx.merge(graphdef, p)(batch["inputs"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return jax.value_and_grad(loss)(params)

  # One compile for both (compiles dominate this test's time).
  compiled = jax.jit(lambda: (loss_and_grads(bf16), loss_and_grads(fp8))).lower().compile()
  (loss_16, grads_16), (loss_8, grads_8) = compiled()
  text = compiled.as_text()
  assert "f8e4m3fn" in text and "f8e5m2" in text
  # E4M3 keeps 3 mantissa bits: each operand element is off by up to 2^-4 relative,
  # and a dot product of n such terms averages that down; the loss moves by well under
  # 1%. Gradients pass through E5M2 (2 bits, up to 2^-3 per element) as well, so each
  # weight gradient tensor is compared by relative norm error, bounded at 15%; a wrong
  # scale or a dropped gradient term would be off by O(1).
  assert abs(float(loss_8) / float(loss_16) - 1) < 0.01, (loss_8, loss_16)
  for name in ("qkv_kernel", "out_kernel", "fc1_kernel", "fc2_kernel"):
    g8, g16 = (np.asarray(g["layers"][name][...], np.float32) for g in (grads_8, grads_16))
    error = np.linalg.norm(g8 - g16) / np.linalg.norm(g16)
    assert error < 0.15, (name, error)


def test_fp8_entry_all_gathers_the_cast_and_computes_what_gathering_first_does():
  # model/fp8.py casts a sequence shard with the amax of every shard and all-gathers the
  # E4M3 cast (half the bytes of bfloat16); the same scale and casts as casting after a
  # bfloat16 all-gather, so the same product and gradients. (On CPU meshes the collectives
  # carry float32; tests/test_mlperf.py checks the E4M3 all-gather on an H100 target.)
  mesh = build_mesh(plan(MeshConfig(data=4, tensor=2), 8), jax.devices()[:8])
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (4, 16, 32), jnp.float32) * jnp.arange(1, 17)[:, None]
  w = jax.random.normal(keys[1], (32, 64), jnp.float32)
  g = jax.random.normal(keys[2], (4, 16, 64), jnp.float32)

  def product(tensor_in_fn):
    def f(x, w):
      return sequence.matmul(
        fp8.einsum,
        "btd,df->btf",
        x,
        w,
        ("batch", "act_seq", "act_embed"),
        ("embed", "mlp"),
        ("batch", "length", "act_mlp"),
        tensor_in_fn,
      )

    with jax.set_mesh(mesh):
      y, vjp = jax.vjp(jax.jit(f), x, w)
      return y, *vjp(g)

  gathered, reference = product(True), product(False)
  # The same E4M3 values reach the same matmul; only XLA's fusion of the scaling may
  # round the last bit differently.
  for a, b in zip(gathered, reference, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(gathered[1])).max() > 0


@pytest.mark.parametrize(
  "mesh_cfg, train, message",
  [
    (
      MeshConfig(data=2, tensor=1, pipeline=4),
      dataclasses.replace(TRAIN, virtual_stages=2),
      "train.virtual_stages must be 1 with the gpipe schedule",
    ),
    (
      MeshConfig(data=1, tensor=1, pipeline=8),
      TRAIN,
      "model.num_layers = 4 does not split into mesh.pipeline 8 x train.virtual_stages 1",
    ),
    (
      MeshConfig(data=4, tensor=1, pipeline=2),
      dataclasses.replace(TRAIN, pipeline_schedule="interleaved", virtual_stages=2),
      "needs at least mesh.pipeline = 2 micro-batches",
    ),
    (
      MeshConfig(data=2, pipeline=4),
      dataclasses.replace(TRAIN, pipeline_schedule="interleaved"),
      "train.virtual_stages must be at least 2 with the interleaved schedule",
    ),
    (
      MeshConfig(data=2, tensor=2, pipeline=2),
      dataclasses.replace(TRAIN, micro_batch=1, pipeline_passes=3),
      "train.pipeline_passes = 3 does not divide the 4 micro-batches",
    ),
    (
      MeshConfig(data=2, tensor=2, pipeline=2),
      dataclasses.replace(
        TRAIN, micro_batch=1, pipeline_schedule="interleaved", virtual_stages=2, pipeline_passes=4
      ),
      "micro-batches per data-parallel replica and pass, got 1",
    ),
    (
      MeshConfig(data=2, pipeline=4),
      dataclasses.replace(TRAIN, pipeline_schedule="1F1B"),
      "train.pipeline_schedule must be one of gpipe, interleaved, 1f1b",
    ),
    (
      MeshConfig(data=2, tensor=2, pipeline=2),
      dataclasses.replace(TRAIN, micro_batch=4, pipeline_schedule="1f1b"),
      "runs micro-batches in groups of mesh.pipeline = 2; 1 per data-parallel",
    ),
    (
      MeshConfig(data=2, tensor=2, pipeline=2),
      dataclasses.replace(TRAIN, micro_batch=1, pipeline_schedule="1f1b", pipeline_passes=2),
      "train.pipeline_passes must be 0 or 1 with the 1f1b schedule",
    ),
  ],
)
def test_bad_pipeline_settings_are_refused(mesh_cfg, train, message):
  with pytest.raises(UserInputError, match=message):
    _program(mesh_cfg, 8, train=train)


def test_pipeline_axis_crosses_infiniband_first():
  layout = plan(MeshConfig(data=2, tensor=2, pipeline=2), 8)
  assert layout.nvlink == {
    "data": 2,
    "fsdp": 1,
    "expert": 1,
    "context": 1,
    "tensor": 2,
    "pipeline": 1,
  }
  assert layout.infiniband["pipeline"] == 2


def _f8_weight_casts(jaxpr, kernel_shapes, in_loop=False):
  """(casts to E4M3 of kernel-shaped arrays outside loops, inside loops), recursively."""
  outside = inside = 0
  for eqn in jaxpr.eqns:
    if (
      eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == jnp.float8_e4m3fn
    ):
      shape = eqn.invars[0].aval.shape
      if any(shape[len(shape) - len(k) :] == k for k in kernel_shapes):
        inside, outside = inside + in_loop, outside + (not in_loop)
    loop = in_loop or eqn.primitive.name in ("scan", "while")
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          o, i = _f8_weight_casts(sub, kernel_shapes, loop)
          outside, inside = outside + o, inside + i
  return outside, inside


def test_fp8_weights_are_cast_once_a_step_outside_the_pipeline_loop():
  model = dataclasses.replace(MODEL, fp8=True, compute_dtype="bfloat16")
  train = dataclasses.replace(
    TRAIN, pipeline_schedule="interleaved", virtual_stages=2, micro_batch=1
  )
  program = _program(MeshConfig(data=2, tensor=2, pipeline=2), 8, model=model, train=train)
  D, F, H, K = model.d_model, model.d_ff, model.num_heads, model.head_dim
  kernels = ((D, 3, H, K), (H, K, D), (D, F), (F, D))
  with jax.set_mesh(program.mesh):
    jaxpr = jax.make_jaxpr(program.step)(
      program.abstract_state, program.abstract_batch(TRAIN.global_batch, MODEL.seq_len)
    )
  # One cast per kernel stack, none per trip or per layer.
  assert _f8_weight_casts(jaxpr.jaxpr, kernels) == (4, 0)


# ------------------------------------------------------------------ uneven pipeline stages
def test_uneven_split_counts_the_embedding_and_the_loss_as_layers():
  # 6 layers in 2 x 2 chunks of 2 slots: model positions 0 and 7 are the embedding's and
  # the loss's places, padding rows that copy their neighbour.
  assert pipeline.split(6, 2, 2) == (2, True) and pipeline.split(8, 2, 2) == (2, False)
  assert pipeline.split(126, 8, 8) == (2, True) and pipeline.stack_rows(126, 8, 8) == 128
  rows = pipeline.stage_order(np.arange(6), stages=2, virtual_stages=2)
  # Rank 0: chunk 0 (padding, layer 0) and chunk 2 (layers 3, 4); rank 1: chunk 1
  # (layers 1, 2) and chunk 3 (layer 5, padding).
  assert rows.tolist() == [0, 0, 3, 4, 1, 2, 5, 5]
  assert pipeline.active_rows(6, 2, 2).tolist() == [
    [False, True, True, True],
    [True, True, True, False],
  ]
  assert pipeline.active_rows(8, 2, 2) is None
  assert pipeline.model_order(rows, 2, 2, num_layers=6).tolist() == list(range(6))


@pytest.mark.parametrize("layers, stages, virtual", [(5, 2, 2), (2, 2, 2), (125, 8, 8)])
def test_a_split_that_does_not_cover_the_layers_is_one_line(layers, stages, virtual):
  with pytest.raises(UserInputError, match=r"^model.num_layers = \d+ does not split") as e:
    pipeline.check(layers, stages, virtual, micro_batches=8)
  assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def single_device_6_layers():
  return _train(_program(MeshConfig(data=1), 1, model=dataclasses.replace(MODEL, num_layers=6)))


@pytest.mark.parametrize(
  "schedule, sequence_parallel",
  [("1f1b", True), ("interleaved", False)],
  ids=["interleaved-1f1b-sequence-parallel", "interleaved-lockstep"],
)
def test_uneven_stages_match_one_device(schedule, sequence_parallel, single_device_6_layers):
  """6 layers on pipeline 2 x 2 virtual stages (data 2, tensor 2): the embedding's and the
  loss's slots are padding the chunks skip. Same float32 reductions as the even cases,
  so the same tolerance (RTOL, ATOL above); the skipped rows add exact zeros."""
  mesh_cfg = MeshConfig(data=2, tensor=2, pipeline=2)
  train = dataclasses.replace(TRAIN, pipeline_schedule=schedule, virtual_stages=2, micro_batch=1)
  model = dataclasses.replace(
    MODEL, num_layers=6, sequence_parallel=sequence_parallel, remat="elementwise"
  )
  program = _program(mesh_cfg, 8, model=model, train=train)
  assert program.abstract_state.params["layers"]["fc1_kernel"].shape[0] == 8
  losses, params, collectives = _train(program)
  params["layers"] = pipeline.model_order(params["layers"], 2, 2, num_layers=6)
  _assert_same((losses, params, collectives), single_device_6_layers)
  assert collectives["collective-permute"] >= 2


def test_uneven_stages_keep_an_amax_history_per_stored_row():
  """FP8 delayed scaling on the uneven 1F1B pipeline: a history row for each of the 8
  stored rows (padding included), and the first step's loss as on one device (its casts
  use the same initial scales; an FP8 rounding can flip where the sharded sums differ in
  order, moving the mean over 128 tokens by well under 1e-3)."""
  model = dataclasses.replace(
    MODEL, num_layers=6, remat="elementwise", fp8=True, fp8_amax_history=4, compute_dtype="bfloat16"
  )
  train = dataclasses.replace(TRAIN, pipeline_schedule="1f1b", virtual_stages=2, micro_batch=1)
  program = _program(MeshConfig(data=2, tensor=2, pipeline=2), 8, model=model, train=train)
  assert program.abstract_state.fp8_history["fc1_kernel"].get_value().shape == (8, 2, 4)
  losses, _, _ = _train(program, steps=1)
  reference, _, _ = _train(_program(MeshConfig(data=1), 1, model=model), steps=1)
  np.testing.assert_allclose(losses, reference, rtol=1e-3)


def test_gradients_reduced_in_the_drain_match_those_reduced_after():
  """train.overlap_grad_reduce: the layer gradients reduce-scattered over `data` (and summed
  over `context`) in the drain's reducing loop, against the same step reducing them after
  the pipeline: the same sums in another order (RTOL, ATOL above). With `tensor` instead of
  `context` the reduction is checked against one device above (the 1f1b case)."""
  mesh_cfg = MeshConfig(data=2, context=2, pipeline=2)
  train = dataclasses.replace(
    TRAIN, pipeline_schedule="1f1b", virtual_stages=3, micro_batch=1, shard_optimizer=True
  )
  # 3 chunks a rank: the reducing loop runs 2 iterations (one would be inlined).
  model = dataclasses.replace(
    MODEL, num_layers=6, sequence_parallel=mesh_cfg.tensor > 1, remat="elementwise"
  )
  overlapped = _program(mesh_cfg, 8, model=model, train=train)
  after = _program(
    mesh_cfg, 8, model=model, train=dataclasses.replace(train, overlap_grad_reduce=False)
  )
  _assert_same(_train(overlapped), _train(after))
  _assert_in_loop(overlapped, MODEL, step_loops.drain_reduce_loops, "reduce-scatter")
  text = after.lower(TRAIN.global_batch, MODEL.seq_len).compile().as_text()
  assert one_f_one_b.DRAIN_REDUCE_SCOPE not in text


def _assert_in_loop(program, model, loops, kind: str) -> None:
  """The compiled step's one loop that `loops` (a step_loops finder) finds runs a `kind`
  collective over 2 ranks (`data`'s)."""
  text = program.lower(TRAIN.global_batch, model.seq_len).compile().as_text()
  (loop,) = loops(hlo.analyze(text))
  found = [c for c, _ in hlo.collectives(loop.body) if c.kind == kind and c.group_size == 2]
  assert found, f"no {kind} over data in {loop.op_name}"


def test_kernels_gathered_in_the_fill_match_those_gathered_before_it():
  """train.overlap_param_gather: the block-scaled kernels, split over `data`, gathered and
  quantized chunk by chunk in the 1F1B fill's gathering loop, against the same step making
  every quantization before the fill: the same blocks quantized from the same values, so
  the same step but for XLA's float32 reduction order (RTOL, ATOL above)."""
  mesh_cfg = MeshConfig(data=2, tensor=2, pipeline=2)
  train = dataclasses.replace(
    TRAIN,
    pipeline_schedule="1f1b",
    virtual_stages=3,
    micro_batch=1,
    shard_optimizer=True,
    overlap_param_gather=True,
  )
  # MXFP8's 32-value blocks: every kernel width a tensor rank holds and the 32 tokens of a
  # micro-batch split into whole blocks. 3 chunks a rank: the gathering loop runs 2
  # iterations (one would be inlined).
  model = dataclasses.replace(
    MODEL,
    num_layers=6,
    d_model=64,
    num_heads=2,
    head_dim=32,
    seq_len=32,
    compute_dtype="float32",
    block_scaling="mxfp8",
    remat="elementwise",
  )
  in_fill = _program(mesh_cfg, 8, model=model, train=train)
  before = _program(
    mesh_cfg, 8, model=model, train=dataclasses.replace(train, overlap_param_gather=False)
  )
  _assert_same(_train(in_fill, model=model), _train(before, model=model))
  _assert_in_loop(in_fill, model, step_loops.fill_gather_loops, "all-gather")
  text = before.lower(TRAIN.global_batch, model.seq_len).compile().as_text()
  assert one_f_one_b.FILL_GATHER_SCOPE not in text
