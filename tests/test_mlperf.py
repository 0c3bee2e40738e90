"""The MLPerf GPT-3 175B experiment: time-to-train arithmetic, published variants by GPU
count, the --set parallelism shortcuts, FP8 matmuls at the FP8 rate, and NVL72 replicas
kept inside racks. No 175B compile here (the calibration runs in
benchmarks/mlperf_gpt3.py); the FP8 check compiles one small matmul deviceless.
Figures are compared as in tests/test_projection.py (its docstring): float arithmetic over
a deterministic compile, pytest.approx's default for rounding, a wider bound with its
reason beside it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from projected import projected

import experiments
from errors import UserInputError
from experiments import mlperf_gpt3_175b as mlperf
from experiments import overrides
from hardware import catalog
from model import fp8
from model.attention import attention
from parallelism import sequence
from parallelism.mesh import AXES, MeshConfig
from projection import (
  aot_compile,
  collective_timing,
  cost_model,
  hlo,
  layout,
  step_loops,
  targets,
)
from projection.plan import plan as plan_target
from reference import mlperf_gpt3
from train.config import TrainConfig

_CUDA, _WHY = targets.cuda_available()
H100 = catalog.get("h100")


# ----------------------------------------------------------------------------- time to train
def test_time_to_train_arithmetic():
  bench = mlperf.BENCHMARK
  # GBS 2048: an evaluation every ceil(24576 / 2048) = 12 steps, 288 steps, 24 evaluations.
  assert (
    bench.eval_interval_steps(2048),
    bench.steps_to_converge(2048),
    bench.evaluations(2048),
  ) == (12, 288, 24)
  # Step 10 s; the validation set pads to ceil(5662 / 2048) = 3 batches at a third of the
  # step's FLOPs: 10 s an evaluation, 2,880 + 240 s in all.
  est = bench.estimate(10.0, 2048, 1 / 3)
  assert est["eval_s_each"] == pytest.approx(10.0)
  assert est["time_to_train_min"] == pytest.approx((2880 + 240) / 60)
  assert est["tokens_to_converge"] == 288 * 2048 * 2048
  # GBS 2688 (the 10,752-GPU run): 220 steps = 22 intervals of 10.
  assert (bench.steps_to_converge(2688), bench.evaluations(2688)) == (220, 22)
  # Between rows: tokens linear in the batch, steps rounded up to whole intervals of 10.
  tokens = (bench.tokens_to_converge(2048) + bench.tokens_to_converge(2688)) / 2
  assert bench.tokens_to_converge(2368) == pytest.approx(tokens)
  steps = bench.steps_to_converge(2368)
  assert steps % 11 == 0 and 0 <= steps * 2368 * 2048 - tokens < 11 * 2368 * 2048
  with pytest.raises(UserInputError, match="global batches 1536-6144 only"):
    bench.steps_to_converge(1024)


def test_published_configurations_are_the_default_for_their_gpu_counts():
  exp = experiments.load("mlperf_gpt3_175b")
  big = experiments.at_target(exp, 10752)
  assert (big.train.global_batch, big.train.micro_batch, big.mesh.tensor) == (2688, 1, 4)
  assert big.train.lr_warmup_steps == 152 and big.train.lr_decay_steps == 62058
  small = experiments.at_target(exp, 512)
  assert (small.train.global_batch, small.train.micro_batch) == (2048, 2)
  assert experiments.at_target(exp, 1024) is exp
  assert mlperf_gpt3.learning_rate(2048) == 2e-5 and mlperf_gpt3.learning_rate(4096) == 3e-5
  assert (exp.model.num_layers, exp.model.d_model, exp.model.seq_len, exp.model.vocab_size) == (
    96,
    12288,
    2048,
    50257,
  )


# ----------------------------------------------------------------------------- overrides
def test_parallelism_shortcuts_set_the_real_fields():
  exp = experiments.load("mlperf_gpt3_175b")
  assert exp.model.fp8 and exp.mesh.pipeline == 8
  got = overrides.apply(
    exp,
    [
      "variant=eos_10752",
      "tensor_parallel=8",
      "pipeline_parallel=4",
      "virtual_stages=3",
      "micro_batch=4",
      "global_batch=3072",
      "precision=bf16",
      "remat=full",
    ],
  )
  assert (got.mesh.tensor, got.mesh.pipeline, got.train.virtual_stages) == (8, 4, 3)
  assert (got.train.micro_batch, got.train.global_batch) == (4, 3072)
  assert (got.model.fp8, got.model.remat) == (False, "full")
  assert got.variants == exp.variants  # a variant keeps its siblings selectable


@pytest.mark.parametrize(
  "assignment, message",
  [
    ("tensor_parallel=0", "--set tensor_parallel: expected a positive whole number, got '0'"),
    ("micro_batch=two", "--set micro_batch: expected a positive whole number, got 'two'"),
    ("precision=fp16", "--set precision: expected one of bf16, fp8, mxfp8, nvfp4, got 'fp16'"),
    ("remat=some", "--set remat: expected one of none, full, save_dots, elementwise, got 'some'"),
    ("variant=eos_1", "--set variant: mlperf_gpt3_175b has variants eos_10752, eos_512"),
  ],
)
def test_bad_shortcut_values_name_the_key_and_what_is_allowed(assignment, message):
  with pytest.raises(UserInputError) as e:
    overrides.apply(experiments.load("mlperf_gpt3_175b"), [assignment])
  assert message in str(e.value)


# ----------------------------------------------------------------------------- FP8
def test_cublaslt_fp8_gemm_is_costed_at_the_fp8_rate():
  # cuBLASLt's FP8 gemm as XLA GPU emits it on Hopper: f8 operands, f32 scales.
  text = """HloModule m, is_scheduled=true

