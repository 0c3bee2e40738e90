"""LoRA fine-tuning (model/lora.py) on CPU devices: adapters on frozen base weights.

A small Llama (grouped-query attention, so the targets are q, kv and out kernels) trains
its adapters only: the base weights stay bit for bit, the optimizer state holds the
adapters alone, a sharded run (tensor 2 x context 2 x data 2 on 8 devices) matches one
device, the loss falls on the token corpus, and a checkpoint resumes bit for bit.
"""

import dataclasses
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import small_models
from flax import nnx

import experiments
from errors import UserInputError
from experiments import _rcp, overrides
from hardware import catalog
from model import flops, gpt, lora
from model import presets as model_presets
from modes import options as options_lib
from parallelism import mesh as mesh_lib
from projection import aot_compile, hlo, search, targets
from projection.plan import plan
from reference import mlperf_llama2_70b_lora as lora_published
from tools import make_tokens
from train import data as data_lib
from train import loop
from train import step as train_step
from train.checkpoint import Checkpoints

TARGETS = "q_kernel,kv_kernel,out_kernel,fc2_kernel"


def _exp(*extra: str) -> experiments.ExperimentConfig:
  exp = overrides.apply(
    experiments.load("tiny"),
    [
      "train.steps=4",
      "train.warmup_steps=0",
      "train.global_batch=8",
      "train.task=learnable",
      "train.learning_rate=1e-2",
      "train.lr_warmup_steps=0",
      "lora.rank=4",
      "lora.alpha=8",
      f"lora.targets={TARGETS}",
      "lora.base_dtype=float32",
      "mesh.data=1",
      "mesh.fsdp=1",
      "mesh.tensor=1",
      "mesh.allow_tensor_beyond_nvlink=true",
      *extra,
    ],
  )
  return dataclasses.replace(exp, model=small_models.SMALL_LLAMA)


def _program(exp, devices: int) -> train_step.TrainProgram:
  layout = mesh_lib.plan(exp.mesh, devices)
  mesh = mesh_lib.build_mesh(layout, jax.devices()[:devices])
  return train_step.build(exp.model, exp.train, mesh, exp.lora)


def _steps(program, exp, steps: int):
  """The states after each of `steps` steps on the experiment's batches, and the losses."""
  state = program.init()
  states, losses = [], []
  for i in range(steps):
    t, m = exp.train, exp.model
    batch = data_lib.batch(t.task, t.seed, i, t.global_batch, m.seq_len, m.vocab_size)
    batch = jax.device_put(batch, program.batch_sharding)
    state, metrics = program.step(state, batch)
    states.append(jax.tree.map(np.asarray, state))
    losses.append(float(metrics["loss"]))
  return states, losses


def _adapters(params):
  return nnx.filter_state(params, lora.Adapter)


def _base(params):
  return nnx.split_state(params, lora.Adapter, ...)[1]


def test_only_adapters_train_and_have_optimizer_state():
  exp = _exp("mesh.fsdp=1")
  program = _program(exp, 1)
  first = jax.tree.map(np.asarray, program.init())
  states, losses = _steps(program, exp, 3)
  # The base weights, embeddings and norms: the same bits after three steps.
  for a, b in zip(
    jax.tree.leaves(_base(first.params)), jax.tree.leaves(_base(states[-1].params)), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  # The adapters moved (B starts at zero and leaves it after the first update).
  moved = [
    not np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(_adapters(first.params)), jax.tree.leaves(_adapters(states[-1].params))
    )
  ]
  assert all(moved), moved
  # Adam's moments mirror the adapters and nothing else: 2 per target kernel (A, B).
  adapters = jax.tree.leaves(_adapters(first.params))
  moments = [x for x in jax.tree.leaves(first.opt_state) if getattr(x, "ndim", 0) > 0]
  assert len(adapters) == 2 * len(TARGETS.split(","))
  assert sorted(x.shape for x in moments) == sorted(2 * [x.shape for x in adapters])
  assert all(np.isfinite(losses))


