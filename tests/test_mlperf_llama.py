"""The MLPerf Llama 3.1 405B benchmark as data: the RCP-normalized time-to-train arithmetic,
the reference convergence chosen as MLPerf's RCP checker chooses it, the rounds' evaluation
schedules, the learning-rate rule and the published configurations by GPU count, and
the published layout compiled deviceless at test size (benchmarks/mlperf.py compiles
405B at both calibration points and prints whether each fits).
Every figure here is Python arithmetic on the published numbers or the compiled HLO;
pytest.approx's default (1e-6 relative) absorbs only float rounding where a formula is
written in another order than the code's.
"""

import dataclasses

import pytest

import experiments
from errors import UserInputError
from experiments import _rcp, overrides
from experiments import mlperf_llama31_405b as mlperf
from experiments._time_to_train import RcpNormalizedTimeToTrain
from hardware import catalog
from model import flops
from model.presets import preset
from parallelism import pipeline
from projection import aot_compile, hlo, targets
from projection.plan import plan as plan_target
from reference import mlperf_llama31_405b as published

V50, V51, V60 = (mlperf.ROUNDS[r] for r in ("v5.0", "v5.1", "v6.0"))


def test_rcp_means_are_the_checkers_olympic_means_pruned():
  """mlcommons/logging rcp_checker.py: each RCP's mean without its fastest and slowest run;
  then the batches below the fastest-converging one dropped, and each inner RCP above the
  interpolation of its neighbours."""
  # v5.0 2,304: 368,640 x 4 and 414,720 x 2, one of each dropped: (3 x 368,640 + 414,720) / 4.
  assert _rcp.olympic_mean(published.RCP_SAMPLES["v5.0"][2304]) == 380_160
  # v5.1 4,608: 460,800 and one 497,664 dropped: (479,232 + 3 x 497,664) / 4 (plain: 488,448).
  assert _rcp.olympic_mean(published.RCP_SAMPLES["v5.1"][4608]) == 493_056
  # v5.0's means by batch: 1,008 324,576; 1,152 322,560; 2,304 380,160; 4,608 495,360; 6,912
  # 604,800; 9,216 691,200. 1,008 goes (1,152 converges faster); 2,304 stays (1,152 to
  # 4,608 gives 322,560 + 172,800 / 3 = 380,160, not above); 4,608 goes (2,304 to 6,912
  # gives 492,480); 6,912 goes (2,304 to 9,216 gives 380,160 + 311,040 x 2 / 3 = 587,520).
  assert V50.mean_samples_by_global_batch == {1152: 322_560, 2304: 380_160, 9216: 691_200}
  # v5.1 and v6.0 (the same file): 2,304 is under 313,344 + 179,712 / 3 = 373,248; kept.
  v51 = {1152: 313_344, 2304: 368_640, 4608: 493_056}
  assert V51.mean_samples_by_global_batch == V60.mean_samples_by_global_batch == v51


def test_mean_samples_interpolate_linearly_between_rcp_batches():
  # 1,536 is a third of the way from 1,152 (322,560) to 2,304 (380,160).
  assert V50.mean_samples(1536) == pytest.approx(322_560 + 57_600 / 3) == 341_760
  assert V50.mean_samples(1152) == 322_560
  # 1,248 is a twelfth of the way.
  assert V50.mean_samples(1248) == pytest.approx(322_560 + 57_600 / 12)
  # 4,608's own RCP is pruned: a third of the way from 2,304 to 9,216 (691,200).
  assert V50.mean_samples(4608) == pytest.approx(380_160 + 311_040 / 3) == 483_840
  with pytest.raises(UserInputError, match="largest 4608"):
    V60.mean_samples(9216)  # above every RCP: MLPerf asks for a new RCP


@pytest.mark.parametrize("global_batch", [448, 576, 768, 896, 1008])
def test_a_batch_below_every_rcp_takes_the_smallest_batchs_rcp(global_batch):
  """rcp_checker scores a batch below the smallest RCP batch against that RCP ("RCP not
  found but slower convergence on smaller batch size"); the published FP8 runs at these
  batches are then costed, not refused. v5.0's 1,008 is pruned, so 1,008 is one of them."""
  assert V50.mean_samples(global_batch) == 322_560
  assert V51.mean_samples(global_batch) == V60.mean_samples(global_batch) == 313_344
  for bench in (V50, V51, V60):
    assert bench.steps_to_converge(global_batch) * global_batch <= bench.mean_samples(1152)


