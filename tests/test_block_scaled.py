"""Block-scaled weight matmuls (model/block_scaled.py): the formats' numerics on CPU (the
emulated GEMM), a tiny model training with them, Hopper refusing them, and a deviceless
Blackwell compile carrying cuDNN's block-scaled GEMMs that the HLO reader counts."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from small_models import SMALL_LLAMA, train_program
from test_launch import launch

import experiments
from errors import UserInputError
from experiments import ExperimentConfig, overrides
from model import block_scaled, fused_quantize
from parallelism.mesh import MeshConfig
from projection import aot_compile, hlo, targets
from train import data
from train.config import TrainConfig

# Relative (Frobenius) error of a block-scaled matmul of Gaussian operands against float32,
# and of its two gradients. Round-to-nearest leaves each element within half a step of
# the format: 2^-4 of itself for E4M3's 3 mantissa bits (MXFP8), 2^-2 for E2M1's 1 (NVFP4)
# at the top of a block, more below it; the errors of K products average out to about
# the elements' RMS error: 3.7% and 13-15% here (the NVFP4 paper's quantizer: 9.5-11%).
MATMUL_RTOL = {"mxfp8": 0.05, "nvfp4": 0.2}
SPEC = "btd,dchk->btchk"  # the fused QKV projection's
# Losses of one program sharded two ways: the reduction order differs in float32's last
# bits, which can move one element across a format rounding boundary (a step of 2^-3 of
# itself) and the mean loss over 128 tokens by a small part of that.
LOSS_RTOL = 1e-3
# One product summed in another order: float32 rounding, 2^-24 relative per addition.
REDUCTION_RTOL = 1e-5
# SMALL_LLAMA with every kernel axis that blocks run along a multiple of 32 (head_dim
# included), so that each kernel's quantization is made once a step
# (block_scaled.quantize_weights) and laid out like it.
BLOCKED = dataclasses.replace(SMALL_LLAMA, d_model=128, head_dim=32, ffn_dim=256, num_layers=2)
# Low enough that bf16's and the formats' runs stay on one path over 20 steps (at 1e-2
# this model's losses part by up to 10% in either format, MXFP8 included).
LEARNING_RATE = 3e-3


def _operands():
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (2, 64, 128))
  w = jax.random.normal(kw, (128, 3, 4, 16)) * 0.1
  g = jax.random.normal(kg, (2, 64, 3, 4, 16))
  return x, w, g


def _relative(a, b) -> float:
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("fmt", block_scaled.FORMAT_NAMES)
def test_quantized_blocks_use_the_format(fmt):
  spec = block_scaled.FORMATS[fmt]
  a = jax.random.normal(jax.random.key(1), (32, 64)) * jnp.logspace(-3, 3, 64)
  q = block_scaled.quantize(a, spec)
  assert q.values.dtype == spec.values and q.scales.dtype == spec.scales
  assert q.scales.shape == (32, 64 // spec.block)
  values = np.asarray(q.values.astype(jnp.float32))
  # Each block's largest value lands near the top of the format's range (one scale step
  # below at worst: a power of two for MXFP8, an E4M3 rounding for NVFP4's scales; the
  # blocks' amaxes here, 1e-3 to 1e3 x a Gaussian's, keep NVFP4's scales off E4M3's
  # subnormals).
  block_max = np.abs(values).reshape(32, -1, spec.block).max(axis=-1)
  assert block_max.min() >= spec.value_max / 2, block_max.min()
  error = _relative(block_scaled.dequantize(q, spec), a)
  assert error < MATMUL_RTOL[fmt], error


def test_nvfp4_tiles_read_the_other_way_are_the_transposes_quantization():
  # 16 x 16 tiles: quantizing a along rows and reading it along columns (transposed) gives
  # the same bits as quantizing a.T, which the input-gradient GEMM relies on.
  spec = block_scaled.FORMATS["nvfp4"]
  a = jax.random.normal(jax.random.key(3), (64, 48)) * jnp.logspace(-2, 2, 48)
  by_rows = block_scaled.transposed(block_scaled.quantize(a, spec, tile_rows=16), spec)
  direct = block_scaled.quantize(a.T, spec, tile_rows=16)
  for got, want in zip(by_rows, direct):
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_block_scaling_shortcut_and_refusals():
  exp = overrides.apply(experiments.load("tiny"), ["precision=fp8", "precision=mxfp8"])
  assert (exp.model.fp8, exp.model.block_scaling) == (False, "mxfp8")
  with pytest.raises(UserInputError, match="replaces per-tensor FP8"):
    dataclasses.replace(exp.model, fp8=True).validate()
  with pytest.raises(UserInputError, match="multiples of 16"):
    block_scaled.quantize(jnp.ones((16, 24)), block_scaled.FORMATS["nvfp4"])


def _both_ways_by_jnp(a, fmt: str):
  spec = block_scaled.FORMATS[fmt]
  by_k, by_m = block_scaled.quantize(a, spec), block_scaled.quantize(a.T, spec)
  return by_k.values, by_k.scales, by_m.values, by_m.scales


def _both_ways_by_kernel(a, fmt: str, row_groups: int = 1):
  if fmt == "mxfp8":
    return fused_quantize.mxfp8_both_ways(a, interpret=True, row_groups=row_groups)
  # The per-tensor scale as block_scaled.both_ways takes it.
  scale = block_scaled.nvfp4_global_scale(jnp.max(jnp.abs(a)).astype(jnp.float32))
  return fused_quantize.nvfp4_both_ways(a, scale, interpret=True, row_groups=row_groups)


def _same_bits(got, expected):
  for a, b in zip(got, expected, strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), b.astype(jnp.float32))


@pytest.mark.parametrize("fmt", block_scaled.FORMAT_NAMES)
def test_fused_kernel_quantizes_both_ways_as_the_jnp_passes(fmt):
  """The Pallas kernel (model/fused_quantize.py), run by the interpreter here, gives the
  values and scales of `quantize` along K and of `quantize` of the transpose: the same
  float32 ops on the same values. Sides of 96 and 576 take 32- and 64-wide tiles (48: 16);
  a zero block and a zero matrix take scale 1; a block a million times smaller than the
  rest its own scale; three matrices under vmap (the experts' stacks) the batch axis."""
  a = jax.random.normal(jax.random.key(1), (3, 96, 576), jnp.bfloat16) * 3
  a = a.at[0, :32, :32].set(0).at[1, :32, 32:64].multiply(1e-6)
  if fmt == "nvfp4":
    a = a[:, :48].at[2].set(0)
  run = functools.partial(_both_ways_by_kernel, fmt=fmt)
  expected = functools.partial(_both_ways_by_jnp, fmt=fmt)
  _same_bits(jax.jit(jax.vmap(run))(a), jax.vmap(expected)(a))


@pytest.mark.parametrize("fmt", block_scaled.FORMAT_NAMES)
def test_fused_kernel_reads_an_expert_buffer_in_place(fmt):
  """An expert buffer [sequences, experts, slots, D] (as the dispatch all-to-all leaves it),
  each expert's rows taken as block_scaled's batched einsum takes them (the expert axis
  moved out and vmapped over): with row_groups = sequences the kernel reads the buffer in
  its own order and gives each expert's quantization, both ways, as the jnp passes do;
  also under an outer vmap (the pipeline stages')."""
  buffer = jax.random.normal(jax.random.key(3), (2, 3, 4, 64, 96), jnp.bfloat16)
  experts = jnp.moveaxis(buffer, 2, 1).reshape(2, 4, 3 * 64, 96)  # [stage, e, b c, d]
  run = functools.partial(_both_ways_by_kernel, fmt=fmt, row_groups=3)
  expected = functools.partial(_both_ways_by_jnp, fmt=fmt)
  _same_bits(jax.jit(jax.vmap(jax.vmap(run)))(experts), jax.vmap(jax.vmap(expected))(experts))


@pytest.mark.parametrize("fmt", block_scaled.FORMAT_NAMES)
@pytest.mark.parametrize("spec", [P("a", "b"), P("b", "a"), P(None, ("a", "b"))])
def test_fused_kernel_runs_per_device_under_sharding(spec, fmt):
  """On 8 devices the kernel runs on each device's block (custom partitioning): the same
  values as the jnp passes; a split that would leave a device less than a block (K 128
  over 8 devices: 16 columns, no MXFP8 tile) is gathered first. NVFP4's per-tensor scale
  is the whole matrix's amax, whatever the split."""
  auto = (jax.sharding.AxisType.Auto,) * 2  # as the model's meshes (parallelism/mesh.py)
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=auto, devices=jax.devices()[:8])
  a = jax.random.normal(jax.random.key(2), (256, 128), jnp.bfloat16)
  a = jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  run = functools.partial(_both_ways_by_kernel, fmt=fmt)
  _same_bits(jax.jit(run)(a), _both_ways_by_jnp(a, fmt))