def test_adapter_shapes_and_shardings_follow_their_kernels():
  exp = _exp("mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2")
  program = _program(exp, 8)
  layers = program.abstract_state.params["layers"]
  cfg = exp.model
  L, D, H, K, G, r = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.kv_heads, 4)
  assert layers["q_kernel_lora_a"].shape == (L, D, r)
  assert layers["q_kernel_lora_b"].shape == (L, r, H, K)
  assert layers["kv_kernel_lora_b"].shape == (L, r, 2, G, K)
  assert layers["out_kernel_lora_a"].shape == (L, H, K, r)
  assert layers["out_kernel_lora_b"].shape == (L, r, D)
  spec = lambda name: tuple(layers[name].sharding.spec)
  # A's input follows the kernel's input (embed over fsdp, heads over tensor), B's output
  # the kernel's output; the rank is never split.
  assert spec("q_kernel_lora_a")[:3] == (None, "fsdp", None)
  assert spec("q_kernel_lora_b")[:3] == (None, None, "tensor")
  assert spec("out_kernel_lora_a")[:2] == (None, "tensor")
  assert spec("out_kernel_lora_b") == (None, None, "fsdp")
  assert "fc1_kernel_lora_a" not in layers  # not a target


def _max_rel_update_error(sharded, single, first):
  """The largest difference of the adapters' total updates, relative to the largest update."""
  worst = 0.0
  for a, b, a0 in zip(
    jax.tree.leaves(_adapters(sharded)),
    jax.tree.leaves(_adapters(single)),
    jax.tree.leaves(_adapters(first)),
    strict=True,
  ):
    worst = max(worst, float(np.max(np.abs(a - b)) / np.max(np.abs(b - a0))))
  return worst


@pytest.mark.parametrize(
  "mesh",
  [
    ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
    ("mesh.data=2", "mesh.tensor=2", "mesh.context=2"),
  ],
  ids=["data2-fsdp2-tensor2", "data2-tensor2-context2"],
)
def test_sharded_adapters_match_one_device(mesh):
  """8 devices against one."""
  exp, one_exp = _exp(*mesh), _exp()
  first = jax.tree.map(np.asarray, _program(one_exp, 1).init())
  sharded, sharded_losses = _steps(_program(exp, 8), exp, 3)
  one, one_losses = _steps(_program(one_exp, 1), one_exp, 3)
  # float32 throughout; the sharded step sums the same products in another order (heads
  # over tensor ranks, rows over replicas, embed over fsdp, keys over context ranks):
  # rounding, 1e-7 relative a sum.
  np.testing.assert_allclose(sharded_losses, one_losses, rtol=1e-5)
  # Three Adam updates (lr 1e-2) normalise each entry by its gradient's size, so the
  # relative rounding of small gradients reaches the parameters undamped: compared with
  # the size of the update itself (measured: 9e-5, and 1.2e-4 with context 2).
  assert _max_rel_update_error(sharded[-1].params, one[-1].params, first.params) < 1e-3
  assert sharded_losses[-1] < sharded_losses[0]


def test_dropout_changes_the_step():
  with_dropout = _exp("mesh.fsdp=1", "lora.dropout=0.5")
  without = _exp("mesh.fsdp=1")
  # B is zero at first, so the first loss ignores the adapters: compare the second.
  assert _steps(_program(with_dropout, 1), with_dropout, 2)[1][1] != pytest.approx(
    _steps(_program(without, 1), without, 2)[1][1], rel=1e-6
  )


STEPS, EVERY = 8, 4