def test_v60_below_and_between_rcp_batches():
  # GBS 448: an evaluation every ceil(18,432 / 448) = 42 steps (18,816 sequences), the
  # first 12 + floor(26 x 448 / 10,000) = 13 not run; 313,344 / 18,816 = 16.65, so 16
  # intervals = 672 steps = 301,056 sequences, 3 evaluated; scaled by 313,344 / 301,056 =
  # 51 / 49.
  assert (V60.eval_interval_steps(448), V60.skipped_evaluations(448)) == (42, 13)
  assert (V60.steps_to_converge(448), V60.evaluations(448)) == (672, 3)
  assert V60.normalization(448) == pytest.approx(51 / 49)
  # GBS 1,248: a twelfth of the way from 1,152 to 2,304, 313,344 + 55,296 / 12 = 317,952;
  # every ceil(18,432 / 1,248) = 15 steps (18,720), 12 + 3 = 15 skipped; 317,952 / 18,720
  # = 16.98, so 16 intervals = 240 steps = 299,520 sequences, 1 evaluated.
  assert V60.mean_samples(1248) == pytest.approx(317_952)
  assert (V60.steps_to_converge(1248), V60.evaluations(1248)) == (240, 1)
  assert V60.normalization(1248) == pytest.approx(317_952 / 299_520)
  # GBS 448 in v5.0: every ceil(46,080 / 448) = 103 steps (46,144); 322,560 / 46,144 = 6.99,
  # so 6 intervals = 618 steps, every one evaluated.
  assert (V50.steps_to_converge(448), V50.evaluations(448)) == (618, 6)


def test_the_round_is_chosen_by_name_and_a_bad_name_is_one_line():
  exp = experiments.load("mlperf_llama31_405b")
  assert exp.benchmark is V50  # the calibration runs' round
  chosen = overrides.apply(exp, ["round=v6.0", "global_batch=448"])
  assert chosen.benchmark is V60 and chosen.train.global_batch == 448
  assert chosen.benchmark.estimate(10.0, 448, 0.3)["benchmark"] == "mlperf_llama31_405b v6.0"
  with pytest.raises(UserInputError) as e:
    overrides.apply(exp, ["round=v7.0"])
  assert str(e.value) == (
    "--set round: mlperf_llama31_405b has rounds v5.0, v5.1, v6.0, got 'v7.0'"
  )
  with pytest.raises(UserInputError, match="tiny has rounds none"):
    overrides.apply(experiments.load("tiny"), ["round=v6.0"])


@pytest.mark.parametrize("run", published.CALIBRATION, ids=lambda r: f"{r.gpus}")
def test_the_run_costed_stops_where_the_calibration_runs_stopped(run):
  # The last evaluation at or before the reference mean: 7 intervals of 30 (GBS 1,536)
  # and of 37 (GBS 1,248), the steps of the published logs.
  assert V50.steps_to_converge(run.global_batch) == run.steps
  assert V50.evaluations(run.global_batch) == 7
  factor = V50.normalization(run.global_batch)
  assert factor == pytest.approx(
    V50.mean_samples(run.global_batch) / (run.steps * run.global_batch)
  )
  # The checker's RCP gives the published score from the cited log's run time, to the
  # score's two decimals: 19.64 x 341,760 / 322,560 = 20.81 and 26.99 x 327,360 / 323,232
  # = 27.33 (the plain means' 343,040 and 327,680 gave 20.89 and 27.36).
  assert round(run.run_time_min * factor, 2) == run.score_min


def test_time_to_train_arithmetic_v50():
  # GBS 1,536, step 5 s, an evaluation a third of a step's FLOPs: 210 steps = 1,050 s,
  # 7 evaluations of ceil(5760 / 1536) = 4 batches = 7 x 4 x 5 / 3 s; scaled by
  # 341,760 / 322,560.
  est = V50.estimate(5.0, 1536, 1 / 3)
  run_s = 1050 + 7 * 4 * 5 / 3
  assert est["steps_to_converge"] == 210 and est["evaluations"] == 7
  assert est["eval_s_each"] == pytest.approx(20 / 3)
  assert est["tokens_to_converge"] == 210 * 1536 * 8192
  assert est["run_time_min"] == pytest.approx(run_s / 60)
  assert est["time_to_train_min"] == pytest.approx(run_s * 341_760 / 322_560 / 60)