@pytest.mark.parametrize("fmt", block_scaled.FORMAT_NAMES)
def test_matmul_and_its_gradients_are_within_the_formats_error(fmt):
  x, w, g = _operands()

  def product(matmul):
    return lambda x, w: jnp.vdot(matmul(SPEC, x, w), g)

  # Jitted: one compile each, where op-by-op dispatch compiles every quantization op apart.
  exact = jax.jit(jax.grad(product(jnp.einsum), argnums=(0, 1)))(x, w)
  scaled = jax.jit(
    jax.grad(product(lambda s, x, w: block_scaled.einsum(s, x, w, fmt)), argnums=(0, 1))
  )(x, w)
  einsum = jax.jit(lambda x, w: block_scaled.einsum(SPEC, x, w, fmt))
  forward = _relative(einsum(x, w), jnp.einsum(SPEC, x, w))
  errors = [forward, _relative(scaled[0], exact[0]), _relative(scaled[1], exact[1])]
  assert max(errors) < MATMUL_RTOL[fmt], errors
  # Not exact either: a format that did nothing would pass the bound above.
  assert min(errors) > 1e-3, errors


@pytest.mark.parametrize("fmt", block_scaled.FORMAT_NAMES)
def test_weights_quantized_once_a_step_give_the_same_products(fmt):
  # quantize_weights lays the forward's and the input gradient's quantizations out like
  # the stacked kernel [L, D, 3, H, K]; read back per layer, they are the ones each
  # matmul would make itself: the same quantized operands, products equal up to the
  # float32 accumulation order of the emulated matmul (its operands arrive in other
  # layouts): REDUCTION_RTOL.
  kx, kw, kg = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(kx, (2, 64, 128))
  stack = jax.random.normal(kw, (2, 128, 3, 4, 32)) * 0.1
  g = jax.random.normal(kg, (2, 64, 3, 4, 32))
  assert block_scaled.cacheable(stack.shape, 1, fmt)

  def total(stack, x, once):
    quantized = block_scaled.quantize_weights(stack, 1, fmt) if once else None
    out = 0.0
    for layer in range(2):
      w = jax.tree.map(lambda a: a[layer], quantized) if once else stack[layer]
      out += jnp.vdot(block_scaled.einsum(SPEC, x, w, fmt), g)
    return out

  once = jax.jit(jax.value_and_grad(lambda s, x: total(s, x, True), argnums=(0, 1)))(stack, x)
  per_call = jax.jit(jax.value_and_grad(lambda s, x: total(s, x, False), argnums=(0, 1)))(stack, x)
  for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(per_call)):
    np.testing.assert_allclose(a, b, rtol=REDUCTION_RTOL, atol=REDUCTION_RTOL * np.abs(b).max())