ENTRY %main (a: f8e4m3fn[4096,4096], b: f8e4m3fn[4096,4096], s: f32[]) -> bf16[4096,4096] {
  %a = f8e4m3fn[4096,4096]{1,0} parameter(0)
  %b = f8e4m3fn[4096,4096]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %g = (bf16[4096,4096]{1,0}, s8[33554432]{0}) custom-call(%a, %b, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  ROOT %r = bf16[4096,4096]{1,0} get-tuple-element(%g), index=0
}
"""
  program = hlo.analyze(text)
  (gemm,) = program.entry
  assert gemm.dot_dtype == "f8e4m3fn" and gemm.dot_flops == 2 * 4096**3
  assert hlo.uses_fp8(program)
  assert cost_model.op_time_s(gemm, H100) == pytest.approx(2 * 4096**3 / 1403e12)


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_fp8_dot_compiled_for_h100_runs_at_the_fp8_rate():
  mesh = Mesh(np.array(targets.target_devices("h100", 1, 1)), ("x",))
  spec = NamedSharding(mesh, PartitionSpec())
  x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=spec)
  scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=spec)

  def fp8_matmul(a, b, sa, sb):
    a8, b8 = (a / sa).astype(jnp.float8_e4m3fn), (b / sb).astype(jnp.float8_e5m2)
    return jnp.dot(a8, b8, preferred_element_type=jnp.bfloat16) * (sa * sb).astype(jnp.bfloat16)

  def bf16_matmul(a, b, sa, sb):
    return jnp.dot(a, b, preferred_element_type=jnp.bfloat16)

  times = {}
  for fn in (fp8_matmul, bf16_matmul):
    program = hlo.analyze(jax.jit(fn).trace(x, x, scale, scale).lower().compile().as_text())
    (dot,) = [n for n, _ in hlo.walk(program) if isinstance(n, hlo.Compute) and n.dot_flops]
    assert dot.dot_flops == 2 * 4096**3
    assert hlo.uses_fp8(program) == (fn is fp8_matmul)
    times[fn.__name__] = cost_model.op_time_s(dot, H100)
  # The FP8 gemm fusion also scales and converts its inputs (vector work): within 1%.
  assert times["fp8_matmul"] == pytest.approx(2 * 4096**3 / 1403e12, rel=0.01)
  assert times["bf16_matmul"] == pytest.approx(2 * 4096**3 / 794e12)


# ----------------------------------------------------------------------------- NVL72 racks
def test_nvl72_replicas_are_rack_aligned():
  gpt3 = experiments.load("gpt3")  # fsdp 8 x tensor 8: 64-GPU replicas
  gb200 = catalog.get("gb200")
  reduced = plan_target(gpt3, gb200, 512).reduced
  assert reduced.target.nvlink_domain == 64  # 16 of each rack's 18 trays
  fsdp_groups = tuple(tuple(range(t, 64, 8)) for t in range(8))
  placements = layout.target_group_domains(fsdp_groups, reduced)
  assert all(len(set(domains)) == 1 for domains in placements)
  # Tensor 4 or 8 alone tiles a whole rack.
  tp8 = dataclasses.replace(gpt3, mesh=dataclasses.replace(gpt3.mesh, fsdp=1))
  assert plan_target(tp8, gb200, 768).reduced.target.nvlink_domain == 72
  assert plan_target(gpt3, H100, 512).reduced.target.nvlink_domain == 8


# ----------------------------------------------------------------------------- attention
@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_cudnn_flash_attention_compiles_deviceless_and_counts_its_matmuls():
  B, T, H, K = 2, 2048, 24, 128
  mesh = Mesh(np.array(targets.target_devices("h100", 1, 1)), ("x",))
  x = jax.ShapeDtypeStruct(
    (B, T, H, K), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec())
  )
  loss = lambda q, k, v: attention(q, k, v, "cudnn").astype(jnp.float32).sum()
  with targets.cudnn_version_of("h100"):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower()
  program = hlo.analyze(lowered.compile().as_text())
  calls = [n for n, _ in hlo.walk(program) if isinstance(n, hlo.Compute) and "fmha" in n.kind]
  # Causal: half of the T x T square; forward Q.K^T and P.V, backward five matmuls.
  square = B * H * T * T * K
  flops = {n.kind: n.dot_flops for n in calls}
  assert flops == {
    "__cudnn$fmhaSoftmax": 2 * 2 * square / 2,
    "__cudnn$fmhaSoftmaxBackward": 5 * 2 * square / 2,
  }
  assert all(n.dot_dtype == "bf16" for n in calls)
  # No [B, H, T, T] scores through HBM: every op moves less than one score tensor.
  assert (
    max(n.bytes_read + n.bytes_written for n, _ in hlo.walk(program) if isinstance(n, hlo.Compute))
    < B * H * T * T * 2
  )


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_sequence_parallel_fp8_entries_all_gather_e4m3_on_h100():
  # Transformer Engine's FP8 all-gather: a tensor-parallel region's entry gathers the
  # E4M3 cast, not bfloat16 (model/fp8.py `gather`); the input gradient is reduce-scattered
  # in bfloat16.
  sizes = [2 if axis == "tensor" else 1 for axis in AXES]  # tensor 2, every other axis 1
  mesh = Mesh(
    np.array(targets.target_devices("h100", 1, 2)).reshape(sizes),
    AXES,
    axis_types=(AxisType.Auto,) * len(AXES),
  )
  x = jax.ShapeDtypeStruct(
    (2, 256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(None, "tensor"))
  )
  w = jax.ShapeDtypeStruct(
    (512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(None, "tensor"))
  )

  def loss(x, w):
    y = sequence.matmul(
      fp8.einsum,
      "btd,df->btf",
      x,
      w,
      ("batch", "act_seq", "act_embed"),
      ("embed", "mlp"),
      ("batch", "length", "act_mlp"),
      tensor_in_fn=True,
    )
    return y.astype(jnp.float32).sum()

  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
  kinds = {(c.kind, c.dtype) for c, _ in hlo.collectives(hlo.analyze(text))}
  assert ("all-gather", "f8e4m3fn") in kinds and ("reduce-scatter", "bf16") in kinds, kinds
  assert ("all-gather", "bf16") not in kinds, kinds


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_split_optimizer_gathers_the_fp8_kernels_casts_over_data_on_h100(toy_experiment):
  # With the moments split over data, FP8 kernels are stored split too and each step
  # all-gathers their E4M3 casts (train/step.py): one byte per kernel element over `data`,
  # and no kernel gathered in bfloat16 (the other parameters are far smaller).
  exp = toy_experiment(
    "fp8_gather",
    mesh=MeshConfig(data=-1, tensor=2, pipeline=2),
    train=TrainConfig(
      global_batch=16, micro_batch=1, pipeline_schedule="1f1b", shard_optimizer=True
    ),
    param_dtype="bfloat16",
    fp8=True,
    fp8_amax_history=16,
  )
  reduced = plan_target(exp, H100, 8).reduced
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  program = aot_compile.compile_step(
    exp.model, train_cfg, tuple(reduced.sizes.items()), "h100", 8
  ).program
  gathered = {"f8e4m3fn": 0, "bf16": 0}
  for node, _ in hlo.collectives(program):
    if node.kind == "all-gather" and layout.axes_of(node.groups, reduced) == "data":
      gathered[node.dtype] = gathered.get(node.dtype, 0) + node.bytes
  kernel_elements = 12 * 4 * 128 * 128 // (2 * 2)  # L (3 D^2 + D^2 + 2 x 4 D^2) per rank
  assert gathered["f8e4m3fn"] == kernel_elements, gathered
  assert gathered["bf16"] < kernel_elements, gathered


# ----------------------------------------------------------------------------- pipeline bubble
@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_bubble_is_the_idle_trips_share_of_the_compiled_pipeline_loops(toy_experiment):
  # 2 stages x 2 virtual stages, 4 micro-batches per replica: 4 x 2 + 2 - 1 = 9 trips of
  # each pipeline loop (forward and backward), 1 of them idle.
  exp = toy_experiment(
    "pp",
    mesh=MeshConfig(data=-1, pipeline=2),
    train=TrainConfig(
      global_batch=16, micro_batch=1, pipeline_schedule="interleaved", virtual_stages=2
    ),
  )
  record = projected(exp, "h100", 8)
  assert (record["micro_batches"], record["compiled_micro_batches"]) == (4, 4)
  reduced = plan_target(exp, H100, 8).reduced
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  program = aot_compile.compile_step(
    exp.model, train_cfg, tuple(reduced.sizes.items()), "h100", 8
  ).program
  timer = collective_timing.collective_timer(reduced, H100)
  loops = [program.entry[i] for i in step_loops.pipeline_loops(program)]
  assert [loop.trip_count for loop in loops] == [9, 9]
  loops_s = sum(cost_model.simulate((loop,), H100, timer).step_s for loop in loops)
  bubble = record["breakdown"]["bubble_s"]
  assert bubble > 0 and bubble == pytest.approx(loops_s / 9)  # (P-1) / (M V + P - 1)
  # The stages pass activations with collective-permutes along `pipeline`, waited for on
  # every trip; the mesh has no other axes than data and pipeline.
  by_axis = record["breakdown"]["exposed_comm_by_axis_s"]
  assert by_axis["pipeline"] > 0
  assert all(set(axes.split("+")) <= {"data", "pipeline"} for axes in by_axis if axes != "none")
  assert max(by_axis.values()) <= record["breakdown"]["exposed_comm_s"] + 1e-12
  # 8 micro-batches: 8 more busy trips per loop, the same one idle.
  eight = step_loops.with_micro_batches(program, 4, 8, virtual_stages=2)
  assert [eight.entry[i].trip_count for i in step_loops.pipeline_loops(eight)] == [17, 17]
  assert step_loops.bubble_s(eight, H100, timer, 8, 2, 2) == pytest.approx(bubble)
  with pytest.raises(RuntimeError, match="not the 8 x 2 \\+ 2 - 1 of the schedule"):
    step_loops.bubble_s(program, H100, timer, 8, 2, 2)
  # The same micro-batches in 2 passes of 2: each pass's loops run 2 x 2 + 1 = 5 trips
  # inside the pass loop, 1 idle, so twice the idle trips of one pass.
  two = dataclasses.replace(exp, train=dataclasses.replace(exp.train, pipeline_passes=2))
  train_cfg = dataclasses.replace(two.train, global_batch=reduced.global_batch)
  passes = step_loops.pipeline_passes(
    aot_compile.compile_step(two.model, train_cfg, tuple(reduced.sizes.items()), "h100", 8).program
  )
  assert [(loop.trip_count, repeats) for loop, repeats in passes] == [(5, 2), (5, 2)]
  loops_s = sum(cost_model.simulate((loop,), H100, timer).step_s for loop, _ in passes)
  two_passes_bubble = projected(two, "h100", 8)["breakdown"]["bubble_s"]
  assert two_passes_bubble == pytest.approx(2 * loops_s / 5)
  # 1f1b, 4 micro-batches in 2 groups: a forward-only fill of V P + P - 1 = 5 trips, one
  # group's steady loop of P V = 4 trips, a backward-only drain of 5; each rank idles
  # P - 1 = 1 trip of the fill and 1 of the drain.
  one_f = dataclasses.replace(exp, train=dataclasses.replace(exp.train, pipeline_schedule="1f1b"))
  train_cfg = dataclasses.replace(one_f.train, global_batch=reduced.global_batch)
  program = aot_compile.compile_step(
    one_f.model, train_cfg, tuple(reduced.sizes.items()), "h100", 8
  ).program
  loops = step_loops.pipeline_passes(program)
  assert [(loop.trip_count, repeats) for loop, repeats in loops] == [(5, 1), (4, 1), (5, 1)]
  fill, _, drain = (cost_model.simulate(loop.body, H100, timer).step_s for loop, _ in loops)
  record = projected(one_f, "h100", 8)
  assert record["breakdown"]["bubble_s"] == pytest.approx(fill + drain)
  # The same memory as those 2 passes (2 micro-batches in flight), half their idle trips.
  assert record["breakdown"]["bubble_s"] < two_passes_bubble * 0.75