def test_v51_skips_the_first_evaluations():
  # GBS 1,152: every ceil(18432 / 1152) = 16 steps, the first floor(0.0026 x 1152 + 12) =
  # 14 not run; the mean 313,344 = 272 steps = 17 intervals, 3 of them evaluated.
  assert (V51.eval_interval_steps(1152), V51.skipped_evaluations(1152)) == (16, 14)
  assert (V51.steps_to_converge(1152), V51.evaluations(1152)) == (272, 3)
  assert V51.normalization(1152) == 1.0
  est = V51.estimate(10.0, 1152, 0.25)
  assert est["eval_s"] == pytest.approx(3 * 5 * 10 * 0.25)  # ceil(5760 / 1152) = 5 batches
  # floor(0.0026 x GBS + 12) in integers, so 0.0026 x 5,000 = 13 counts whole.
  assert V51.skipped_evaluations(5000) == 25 and V50.skipped_evaluations(5000) == 0


def test_a_run_converges_no_earlier_than_its_first_evaluation_run():
  # GBS 4,608 in v5.1: intervals of 4 steps, 23 skipped; the mean, 493,056 = 107 steps,
  # is past 26 intervals (104 steps), the last 3 of them evaluated.
  assert (V51.eval_interval_steps(4608), V51.skipped_evaluations(4608)) == (4, 23)
  assert (V51.steps_to_converge(4608), V51.evaluations(4608)) == (104, 3)
  # A batch whose mean lies before the first evaluation run stops at that evaluation,
  # and a run with more samples than the mean is not scaled down.
  bench = RcpNormalizedTimeToTrain("t", 8192, 18_432, 5760, {4608: 300_000.0}, 12, 26)
  assert bench.steps_to_converge(4608) == (23 + 1) * 4 and bench.evaluations(4608) == 1
  assert bench.normalization(4608) == 1.0


def test_learning_rate_rule_by_global_batch():
  assert published.learning_rate(1152) == pytest.approx(8e-5)
  assert published.learning_rate(2304) == pytest.approx(16e-5)
  assert published.warmup_steps(1152) == 8000
  assert published.warmup_steps(1536) == 6000 and published.warmup_steps(1248) == 7385
  cfg = mlperf.train_config(1536, 1)
  assert cfg.learning_rate == pytest.approx(8e-5 * 1536 / 1152)
  assert cfg.learning_rate * cfg.min_lr_ratio == pytest.approx(8e-7)
  assert (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.grad_clip) == (
    0.9,
    0.95,
    1e-5,
    0.1,
    1.0,
  )
  assert cfg.steps == 210