@pytest.mark.parametrize("fmt", block_scaled.FORMAT_NAMES)
def test_expert_stacks_run_one_block_scaled_gemm_an_expert(fmt):
  # A stack of 3 experts' up-projections [L, E, D, 2, F] (one layer), the expert axis a
  # batch axis of the matmul ("becd,edgf->becgf", model/moe.py): within the format's error
  # of jnp.einsum, forward and both gradients, like a shared weight's (MATMUL_RTOL); its
  # quantizations made once a step (quantize_weights with a batch axis) give the products
  # of those made in each call (REDUCTION_RTOL, as above); each expert quantized apart: a
  # 1000x larger expert leaves the others' products as accurate.
  spec = "becd,edgf->becgf"
  kx, kw, kg = jax.random.split(jax.random.key(4), 3)
  x = jax.random.normal(kx, (2, 3, 32, 64))
  stack = jax.random.normal(kw, (1, 3, 64, 2, 32)) * 0.1
  stack = stack.at[:, 0].multiply(1000.0)
  g = jax.random.normal(kg, (2, 3, 32, 2, 32))
  assert block_scaled.batch_axes(spec) == "e"
  assert block_scaled.cacheable(stack.shape, 1, fmt, batch=1)

  def total(matmul, stack, x, once):
    quantized = block_scaled.quantize_weights(stack, 1, fmt, batch=1) if once else None
    w = jax.tree.map(lambda a: a[0], quantized) if once else stack[0]
    return jnp.vdot(matmul(spec, x, w), g)

  scaled = lambda s, x, w: block_scaled.einsum(s, x, w, fmt)
  grads = lambda matmul, once: jax.jit(
    jax.value_and_grad(lambda s, x: total(matmul, s, x, once), argnums=(0, 1))
  )(stack, x)
  once, per_call = grads(scaled, True), grads(scaled, False)
  for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(per_call)):
    np.testing.assert_allclose(a, b, rtol=REDUCTION_RTOL, atol=REDUCTION_RTOL * np.abs(b).max())
  exact = grads(lambda s, x, w: jnp.einsum(s, x, w), False)[1]
  forward = jax.jit(lambda x, w: block_scaled.einsum(spec, x, w, fmt))(x, stack[0])
  for e in range(3):  # each expert's product and gradients
    errors = [
      _relative(forward[:, e], jnp.einsum(spec, x, stack[0])[:, e]),
      _relative(per_call[1][0][:, e], exact[0][:, e]),
      _relative(per_call[1][1][:, e], exact[1][:, e]),
    ]
    assert max(errors) < MATMUL_RTOL[fmt], (e, errors)