@pytest.fixture(scope="module")
def corpus_exp(tmp_path_factory):
  corpus = str(tmp_path_factory.mktemp("corpus") / "python_docs.bin")
  make_tokens.make(make_tokens.PYTHON_DOCS, corpus)
  exp = overrides.apply(
    experiments.load("tiny"),
    [
      "model=llama3-tiny",
      "train.task=tokens",
      f"train.data_path={corpus}",
      f"train.steps={STEPS}",
      "train.warmup_steps=0",
      "train.learning_rate=3e-2",
      "mesh.fsdp=1",
      "mesh.tensor=2",
      "mesh.allow_tensor_beyond_nvlink=true",
      "lora.rank=8",
      "lora.dropout=0.1",
      "lora.targets=q_kernel,kv_kernel,out_kernel,fc1_kernel,fc2_kernel",
    ],
  )
  return exp


@pytest.fixture(scope="module")
def corpus_run(corpus_exp, tmp_path_factory):
  program = _program(corpus_exp, 2)
  directory = str(tmp_path_factory.mktemp("ckpt"))
  result = loop.run(program, corpus_exp.model, corpus_exp.train, Checkpoints(directory, EVERY, 3))
  return program, directory, result


def test_lora_lowers_the_loss_on_the_token_corpus(corpus_run):
  losses = corpus_run[2].losses
  assert len(losses) == STEPS
  # The random base model predicts ~uniformly over 256 bytes (ln 256 = 5.55); adapters
  # on every kernel learn byte frequencies within a few steps. The corpus is the running
  # Python's pydoc topics, which differ between patch releases: 8 steps take the loss down
  # 0.28 on Python 3.11.2's and 0.32 on 3.11.7's (untrained adapters would leave it near 5.55).
  assert losses[-1] < losses[0] - 0.2, losses