def test_each_target_runs_its_published_run_or_its_generations_layout():
  exp = experiments.load("mlperf_llama31_405b")
  eos = experiments.at_target(exp, 8192, "h100")
  assert (eos.mesh.tensor, eos.mesh.pipeline, eos.train.virtual_stages) == (8, 8, 8)
  assert (eos.train.global_batch, eos.train.micro_batch, eos.train.pipeline_schedule) == (
    1536,
    1,
    "1f1b",
  )
  carina = experiments.at_target(exp, 2496, "gb200")
  assert (carina.mesh.tensor, carina.mesh.pipeline, carina.train.virtual_stages) == (4, 8, 8)
  assert (carina.train.global_batch, carina.train.micro_batch) == (1248, 1)
  assert experiments.at_target(exp, 1024) is exp  # no hardware: the experiment as loaded
  # The batch rule reproduces both published batches from their replica counts.
  assert [mlperf.global_batch(r) for r in (64, 39)] == [1536, 1248]
  # Elsewhere, the generation's tensor size and that rule: 8,192 GB300 is 256 replicas of
  # TP 2 x PP 8 x CP 2, and the smallest multiple of 256 x 8 from 1,152 is 2,048.
  gb300 = experiments.at_target(exp, 8192, "gb300")
  assert (gb300.mesh.tensor, gb300.train.global_batch) == (2, 2048)
  assert gb300.train.steps == mlperf.ROUNDS["v5.0"].steps_to_converge(2048)
  h200 = experiments.at_target(exp, 512, "h200")
  assert (h200.mesh.tensor, h200.mesh.context, h200.train.global_batch) == (4, 2, 1152)
  assert experiments.at_target(exp, 512, "a100") is exp  # no published Llama layout
  assert set(gb300.variants) == {"eos_8192", "carina_2496"}
  for variant in (eos, carina):
    assert variant.benchmark is V50 and variant.train.shard_optimizer
    assert variant.mesh.context == 2 and variant.mesh.data == -1
  # Each published run's batch: per-replica batch x GPUs / (TP x PP x CP).
  for run in published.CALIBRATION:
    replicas = run.gpus // (run.tensor * run.pipeline * run.context)
    assert run.global_batch % replicas == 0
    assert (run.global_batch // replicas) % run.pipeline == 0  # 1F1B's groups of P
  # 126 layers in 8 x 8 chunks: the embedding and the loss take two slots of 128.
  assert pipeline.split(126, 8, 8) == (2, True)
  model = exp.model
  assert (
    model.num_layers,
    model.d_model,
    model.num_heads,
    model.num_kv_heads,
    model.ffn_dim,
    model.seq_len,
    model.vocab_size,
  ) == (126, 16384, 128, 8, 53248, 8192, 32_768)
  assert model.fp8 and model.sequence_parallel and not model.tie_embeddings


# ----------------------------------------------------------------------------- compiled
_CUDA, _WHY = targets.cuda_available()


@pytest.mark.skipif(not _CUDA, reason=f"no deviceless CUDA: {_WHY}")
def test_the_published_layout_compiles_for_h100_with_masked_cudnn_attention():
  """The benchmark's program at test size on 16 H100 (deviceless): context 2 x tensor 2
  with sequence parallelism, a 1F1B pipeline 2 whose 3 layers leave a padding row (as
  405B's 126 do in Eos's 8 x 8 chunks), FP8 with delayed scaling, cuDNN attention.
  Each rank's two query chunks run one masked cuDNN call each: the early chunk against
  the first half of the sequence, the late one against all of it."""
  T, CP, TP = 256, 2, 2
  model = dataclasses.replace(
    mlperf.MODEL,
    **{f: getattr(preset("llama3-tiny"), f) for f in ("d_model", "num_heads")},
    num_layers=3,
    head_dim=16,
    num_kv_heads=2,
    # SwiGLU's gate and up kernels 2 x 64 wide a tensor rank: the GEMM fusions pad a
    # width that is not a multiple of 128 (96 was counted as 128), which 405B's are.
    ffn_dim=128,
    vocab_size=256,
    seq_len=T,
    fp8_amax_history=4,
  )
  exp = experiments.at_target(experiments.load("mlperf_llama31_405b"), 8192, "h100")
  exp = dataclasses.replace(
    exp,
    model=model,
    mesh=dataclasses.replace(exp.mesh, context=CP, tensor=TP, pipeline=2),
    train=dataclasses.replace(exp.train, global_batch=8, virtual_stages=1),
    latency_profile=False,
  )
  reduced = plan_target(exp, catalog.get("h100"), 16).reduced
  train_cfg = dataclasses.replace(exp.train, global_batch=reduced.global_batch)
  compiled = aot_compile.compile_step(exp.model, train_cfg, tuple(reduced.sizes.items()), "h100", 8)
  assert compiled.compile_target == "cuda"
  calls = [n for n, _ in hlo.walk(compiled.program) if isinstance(n, hlo.Compute)]
  kinds = {n.kind for n in calls if "fmha" in n.kind}
  assert kinds == {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}
  # Score rectangles of one micro-batch row and a rank's heads: c x (T / 2) and c x T,
  # c = T / 2 CP; forward FLOPs 2 matmuls x 2 x scores x K, no causal half.
  c, heads, K = T // (2 * CP), model.num_heads // TP, model.head_dim
  forward = {n.dot_flops for n in calls if n.kind == "__cudnn$fmhaScaleBiasSoftmax"}
  assert forward == {2 * 2 * heads * c * (T // 2) * K, 2 * 2 * heads * c * T * K}
  # The whole step's matmul FLOPs against the formula for this layout (model/flops.py):
  # 3T/4 keys a query with context parallelism, cuDNN's five backward matmuls, the remat
  # policy's recomputation, and the 1F1B ranks computing in all M V + P - 1 trips. Both
  # count whole multiply-adds: they differ only by float rounding.
  M, P = reduced.compiled_micro_batches, reduced.sizes["pipeline"]
  expected = flops.matmul_flops_per_step(
    model,
    reduced.global_batch,
    context_ranks=CP,
    layer_rows=pipeline.stack_rows(model.num_layers, P, 1),
    layer_passes=(M + P - 1) / M,
  )
  counted = hlo.dot_flops(compiled.program) * reduced.devices
  assert counted == pytest.approx(expected), (counted, expected, exp.model.remat)