def _losses(
  model, steps: int, mesh=MeshConfig(data=-1), devices: int = 1, shard_optimizer: bool = False
) -> list[float]:
  return _run(model, steps, mesh, devices, shard_optimizer)[0]


def _run(model, steps: int, mesh, devices: int, shard_optimizer: bool):
  """(losses, the train program)."""
  train = TrainConfig(
    global_batch=8,
    steps=steps,
    task="learnable",
    learning_rate=LEARNING_RATE,
    shard_optimizer=shard_optimizer,
  )
  exp = ExperimentConfig(name="block_scaled", description="", model=model, mesh=mesh, train=train)
  program = train_program(exp, devices)
  step = program.lower(exp.train.global_batch, model.seq_len).compile()
  state, losses = program.init(), []
  for i in range(steps):
    batch = data.batch("learnable", 0, i, exp.train.global_batch, model.seq_len, model.vocab_size)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses, program


def test_tiny_llama_trains_with_block_scaled_matmuls():
  bf16 = dataclasses.replace(BLOCKED, compute_dtype="bfloat16")
  steps = 20
  reference = _losses(bf16, steps)
  for fmt, bound in (("mxfp8", 0.01), ("nvfp4", 0.05)):
    losses = _losses(dataclasses.replace(bf16, block_scaling=fmt), steps)
    # It learns: the loss falls as bf16's does (by a third over 20 steps here) ...
    assert losses[-1] < 0.8 * losses[0], (fmt, losses)
    # ... and stays near bf16's through updates taken with rounded gradients: E4M3's
    # 2^-4 steps (MXFP8) and E2M1's 2^-2 (NVFP4) moved it by at most 0.26% and 1.65%
    # here; the bounds leave 3-4x for another machine's reduction order.
    drift = [abs(a / b - 1) for a, b in zip(losses, reference)]
    assert max(drift) < bound, (fmt, drift)