def test_checkpoint_holds_adapters_and_resumes_bit_for_bit(corpus_exp, corpus_run, tmp_path):
  program, directory, reference = corpus_run
  shutil.copytree(os.path.join(directory, str(EVERY)), tmp_path / str(EVERY))
  checkpoints = Checkpoints(str(tmp_path), EVERY, 3)
  resumed = loop.run(program, corpus_exp.model, corpus_exp.train, checkpoints)
  assert resumed.first_step == EVERY
  assert resumed.losses == reference.losses[EVERY:]
  # The checkpoint's tree names the adapters (and their Adam moments).
  metadata = "".join(
    open(os.path.join(root, f), errors="ignore").read()
    for root, _, files in os.walk(os.path.join(directory, str(EVERY)))
    for f in files
    if "METADATA" in f.upper()
  )
  assert "q_kernel_lora_a" in metadata and "fc2_kernel_lora_b" in metadata
  for a, b in zip(
    jax.tree.leaves(resumed.final_state), jax.tree.leaves(reference.final_state), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_stored_base_trains():
  exp = _exp("mesh.fsdp=1", "model.fp8=true", "lora.base_dtype=float8_e4m3fn")
  exp = dataclasses.replace(exp, model=dataclasses.replace(exp.model, fp8=True))
  program = _program(exp, 1)
  layers = program.abstract_state.params["layers"]
  assert layers["fc1_kernel"].dtype == np.dtype("float8_e4m3fn")
  assert layers["fc1_kernel_fp8_scale"].shape == (exp.model.num_layers,)
  _, losses = _steps(program, exp, 3)
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize(
  "targets, remat",
  [("qkv_kernel,out_kernel", "none"), ("q_kernel,kv_kernel,fc1_kernel,fc2_kernel", "save_dots")],
)
def test_hlo_matmul_flops_equal_the_lora_formula(targets, remat):
  """The compiled step runs the frozen weights' forward and input gradients, and weight
  gradients only for the adapters: model/flops.py lora_matmul_flops_per_step, exactly."""
  exp = _exp("lora.rank=4", f"lora.targets={targets}")
  model = dataclasses.replace(exp.model, remat=remat, num_layers=3)
  exp = dataclasses.replace(exp, model=model)
  program = _program(exp, 1)
  compiled = program.lower(exp.train.global_batch, model.seq_len).compile()
  found = hlo.dot_flops(hlo.analyze(compiled.as_text()))
  expected = flops.lora_matmul_flops_per_step(model, exp.lora, exp.train.global_batch)
  assert found == expected
  # Less than full training's count by the base weights' gradients, 2 N a token.
  full = flops.matmul_flops_per_step(model, exp.train.global_batch)
  assert found < full


def test_llama2_70b_parameters_from_abstract_shapes():
  cfg = model_presets.preset("llama2-70b")
  adapters = lora.LoraConfig(rank=16, alpha=32, targets="qkv_kernel,out_kernel")
  abstract = nnx.eval_shape(lambda: gpt.GPT(cfg, nnx.Rngs(0), adapters=adapters))
  params = nnx.state(abstract, nnx.Param)
  total = sum(x.size for x in jax.tree.leaves(params))
  trainable = sum(x.size for x in jax.tree.leaves(nnx.filter_state(params, lora.Adapter)))
  base = total - trainable
  # Meta's published size: 68.98 B (the 0.5% covers the published figure's rounding).
  assert abs(base / 68.98e9 - 1) < 0.005, base
  assert base == flops.param_count(cfg)
  # MLPerf's adapters: rank 16 on the fused QKV (one A for q and kv) and the attention
  # output, "about 44.6 M" trainable parameters.
  assert trainable == flops.lora_adapter_param_count(cfg, adapters) == 44_564_480
  layers = params["layers"]
  assert layers["qkv_kernel_lora_a"].shape == (80, 8192, 16)
  assert layers["kv_kernel_lora_b"].shape == (80, 16, 2, 8, 128)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
  "settings, message",
  [
    (("lora.rank=-1",), "lora.rank must be 0 (off) or a positive integer, got -1"),
    (("lora.rank=4", "lora.targets=qkv_kernel,attn_kernel"), "unknown kernel 'attn_kernel'"),
    # GPT-3's attention has one fused QKV kernel, no separate query kernel.
    (("lora.rank=4", "lora.targets=q_kernel"), "this model has no q_kernel"),
  ],
  ids=["negative-rank", "unknown-kernel", "kernel-the-model-lacks"],
)
def test_bad_lora_settings_are_refused_naming_the_field(settings, message):
  # In-process, as launch.py's train mode reads the experiment and builds its step (which
  # checks the adapters before tracing); one launch below shows a refusal reaching the
  # command line.
  exp = options_lib.experiment(options_lib.Options(experiment="tiny", sets=settings), "train")
  mesh = mesh_lib.build_mesh(mesh_lib.plan(mesh_lib.MeshConfig(data=1), 1), jax.devices()[:1])
  with pytest.raises(UserInputError, match="^lora\\.") as refused:
    train_step.build(exp.model, exp.train, mesh, exp.lora)
  assert message in str(refused.value)