def test_tensor_and_sequence_parallel_steps_match_one_device():
  # Sequence parallelism's shard_map then runs with every mesh axis manual (sequence.py
  # whole_mesh). MXFP8 has no per-tensor scale, and each tensor rank's share of a
  # row-parallel contraction (2 of 4 heads of 32 features, 128 of 256 MLP features) is
  # whole 32-value blocks, so both programs quantize the same blocks: equal up to the
  # float32 reduction order, LOSS_RTOL.
  model = dataclasses.replace(
    BLOCKED, compute_dtype="float32", block_scaling="mxfp8", sequence_parallel=True
  )
  one = _losses(dataclasses.replace(model, sequence_parallel=False), 3)
  sharded = _losses(model, 3, MeshConfig(data=-1, tensor=2, devices_per_node=2), devices=2)
  assert np.allclose(sharded, one, rtol=LOSS_RTOL), (sharded, one)


def test_split_optimizer_keeps_block_scaled_kernels_split():
  # train.shard_optimizer: the kernels whose quantizations are made once a step are stored
  # split over `data` like their moments; each step gathers them whole and quantizes them
  # (no whole copy kept between steps). The same blocks are quantized as on one device:
  # the one-device losses up to the float32 reduction order, LOSS_RTOL.
  model = dataclasses.replace(BLOCKED, compute_dtype="float32", block_scaling="mxfp8")
  one = _losses(model, 3)
  mesh = MeshConfig(data=2, devices_per_node=2)
  split, program = _run(model, 3, mesh, 2, shard_optimizer=True)
  assert np.allclose(split, one, rtol=LOSS_RTOL), (split, one)
  layers = program.abstract_state.params["layers"]
  for name in ("q_kernel", "fc1_kernel", "fc2_kernel"):
    assert "data" in jax.tree.leaves(tuple(layers[name].sharding.spec)), name
  assert "data" not in jax.tree.leaves(tuple(layers["ln1_scale"].sharding.spec))


def test_hopper_refuses_block_scaled_formats():
  result = launch(
    "--mode=project",
    "--experiment=tiny",
    "--hardware=h100",
    "--gpus=8",
    "--set",
    "precision=nvfp4",
  )
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "model.block_scaling = nvfp4" in lines[0], result.stderr
  assert "Traceback" not in result.stderr


@functools.cache
def _blackwell_step(fmt: str, head: bool = False):
  """A 2-layer Llama's training step compiled deviceless for B200 with `fmt` matmuls (the
  output head's too with `head`), and its model. Widths of 128: cuDNN pads a block-scaled
  GEMM's dimensions to multiples of 128."""
  model = dataclasses.replace(
    SMALL_LLAMA,
    d_model=128,
    head_dim=32,
    ffn_dim=256,
    compute_dtype="bfloat16",
    num_layers=2,
    block_scaling=fmt,
    block_scaled_head=head,
    remat="none",
  )
  train = TrainConfig(global_batch=8, steps=1)
  step = aot_compile.compile_step(
    model,
    train,
    (("data", 1), ("fsdp", 1), ("expert", 1), ("context", 1), ("tensor", 1), ("pipeline", 1)),
    "b200",
    8,
  )
  return step, model