def test_a_bad_lora_setting_is_one_line_and_exit_2(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  done = subprocess.run(
    [sys.executable, os.path.join(ROOT, "launch.py"), f"--output_dir={tmp_path}"]
    + ["--set", "lora.rank=-1"],
    cwd=str(tmp_path),
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 2 and len(lines) == 1, done.stderr
  assert lines[0] == "error: lora.rank must be 0 (off) or a positive integer, got -1", lines[0]
  assert "Traceback" not in done.stderr and os.listdir(tmp_path) == []


def test_mlperf_llama2_70b_lora_definition_and_schedule():
  exp = experiments.load("mlperf_llama2_70b_lora")
  bench = exp.benchmark
  # The RCP interpolated between GBS 16 and 128 (the reference file's 7,131.4 at 64).
  assert bench.mean_samples(64) == pytest.approx(7131.43, abs=0.01)
  # Every 384 sequences: 6 steps at GBS 64; the first floor(0.125 x 64 + 2) = 10 skipped.
  assert bench.eval_interval_steps(64) == 6 and bench.skipped_evaluations(64) == 10
  # 18 intervals (6,912 samples) at or before the mean; 8 evaluations on the clock.
  assert bench.steps_to_converge(64) == 108 and bench.evaluations(64) == 8
  assert exp.lora.rank == 16 and exp.lora.targets == "qkv_kernel,out_kernel"
  assert (exp.mesh.tensor, exp.mesh.context, exp.train.global_batch) == (4, 2, 64)
  replay = exp.variants["azure_h200_512_as_run"].benchmark.estimate(1.0, 64, 0.25)
  assert (replay["steps_to_converge"], replay["evaluations"]) == (114, 9.5)
  eos_8 = experiments.at_target(exp, 8, "h100")
  assert eos_8.mesh.context == 1
  # As NVIDIA's configurations: sequence parallelism, no recomputation (one node fits).
  assert exp.model.sequence_parallel and eos_8.model.sequence_parallel
  assert eos_8.model.remat == "none"


_CUDA, _WHY = targets.cuda_available()


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_mlperf_llama2_70b_lora_rcps_are_the_checkers():
  """mlcommons/logging rcp_checker.py on the RCP file's 20 runs a batch (in samples):
  olympic means, then pruning from the second RCP on, each against its current
  neighbours."""
  runs = lora_published.RCP_SAMPLES
  # GBS 8: 2,688 x 3, 3,072 x 9, 3,456 x 7, 3,840; one 2,688 and the 3,840 dropped:
  # (2 x 2,688 + 9 x 3,072 + 7 x 3,456) / 18 = 57,216 / 18 = 3,178.67.
  assert _rcp.olympic_mean(runs[8]) == pytest.approx(57_216 / 18)
  # GBS 16: 3,456, 3,840 x 13, 4,224 x 2, 4,608 x 2, 4,992 x 2; the 3,456 and a 4,992
  # dropped: (13 x 3,840 + 2 x 4,224 + 2 x 4,608 + 4,992) / 18 = 72,576 / 18 = 4,032.
  assert _rcp.olympic_mean(runs[16]) == 4_032
  # GBS 32: 5,376, 5,760 x 8, 6,144 x 7, 6,528 x 4: (8 x 5,760 + 7 x 6,144 + 3 x 6,528) /
  # 18 = 108,672 / 18 = 6,037.33.
  assert _rcp.olympic_mean(runs[32]) == pytest.approx(108_672 / 18)
  # GBS 128: 9,984 x 2, 10,752 x 5, 11,136 x 7, 11,520 x 2, 12,288, 12,672, 13,056 x 2: a
  # 9,984 and a 13,056 dropped, 202,752 / 18 = 11,264.
  assert _rcp.olympic_mean(runs[128]) == 11_264
  # 16 is checked first, against 8 and 32: 3,178.67 + (6,037.33 - 3,178.67) x 8 / 24 =
  # 4,131.56, and 4,032 is under it, so it stays; then 32 against 16 and 128: 4,032 +
  # 7,232 x 16 / 112 = 5,065.14, and 6,037.33 is above it, so it goes. (16 against 8 and
  # 128, 3,178.67 + 8,085.33 x 8 / 120 = 3,717.69, would prune it; the checker's walk
  # never makes that comparison.)
  means = _rcp.checker_means(runs)
  assert means == pytest.approx({8: 57_216 / 18, 16: 4_032, 128: 11_264})
  bench = experiments.load("mlperf_llama2_70b_lora").benchmark
  assert bench.mean_samples_by_global_batch == means
  # GBS 8 (eos_8): an evaluation every 48 steps (384 sequences), the first floor(0.125 x 8
  # + 2) = 3 skipped; 3,178.67 / 384 = 8.28, so 8 intervals = 384 steps = 3,072 samples, 5
  # evaluations, scaled by 57,216 / 18 / 3,072 = 1.0347 (the rounded 3,178.67 gave the
  # same to 1e-6).
  assert (bench.steps_to_converge(8), bench.evaluations(8)) == (384, 5)
  assert bench.normalization(8) == pytest.approx(57_216 / 18 / 3_072)
  # GBS 128 (eos_1024): every 3 steps, 2 + 16 = 18 skipped; 11,264 / 384 = 29.3, so 29
  # intervals = 87 steps = 11,136 samples, 11 evaluations, scaled by 11,264 / 11,136.
  assert (bench.steps_to_converge(128), bench.evaluations(128)) == (87, 11)
  assert bench.normalization(128) == pytest.approx(11_264 / 11_136)


def test_benchmark_step_at_512_h100_fits_and_runs_the_lora_flops():
  """The LoRA benchmark's step (Llama 2 70B, FP8 matmuls on FP8-stored frozen weights,
  cuDNN attention, adapters on the fused QKV and output) in its 512-GPU layout, compiled
  deviceless for H100 on the reduced mesh (data 2 x context 2 x tensor 4; about a minute):
  it fits, and its matmul FLOPs are the LoRA formula's, no weight gradient of a frozen
  kernel among them. (At test size, GEMM fusions pad the narrow shapes and the count is
  3% over.)"""
  exp = experiments.at_target(experiments.load("mlperf_llama2_70b_lora"), 512, "h100")
  exp = dataclasses.replace(exp, latency_profile=False)
  reduced = plan(exp, catalog.get("h100"), 512).reduced
  assert (reduced.sizes["data"], reduced.sizes["context"], reduced.sizes["tensor"]) == (2, 2, 4)
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  compiled = aot_compile.compile_step(
    exp.model, train_cfg, tuple(reduced.sizes.items()), "h100", 8, adapters=exp.lora
  )
  assert compiled.compile_target == "cuda"
  assert compiled.memory_per_device_bytes < catalog.get("h100").hbm_bytes
  found = hlo.dot_flops(compiled.program) * 16
  expected = flops.lora_matmul_flops_per_step(exp.model, exp.lora, reduced.global_batch, 2)
  # Exactly, with sequence parallelism (the benchmark's layout): each tensor rank runs the
  # fused QKV adapter's x A on its own slice of the tokens. (Without it the input is
  # replicated over the 4 tensor ranks and each repeats x A: 0.145% over.)
  assert found == pytest.approx(expected, rel=1e-12)
  # Against full fine-tuning of the same step: the frozen weights' gradients are gone.
  assert found < 0.75 * flops.matmul_flops_per_step(exp.model, reduced.global_batch, 2)


def test_search_ranks_lora_candidates_as_lora():
  """The search's pruning and prior take the adapters: no pipelined candidate (LoRA
  refuses pipelines), the state of the frozen weights and the adapters' moments, the
  gradients of the adapters only."""
  exp = _exp("model.seq_len=64")
  hw = catalog.get("h100")
  found = search.rank(exp, hw, 8)
  full = search.rank(dataclasses.replace(exp, lora=lora.LoraConfig()), hw, 8)
  assert "mesh.pipeline" in found.pruned
  assert all(reduced.target.sizes["pipeline"] == 1 for _, _, reduced in found.survivors)
  priors = {c: p for c, p, _ in full.survivors}
  for candidate, prior, _ in found.survivors:
    assert prior.state_gb < priors[candidate].state_gb
    assert prior.gradients_gb < priors[candidate].gradients_gb


def test_the_benchmark_sweep_plans_at_every_count():
  """`--mode=sweep --experiment=mlperf_llama2_70b_lora`: every point the benchmark's own
  layout (for_target), planned on each generation without a pipeline."""
  sweep = experiments.sweep("mlperf_llama2_70b_lora")
  assert sweep.scalings == ("configured",) and sweep.mode == "project"
  exp = experiments.load("mlperf_llama2_70b_lora")
  for hardware in sweep.hardware:
    for gpus in sweep.counts:
      point = experiments.at_target(exp, gpus, hardware)
      sizes = plan(point, catalog.get(hardware), gpus).reduced.target.sizes
      assert (sizes["tensor"], sizes["pipeline"]) == (4, 1)