@pytest.mark.skipif(not targets.cuda_available()[0], reason="needs jax-cuda12-plugin")
@pytest.mark.parametrize("fmt, operand", [("nvfp4", "f4e2m1fn"), ("mxfp8", "f8e4m3fn")])
def test_blackwell_compile_runs_every_weight_gemm_block_scaled(fmt, operand):
  step, model = _blackwell_step(fmt)
  assert step.compile_target == "cuda", step.note
  scaled = [
    (n, m)
    for n, m in hlo.walk(step.program)
    if isinstance(n, hlo.Compute) and n.dot_dtype == operand and n.dot_flops
  ]
  # Each layer's five weight matmuls (Q, KV, output, gate/up, down), forward and both
  # gradients, B x T = 128 tokens: 2 x 128 x (in x out) FLOPs per GEMM.
  D, F, G, K = model.d_model, model.d_ff, model.kv_heads, model.head_dim
  weights = D * D + D * 2 * G * K + D * D + D * 2 * F + F * D
  expected = 3 * 2 * 128 * weights * model.num_layers
  assert sum(n.dot_flops * m for n, m in scaled) == pytest.approx(expected, rel=0.01)


@pytest.mark.skipif(not targets.cuda_available()[0], reason="needs jax-cuda12-plugin")
def test_a_block_scaled_head_runs_its_three_gemms_block_scaled():
  """model.block_scaled_head (GB300's MXFP8 LM head): the head's forward and both gradients
  join the block-scaled GEMMs, 3 x 2 x 128 tokens x D x V more FLOPs, and no dot in the
  compute dtype is left with the head's shape."""
  plain, model = _blackwell_step("mxfp8")
  headed, _ = _blackwell_step("mxfp8", head=True)

  def flops(step, dtype):
    return sum(
      n.dot_flops * m
      for n, m in hlo.walk(step.program)
      if isinstance(n, hlo.Compute) and n.dot_dtype == dtype and n.dot_flops
    )

  head = 3 * 2 * 128 * model.d_model * model.vocab_size
  assert flops(headed, "f8e4m3fn") - flops(plain, "f8e4m3fn") == pytest.approx(head, rel=1e-6)
  assert flops(plain, "bf16") - flops(headed, "bf16") == pytest.approx(head, rel=1e-6)
  with pytest.raises(UserInputError, match="model.block_scaled_head = true needs"):
    dataclasses.replace(model, block_scaling="none", block_scaled_head=True).validate()


@pytest.mark.skipif(not targets.cuda_available()[0], reason="needs jax-cuda12-plugin")
@pytest.mark.parametrize("fmt", block_scaled.FORMAT_NAMES)
def test_blackwell_quantizes_each_operand_in_one_kernel(fmt):
  """Each activation and gradient a weight GEMM reads is quantized both ways by the fused
  kernel (model/fused_quantize.py), once: in the forward pass a layer's four inputs (Q and
  KV read the same normed activations, and share their quantization), in the backward pass
  the output gradients of its five weight matmuls (and the recomputed forward's inputs);
  and no amax reduction of its own is left in the layer loops but NVFP4's per-tensor one,
  at most one a kernel."""
  step, model = _blackwell_step(fmt)
  in_loops = [(n, m) for n, m in hlo.walk(step.program) if isinstance(n, hlo.Compute) and m > 1]
  kernels = lambda part: sum(
    m for n, m in in_loops if n.kind == "__gpu$xla.gpu.triton" and n.op_name.startswith(part)
  )
  trips = max(m for _, m in in_loops)  # the layer loop's
  forward, backward = kernels("jit(step_on_mesh)/jvp()"), kernels("jit(step_on_mesh)/transpose")
  assert forward == 4 * trips, (forward, trips)
  assert backward >= (4 + 5) * trips, (backward, trips)
  amaxes = sum(m for n, m in in_loops if "reduce_max" in n.op_name)
  assert amaxes <= (forward + backward if fmt == "nvfp4" else 0), amaxes
